"""A default bound on what one training step does to state that tenants share.

On the shared segment (``--federation shared`` and ``sequential``) every tenant's step goes
through one optimizer: the weights *and* AdamW's moments are everyone's. The lr cap bounds
the step size only through those moments: AdamW moves a weight by
``lr * m_hat / (sqrt(v_hat) + eps)``, at most ``lr * (1 - b1) / sqrt(1 - b2)`` (3.16 lr at the
defaults; Kingma & Ba 2015, section 2.1) whatever the gradient, but a gradient ``x1e6``
leaves ``v`` 1e12 times too large for ~``ln(1e12) / (1 - b2)`` steps: every later step of
every tenant is ~1e6 times too small (issue 40 measured ~1,400x on ``tiny-demo``).

So each step on shared state has its global gradient norm clipped (Pascanu et al. 2013) to

    bound = factor * exp(mean of log(norm) over the steps before it)

a running geometric mean, an EMA with window ``window`` steps (weight ``1/window``), bias-
corrected as Adam corrects its moments so that the first steps weigh equally, and updated with
the norm *as applied* (clipped). O(1) per step: one log, one exp. During the first ``warmup``
steps the factor is squared: a young statistic is a mean of few norms, and the first steps of a
training vary most (honest steps 3-7 of the test suite's runs reached 2.9x the mean before them;
later ones 1.5x). What it bounds:

- a step's norm is at most ``factor`` times the typical one, so its share of ``v`` is at most
  ``factor**2`` times an honest step's, and of ``m`` ``factor`` times: ``x1e6`` is worth no
  more than ``x factor``, an honest step's spike;
- the statistic moves by at most ``log(factor) / n`` per step, ``n`` the steps in it up to
  ``window``: a tenant alone raises an old bound by ``factor**(1/window)`` per step
  (``3**0.01``: 1.1%; a young one faster: it is a mean of fewer norms), and a tenant with a fraction
  ``f`` of the steps holds it at most ``factor**(f / (1 - f))`` above the honest steps' (a
  geometric mean: the honest steps pull back in proportion; an arithmetic one would be
  ratcheted without bound by half of the steps);
- an honest step below the bound is applied untouched: bit-identical to the unsplit model.

The first step of a fresh server has no statistic to clip against, and whoever takes the first
steps sets the scale: the first is clipped only by ``--max-grad-norm`` if given (the statistic
is saved with the checkpoint, so a restarted server keeps it). ``--max-grad-norm`` replaces
this clip by a fixed one. A server of one tenant has no one else's training to protect: no
clip unless ``--max-grad-norm`` (its honest steps are the unsplit model's, spikes included).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class Clipped:
    """What the clip did to one step: the norm it found, and the bound in force (None: none)."""

    norm: float  # the step's gradient norm, before the clip
    bound: Optional[float]  # the norm a step may have (None: no bound yet)

    @property
    def clipped(self) -> bool:
        return self.bound is not None and self.norm > self.bound

    @property
    def applied(self) -> float:
        """The norm the optimizer stepped with."""
        return min(self.norm, self.bound) if self.bound is not None else self.norm


class NormClip:
    """The bound of a step's gradient norm: fixed (``fixed``), or ``factor`` times the running
    geometric mean of the norms applied before (``factor`` None and no ``fixed``: no bound)."""

    def __init__(self, factor: Optional[float], window: int, warmup: int = 0, fixed: Optional[float] = None):
        self.factor, self.warmup, self.fixed = factor, warmup, fixed
        self.keep = 1.0 - 1.0 / window  # the EMA's weight of the past
        self.log_ema = 0.0  # EMA of log(norm), not bias-corrected
        self.weight = 0.0  # 1 - keep**steps: the bias correction (Kingma & Ba 2015, section 3)
        self.steps = 0  # norms in the statistic

    def bound(self, shared: bool = True) -> Optional[float]:
        """The bound of a step on shared state (``shared``), or on a client's own (fixed only)."""
        if self.fixed is not None:
            return self.fixed
        if not shared or self.factor is None or self.steps == 0:
            return None
        factor = self.factor ** 2 if self.steps < self.warmup else self.factor
        return factor * math.exp(self.log_ema / self.weight)

    def clip(self, params: list[torch.nn.Parameter], norm: float, shared: bool = True) -> Clipped:
        """Scale the gradients of ``params`` (global norm ``norm``) down to the bound; what it did."""
        c = Clipped(norm, self.bound(shared))
        if c.clipped:
            torch._foreach_mul_([p.grad for p in params], c.bound / norm)
        return c

    def applied(self, c: Clipped) -> None:
        """A step with ``c`` was applied: its norm joins the statistic (a zero norm says nothing)."""
        if c.applied > 0.0:
            self.log_ema = self.keep * self.log_ema + (1.0 - self.keep) * math.log(c.applied)
            self.weight = self.keep * self.weight + (1.0 - self.keep)
            self.steps += 1

    def state(self) -> dict:
        """The statistic, JSON-able (a checkpoint's counters)."""
        return {"log_ema": self.log_ema, "weight": self.weight, "steps": self.steps}

    def restore(self, state: dict) -> None:
        if state:
            self.log_ema, self.weight = float(state["log_ema"]), float(state["weight"])
            self.steps = int(state["steps"])
