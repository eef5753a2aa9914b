"""A segment: a contiguous run of a decoder-only model's layers, with the embeddings and/or the
LM head, for any family the adapter (:mod:`splitlearn.model.arch`) knows. A cut at layer
boundaries gives at most three kinds of segment::

    bottom = embeddings + layers[0:c1]          input_ids (B, T)   -> hidden (B, T, d)
    trunk  = layers[c1:c2]                      hidden (B, T, d)   -> hidden (B, T, d)
    top    = layers[c2:n] + final norm + head   hidden (B, T, d)   -> logits (B, T, V)

(``full`` holds everything and exists for tests and single-process use.)

Every segment takes the 2-D ``attention_mask`` of the whole sequence so far, (B, past + T), 1
for real tokens and 0 for (left) padding, builds its 4-D causal mask against a cache slot it
holds (docs/INTERNALS.md, "transformers 5 and segments"; one mask per layer type) and derives
positions from the mask (cumsum - 1) as ``generate()`` does, or takes the first segment's
``position_ids`` (rotary is recomputed on each side from them: docs/MODELS.md). Blocks keep their global ``layer_idx``, so one
:class:`SegmentCache` per segment lets each side decode token by token on its own.

One block runner: :func:`run_blocks` (the causal mask against a slot the blocks hold, then the
blocks) and :func:`embed` (token + position embeddings, dropout) are what both a
:class:`Segment` (export, the server, the analyzer) and the split model classes
(:mod:`splitlearn.hf.trunk`, :mod:`splitlearn.hf.familytrunk`) run their layers and embeddings through.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from transformers import DynamicCache, PretrainedConfig

from ..errors import ConfigError
from .arch import Arch, arch_of

KINDS = ("bottom", "trunk", "top", "full")


class SegmentCache(DynamicCache):
    """The KV cache of one segment for one batch of sequences: the ``DynamicCache`` the split
    model classes use too (a slot per model layer), plus the length seen so far.

    The length is kept here (not asked of the cache) because a bottom with no blocks has no
    cache slot to ask. ``kv`` is the cache itself (the server's sessions and batcher read and
    operate on it under that name).
    """

    def __init__(self, config: PretrainedConfig):
        super().__init__(config=config)
        self.length = 0  # tokens already processed, padding included

    @property
    def kv(self) -> "SegmentCache":
        return self

    def __repr__(self) -> str:
        return f"SegmentCache(length={self.length})"


def filled(cache) -> list:
    """The layers of ``cache`` that hold keys (a segment's or a client's; the model's others stay empty)."""
    return [layer for layer in cache.layers if layer.is_initialized and getattr(layer, "keys", None) is not None]


def droppable(layer) -> int:
    """How many of its last positions a filled cache ``layer`` can drop exactly with its own
    ``crop(-k)``: a full layer (or a sliding one that still holds all it saw) all of them; a
    sliding layer (transformers' ``DynamicSlidingWindowLayer``) past its window only those that
    leave it the ``window - 1`` before the cut: what it recorded since its last ``crop``
    (``activate_past_recording``), the last step's new positions; none if it records nothing."""
    held = layer.keys.shape[-2]
    seen = getattr(layer, "cumulative_length", None)
    if not getattr(layer, "is_sliding", False) or not isinstance(seen, int) or held >= seen:
        return held
    return max(held - (layer.sliding_window - 1), 0)


def embed(tok: nn.Module, pos: nn.Module, drop: nn.Module, position_ids: torch.Tensor,
          input_ids: Optional[torch.Tensor] = None, inputs_embeds: Optional[torch.Tensor] = None,
          token_type_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Learned-position embeddings (the split GPT-2 classes'): ``tok(ids)`` (or ``inputs_embeds``)
    + ``pos(position_ids)`` (+ ``tok(token_type_ids)``), then dropout. (B, T, d)."""
    if inputs_embeds is None:
        inputs_embeds = tok(input_ids)
    h = inputs_embeds + pos(position_ids).to(inputs_embeds.device)
    if token_type_ids is not None:
        h = h + tok(token_type_ids)
    return drop(h)


def run_blocks(blocks, config: PretrainedConfig, layer_idx: int, hidden: torch.Tensor,
               attention_mask: Optional[torch.Tensor] = None, cache=None,
               position_ids: Optional[torch.Tensor] = None,
               inputs_embeds: Optional[torch.Tensor] = None, rotary: Optional[nn.Module] = None,
               arch: Optional[Arch] = None) -> torch.Tensor:
    """Run ``blocks`` (consecutive layers, the first with global ``layer_idx``) on the new
    positions ``hidden`` (B, T, d): :meth:`splitlearn.model.arch.Arch.run_layers` (masks per layer
    type from the 2-D ``attention_mask`` (B, past + T) or None, sized against ``cache``'s slots;
    rotary from ``position_ids`` when ``rotary`` is given), then the layers.
    ``inputs_embeds``: what the masks take their dtype from (default ``hidden``)."""
    if not len(blocks):
        return hidden
    return (arch or arch_of(config)).run_layers(blocks, layer_idx, hidden, attention_mask, cache, position_ids,
                                                rotary, inputs_embeds)


def positions_from_mask(attention_mask: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Position ids of the last ``new_tokens`` columns, as ``generate()`` computes them.

    attention_mask: (B, past + T) of 0/1. Returns (B, T) long; padding positions are 0.
    """
    pos = attention_mask.long().cumsum(-1) - 1  # (B, past + T)
    pos = pos.masked_fill(attention_mask == 0, 0)
    return pos[:, -new_tokens:]


def loss_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Causal-LM loss exactly as transformers' ``ForCausalLM`` loss computes it (shift by one, ignore -100).

    logits: (B, T, V); labels: (B, T). Returns the mean over non-ignored targets.
    """
    shift_logits = logits[:, :-1, :].float().reshape(-1, logits.shape[-1])  # (B*(T-1), V)
    shift_labels = labels[:, 1:].reshape(-1).to(logits.device)  # (B*(T-1),)
    return nn.functional.cross_entropy(shift_logits, shift_labels, ignore_index=-100)


def labels_from_batch(input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor]) -> torch.Tensor:
    """Language-model labels: the inputs themselves, padding set to -100 (ignored)."""
    if attention_mask is None:
        return input_ids
    return input_ids.masked_fill(attention_mask == 0, -100)


class Segment(nn.Module):
    """Layers ``[start, end)`` of a decoder-only model, with its embeddings if ``start == 0``
    (bottom) and its final norm + LM head if ``end == num_hidden_layers`` (top).

    Build one with :func:`splitlearn.partition` (sharing the model's parameters) or
    :func:`splitlearn.load_segment` (from an exported file). Submodules keep the family's own
    names (``arch.embed_names``, ``arch.layers_name``, ``arch.norm_names``, ``arch.head_name``,
    and ``rotary_emb`` where the family has one); :meth:`hf_state_dict` gives the
    ``*ForCausalLM``'s parameter names. Family-neutral views: :attr:`layers_list`,
    :attr:`head_module`, :meth:`head_hidden`, :meth:`logits`.
    """

    def __init__(self, config: PretrainedConfig, kind: str, start: int, end: int,
                 modules: Optional[dict] = None):
        super().__init__()
        if kind not in KINDS:
            raise ConfigError(f"segment kind must be one of {KINDS}, got {kind!r}")
        self.config = config
        self.arch = arch = arch_of(config)
        self.kind = kind
        self.start, self.end = start, end
        self.has_embeddings = kind in ("bottom", "full")
        self.has_head = kind in ("top", "full")
        if modules is None:  # new modules: the model's own classes (on meta in load_segment)
            modules = arch.parts(arch.new_model(config))
            modules = {**modules, "layers": list(modules["layers"][start:end])}
        if self.has_embeddings:
            for name, m in modules["embed"].items():
                setattr(self, name, m)
        setattr(self, arch.layers_name, nn.ModuleList(modules["layers"]))
        if modules.get("rotary") is not None and len(modules["layers"]):
            self.rotary_emb = modules["rotary"]
        if self.has_head:
            for name, m in modules["norm"].items():
                setattr(self, name, m)
            setattr(self, arch.head_name, modules["head"])

    # -- description -------------------------------------------------------------------

    @property
    def blocks(self) -> tuple[int, int]:
        """The global layer range ``[start, end)`` this segment holds."""
        return (self.start, self.end)

    @property
    def layers_list(self) -> nn.ModuleList:
        """The segment's layers (the family's name for them: ``layers``, ``h``)."""
        return getattr(self, self.arch.layers_name)

    @property
    def head_module(self) -> nn.Module:
        """The LM head (a top's)."""
        return getattr(self, self.arch.head_name)

    def extra_repr(self) -> str:
        return f"kind={self.kind}, blocks=[{self.start}, {self.end}), family={self.arch.model_type}"

    def input_kind(self) -> str:
        """``"ids"`` for a segment that takes token ids, ``"hidden"`` for activations."""
        return "ids" if self.has_embeddings else "hidden"

    def new_cache(self) -> SegmentCache:
        return SegmentCache(self.config)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Parameters and buffers under the names the family's ``*ForCausalLM`` gives them."""
        return {self.arch.hf_name(name, self.start): t for name, t in self.state_dict().items()}

    # -- computation -------------------------------------------------------------------

    def head_hidden(self, x: torch.Tensor) -> torch.Tensor:
        """The final norm (and any projection after it): what the head multiplies. (B, T, d)."""
        return self.arch.head_hidden({n: getattr(self, n, None) for n in self.arch.norm_names}, x)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The last layer's output (B, T, d) -> logits (B, T, V): final norm, head (and softcap)."""
        return self.arch.logits(self.head_module, self.head_hidden(x))

    def forward(self, x: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                cache: Optional[SegmentCache] = None,
                position_ids: Optional[torch.Tensor] = None, logits_to_keep: int = 0,
                head: bool = True) -> torch.Tensor:
        """Run the segment on the new positions ``x``.

        x: input_ids (B, T) for a bottom/full segment, else hidden states (B, T, d).
        attention_mask: (B, past + T) 0/1 for the whole sequence so far, or None (no padding).
        cache: this segment's :class:`SegmentCache` to read and extend, or None (no cache).
        position_ids: (B, T) or (1, T): the positions the first segment used (default: derived
            from the mask, ``generate()``'s rule, or counted from the cache without one).
        logits_to_keep: with the head, compute logits for the last this many positions only
            (0: all), as Hugging Face's ``logits_to_keep``; generation needs just the last.
        head: False: a top stops before the final norm and returns its last layer's output
            (B, T, d), for a loss computed in chunks (:mod:`splitlearn.model.headloss`).
        Returns hidden states (B, T, d), or logits (B, T, V) for a top/full segment
        ((B, logits_to_keep, V) if that is given).
        """
        past = cache.length if cache is not None else 0
        T = x.shape[1]
        if attention_mask is not None and attention_mask.shape[-1] != past + T:
            raise ConfigError(
                f"attention_mask covers {attention_mask.shape[-1]} positions but the segment has "
                f"seen {past} and is given {T} new ones")
        rotary = getattr(self, "rotary_emb", None)
        if position_ids is None and (self.has_embeddings or rotary is not None):
            position_ids = self.arch.positions(attention_mask, past, T, x.device)  # (B|1, T)
        if self.has_embeddings:
            self.arch.check_positions(position_ids)
            x = self.arch.embed({n: getattr(self, n, None) for n in self.arch.embed_names}, position_ids,
                                input_ids=x, attention_mask=attention_mask, past=past)  # (B, T, d)
        x = run_blocks(self.layers_list, self.config, self.start, x, attention_mask,
                       cache.kv if cache is not None else None, position_ids,
                       rotary=rotary, arch=self.arch)  # (B, T, d)
        if cache is not None:
            cache.length = past + T
        if self.has_head and head:
            if logits_to_keep:
                x = x[:, -logits_to_keep:]  # (B, k, d): the norm and head act per position
            x = self.logits(x)  # (B, T or k, V)
        return x
