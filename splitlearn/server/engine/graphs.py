"""CUDA graphs for the batched decode: a block's row-wise parts replayed, its attention eager.

A decode step of GPT-2 small's trunk launches ~30 kernels a block, each a few microseconds of
work: on a GPU the step is bound by launching them, not by computing (the H100 of issue 42: the
server's 8 blocks took 7.5 ms a token). Everything in a block whose shapes depend only on the
batch's rows N (the first norm and the attention's input projection; the output projection and
its residual; the second norm, the MLP and its residual: the family's ``decode_stages`` in
:mod:`splitlearn.model.arch`, GPT-2's only) is captured once per N as a CUDA graph and replayed;
attention, whose key length grows every step, runs as before, per session with its own cache.
A step of N rows through L blocks::

    x (N, 1, d) -> stage 0: norm, input projection of block 0                  -> qkv
    block i:       attention of each session (eager, its cache grows)        -> o (N, 1, d)
                   stage i + 1: x += out_proj(o); x += mlp(norm_2(x));
                                norm, input projection of block i + 1
                                (the last stage: the final norm, the LM head)

L + 1 graph launches and the attention's few kernels per block, instead of every kernel.
Replaying a graph launches the kernels eager code launched when it was captured, for the same
shapes, so a row's output is eager's bit for bit (``tests/test_server_graphs.py`` on a GPU:
greedy tokens equal the unsplit model's). Why not a static KV cache (transformers'
``StaticCache`` + ``torch.compile(mode="reduce-overhead")``): attention over a padded cache runs
other kernels, and in bfloat16 greedy decoding then picks other tokens than the dynamic cache
(benchmarks/results/gpu/latest.md).

Bounds (N is chosen by the clients: the batch's rows): graphs for at most ``max_graphs`` row
counts (least recently used dropped first); a row count is captured only after ``repeats``
batches of it, and at most one capture per ``capture_every_s``, so a tenant varying its rows
costs the others at most a capture a second and otherwise runs eagerly; what the graphs hold
(their memory pool and static buffers, measured around the capture) is reserved in the
server's :class:`~.memory.MemoryAccount` as the server's own (a capture that does not fit is
not made). Used only where the outputs cannot differ: a CUDA segment in evaluation mode, no
LoRA adapter in the batch, every session's cache already filled (a first update keeps the new
keys as they are, which would be a view of a graph's buffer), and the weights still the
tensors captured (a replaced parameter drops the graphs).
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

log = logging.getLogger(__name__)


@dataclass
class Stage:
    """One captured stage: ``replay()`` recomputes ``outputs`` (static tensors) from the static inputs."""

    replay: Callable[[], None]
    outputs: tuple


def capture_cuda(fn: Callable[[], tuple], pool) -> Stage:
    """Warm ``fn`` up on a side stream (cuBLAS handles, the allocator), then capture it. Only
    this thread's calls are checked during the capture (``thread_local``): the WSGI threads
    copy other answers to the host meanwhile, on their own streams."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        outputs = fn()
    return Stage(graph.replay, outputs)


def capture_eager(fn: Callable[[], tuple], pool) -> Stage:
    """A stand-in for :func:`capture_cuda` off a GPU (tests): the same static outputs, recomputed
    by running ``fn`` again at each replay."""
    outputs = fn()

    def replay() -> None:
        for static, new in zip(outputs, fn()):
            static.copy_(new)

    return Stage(replay, outputs)


@dataclass
class Captured:
    """The stages of one row count, their static input and attention-output buffers."""

    rows: int
    x: torch.Tensor  # (N, 1, d): the batch's rows go in here
    o: torch.Tensor  # (N, 1, d): the attention's output, per block
    stages: list
    weights: tuple  # the parameters' storage when captured
    hold: Any = None  # its reservation in the memory account


def weights_key(segment) -> tuple:
    return tuple(p.data_ptr() for p in segment.parameters())


@dataclass
class DecodeGraphs:
    """The captured decode stages of a segment, per row count (see the module docstring)."""

    segment: Any
    max_graphs: int = 4
    account: Any = None  # the server's MemoryAccount (None: nothing reserved)
    repeats: int = 3
    capture_every_s: float = 1.0
    capture: Callable = capture_cuda
    clock: Callable[[], float] = time.monotonic
    graphs: "OrderedDict[int, Captured]" = field(default_factory=OrderedDict)
    seen: dict = field(default_factory=dict)  # row count -> batches of it since its last capture
    last_capture: float = float("-inf")
    replays: int = 0
    captures: int = 0

    def usable(self, items, x: torch.Tensor) -> bool:
        """Whether ``items`` (DecodeItems; their rows ``x``) may run on graphs: on a CUDA device
        (or a stand-in capture), where the outputs cannot differ from eager's."""
        seg = self.segment
        return (self.max_graphs > 0 and len(seg.layers_list) > 0 and not seg.training
                and (x.is_cuda or self.capture is not capture_cuda)
                and all(it.adapter is None and it.cache.length > 0 for it in items))

    def get(self, rows: int, like: torch.Tensor) -> Optional[Captured]:
        """The stages for ``rows``, captured now if due; None: run eagerly."""
        cap = self.graphs.get(rows)
        if cap is not None:
            if cap.weights == weights_key(self.segment):
                self.graphs.move_to_end(rows)
                return cap
            self.drop(rows)  # a parameter was replaced: its pointers are stale
        if len(self.seen) > 256:
            self.seen.clear()
        n = self.seen[rows] = self.seen.get(rows, 0) + 1
        now = self.clock()
        if n < self.repeats or now - self.last_capture < self.capture_every_s:
            return None
        self.last_capture = now
        self.seen.pop(rows, None)
        while len(self.graphs) >= self.max_graphs:
            self.drop(next(iter(self.graphs)))
        try:
            cap = self._capture(rows, like)
        except Exception as e:  # noqa: BLE001 - the step runs eagerly instead; said once per row count
            log.warning("decode graphs for %d rows not captured (%s: %s): that row count runs eagerly",
                        rows, type(e).__name__, e)
            return None
        self.graphs[rows] = cap
        self.captures += 1
        return cap

    def drop(self, rows: int) -> None:
        cap = self.graphs.pop(rows, None)
        if cap is not None and self.account is not None:
            self.account.release(cap.hold)

    def close(self) -> None:
        for rows in list(self.graphs):
            self.drop(rows)

    @torch.no_grad()
    def _capture(self, rows: int, like: torch.Tensor) -> Captured:
        seg, cuda = self.segment, like.is_cuda
        before = (torch.cuda.memory_allocated(like.device), torch.cuda.memory_reserved(like.device)) if cuda else None
        x = torch.zeros_like(like)  # (N, 1, d)
        o = torch.zeros_like(like)
        pool = torch.cuda.graph_pool_handle() if cuda else None
        blocks, arch = list(seg.layers_list), seg.arch
        stages = [self.capture(lambda: (arch.decode_attn_input(blocks[0], x),), pool)]
        h = x
        for i, block in enumerate(blocks):
            nxt = blocks[i + 1] if i + 1 < len(blocks) else None

            def stage(block=block, h=h, nxt=nxt):
                y = arch.decode_rest(block, h, o)
                if nxt is not None:
                    return y, arch.decode_attn_input(nxt, y)
                return (y, seg.logits(y)) if seg.has_head else (y,)  # the final norm, the LM head

            stages.append(self.capture(stage, pool))
            h = stages[-1].outputs[0]
        if cuda:  # its static tensors, and the pool's blocks its intermediates return to
            nbytes = max(torch.cuda.memory_allocated(like.device) - before[0],
                         torch.cuda.memory_reserved(like.device) - before[1])
        else:
            nbytes = sum(t.numel() * t.element_size() for s in stages for t in s.outputs) + 2 * x.nbytes
        hold = None
        if self.account is not None:  # 429/503 past the account: not kept (the step runs eagerly)
            hold = self.account.reserve("", max(nbytes, 0), f"decode graphs for {rows} rows", shared=False)
        return Captured(rows, x, o, stages, weights_key(seg), hold)

    def run(self, cap: Captured, x: torch.Tensor, attend_block: Callable) -> torch.Tensor:
        """One step on ``cap``'s stages: ``x`` (N, 1, d) in; ``attend_block(i, qkv)`` runs block
        i's attention (eager, the sessions' caches) and returns its output (N, 1, d). The
        output (N, 1, d|V), a copy (the static buffers serve the next step)."""
        cap.x.copy_(x)
        first = cap.stages[0]
        first.replay()
        qkv = first.outputs[0]
        for i in range(len(cap.stages) - 1):
            cap.o.copy_(attend_block(i, qkv))
            stage = cap.stages[i + 1]
            stage.replay()
            qkv = stage.outputs[-1]
        self.replays += 1
        return cap.stages[-1].outputs[-1].clone()
