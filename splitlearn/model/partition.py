"""Cut a decoder-only model at layer boundaries: ``partition(model, cuts)``::

    2-way:    client [bottom: emb + layers[0:c]]  ->  server [top: layers[c:n] + norm + head]
    U-shape:  client [bottom: emb + layers[0:c1]] ->  server [trunk: layers[c1:c2]]
              -> client [top: layers[c2:n] + norm + head]

Every ``0 <= c1 < c2 <= num_hidden_layers`` is valid; any family the adapter
(:mod:`splitlearn.model.arch`, docs/MODELS.md) knows. The segments share the model's modules (no
copy; a tied embedding/head stays one tensor in one process): README.md, 'Cut a model, in one
process'."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import torch
from torch import nn
from transformers import PretrainedConfig

from ..errors import ConfigError
from .arch import arch_of, check_causal_lm
from .segments import Segment, SegmentCache, labels_from_batch, loss_from_logits


def validate_cuts(cuts: Sequence[int] | int, n_layers: int) -> tuple[int, ...]:
    """Check cut points against ``n_layers`` blocks; return them as a tuple. Raises
    :class:`ConfigError`: not integers, none or more than two, out of ``[0, n_layers]``, unsorted
    or duplicated."""
    if isinstance(cuts, int):
        cuts = (cuts,)
    try:
        cuts = tuple(cuts)
    except TypeError:  # None, 2.5: neither a cut nor a sequence of cuts
        raise ConfigError(f"cuts must be an integer or a sequence of integers, got {cuts!r}") from None
    if not cuts or len(cuts) > 2:
        raise ConfigError(f"give one cut (2-way) or two cuts (U-shape), got {len(cuts)}: {cuts}")
    for c in cuts:
        if isinstance(c, bool) or not isinstance(c, int):
            raise ConfigError(f"cuts must be integers, got {c!r}")
        if not 0 <= c <= n_layers:
            raise ConfigError(f"cut {c} is out of range: this model has {n_layers} blocks, "
                              f"so cuts must lie in [0, {n_layers}]")
    if len(cuts) == 2 and cuts[0] == cuts[1]:
        raise ConfigError(f"duplicated cut {cuts[0]}: the two cuts of a U-shape must differ")
    if len(cuts) == 2 and cuts[0] > cuts[1]:
        raise ConfigError(f"cuts must be sorted, got {list(cuts)}; did you mean {sorted(cuts)}?")
    return cuts


def check_gpt2(model: nn.Module) -> nn.Module:
    """Refuse anything the adapter cannot cut (kept under its old name: any family now,
    :func:`splitlearn.model.arch.check_causal_lm`)."""
    return check_causal_lm(model)


def segment_ranges(cuts: tuple[int, ...], n_layers: int) -> list[tuple[str, int, int]]:
    """``[(kind, start, end), ...]`` for validated cuts."""
    bounds = (0, *cuts, n_layers)
    kinds = ("bottom", "top") if len(cuts) == 1 else ("bottom", "trunk", "top")
    return [(k, bounds[i], bounds[i + 1]) for i, k in enumerate(kinds)]


@dataclass
class Partition:
    """The segments of one split model, in order; iterate, index, or use the names."""

    config: PretrainedConfig
    cuts: tuple[int, ...]
    segments: list[Segment]

    def __iter__(self) -> Iterator[Segment]:
        return iter(self.segments)

    def __len__(self) -> int:
        return len(self.segments)

    def __getitem__(self, i: int) -> Segment:
        return self.segments[i]

    @property
    def bottom(self) -> Segment:
        return self.segments[0]

    @property
    def top(self) -> Segment:
        return self.segments[-1]

    @property
    def trunk(self) -> Optional[Segment]:
        return self.segments[1] if len(self.segments) == 3 else None

    @property
    def u_shape(self) -> bool:
        return len(self.cuts) == 2

    def new_caches(self) -> list[SegmentCache]:
        return [s.new_cache() for s in self.segments]

    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                caches: Optional[list[SegmentCache]] = None,
                position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Chain all segments in this process: input_ids (B, T) -> logits (B, T, V). Every
        segment gets the first one's ``position_ids`` (default: from the mask)."""
        x = input_ids
        for i, seg in enumerate(self.segments):
            x = seg(x, attention_mask, caches[i] if caches is not None else None, position_ids)
        return x

    __call__ = forward

    def loss(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Causal-LM loss of the chained segments, as ``model(input_ids, labels=input_ids)``."""
        logits = self.forward(input_ids, attention_mask)
        return loss_from_logits(logits, labels_from_batch(input_ids, attention_mask))


def partition(model: nn.Module, cuts: Sequence[int] | int) -> Partition:
    """Cut ``model`` (a decoder-only transformers ``*ForCausalLM``) at ``cuts``: ``c`` (bottom,
    top) or ``c1 < c2`` (bottom, trunk, top). Returns a :class:`Partition` of ``nn.Module``
    segments sharing the model's parameters."""
    check_causal_lm(model)
    cfg = model.config
    arch = arch_of(cfg)
    cuts = validate_cuts(cuts, arch.n_layers)
    parts = arch.parts(model)
    segments = []
    for kind, start, end in segment_ranges(cuts, arch.n_layers):
        modules = {**parts, "layers": list(parts["layers"][start:end])}
        segments.append(Segment(cfg, kind, start, end, modules))
    return Partition(cfg, cuts, segments)


def whole(model: nn.Module) -> Segment:
    """The whole model as one ``full`` segment (shares parameters); handy for baselines."""
    check_causal_lm(model)
    arch = arch_of(model.config)
    return Segment(model.config, "full", 0, arch.n_layers, arch.parts(model))
