"""Priority classes on the one compute thread: decode steps before training and prefill.

Every tensor operation of a server runs on one thread (:mod:`.compute`), in arrival order.
A decode step is a few milliseconds; a training step's forward or backward of a b4 x 128
batch on GPT-2 small's trunk is seconds, and a decode step that arrives during one waited
for all of it (3.7 s worst token against 37 ms p99 alone, measured on one thread). Seed 003's
lesson: latency-bound work first, throughput-bound work fills the gaps.

``decode-first`` (the default) cuts training into pieces small enough that a decode batch
never waits for a whole forward or backward: while a training request runs, the segment's
heavy modules (each layer's linear layers, any family: GPT-2's four Conv1D, a Llama's
``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, ``gate_proj``, ``up_proj``, ``down_proj``; and the LM
head) get a *preemption point* before their forward and, through a hook on their output, before
their backward::

    training forward:  ... q_proj | k_proj | v_proj | o_proj | gate_proj | up_proj | down_proj | ...
                              ^ a decode step queued now runs here, then training goes on
    training backward: ... d down_proj | d up_proj | d gate_proj | d o_proj | ...
                              ^ the same, between two gradient products

At a point, if decode steps are queued (:meth:`~.batching.DecodeBatcher.pending`), they run
there and then, on the compute thread, in no-grad eval mode with their own KV caches; the
training step then continues. Training is unchanged: decode neither reads the step's
activations nor changes a parameter, the optimizer steps only at the step's apply,
and the segment's train/eval mode is restored. ``fifo`` keeps arrival order (the comparison).

Fair and bounded (a hostile tenant keeping 16 sessions x 64 rows of one-token steps queued
made another owner's training step 6.9x slower, when every point ran the whole queue):

- **Per tenant, in turn.** A decode batch (at a point, or a drain between requests) takes the
  queued steps one owner (tenant) at a time, round-robin, starting after the owner served
  last, up to ``--decode-rows`` rows (:func:`fair_take`); the rest wait for the next point or
  drain. So one tenant's queue never keeps another tenant's step out of a batch.
- **Per training step.** Every decode batch draws on a :class:`DecodeBudget` that grows at
  ``--decode-share`` seconds per second of other work, up to :data:`BURST_S` (a token
  bucket). With the budget spent, a point runs nothing, and a drain with other work waiting
  for the compute thread steps behind that work. So decode steps slow a training step by at
  most ``share x`` its own time plus the burst and one batch, whatever is queued; with
  nothing else waiting decode steps run at once, as before.

On CUDA the decode batch also runs on a high-priority stream (``torch.cuda.Stream(priority=-1)``)
so its kernels overtake training's queued ones (:class:`~.batching.DecodeBatcher`); untested
here (no GPU in CI).

:class:`QueueWaits` keeps how long work of each class waited for the compute thread (from
arrival to start), reported in ``/v1/info`` under ``priority``.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator, Optional

import torch
from torch import nn

from ...model.packed import Restep

POLICIES = ("decode-first", "fifo")
CLASSES = ("decode", "prefill", "training", "other")
BURST_S = 0.25  # seconds of decode the points may run ahead of their share (the bucket's size)


class DecodeBudget:
    """Seconds of decode that may run while other work waits: earns ``share`` per second of
    other work (time not spent decoding), at most :data:`BURST_S`; decode that other work
    waits for spends it (down to -:data:`BURST_S`: a batch is not cut short, the next wait)."""

    def __init__(self, share: float):
        self.share = share
        self.left = BURST_S
        self.held_back = 0  # decode batches deferred for want of budget
        self._last = time.monotonic()

    def available(self) -> bool:
        now = time.monotonic()
        self.left = min(BURST_S, self.left + self.share * (now - self._last))
        self._last = now
        if self.left > 0:
            return True
        self.held_back += 1
        return False

    def spend(self, seconds: float) -> None:
        self.left = max(-BURST_S, self.left - seconds)  # a debt of one burst at most
        self._last = time.monotonic()


def fair_take(queue: list, max_rows: int, after: Optional[str] = None) -> tuple[list, list, Optional[str]]:
    """One batch of ``queue``'s items (each with ``.owner`` and ``.hidden`` (B, 1, d)): one item
    per owner in turn, owners in order of first appearance starting after ``after``, each
    owner's in arrival order, while the rows fit ``max_rows`` (the first item always goes).
    Returns (batch, the rest in arrival order, the owner served last)."""
    owners = list(dict.fromkeys(it.owner for it in queue))
    if after in owners:
        i = owners.index(after) + 1
        owners = owners[i:] + owners[:i]
    lanes = {o: deque(it for it in queue if it.owner == o) for o in owners}
    batch, rows, last = [], 0, after
    while any(lanes.values()):
        for o in owners:
            if not lanes[o]:
                continue
            n = lanes[o][0].hidden.shape[0]
            if batch and rows + n > max_rows:
                taken = {id(it) for it in batch}
                return batch, [it for it in queue if id(it) not in taken], last
            batch.append(lanes[o].popleft())
            rows, last = rows + n, o
    return batch, [], last


class QueueWaits:
    """Waits for the compute thread per class: the last ``keep`` of each, in milliseconds."""

    def __init__(self, keep: int = 2048):
        self._waits = {c: deque(maxlen=keep) for c in CLASSES}
        self._counts = dict.fromkeys(CLASSES, 0)
        self._lock = threading.Lock()
        self.listeners: list[Callable[[str, float], None]] = []  # each wait, seconds (/metrics' histogram)

    def record(self, cls: str, seconds: float) -> None:
        with self._lock:
            self._waits[cls].append(seconds * 1e3)
            self._counts[cls] += 1
        for listener in self.listeners:
            listener(cls, seconds)

    def summary(self) -> dict:
        out = {}
        with self._lock:
            for c, w in self._waits.items():
                s = sorted(w)
                pick = lambda q: round(s[min(len(s) - 1, int(q * len(s)))], 3) if s else None  # noqa: E731
                out[c] = {"count": self._counts[c], "p50_ms": pick(0.5), "p99_ms": pick(0.99),
                          "max_ms": round(s[-1], 3) if s else None}
        return out


def heavy_modules(segment: nn.Module) -> list[nn.Module]:
    """The modules between which training may yield: each layer's linear layers (in module
    order, any family), the head."""
    from transformers.pytorch_utils import Conv1D
    mods = []
    for block in getattr(segment, "layers_list", []):
        mods += [m for m in block.modules() if isinstance(m, (nn.Linear, Conv1D))]
    head = getattr(segment, "head_module", None) if getattr(segment, "has_head", False) else None
    if head is not None:
        mods.append(head)
    return mods


class Preemptor:
    """Preemption points in a segment's training forward and backward (``decode-first``).

    ``ready()`` says whether latency work waits; ``run()`` runs it (on the compute thread).
    Points fire only on ``on_thread()`` (the compute thread) and only while gradients are
    being built or propagated, never inside a decode forward itself.
    """

    def __init__(self, ready: Callable[[], bool], run: Callable[[], None], on_thread: Callable[[], bool],
                 budget: Optional[DecodeBudget] = None):
        self.ready, self.run, self.on_thread = ready, run, on_thread
        self.budget = budget  # a point runs decode only while it lasts (``run`` spends it); None: always
        self.preemptions = 0  # times training yielded to decode steps
        self._inside = False

    def __deepcopy__(self, memo) -> "Preemptor":
        return self  # a copied segment (SplitFed's per-member copies) keeps the same points

    def point(self) -> None:
        if self._inside or not self.ready() or not self.on_thread():
            return
        if self.budget is not None and not self.budget.available():
            return
        self._inside = True
        try:
            self.run()
            self.preemptions += 1
        finally:
            self._inside = False

    @contextmanager
    def active(self, segments: Iterable[nn.Module]) -> Iterator[None]:
        """Points on the heavy modules of ``segments`` while a training request runs.

        Hooked only for the request: a module with hooks leaves PyTorch's fast call path
        (measured: +4-22 us a call, 32 calls a decode step on GPT-2 small's trunk), and decode
        steps run far more often than training requests. The backward's points are tensor
        hooks on the forward's outputs, so they outlive the context until the backward
        (a U-shape step's second request) has run."""
        handles = []
        try:
            for seg in segments:
                for m in heavy_modules(seg):
                    handles.append(m.register_forward_pre_hook(self._before_forward))
                    handles.append(m.register_forward_hook(self._after_forward))
            yield
        finally:
            for h in handles:
                h.remove()

    def _before_forward(self, module: nn.Module, args) -> None:
        if torch.is_grad_enabled():  # a training forward (decode runs under no_grad)
            self.point()

    def _after_forward(self, module: nn.Module, args, out) -> None:
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(self._before_backward)  # runs when the gradient reaches `out`

    def _before_backward(self, grad: torch.Tensor) -> None:
        self.point()  # returning None leaves the gradient as it is


#: optimizers whose step of a parameter reads only that parameter's gradient and state
PER_PARAMETER = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, torch.optim.RMSprop)
PART_BYTES = 16 << 20  # parameters stepped between two preemption points of an optimizer step


def step_in_parts(opt: torch.optim.Optimizer, point: Callable[[], None], part_bytes: int = PART_BYTES) -> int:
    """``opt.step()`` in parts of its parameters, with a preemption point after each part (the
    optimizer step of GPT-2 small's trunk, 57M parameters, took up to 0.55 s on one CPU thread:
    the longest span a decode step waited for). Exact: an optimizer steps each parameter from its
    own gradient and state, and skips one without a gradient, so stepping the parts one after
    another with the others' gradients held back is the one step. A decode step run at a point
    reads the parameters as they were before the step: each part is stepped in place, its new
    values set aside and its old ones put back, and all new values go in at once after the last
    part (between two operations of the one compute thread). Costs one copy of the parameters
    stepped; the number of parts. Optimizers other than :data:`PER_PARAMETER` step at once."""
    if type(opt) not in PER_PARAMETER:
        opt.step()
        return 1
    params = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
    parts, part, size = [], [], 0
    for p in params:
        part.append(p)
        size += p.numel() * p.element_size()
        if size >= part_bytes:
            parts.append(part)
            part, size = [], 0
    if part:
        parts.append(part)
    if len(parts) <= 1:
        opt.step()
        return len(parts)
    grads = [p.grad for p in params]
    stepped, packs = [], Restep()
    try:
        for i, part in enumerate(parts):
            mine = {id(p) for p in part}
            for p, g in zip(params, grads):
                p.grad = g if id(p) in mine else None
            old = [(p.data, Restep.key(p)) for p in part]
            for p in part:
                p.data = p.detach().clone()  # stepped in a copy: the old values stay where they are
            opt.step()
            for p, (o, key) in zip(part, old):
                stepped.append((p, p.data))
                p.data = o  # decode at the point below reads the parameters before the step
                Restep.kept(p, key)  # and their prepacked copies (a server's) still hold
            point()
        for p, new in stepped:  # the new values' prepacked copies, made ahead, a point after every 8
            if packs.pack_new(p, new) and packs.made % 8 == 0:
                point()
    finally:  # a part that failed leaves the parameters as before (the caller aborts the step)
        for p, g in zip(params, grads):
            p.grad = g
    for p, new in stepped:
        p.data = new
    packs.install()
    return len(parts)


def timed(waits: QueueWaits, cls: str, fn: Callable) -> Callable:
    """``fn`` wrapped to record, when it starts, how long it waited since now."""
    queued = time.monotonic()

    def run(*args, **kwargs):
        waits.record(cls, time.monotonic() - queued)
        return fn(*args, **kwargs)

    return run
