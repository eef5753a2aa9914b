"""Privacy of split learning: how much of the input the server can read back from what
crosses the wire, and client-side defenses that reduce it.

- :mod:`.defenses`: :class:`GaussianNoise` (clip + noise, with (epsilon, delta) from
  ``dp-accounting``) and :class:`NoPeek` (distance-correlation loss), applied by the client;
- :mod:`.accounting`: the differential-privacy accounting of the Gaussian defense;
- :mod:`.attacks`: learned inverters (linear, MLP, GRU) and white-box inversion;
- :mod:`.meter`: :func:`measure_leakage`, token recovery and perplexity at one cut;
- :mod:`.reference`: :func:`train_reference`, a trained (cached) model to measure;

See docs/PRIVACY.md for the threat model and measured numbers.
"""
from .accounting import gaussian_epsilon
from .attacks import ATTACKS, AttackConfig
from .defenses import Defense, GaussianNoise, NoPeek, distance_correlation, make_defense
from .meter import LeakageReport, measure_leakage, split_corpus
from .reference import train_reference

__all__ = ["ATTACKS", "AttackConfig", "Defense", "GaussianNoise", "LeakageReport", "NoPeek",
           "distance_correlation", "gaussian_epsilon", "make_defense", "measure_leakage",
           "split_corpus", "train_reference"]
