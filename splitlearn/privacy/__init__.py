"""Privacy of split learning: how much of the input the server can read back from what
crosses the wire, and client-side defenses that reduce it.

- :mod:`.defenses`: :class:`GaussianNoise` (clip + noise, with (epsilon, delta) from
  ``dp-accounting``) and :class:`NoPeek` (distance-correlation loss), applied by the client;
- :mod:`.accounting`: the differential-privacy accounting of the Gaussian defense;

See docs/PRIVACY.md for the threat model and measured numbers.
"""
from .accounting import gaussian_epsilon
from .defenses import Defense, GaussianNoise, NoPeek, distance_correlation, make_defense

__all__ = ["Defense", "GaussianNoise", "NoPeek", "distance_correlation", "gaussian_epsilon",
           "make_defense"]
