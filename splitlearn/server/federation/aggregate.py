"""The arithmetic of a round, pure functions over tensors (as Flower's ``strategy/aggregate.py``):
how far an update went (:func:`update_norm`), how far it may go (:func:`update_limit`), a point toward it (:func:`toward`), the FedAvg
weights under the member cap (:func:`capped_weights`), and a strategy's answer
(:class:`Aggregate`). Read by :mod:`.rounds` (where a round closes) and :mod:`.strategy` (the
rules); the rules and their references: :mod:`.strategy`'s docstring.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch

Weights = dict[str, torch.Tensor]


@dataclass
class Aggregate:
    """A strategy's answer: the new weights (float32) and what bounding did to each update."""

    weights: Weights
    norms: list[float]  # ||w_k - w||_2 of each update as sent
    clipped: list[bool]  # whether each update was scaled down to max_update_norm
    share_capped: list[bool] = field(default_factory=list)  # whether each FedAvg weight was lowered to max_share


def update_norm(reference: Weights, weights: Weights) -> float:
    """``||weights - reference||_2`` over every floating-point tensor, in float64 (the
    difference of two finite float32 values can overflow float32, never float64)."""
    total = 0.0
    for k, ref in reference.items():
        if ref.is_floating_point():
            total += float((weights[k].double() - ref.double()).pow(2).sum())
    return math.sqrt(total)


def weights_norm(weights: Weights) -> float:
    """``||weights||_2`` over every floating-point tensor, in float64."""
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in weights.values() if t.is_floating_point()))


def update_limit(max_norm: Optional[float], max_ratio: Optional[float], reference: Weights) -> Optional[float]:
    """The L2 bound of one member's update around ``reference``: ``max_norm``, and at most
    ``max_ratio`` times the reference's own norm (a bound in the weights' own scale: a member
    moves a side by at most that fraction of it per round); None: unbounded. A reference of
    norm 0 is bounded by ``max_norm`` only."""
    limit = max_norm
    if max_ratio is not None:
        own = weights_norm(reference) * max_ratio
        if own > 0.0 and (limit is None or own < limit):
            limit = own
    return limit


def capped_weights(samples: list[int], max_share: Optional[float]) -> list[float]:
    """FedAvg weights in which no member holds more than ``max_share`` of the total: members
    over it are lowered to exactly that share of the new total, the others keep theirs
    (water-filling, largest first). ``samples`` itself, the same ints, when no member is over
    (so an honest round's arithmetic is unchanged bit for bit); equal weights when no weights
    can satisfy the cap (``max_share * K <= 1``)."""
    total, k = sum(samples), len(samples)
    if max_share is None or k < 2 or max(samples) <= max_share * total:
        return samples
    if max_share * k <= 1:
        return [1] * k
    order = sorted(range(k), key=lambda i: -samples[i])
    for c in range(1, k):  # the c largest are capped at x = max_share * (rest + c x)
        rest = sum(samples[i] for i in order[c:])
        x = max_share * rest / (1 - max_share * c)
        if samples[order[c]] <= x:
            out = [float(n) for n in samples]
            for i in order[:c]:
                out[i] = x
            return out
    return [1] * k  # (unreachable: max_share * k > 1 leaves the smallest uncapped)


def toward(ref: torch.Tensor, w: torch.Tensor, scale: float) -> torch.Tensor:
    """``ref + scale * (w - ref)`` (0 < scale < 1) in float64, as float32: a point between two
    float32 values, so finite."""
    r = ref.double()
    return (r + (w.double() - r) * scale).float()
