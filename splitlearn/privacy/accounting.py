"""Differential-privacy accounting of the Gaussian defense, with Google's ``dp-accounting``.

What is accounted (see docs/PRIVACY.md for the whole threat model):

- **Mechanism.** :class:`~.defenses.GaussianNoise` releases, for every token position t of a
  sequence, ``y_t = clip_C(h_t) + N(0, (sigma * C)^2 I)`` where ``clip_C`` scales the cut-layer
  vector ``h_t`` to L2 norm at most ``C`` (DP-Forward, Du et al., CCS 2023, arXiv 2309.06746,
  perturbs forward activations the same way).
- **Neighbouring relation.** Two inputs are neighbours if they differ *in any way* (replace
  one sequence by any other; in particular, replace one token). Every clipped vector lies in
  the ball of radius ``C``, so whatever the bottom computes, one released vector changes by at
  most ``2C`` in L2: the **L2 sensitivity is 2C** per released vector, and the noise
  multiplier (noise std / sensitivity) is ``sigma * C / (2C) = sigma / 2``.
- **Composition.** Causal attention lets a token influence every later position, so one token
  (or one sequence) can change every vector released after it. We account every release that
  can depend on the protected input: ``releases = tokens_per_send * sends`` (a training
  sequence of T tokens sent once is T releases; sent for E epochs, E*T; generation sends the
  prompt's P vectors and one more per decoding step: P + new tokens). The releases compose
  as that many Gaussian mechanisms (fresh noise each), computed by the accountant.
- **Not accounted:** the weights. The bottom is trained on the client's data and later
  releases are computed with those weights; the guarantee treats the weights at each release
  as fixed. Labels sent to the server in the 2-way split are not protected at all.
"""
from __future__ import annotations

import logging
import math

from ..errors import ConfigError

log = logging.getLogger(__name__)

ACCOUNTANTS = ("rdp", "pld")  # Renyi DP (Mironov 2017) | privacy loss distributions (exact-ish)


def gaussian_epsilon(noise_multiplier: float, releases: int, delta: float,
                     accountant: str = "rdp") -> float:
    """epsilon at ``delta`` of ``releases`` Gaussian mechanisms of ``noise_multiplier`` each.

    noise_multiplier: noise standard deviation / L2 sensitivity (> 0; 0 gives ``inf``).
    releases: how many times the mechanism runs on data depending on the protected input.
    delta: target delta, in (0, 1).
    accountant: ``"rdp"`` (``dp_accounting.rdp.RdpAccountant``) or ``"pld"``
        (``dp_accounting.pld.PLDAccountant``, tighter).
    Returns epsilon (``math.inf`` without noise).
    """
    check_accounting(noise_multiplier, releases, delta, accountant)
    if noise_multiplier == 0:
        return math.inf
    from .._extras import require

    require("privacy", "dp_accounting", what="the Gaussian defense's epsilon")
    import dp_accounting

    event = dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(noise_multiplier),
                                              releases)
    if accountant == "rdp":
        acc = dp_accounting.rdp.RdpAccountant()
    else:
        acc = dp_accounting.pld.PLDAccountant()
    acc.compose(event)
    eps = float(acc.get_epsilon(delta))
    log.debug("epsilon(z=%g, releases=%d, delta=%g, %s) = %g", noise_multiplier, releases, delta,
              accountant, eps)
    return eps


def check_accounting(noise_multiplier: float, releases: int, delta: float, accountant: str) -> None:
    """Raise :class:`ConfigError` naming the first unusable accounting parameter."""
    if not isinstance(noise_multiplier, (int, float)) or not noise_multiplier >= 0:
        raise ConfigError(f"noise_multiplier must be >= 0, got {noise_multiplier!r}")
    if isinstance(releases, bool) or not isinstance(releases, int) or releases < 1:
        raise ConfigError(f"releases must be a positive integer, got {releases!r}")
    if not isinstance(delta, (int, float)) or not 0 < delta < 1:
        raise ConfigError(f"delta must lie in (0, 1), got {delta!r}")
    if accountant not in ACCOUNTANTS:
        raise ConfigError(f"unknown accountant {accountant!r}; use one of {', '.join(ACCOUNTANTS)}")
