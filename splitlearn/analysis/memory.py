"""Peak memory of a segment run and of each submodule inside it: resident parameter and buffer
bytes + the most allocated on top of what was live when the call started. CUDA: the caching
allocator's peak; CPU and submodules: a ``TorchDispatchMode`` tracker of operator outputs
(train-mode CPU peaks are lower bounds; docs/ANALYSIS.md, 'What is measured, and how')."""
from __future__ import annotations

import weakref
from typing import Callable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def resident_bytes(module: nn.Module) -> int:
    """Bytes of a module's parameters and buffers, each storage counted once."""
    seen, total = set(), 0
    for t in list(module.parameters()) + list(module.buffers()):
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


class _Tracker(TorchDispatchMode):
    """Live bytes of operator outputs; ``frames`` hold (live at entry, peak) per open module."""

    def __init__(self):
        super().__init__()
        self.live = 0
        self.refs: dict[int, list] = {}  # storage ptr -> [nbytes, python tensors alive]
        self.frames: dict[str, list] = {}
        self.peaks: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._track(t)
        return out

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key == 0:
            return
        entry = self.refs.get(key)
        if entry is None:
            entry = self.refs[key] = [storage.nbytes(), 0]
            self.live += entry[0]
            for frame in self.frames.values():
                frame[1] = max(frame[1], self.live)
        entry[1] += 1
        weakref.finalize(t, self._release, key)

    def _release(self, key: int) -> None:
        entry = self.refs.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] <= 0:
            self.live -= entry[0]
            del self.refs[key]

    def open(self, name: str) -> None:
        self.frames[name] = [self.live, self.live]

    def close(self, name: str) -> None:
        start, peak = self.frames.pop(name, (self.live, self.live))
        self.peaks[name] = max(self.peaks.get(name, 0), peak - start)


def measure_peaks(run: Callable[[], None], modules: dict[str, nn.Module],
                  device: torch.device) -> tuple[int, dict[str, int]]:
    """Run ``run()`` once; return (the run's peak extra bytes, {module name: peak extra bytes}),
    "extra" above what was allocated when the call began (add :func:`resident_bytes`)."""
    tracker = _Tracker()
    handles = []
    for name, mod in modules.items():
        handles.append(mod.register_forward_pre_hook(lambda *_, n=name: tracker.open(n)))
        handles.append(mod.register_forward_hook(lambda *_, n=name: tracker.close(n)))
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    try:
        with tracker:
            tracker.open("")
            run()
            tracker.close("")
    finally:
        for h in handles:
            h.remove()
    total = tracker.peaks.pop("", 0)
    if cuda:
        torch.cuda.synchronize(device)
        total = torch.cuda.max_memory_allocated(device) - before
    return total, tracker.peaks
