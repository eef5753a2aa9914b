"""Per-operator arithmetic intensity (FLOPs / bytes moved) and compute- vs memory-bound against
the device's ridge point (peak FLOP/s / bandwidth, measured unless given). How FLOPs and bytes
are counted: docs/ANALYSIS.md, 'What is measured, and how'."""
from __future__ import annotations

import logging
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch.utils import flop_counter as fc
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..model.devices import synchronize
from .counting import _custom_mapping
from ..errors import ConfigError

log = logging.getLogger(__name__)

_SKIP = {"detach", "view", "_unsafe_view", "t", "transpose", "expand", "permute", "unsqueeze",
         "squeeze", "slice", "select", "split", "split_with_sizes", "alias", "as_strided",
         "reshape", "_reshape_alias", "lift_fresh", "empty", "empty_like", "zeros", "ones",
         "arange", "scalar_tensor", "_to_copy", "new_empty", "new_zeros", "clone", "full",
         "unbind", "index_put_", "lift_fresh_copy", "is_same_size"}


@dataclass
class DevicePeaks:
    """What the device can do at best; ridge = flops / bandwidth (FLOP per byte)."""

    tflops: float       # peak arithmetic, 10^12 FLOP/s
    mem_bw_gbs: float   # memory bandwidth, 10^9 bytes/s
    measured: bool      # False when the user gave both numbers

    def __post_init__(self):
        if self.tflops <= 0 or self.mem_bw_gbs <= 0:
            raise ConfigError(f"peak TFLOP/s and bandwidth must be > 0, got {self.tflops}, "
                             f"{self.mem_bw_gbs}")

    @property
    def ridge(self) -> float:
        return self.tflops * 1e12 / (self.mem_bw_gbs * 1e9)


def measure_peaks(device: torch.device, dtype: torch.dtype, tflops: Optional[float] = None,
                  mem_bw_gbs: Optional[float] = None) -> DevicePeaks:
    """Measure what the user did not give: a square matmul (n=2048 CPU, 8192 GPU) for FLOP/s
    and a 256 MiB copy (read + write) for bandwidth; best of a few runs."""
    measured = tflops is None or mem_bw_gbs is None
    if tflops is None:
        n = 8192 if device.type == "cuda" else 1024
        a = torch.randn(n, n, device=device, dtype=dtype)
        tflops = 2 * n ** 3 / _best_seconds(lambda: a @ a, device) / 1e12
    if mem_bw_gbs is None:
        numel = (256 if device.type == "cuda" else 64) * 2 ** 20 // 4
        src = torch.empty(numel, device=device, dtype=torch.float32)
        dst = torch.empty_like(src)
        mem_bw_gbs = 2 * src.nbytes / _best_seconds(lambda: dst.copy_(src), device) / 1e9
    log.info("device peaks: %.3f TFLOP/s, %.1f GB/s", tflops, mem_bw_gbs)
    return DevicePeaks(tflops, mem_bw_gbs, measured)


def _best_seconds(fn: Callable[[], object], device: torch.device, runs: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(runs):
        synchronize(device)
        t = time.perf_counter()
        fn()
        synchronize(device)
        best = min(best, time.perf_counter() - t)
    return best


@dataclass
class OpStats:
    """One operator's totals over a run (all its calls)."""

    op: str
    calls: int
    flops: int
    bytes: int

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes if self.bytes else 0.0

    def bound(self, ridge: float) -> str:
        return "compute" if self.intensity >= ridge else "memory"

    def to_dict(self, ridge: float) -> dict:
        return {"op": self.op, "calls": self.calls, "flops": self.flops, "bytes": self.bytes,
                "intensity": self.intensity, "bound": self.bound(ridge)}


class _OpRecorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.registry = {**fc.flop_registry, **{k: fc.shape_wrapper(v)
                                                for k, v in _custom_mapping().items()}}
        self.stats: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func._overloadpacket.__name__
        if name in _SKIP:
            return out
        packet = func._overloadpacket
        if packet in self.registry:
            flops = self.registry[packet](*args, **kwargs, out_val=out)
        else:
            flops = sum(t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        seen, nbytes = set(), 0
        for t in tree_leaves((args, kwargs, out)):
            if isinstance(t, torch.Tensor):
                key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
                if key not in seen:
                    seen.add(key)
                    nbytes += t.numel() * t.element_size()
        s = self.stats[name]
        s[0] += 1
        s[1] += int(flops)
        s[2] += nbytes
        return out


def profile_ops(run: Callable[[], None]) -> list[OpStats]:
    """Run ``run()`` once and return per-operator totals, the most FLOPs first."""
    rec = _OpRecorder()
    with rec:
        run()
    ops = [OpStats(n, c, f, b) for n, (c, f, b) in rec.stats.items()]
    return sorted(ops, key=lambda o: (-o.flops, o.op))
