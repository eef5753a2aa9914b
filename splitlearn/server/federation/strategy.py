"""How a round's updates become the shared weights: federation strategies as objects (as in
Flower's ``flwr.server.strategy``), shared by the segment server and the fed server.

Every rule works on updates ``d_k = w_k - w`` around the current shared weights ``w``:

1. **bounded**: ``d_k * min(1, M / ||d_k||_2)``, the norm over all tensors, ``M`` the smaller of
   ``--max-update-norm`` and ``--max-update-ratio`` x ``||w||_2`` (the side's own norm: default
   0.5, so a member moves a side by at most half its norm in a round, whatever the model's size);
2. **combined** coordinate by coordinate, in float64, over ``w + d'_k``:
   ``FedAvg`` sum_k n_k w'_k / sum_k n_k (McMahan et al. 2017, eq. 1; n_k: the target tokens
   the server trained for member k, capped at ``--max-member-share`` by :func:`.aggregate.capped_weights`);
   ``FedMedian`` (Yin et al. 2018, option I; an even count averages the two middle values, as
   numpy); ``FedTrimmedAvg`` the mean after dropping the floor(beta K) largest and smallest
   values (option II; Flower's ``_trim_mean``);
3. the result is float32 and finite (every rule's result lies between the smallest and largest
   bounded upload). Integer and boolean tensors (buffers) keep the reference's values.

Design: docs/FEDERATION.md, 'One member cannot break the federation'.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch

from ..config import (DEFAULT_MAX_MEMBER_SHARE, DEFAULT_MAX_UPDATE_NORM, DEFAULT_MAX_UPDATE_RATIO,
                      check_aggregation, check_bounds, check_ratio, check_trim_beta)
from .aggregate import Aggregate, Weights
from .rounds import aggregate

log = logging.getLogger(__name__)


class Strategy:
    """Base: bound every update, then :meth:`combine` them (subclasses), around the reference."""

    name = "strategy"

    def __init__(self, max_update_norm: Optional[float] = None, max_share: Optional[float] = None, *,
                 max_update_ratio: Optional[float] = None):
        check_bounds(max_update_norm, max_share)
        check_ratio(max_update_ratio)
        self.max_update_norm = max_update_norm  # L2 bound of one member's update (None: unbounded)
        self.max_update_ratio = max_update_ratio  # ... and at most this times the side's own L2 norm (None: no)
        self.max_share = max_share  # largest fraction of a round's FedAvg weight one member holds (None: any)

    def describe(self) -> dict:
        return {"aggregation": self.name, "max_update_norm": self.max_update_norm,
                "max_update_ratio": self.max_update_ratio, "max_member_share": self.max_share}

    def aggregate(self, reference: Weights, updates: list[tuple[Weights, int]]) -> Aggregate:
        """The new shared weights from ``updates`` ((weights, samples) per member) around
        ``reference`` (the current shared weights, which every member started from): a round
        of one server, closed by :func:`.rounds.close_round` as every round is."""
        return aggregate(self, reference, updates)

    def combine(self, bounded: list[torch.Tensor], samples: list[float]) -> torch.Tensor:
        """The combination of the members' bounded uploads (float32 tensors of one shape: a
        flat buffer, or one tensor of the weights), coordinate by coordinate, in float64. Every rule here commutes with translation, so
        combining ``w + d_k`` equals ``w`` plus the combination of the ``d_k``."""
        raise NotImplementedError


class FedAvg(Strategy):
    """Sample-weighted mean of the bounded updates (McMahan et al. 2017; Sun et al. 2019)."""

    name = "fedavg"

    def combine(self, bounded: list[torch.Tensor], samples: list[float]) -> torch.Tensor:
        total = sum(samples)  # python ints (floats once a share is capped): never overflows
        acc = torch.zeros_like(bounded[0], dtype=torch.float64)
        for w, n in zip(bounded, samples):
            acc += w.double() * (n / total)
        return acc


class FedMedian(Strategy):
    """Coordinate-wise median of the bounded updates (Yin et al. 2018); samples are ignored,
    so a member cannot buy weight by claiming them."""

    name = "median"

    def combine(self, bounded: list[torch.Tensor], samples: list[int]) -> torch.Tensor:
        s = torch.stack(bounded).sort(dim=0).values  # (K, ...)
        K = s.shape[0]
        return s[K // 2].double() if K % 2 else (s[K // 2 - 1].double() + s[K // 2].double()) / 2


class FedTrimmedAvg(Strategy):
    """Coordinate-wise trimmed mean (Yin et al. 2018): drop the floor(beta K) largest and
    smallest values of each coordinate, average the rest (unweighted, like the median)."""

    name = "trimmed-mean"

    def __init__(self, max_update_norm: Optional[float] = None, beta: float = 0.2,
                 max_share: Optional[float] = None, *, max_update_ratio: Optional[float] = None):
        super().__init__(max_update_norm, max_share, max_update_ratio=max_update_ratio)
        check_trim_beta(beta)
        self.beta = beta  # fraction of the members trimmed at each end

    def describe(self) -> dict:
        return {**super().describe(), "trim_beta": self.beta}

    def combine(self, bounded: list[torch.Tensor], samples: list[int]) -> torch.Tensor:
        s = torch.stack(bounded).sort(dim=0).values  # (K, ...)
        cut = int(self.beta * s.shape[0])
        return s[cut:s.shape[0] - cut].double().mean(dim=0)


def make_strategy(aggregation: str = "fedavg", max_update_norm: Optional[float] = DEFAULT_MAX_UPDATE_NORM,
                  trim_beta: float = 0.2, max_share: Optional[float] = DEFAULT_MAX_MEMBER_SHARE, *,
                  max_update_ratio: Optional[float] = DEFAULT_MAX_UPDATE_RATIO) -> Strategy:
    """The strategy of ``--aggregation`` (fedavg | median | trimmed-mean); ``max_share``:
    ``--max-member-share`` (the robust rules weigh every member alike anyway);
    ``max_update_ratio``: ``--max-update-ratio``."""
    check_aggregation(aggregation)  # ConfigError for any other name
    if aggregation == "fedavg":
        return FedAvg(max_update_norm, max_share, max_update_ratio=max_update_ratio)
    if aggregation == "median":
        return FedMedian(max_update_norm, max_share, max_update_ratio=max_update_ratio)
    return FedTrimmedAvg(max_update_norm, trim_beta, max_share, max_update_ratio=max_update_ratio)


def strategy_of(cfg) -> Strategy:
    """The strategy of a config's :class:`~splitlearn.server.config.StrategyOptions` (ConfigError if invalid)."""
    return make_strategy(cfg.aggregation, cfg.max_update_norm, cfg.trim_beta, cfg.max_member_share,
                         max_update_ratio=cfg.max_update_ratio)


def coordinate_median(uploads: list[Weights]) -> Weights:
    """The coordinate-wise median of uploads (float32): the reference of a first round when
    the server cannot know the weights every client started from (:mod:`.clientside`)."""
    med = FedMedian()
    return {k: (med.combine([w[k].float() for w in uploads], []).float() if t.is_floating_point() else t.clone())
            for k, t in uploads[0].items()}
