"""Cross-session batching of decode steps: many sessions, one pass over the weights.

Decoding one token per session is weight-bound: every step reads all of the segment's
weights to process a handful of rows. When several sessions step at the same time, the
server stacks their new rows and runs the weight-heavy parts of each block once::

    rows of session 1 (B1, 1, d) -+                 +-> attention of session 1 with its own cache
    rows of session 2 (B2, 1, d) -+-> ln_1, c_attn -+-> attention of session 2 with its own cache -+-> c_proj, MLP
    ...                            (N, 1, d)        +-> ...                                        |   (N, 1, d)
                                                                                                   +-> ln_f, lm_head

Attention stays per session: each keeps its own KV cache, positions and padding mask, built
exactly as :class:`~splitlearn.segments.Segment` builds them, and calls the same attention
kernel; only the row-wise matrix products are shared. No request waits for others: a step
queues, and the first step queued schedules one *drain* on the server's compute thread
(:mod:`.compute`); when the drain runs it takes every step queued by then, so steps that
arrive while the model is busy share the next pass (see :class:`DecodeBatcher`).
"""
from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from transformers.masking_utils import create_causal_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.gpt2.modeling_gpt2 import eager_attention_forward

from ..lora import lora_rows
from ..segments import Segment, SegmentCache
from .compute import ComputeThread


@dataclass
class DecodeItem:
    """One session's decode step: its cache and new rows (B, 1, d).

    ``prepare`` runs on the compute thread just before the batch: it raises if the step may
    not run now (a 409 or 429 for this session alone) and returns the mask of the whole
    sequence, (B, past + 1), or None for no padding. ``finish`` turns the step's output
    (B, 1, d|V) into the answer (the response bytes), also on the compute thread. ``future``
    gets that answer, or the step's error.
    """

    cache: SegmentCache
    hidden: torch.Tensor
    prepare: Callable[[], Optional[torch.Tensor]] = lambda: None
    finish: Callable[[torch.Tensor], Any] = lambda out: out
    mask: Optional[torch.Tensor] = None
    future: Future = field(default_factory=Future)
    adapter: Any = None  # the session's LoRA adapter (splitlearn.lora.Adapter), None: the base


@torch.no_grad()
def batched_decode(segment: Segment, items: list[DecodeItem]) -> list[torch.Tensor]:
    """Run one new position of every item through ``segment``; outputs in item order.

    Outputs are hidden states (B_i, 1, d), or logits (B_i, 1, V) for a segment with the head.
    """
    rows = [it.hidden.shape[0] for it in items]
    x = torch.cat([it.hidden for it in items], dim=0)  # (N, 1, d)
    cfg = segment.config
    attend = ALL_ATTENTION_FUNCTIONS.get_interface(cfg._attn_implementation, eager_attention_forward)
    masks = [create_causal_mask(config=cfg, inputs_embeds=it.hidden, attention_mask=it.mask,
                                past_key_values=it.cache.kv, layer_idx=segment.start)
             for it in items] if len(segment.h) else []
    with lora_rows(segment, [(n, it.adapter) for it, n in zip(items, rows)]):  # per-row adapters
        x = _blocks(segment, items, rows, masks, attend, x)  # (N, 1, d)
    for it in items:
        it.cache.length += 1
    if segment.has_head:
        x = segment.lm_head(segment.ln_f(x))  # (N, 1, V)
    return list(x.split(rows, dim=0))


def _blocks(segment: Segment, items: list[DecodeItem], rows: list[int], masks: list, attend, x: torch.Tensor) -> torch.Tensor:
    """The blocks of :func:`batched_decode`: shared row-wise products, attention per session."""
    for block in segment.h:
        attn = block.attn
        a = block.ln_1(x)  # (N, 1, d)
        q, k, v = attn.c_attn(a).split(attn.split_size, dim=2)  # 3 x (N, 1, d)
        heads = lambda t: t.view(t.shape[0], 1, -1, attn.head_dim).transpose(1, 2)  # (N, H, 1, hd)
        q, k, v = heads(q), heads(k), heads(v)
        outs, start = [], 0
        for it, n, mask in zip(items, rows, masks):
            sl = slice(start, start + n)
            keys, values = it.cache.kv.update(k[sl], v[sl], attn.layer_idx)  # (n, H, past+1, hd)
            o, _ = attend(attn, q[sl], keys, values, mask, dropout=0.0, scaling=attn.scaling)
            outs.append(o.reshape(n, 1, -1))  # (n, 1, d)
            start += n
        x = x + attn.c_proj(torch.cat(outs, dim=0))  # (N, 1, d)
        x = x + block.mlp(block.ln_2(x))  # (N, 1, d)
    return x


class DecodeBatcher:
    """Collects decode steps from any thread and runs them together on the compute thread.

    ``batching=False`` runs each queued step alone (the benchmark's unbatched baseline).
    ``lock``, if given, is held while a batch runs (the runtime's state lock).
    """

    def __init__(self, segment: Segment, compute: ComputeThread, lock: Optional[threading.RLock] = None,
                 batching: bool = True):
        self.segment = segment
        self.compute = compute
        self.lock = lock or threading.RLock()
        self.batching = batching
        self._queue: list[DecodeItem] = []
        self._queue_lock = threading.Lock()
        self._scheduled = False  # a drain is queued on the compute thread
        self.batches = 0  # forwards run
        self.items = 0  # steps served

    def enqueue(self, item: DecodeItem) -> Future:
        """Queue ``item`` (from any thread, the compute thread included); its future."""
        with self._queue_lock:
            self._queue.append(item)
            if not self._scheduled:
                self._scheduled = True
                self.compute.submit(self.drain)
        return item.future

    def submit(self, item: DecodeItem):
        """Queue ``item`` and wait for its answer (not from the compute thread itself)."""
        return self.enqueue(item).result()

    def drain(self) -> None:
        """Run everything queued so far (on the compute thread)."""
        with self._queue_lock:
            batch, self._queue, self._scheduled = self._queue, [], False
        if self.batching:
            self._run(batch)
        else:
            for it in batch:
                self._run([it])

    def _run(self, batch: list[DecodeItem]) -> None:
        with self.lock:
            ready = []
            for it in batch:
                try:
                    it.mask = it.prepare()
                    ready.append(it)
                except Exception as e:  # this step is refused; the others go on
                    it.future.set_exception(e)
            if not ready:
                return
            try:
                if self.segment.training:  # eval() walks every submodule: 0.16 ms for 8 blocks
                    self.segment.eval()
                outputs = batched_decode(self.segment, ready)
                self.batches += 1
                self.items += len(ready)
            except Exception as e:
                for it in ready:
                    it.future.set_exception(e)
                return
        for it, out in zip(ready, outputs):
            try:
                it.future.set_result(it.finish(out))
            except Exception as e:
                it.future.set_exception(e)
