"""The privacy a training run spent: epsilon at delta of the defense over the windows it sent.

A run that sent ``windows`` random windows of ``seq_len`` tokens from a text of ``tokens`` tokens
put each token of the text in about ``ceil(windows * seq_len / tokens)`` windows (a mean: random
windows), and each window releases up to ``seq_len`` vectors that depend on that token: that many
Gaussian releases per token, composed (docs/PRIVACY.md, 'Differential-privacy accounting'). A
defense without a formal guarantee (NoPeek) spends no epsilon it can state: None."""
from __future__ import annotations

import math
from typing import Optional

from ..errors import ConfigError


def spent(defense, *, windows: int, seq_len: int, tokens: int, delta: float = 1e-5) -> Optional[dict]:
    """``{"epsilon", "delta", "sends_per_token", "releases_per_token"}`` of a run of ``defense``
    that sent ``windows`` windows of ``seq_len`` tokens drawn from ``tokens`` tokens; None when
    the defense states no epsilon (or there is none)."""
    if defense is None or not hasattr(defense, "noise_multiplier"):
        return None
    if windows < 1 or seq_len < 1 or tokens < 1:
        raise ConfigError(f"windows, seq_len and tokens must be >= 1, got {windows}, {seq_len}, {tokens}")
    per_token = math.ceil(windows * seq_len / tokens)
    if getattr(defense, "defends_gradient", False):  # both channels released: composed
        eps = defense.training_epsilon(delta, steps=per_token, tokens=seq_len)
    else:
        eps = defense.epsilon(delta, steps=per_token, tokens=seq_len)
    if eps is None:
        return None
    return {"epsilon": eps, "delta": delta, "sends_per_token": per_token, "releases_per_token": per_token * seq_len}


def describe(s: Optional[dict]) -> str:
    """One line for a run's end."""
    if s is None:
        return "privacy spent: no DP defense, no epsilon to state"
    return (f"privacy spent: epsilon {s['epsilon']:.3g} at delta {s['delta']:g} ({s['releases_per_token']} "
            f"releases per token: each token in ~{s['sends_per_token']} windows sent)")
