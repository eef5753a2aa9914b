"""A default bound on what one training step, and one tenant, do to state that tenants share.

On the shared segment (``--federation shared`` and ``sequential``) every tenant's step goes
through one optimizer: the weights *and* AdamW's moments are everyone's. The lr cap bounds
the step size only through those moments: AdamW moves a weight by
``lr * m_hat / (sqrt(v_hat) + eps)``, at most ``lr * (1 - b1) / sqrt(1 - b2)`` (3.16 lr at the
defaults; Kingma & Ba 2015, section 2.1) whatever the gradient, but a gradient ``x1e6``
leaves ``v`` 1e12 times too large for ~``ln(1e12) / (1 - b2)`` steps: every later step of
every tenant is ~1e6 times too small (issue 40 measured ~1,400x on ``tiny-demo``).

So each step on shared state has its global gradient norm clipped (Pascanu et al. 2013) to

    bound = factor * exp(L)

``L`` the mean over tenants of each tenant's typical log-norm (issue 50):

- each tenant ``t`` has its own statistic ``X_t``: the mean of ``log(norm)`` over its own
  steps, an EMA with window ``window`` steps, bias-corrected as Adam corrects its moments (so
  its first steps weigh equally), updated with the norm *as applied* (clipped), each step
  weighted by the fraction ``r`` of the server's lr it was applied at; a step that moves no
  weight (lr 0, or below ``MIN_SHARE`` of it) is not applied at all (:mod:`.training`). A
  tenant's ``X_t`` moves only with its own steps: it stays where it was while the tenant is
  idle;
- each log-norm enters ``X_t`` clamped to ``L +- c``, ``c = log(reach)`` (reach 2), so every
  ``X_t`` stays within ``c`` of the estimate;
- ``L`` is the mean of the ``X_t``, one vote a tenant (not a step; a tenant's vote is 1 once
  its steps weigh one step at the full lr, its weight in units of that before: steps at a tiny
  lr buy a tiny vote). With ``X_m >= L - c`` whatever tenant ``m`` sends, ``L >= mean of the
  others - c / (N - 1)`` (and ``<= + c / (N - 1)``): with two tenants, one moves the bound by a
  factor ``reach`` (2) up or down at most, for however long the other is idle; with three,
  ``sqrt(2)``. A norm of 1e-12 (``"clip": 1e-12``, or a tiny gradient) pulls the bound down
  to half, never to 1e-11; ``x1e6`` raises it twice at most. One tenant alone (the only one that ever stepped) is its own estimate: the
  running geometric mean of its norms, each within ``reach`` of the mean before it.

What it does not keep: the clamp is symmetric, so while another tenant holds ``L`` a factor
``reach`` below a tenant's ``X_t``, that tenant's norms above its own mean enter clamped, and its
``X_t`` crawls down (``s`` the spread of its log-norms: by at most ``0.4 s / window`` a step,
``0.08 s / window`` once ``s`` below its norms' mean, ``0.009 s / window`` once ``2 s``).

O(tenants) a step. During the first ``warmup`` steps the factor is squared: a young statistic
is a mean of few norms, and the first steps of a training vary most (honest steps 3-7 of the
test suite's runs reached 2.9x the mean before them; later ones 1.5x). What it bounds:

- a step's norm is at most ``factor`` times the typical one, so its share of ``v`` is at most
  ``factor**2`` times an honest step's, and of ``m`` ``factor`` times: ``x1e6`` is worth no
  more than ``x factor * reach`` (6) of the others' typical norm;
- AdamW's moments hear a step as far as it may move the weights (:func:`partial_step`): a step
  at a fraction ``r`` of the server's lr is ``r`` of a step in ``m``, ``v`` and the step count,
  and one below ``MIN_SHARE`` is not taken (lr 0): a tenant's steps at lr 0 or a tiny lr move no
  statistic, whatever their gradients. This holds once another tenant has stepped (whose
  training there is to protect): a tenant alone steps as the unsplit model does (an lr
  schedule, lr 0 included), so the first tenant of a fresh server also sets the moments' scale;
- an honest step below the bound is applied untouched: bit-identical to the unsplit model.

The first step of a fresh server has no statistic to clip against, and whoever takes the first
steps sets the scale: the first is clipped only by ``--max-grad-norm`` if given (the statistic
is saved with the checkpoint, so a restarted server keeps it). ``--max-grad-norm`` replaces
this clip by a fixed one. A server of one tenant has no one else's training to protect: no
clip unless ``--max-grad-norm`` (its honest steps are the unsplit model's, spikes included).
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

REACH = 2.0  # the factor by which one tenant (of two) can move the bound, up or down
# an apply on state shared between tenants below this fraction of the server's lr moves no weight
# (AdamW moves one by at most 3.16 lr; float32 resolves 2**-24 of it): it is applied as lr 0,
# which steps nothing and moves no statistic (the clip's, AdamW's moments and step count)
MIN_SHARE = 2.0 ** -20


@contextmanager
def partial_step(opt: torch.optim.Optimizer, share: float) -> Iterator[None]:
    """The optimizer's next step counts as ``share`` (0..1) of a step in its moments: Adam's
    EMAs decay by ``b ** share`` and take the gradient at ``1 - b ** share``, and its step count
    grows by ``share`` (so its bias corrections ``1 - b ** t`` stay exact: Kingma & Ba 2015,
    section 3). A step at a fraction of the lr moves the statistics as far as that fraction of a
    step, so a run of steps at a tiny lr moves them as little as it moves the weights. Torch's
    Adam reads ``betas`` from the group and counts ``step`` (a float tensor) by one: for this
    step the betas are ``b ** share`` and the count is set to ``t / share - 1`` before it
    (``(b ** share) ** (t / share) = b ** t``, ``t`` the new count), then to ``t``. Optimizers
    without betas (SGD) step as they are."""
    groups = [g for g in opt.param_groups if "betas" in g]
    if share >= 1.0 or not groups:
        yield
        return
    saved = [g["betas"] for g in groups]
    counts = {}  # param -> its step count after this step
    for g in groups:
        g["betas"] = tuple(b ** share for b in g["betas"])
        for p in g["params"]:
            st = opt.state.get(p)
            if p.grad is not None and st and "step" in st:
                counts[p] = float(st["step"]) + share
                st["step"].fill_(counts[p] / share - 1.0)
    try:
        yield
    finally:
        for g, betas in zip(groups, saved):
            g["betas"] = betas
            for p in g["params"]:
                st = opt.state.get(p)
                if st and "step" in st and p.grad is not None:  # new state (its first step): share
                    st["step"].fill_(counts.get(p, share))


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
    """The bound of a step's gradient norm: fixed (``fixed``), or ``factor`` times the geometric
    mean over tenants of each tenant's running geometric mean of the norms it applied (``factor``
    None and no ``fixed``: no bound)."""

    def __init__(self, factor: Optional[float], window: int, warmup: int = 0, fixed: Optional[float] = None,
                 reach: float = REACH):
        self.factor, self.warmup, self.fixed, self.window = factor, warmup, fixed, window
        self.c = math.log(reach)  # how far from L a log-norm enters a tenant's statistic
        self.tenants: dict[str, list[float]] = {}  # tenant -> [EMA of log(norm) (not bias-corrected), its weight]
        self.steps = 0  # norms in the statistic, all tenants'
        self.log_mean: Optional[float] = None  # L (None: no norm yet)

    def bound(self, shared: bool = True) -> Optional[float]:
        """The bound of a step on shared state (``shared``), or on a client's own (fixed only)."""
        if self.fixed is not None:
            return self.fixed
        if not shared or self.factor is None or self.log_mean is None:
            return None
        factor = self.factor ** 2 if self.steps < self.warmup else self.factor
        return factor * math.exp(self.log_mean)

    def clip(self, params: list[torch.nn.Parameter], norm: float, shared: bool = True) -> Clipped:
        """Scale the gradients of ``params`` (global norm ``norm``) down to the bound; what it did."""
        c = Clipped(norm, self.bound(shared))
        if c.clipped:
            torch._foreach_mul_([p.grad for p in params], c.bound / norm)
        return c

    def applied(self, c: Clipped, tenant: str = "", share: float = 1.0) -> None:
        """A step of ``tenant`` with ``c`` was applied at ``share`` (0..1] of the server's lr: its
        norm joins the tenant's statistic with that weight (a zero norm, or lr, says nothing)."""
        if not c.applied > 0.0 or not share > 0.0:
            return
        w = min(share, 1.0) / self.window  # the EMA's weight of this step
        x = math.log(c.applied)
        if self.log_mean is not None:  # within a factor reach of the estimate, either way
            x = min(max(x, self.log_mean - self.c), self.log_mean + self.c)
        ema = self.tenants.setdefault(tenant, [0.0, 0.0])
        ema[0] = (1.0 - w) * ema[0] + w * x
        ema[1] = (1.0 - w) * ema[1] + w  # the bias correction (Kingma & Ba 2015, section 3)
        self.steps += 1
        self._estimate()

    def means(self) -> dict[str, float]:
        """Each tenant's statistic: the (bias-corrected) mean of its log-norms."""
        return {t: e / w for t, (e, w) in self.tenants.items() if w > 0.0}

    def others(self, tenant: str) -> bool:
        """Has a tenant other than ``tenant`` stepped (its norms are in the statistic)?"""
        return any(t != tenant for t in self.tenants)

    def votes(self) -> dict[str, float]:
        """Each tenant's vote in ``L``: 1 once its steps weigh one step at the full lr, less before
        (a tenant's steps at a tiny lr buy a tiny vote)."""
        return {t: min(1.0, w * self.window) for t, (_, w) in self.tenants.items() if w > 0.0}

    def _estimate(self) -> None:
        means, votes = self.means(), self.votes()
        total = sum(votes.values())
        self.log_mean = sum(votes[t] * x for t, x in means.items()) / total if total > 0.0 else None

    def state(self) -> dict:
        """The statistic, JSON-able (a checkpoint's counters)."""
        return {"tenants": {t: list(v) for t, v in self.tenants.items()}, "steps": self.steps}

    def restore(self, state: dict) -> None:
        if not state:
            return
        if "tenants" in state:
            self.tenants = {str(t): [float(e), float(w)] for t, (e, w) in state["tenants"].items()}
        else:  # a checkpoint of one statistic for all (before issue 50): one voter
            self.tenants = {"": [float(state["log_ema"]), float(state["weight"])]}
        self.steps = int(state["steps"])
        self._estimate()
