"""A GPT-2 segment: a contiguous run of blocks, with the embeddings and/or the LM head.

A GPT-2 cut at block boundaries gives at most three kinds of segment::

    bottom = wte + wpe + blocks[0:c1]           input_ids (B, T)   -> hidden (B, T, d)
    trunk  = blocks[c1:c2]                      hidden (B, T, d)   -> hidden (B, T, d)
    top    = blocks[c2:n] + ln_f + lm_head      hidden (B, T, d)   -> logits (B, T, V)

(``full`` holds everything and exists for tests and single-process use.)

Every segment takes the 2-D ``attention_mask`` of the whole sequence so far, (B, past + T), 1
for real tokens and 0 for (left) padding, builds its 4-D causal mask against a cache slot it
holds (docs/INTERNALS.md, "transformers 5 and segments") and derives positions from the mask
(cumsum - 1) as ``generate()`` does. Blocks keep their global ``layer_idx``, so one
:class:`SegmentCache` per segment lets each side decode token by token on its own.

One block runner: :func:`run_blocks` (the causal mask against a slot the blocks hold, then the
blocks) and :func:`embed` (token + position embeddings, dropout) are what both a
:class:`Segment` (export, the server, the analyzer) and the split model classes
(:class:`splitlearn.hf.trunk.SplitGPT2Model`) run their blocks and embeddings through.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from transformers import DynamicCache, GPT2Config
from transformers.masking_utils import create_causal_mask
from transformers.models.gpt2.modeling_gpt2 import GPT2Block

from ..errors import ConfigError

KINDS = ("bottom", "trunk", "top", "full")


class SegmentCache(DynamicCache):
    """The KV cache of one segment for one batch of sequences: the ``DynamicCache`` the split
    model classes use too (a slot per model layer), plus the length seen so far.

    The length is kept here (not asked of the cache) because a bottom with no blocks has no
    cache slot to ask. ``kv`` is the cache itself (the server's sessions and batcher read and
    operate on it under that name).
    """

    def __init__(self, config: GPT2Config):
        super().__init__(config=config)
        self.length = 0  # tokens already processed, padding included

    @property
    def kv(self) -> "SegmentCache":
        return self

    def __repr__(self) -> str:
        return f"SegmentCache(length={self.length})"


def embed(wte: nn.Module, wpe: nn.Module, drop: nn.Module, position_ids: torch.Tensor,
          input_ids: Optional[torch.Tensor] = None, inputs_embeds: Optional[torch.Tensor] = None,
          token_type_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """GPT-2's embeddings, as ``GPT2Model`` computes them: ``wte(ids)`` (or ``inputs_embeds``)
    + ``wpe(position_ids)`` (+ ``wte(token_type_ids)``), then dropout. (B, T, d)."""
    if inputs_embeds is None:
        inputs_embeds = wte(input_ids)
    h = inputs_embeds + wpe(position_ids).to(inputs_embeds.device)
    if token_type_ids is not None:
        h = h + wte(token_type_ids)
    return drop(h)


def run_blocks(blocks, config: GPT2Config, layer_idx: int, hidden: torch.Tensor,
               attention_mask: Optional[torch.Tensor] = None, cache=None,
               position_ids: Optional[torch.Tensor] = None,
               inputs_embeds: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Run ``blocks`` (consecutive ``GPT2Block``\\ s, the first with global ``layer_idx``) on the
    new positions ``hidden`` (B, T, d): one 4-D causal mask from the 2-D ``attention_mask``
    (B, past + T) or None, sized against slot ``layer_idx`` of ``cache`` (a transformers
    ``Cache`` with a slot per model layer, read and extended, or None), then the blocks.
    ``position_ids``: as ``GPT2Model`` passes them (the mask's packed-sequence check without a
    cache). ``inputs_embeds``: what the mask takes its dtype from (default ``hidden``)."""
    if not len(blocks):
        return hidden
    mask = create_causal_mask(config=config, inputs_embeds=hidden if inputs_embeds is None else inputs_embeds,
                              attention_mask=attention_mask, cache=cache, position_ids=position_ids,
                              layer_idx=layer_idx)
    kw = {} if position_ids is None else {"position_ids": position_ids}
    for block in blocks:
        hidden = block(hidden, cache, mask, use_cache=cache is not None, **kw)  # (B, T, d)
    return hidden


def positions_from_mask(attention_mask: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Position ids of the last ``new_tokens`` columns, as ``generate()`` computes them.

    attention_mask: (B, past + T) of 0/1. Returns (B, T) long; padding positions are 0.
    """
    pos = attention_mask.long().cumsum(-1) - 1  # (B, past + T)
    pos = pos.masked_fill(attention_mask == 0, 0)
    return pos[:, -new_tokens:]


def loss_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Causal-LM loss exactly as ``GPT2LMHeadModel`` computes it (shift by one, ignore -100).

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
    """Blocks ``[start, end)`` of a GPT-2, with embeddings if ``start == 0`` (bottom) and
    ``ln_f`` + ``lm_head`` if ``end == n_layer`` (top).

    Build one with :func:`splitlearn.partition` (sharing the model's parameters) or
    :func:`splitlearn.load_segment` (from an exported file). Submodules are named like the
    Hugging Face model's (``wte``, ``wpe``, ``h``, ``ln_f``, ``lm_head``) and
    :meth:`hf_state_dict` gives the Hugging Face parameter names.
    """

    def __init__(self, config: GPT2Config, kind: str, start: int, end: int,
                 modules: Optional[dict] = None):
        super().__init__()
        if kind not in KINDS:
            raise ConfigError(f"segment kind must be one of {KINDS}, got {kind!r}")
        self.config = config
        self.kind = kind
        self.start, self.end = start, end
        self.has_embeddings = kind in ("bottom", "full")
        self.has_head = kind in ("top", "full")
        m = modules or {}

        def take(name, build):  # the model's own module when partitioning, else a new one
            return m[name] if m.get(name) is not None else build()

        if self.has_embeddings:
            self.wte = take("wte", lambda: nn.Embedding(config.vocab_size, config.n_embd))
            self.wpe = take("wpe", lambda: nn.Embedding(config.n_positions, config.n_embd))
            self.drop = take("drop", lambda: nn.Dropout(config.embd_pdrop))
        self.h = nn.ModuleList(take("h", lambda: [GPT2Block(config, layer_idx=i)
                                                  for i in range(start, end)]))
        if self.has_head:
            self.ln_f = take("ln_f", lambda: nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon))
            self.lm_head = take("lm_head", lambda: nn.Linear(config.n_embd, config.vocab_size, bias=False))

    # -- description -------------------------------------------------------------------

    @property
    def blocks(self) -> tuple[int, int]:
        """The global block range ``[start, end)`` this segment holds."""
        return (self.start, self.end)

    def extra_repr(self) -> str:
        return f"kind={self.kind}, blocks=[{self.start}, {self.end})"

    def input_kind(self) -> str:
        """``"ids"`` for a segment that takes token ids, ``"hidden"`` for activations."""
        return "ids" if self.has_embeddings else "hidden"

    def new_cache(self) -> SegmentCache:
        return SegmentCache(self.config)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Parameters and buffers under the names ``GPT2LMHeadModel`` gives them."""
        out = {}
        for name, t in self.state_dict().items():
            if name.startswith("h."):
                local, rest = name[2:].split(".", 1)
                out[f"transformer.h.{self.start + int(local)}.{rest}"] = t
            elif name.startswith(("wte.", "wpe.", "ln_f.")):
                out[f"transformer.{name}"] = t
            else:
                out[name] = t  # lm_head.weight
        return out

    # -- computation -------------------------------------------------------------------

    def forward(self, x: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                cache: Optional[SegmentCache] = None,
                position_ids: Optional[torch.Tensor] = None, logits_to_keep: int = 0,
                head: bool = True) -> torch.Tensor:
        """Run the segment on the new positions ``x``.

        x: input_ids (B, T) for a bottom/full segment, else hidden states (B, T, d).
        attention_mask: (B, past + T) 0/1 for the whole sequence so far, or None (no padding).
        cache: this segment's :class:`SegmentCache` to read and extend, or None (no cache).
        position_ids: (B, T) to override the positions derived from the mask (bottom only).
        logits_to_keep: with the head, compute logits for the last this many positions only
            (0: all), as Hugging Face's ``logits_to_keep``; generation needs just the last.
        head: False: a top stops before ``ln_f`` and returns its last block's output (B, T, d),
            for a loss computed in chunks (:mod:`splitlearn.model.headloss`) or a few positions' logits.
        Returns hidden states (B, T, d), or logits (B, T, V) for a top/full segment
        ((B, logits_to_keep, V) if that is given).
        """
        past = cache.length if cache is not None else 0
        T = x.shape[1]
        if attention_mask is not None and attention_mask.shape[-1] != past + T:
            raise ConfigError(
                f"attention_mask covers {attention_mask.shape[-1]} positions but the segment has "
                f"seen {past} and is given {T} new ones")
        if self.has_embeddings:
            x = self._embed(x, attention_mask, past, position_ids)  # (B, T, d)
        x = run_blocks(self.h, self.config, self.start, x, attention_mask,
                       cache.kv if cache is not None else None)  # (B, T, d)
        if cache is not None:
            cache.length = past + T
        if self.has_head and head:
            if logits_to_keep:
                x = x[:, -logits_to_keep:]  # (B, k, d): ln_f and lm_head act per position
            x = self.lm_head(self.ln_f(x))  # (B, T or k, V)
        return x

    def _embed(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor], past: int,
               position_ids: Optional[torch.Tensor]) -> torch.Tensor:
        T = input_ids.shape[1]
        if position_ids is None:
            if attention_mask is not None:
                position_ids = positions_from_mask(attention_mask, T)  # (B, T)
            else:
                position_ids = torch.arange(past, past + T, device=input_ids.device)[None]  # (1, T)
        if int(position_ids.max()) >= self.config.n_positions:
            raise ConfigError(f"position {int(position_ids.max())} is past n_positions="
                             f"{self.config.n_positions}")
        return embed(self.wte, self.wpe, self.drop, position_ids, input_ids)  # (B, T, d)
