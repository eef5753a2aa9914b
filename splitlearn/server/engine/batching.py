"""Cross-session batching of decode steps: many sessions, one pass over the weights.

Decoding one token per session is weight-bound: every step reads all of the segment's
weights to process a handful of rows. When several sessions step at the same time, the
server stacks their new rows and runs the weight-heavy parts of each block once::

    rows of session 1 (B1, 1, d) -+                  +-> attention of session 1 with its own cache
    rows of session 2 (B2, 1, d) -+-> norm, q, k, v -+-> attention of session 2 with its own cache -+-> out proj, MLP
    ...                            (N, 1, d)         +-> ...                                        |   (N, 1, d)
                                                                                                    +-> final norm, head

Attention stays per session: each keeps its own KV cache, positions and padding mask, built
exactly as :class:`~splitlearn.model.segments.Segment` builds them, and calls the same attention
kernel; only the row-wise matrix products are shared. GPT-2 runs a hand-written block (the layout
the CUDA graphs capture, :mod:`.graphs`); every other family runs its layers' own call on the
stacked rows (:func:`family_decode`): a :class:`SessionRows` cache extends each session's own
cache and hands the attention the sessions' keys padded to one length, with the sessions' masks
(one per layer type, sliding windows included) stacked and the padding masked, so each row still
attends to its own session's keys only, through the family's attention function (transformers'
``ALL_ATTENTION_FUNCTIONS``: eager, sdpa). No request waits for others: a step
queues, and the first step queued schedules one *drain* on the server's compute thread
(:mod:`.compute`); when the drain runs it takes every step queued by then, so steps that
arrive while the model is busy share the next pass (see :class:`DecodeBatcher`).

Sessions that shared a batch get their answers at the same moment, and their next steps come
back a little apart (each client turns its answer into the next step at its own pace). A
drain that runs at the first of them would split the group: one pass for the early one, one
for the rest, and the split would last. So a drain that finds some, but not all, of the
previous batch's sessions back waits up to ``wait_s`` (``--batch-wait-ms``) for the others::

    batch k:  {A, B, C}   answers out at t
    queue:    A (t + 0.2 ms)                  -> wait: B and C were in batch k
              B (t + 0.5 ms), C (t + 0.9 ms)  -> all back: batch k+1 = {A, B, C}

A session that was not in the previous batch never makes a drain wait (a client's two row
groups in flight, which alternate by design, stay apart), and a closed session is forgotten.
"""
from __future__ import annotations

import inspect
import threading
import time
from concurrent.futures import Future
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from transformers.masking_utils import create_causal_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.gpt2.modeling_gpt2 import eager_attention_forward

from ...model.lora import lora_rows
from ...model.segments import Segment, SegmentCache
from .compute import ComputeThread
from .graphs import DecodeGraphs
from .priority import DecodeBudget, fair_take


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
    adapter: Any = None  # the session's LoRA adapter (splitlearn.model.lora.Adapter), None: the base
    key: Any = None  # the session's id: which steps belong together across batches
    queued_at: float = 0.0  # time.monotonic() when it was queued
    owner: str = ""  # the session's tenant: batches take owners in turn (splitlearn/server/priority.py)
    positions: Optional[torch.Tensor] = None  # the first segment's position ids (B|1, 1); None: from the mask


@torch.no_grad()
def batched_decode(segment: Segment, items: list[DecodeItem], graphs: Optional[DecodeGraphs] = None) -> list[torch.Tensor]:
    """Run one new position of every item through ``segment``; outputs in item order.

    Outputs are hidden states (B_i, 1, d), or logits (B_i, 1, V) for a segment with the head.
    ``graphs``: the row-wise parts replayed as CUDA graphs where they may be (:mod:`.graphs`).
    GPT-2 (the adapter's ``decode_batching``) runs the hand-written block; another family runs
    :func:`family_decode`, or each session's step alone through the segment where its rows do not
    stack (:func:`rows_batchable`; one session: alone, exactly).
    """
    if not segment.arch.family.decode_batching:
        if len(items) > 1 and rows_batchable(segment):
            return family_decode(segment, items)
        outs = []
        for it in items:
            with lora_rows(segment, [(it.hidden.shape[0], it.adapter)]):
                outs.append(segment(it.hidden, it.mask, it.cache, it.positions))  # (B_i, 1, d|V); length grows
        return outs
    rows = [it.hidden.shape[0] for it in items]
    x = torch.cat([it.hidden for it in items], dim=0)  # (N, 1, d)
    cfg = segment.config
    attend = ALL_ATTENTION_FUNCTIONS.get_interface(cfg._attn_implementation, eager_attention_forward)
    masks = [create_causal_mask(config=cfg, inputs_embeds=it.hidden, attention_mask=it.mask,
                                cache=it.cache.kv, layer_idx=segment.start)
             for it in items] if len(segment.h) else []

    def attention(block, qkv: torch.Tensor) -> torch.Tensor:  # (N, 1, 3d) -> (N, 1, d), per session
        attn = block.attn
        q, k, v = qkv.split(attn.split_size, dim=2)  # 3 x (N, 1, d)
        heads = lambda t: t.view(t.shape[0], 1, -1, attn.head_dim).transpose(1, 2)  # (N, H, 1, hd)
        q, k, v = heads(q), heads(k), heads(v)
        outs, start = [], 0
        for it, n, mask in zip(items, rows, masks):
            sl = slice(start, start + n)
            keys, values = it.cache.kv.update(k[sl], v[sl], attn.layer_idx)  # (n, H, past+1, hd)
            o, _ = attend(attn, q[sl], keys, values, mask, dropout=0.0, scaling=attn.scaling)
            outs.append(o.reshape(n, 1, -1))  # (n, 1, d)
            start += n
        return torch.cat(outs, dim=0)

    cap = graphs.get(x.shape[0], x) if graphs is not None and graphs.usable(items, x) else None
    if cap is not None:
        x = graphs.run(cap, x, lambda i, qkv: attention(segment.h[i], qkv))  # (N, 1, d|V)
    else:
        with lora_rows(segment, [(n, it.adapter) for it, n in zip(items, rows)]):  # per-row adapters
            arch = segment.arch  # the family's row-wise parts of a layer (Family.decode_stages)
            for block in segment.h:
                x = arch.decode_rest(block, x, attention(block, arch.decode_attn_input(block, x)))  # (N, 1, d)
        if segment.has_head:
            x = segment.logits(x)  # (N, 1, V): the final norm, the head
    for it in items:
        it.cache.length += 1
    return list(x.split(rows, dim=0))


ROWS_ATTENTION = ("eager", "sdpa")  # attention functions whose masks stack (a tensor per row)


def rows_batchable(segment: Segment) -> bool:
    """Whether :func:`family_decode` batches this segment's sessions: hidden states in (not token
    ids), an attention function whose masks are tensors (eager, sdpa), no alibi (Falcon's is
    folded into a mask rebuilt from each session's whole 2-D mask: run per session)."""
    return (not segment.has_embeddings and not segment.arch.uses_alibi
            and getattr(segment.config, "_attn_implementation", None) in ROWS_ATTENTION)


class SessionRows:
    """The sessions' caches seen by a family's layers as one cache of N rows.

    A layer's attention calls ``update(keys, values, layer_idx)`` with the new position's keys
    and values of every row, (N, H_kv, 1, hd). Each session's rows extend that session's own
    cache (its slot, sliding window and all, exactly as the segment alone would), and the
    sessions' whole keys and values come back stacked, each left-padded with zeros to the
    longest of that layer type, (N, H_kv, K_max, hd). The stacked mask (:func:`stack_masks`)
    masks the padding, so a row attends to its own session's keys and nothing else."""

    def __init__(self, items: list[DecodeItem], rows: list[int], types: list[str], lengths: dict):
        self.items, self.rows, self.types = items, rows, types  # types: the layer type of each global layer
        self.lengths = lengths  # layer type -> [keys of each session after this step]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        lengths = self.lengths[self.types[layer_idx]]
        width = max(lengths)
        keys, values, start = [], [], 0
        for it, n, length in zip(self.items, self.rows, lengths):
            k, v = it.cache.kv.update(key_states[start:start + n], value_states[start:start + n], layer_idx)
            if k.shape[-2] != length:  # the mask was sized for another length: never attend to it
                raise RuntimeError(f"layer {layer_idx}: a session's cache holds {k.shape[-2]} keys, its mask {length}")
            keys.append(F.pad(k, (0, 0, width - length, 0)))  # (n, H_kv, width, hd)
            values.append(F.pad(v, (0, 0, width - length, 0)))
            start += n
        return torch.cat(keys), torch.cat(values)  # (N, H_kv, width, hd)


def stack_masks(per_session: list[dict], rows: list[int]) -> tuple[dict, dict]:
    """The sessions' 4-D masks (one per layer type each, (B_i|1, 1, 1, K_i), bool or additive
    float) stacked into (N, 1, 1, K_max) per type, each left-padded with "masked" (False, or the
    dtype's min); and each type's K_i per session."""
    masks, lengths = {}, {}
    for t in per_session[0]:
        ms = [m[t] for m in per_session]
        width = max(m.shape[-1] for m in ms)
        fill = False if ms[0].dtype == torch.bool else torch.finfo(ms[0].dtype).min
        masks[t] = torch.cat([F.pad(m.expand(n, *m.shape[1:]), (width - m.shape[-1], 0), value=fill)
                              for m, n in zip(ms, rows)])
        lengths[t] = [m.shape[-1] for m in ms]
    return masks, lengths


def family_decode(segment: Segment, items: list[DecodeItem]) -> list[torch.Tensor]:
    """One new position of every item through a family's segment (not GPT-2's hand-written
    block): the row-wise products (projections, MLP, norms, the head) once over the stacked rows,
    attention per session through :class:`SessionRows`; rotary from each session's own positions
    (the first segment's, or its mask's, as the segment alone derives them)."""
    arch, rows = segment.arch, [it.hidden.shape[0] for it in items]
    x = torch.cat([it.hidden for it in items], dim=0)  # (N, 1, d)
    pos = [(it.positions if it.positions is not None
            else arch.positions(it.mask, it.cache.length, 1, x.device)).expand(n, 1)
           for it, n in zip(items, rows)]  # (B_i, 1) each
    layers = segment.layers_list
    with lora_rows(segment, [(n, it.adapter) for it, n in zip(items, rows)]):
        if len(layers):
            per = [arch.masks(segment.start, segment.end, it.hidden, it.mask, it.cache.kv, p, materialize=True)
                   for it, p in zip(items, pos)]
            masks, lengths = stack_masks(per, rows)
            position_ids = torch.cat(pos)  # (N, 1)
            rotary = getattr(segment, "rotary_emb", None)
            pes = {}
            if rotary is not None:
                per_type = "layer_type" in inspect.signature(type(rotary).forward).parameters
                for t in masks:
                    pes[t] = rotary(x, position_ids, t) if per_type else rotary(x, position_ids)
            cache = SessionRows(items, rows, arch.layer_types, lengths)
            for j, layer in enumerate(layers):
                t = arch.layer_types[segment.start + j]
                x = arch.call_layer(layer, x, masks[t], position_ids, cache, pes.get(t))  # (N, 1, d)
        if segment.has_head:
            x = segment.logits(x)  # (N, 1, V)
    for it in items:
        it.cache.length += 1
    return list(x.split(rows, dim=0))


class DecodeBatcher:
    """Collects decode steps from any thread and runs them together on the compute thread.

    ``batching=False`` runs each queued step alone (the benchmark's unbatched baseline).
    ``lock``, if given, is held while a batch runs (the runtime's state lock). ``wait_s``: how
    long a drain waits for the rest of the previous batch (see the module docstring).
    ``inference``: a context for the forward (the runtime's prepacked weights,
    :mod:`splitlearn.model.packed`). ``max_rows``: rows of one batch at most, taken from the queued
    steps one owner at a time (:func:`.priority.fair_take`); the rest wait for the next drain
    (queued behind the compute thread's other work) or preemption point. None: everything queued.
    """

    def __init__(self, segment: Segment, compute: ComputeThread, lock: Optional[threading.RLock] = None,
                 batching: bool = True, wait_s: float = 0.0, inference: Callable[[], Any] = nullcontext,
                 on_wait: Callable[[float], None] = lambda seconds: None, max_rows: Optional[int] = None,
                 budget: Optional[DecodeBudget] = None, graphs: Optional[DecodeGraphs] = None):
        self.segment = segment
        self.graphs = graphs  # CUDA graphs of the row-wise parts (.graphs), None: eager
        self.max_rows = max_rows
        self.budget = budget  # decode-first: batches spend it; a drain with it spent yields to waiting work
        self._turn: Optional[str] = None  # the owner served last (the next batch starts after it)
        self.compute = compute
        self.lock = lock or threading.RLock()
        self.batching = batching
        self.wait_s = wait_s
        self.inference = inference
        self._queue: list[DecodeItem] = []
        self._queue_lock = threading.Lock()
        self._arrived = threading.Condition(self._queue_lock)
        self._scheduled = False  # a drain is queued on the compute thread
        self._last: set = set()  # keys of the previous batch's sessions
        self.batches = 0  # forwards run
        self.items = 0  # steps served
        self.on_wait = on_wait  # called with each step's wait for the compute thread (seconds)
        # CUDA: decode kernels on a high-priority stream overtake training's (splitlearn/server/priority.py)
        dev = next(segment.parameters()).device
        self._stream = torch.cuda.Stream(device=dev, priority=-1) if dev.type == "cuda" else None

    def enqueue(self, item: DecodeItem) -> Future:
        """Queue ``item`` (from any thread, the compute thread included); its future."""
        item.queued_at = time.monotonic()
        with self._queue_lock:
            self._queue.append(item)
            self._arrived.notify()
            if not self._scheduled:
                self._scheduled = True
                self.compute.submit(self.drain)
        return item.future

    def submit(self, item: DecodeItem):
        """Queue ``item`` and wait for its answer (not from the compute thread itself)."""
        return self.enqueue(item).result()

    def forget(self, key: Any) -> None:
        """``key``'s session is closed: no drain waits for it."""
        with self._queue_lock:
            self._last.discard(key)

    def pending(self) -> bool:
        """Decode steps are queued (a hint: read without the lock)."""
        return bool(self._queue)

    def run_now(self) -> None:
        """Run what is queued at once, without the batch window (on the compute thread, in
        the middle of a training step: :mod:`.priority`); the segment's mode is restored."""
        with self._queue_lock:
            batch = self._take()
        if batch:
            was_training = self.segment.training
            try:
                self._run(batch)
            finally:
                if was_training:
                    self.segment.train()

    def drain(self) -> None:
        """Run everything queued so far (on the compute thread)."""
        if self.budget is not None and self.compute.waiting() and not self.budget.available():
            self.compute.submit(self.drain)  # other work first (still scheduled)
            return
        with self._queue_lock:
            if self.batching and self.wait_s > 0:
                self._wait_for_last_batch()
            batch = self._take()
            self._scheduled = bool(self._queue)
            if self._queue:  # over max_rows: the rest after the work queued meanwhile
                self.compute.submit(self.drain)
            if self.batching:
                self._last = {it.key for it in batch if it.key is not None}
        charged = self.compute.waiting() > 0  # decode with nothing else waiting is free
        if self.batching:
            self._run(batch, charged)
        else:
            for it in batch:
                self._run([it], charged)

    def _take(self) -> list[DecodeItem]:
        """One batch off the queue (``_queue_lock`` held): all of it, or ``max_rows`` taken fairly."""
        if self.max_rows is None:
            batch, self._queue = self._queue, []
            return batch
        batch, self._queue, self._turn = fair_take(self._queue, self.max_rows, self._turn)
        return batch

    def _on_stream(self):
        if self._stream is None:
            return nullcontext()
        self._stream.wait_stream(torch.cuda.current_stream(self._stream.device))  # caches written before
        return torch.cuda.stream(self._stream)

    def _wait_for_last_batch(self) -> None:
        """Wait (``_queue_lock`` held) up to ``wait_s`` while some of the previous batch's
        sessions are queued and others are not yet."""
        deadline = time.monotonic() + self.wait_s
        while True:
            queued = {it.key for it in self._queue}
            if not (self._last & queued) or self._last <= queued:
                return
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._arrived.wait(left)

    def _run(self, batch: list[DecodeItem], charged: bool = True) -> None:
        """Run ``batch``; ``charged``: other work waits for it (a point, or a drain with work
        queued behind it), so it spends the budget (preparing, computing, encoding)."""
        began = time.monotonic()
        try:
            self._run_batch(batch)
        finally:
            if self.budget is not None and charged:
                self.budget.spend(time.monotonic() - began)

    def _run_batch(self, batch: list[DecodeItem]) -> None:
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
            now = time.monotonic()
            for it in ready:
                self.on_wait(now - it.queued_at)
            try:
                if self.segment.training:  # eval() walks every submodule: 0.16 ms for 8 blocks
                    self.segment.eval()
                with self.inference(), self._on_stream():
                    outputs = batched_decode(self.segment, ready, self.graphs)
                if self._stream is not None:
                    self._stream.synchronize()  # the answers are read on the CPU next
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
