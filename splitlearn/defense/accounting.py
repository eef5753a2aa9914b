"""Differential-privacy accounting of the Gaussian defense, with Google's ``dp-accounting``.

Mechanism, neighbouring relation (L2 sensitivity 2C, noise multiplier sigma/2), composition
(``releases = tokens * sends``) and what is not accounted: docs/PRIVACY.md,
'Differential-privacy accounting'."""
from __future__ import annotations

import logging
import math

from ..errors import ConfigError

log = logging.getLogger(__name__)

ACCOUNTANTS = ("rdp", "pld")  # Renyi DP (Mironov 2017) | privacy loss distributions (exact-ish)


def gaussian_epsilon(noise_multiplier: float, releases: int, delta: float,
                     accountant: str = "rdp") -> float:
    """epsilon at ``delta`` (in (0, 1)) of ``releases`` Gaussian mechanisms of ``noise_multiplier``
    (noise std / L2 sensitivity; 0 gives ``math.inf``) each. ``accountant``: ``"rdp"``
    (``RdpAccountant``) or ``"pld"`` (``PLDAccountant``, tighter)."""
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


def composed_gaussian_epsilon(parts, delta: float, accountant: str = "rdp") -> float:
    """epsilon at ``delta`` of several self-composed Gaussian mechanisms composed:
    ``parts`` = [(noise_multiplier, releases), ...] (e.g. the activations and the gradients a
    U-shape client sends); ``math.inf`` when any noise multiplier is 0."""
    parts = list(parts)
    if not parts:
        raise ConfigError("composed_gaussian_epsilon needs at least one (noise_multiplier, releases)")
    for z, n in parts:
        check_accounting(z, n, delta, accountant)
    if any(z == 0 for z, _ in parts):
        return math.inf
    from .._extras import require

    require("privacy", "dp_accounting", what="the Gaussian defense's epsilon")
    import dp_accounting

    event = dp_accounting.ComposedDpEvent([
        dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(z), n) for z, n in parts])
    acc = dp_accounting.rdp.RdpAccountant() if accountant == "rdp" else dp_accounting.pld.PLDAccountant()
    acc.compose(event)
    return float(acc.get_epsilon(delta))


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
