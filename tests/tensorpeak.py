"""A tensor-level peak on the CPU: the live bytes of the storages operators make, as CUDA's
``torch.cuda.max_memory_allocated()`` counts them on a GPU (not the RSS: no allocator slack).

A ``TorchDispatchMode`` sees every operator's outputs; an output whose storage is none of its
inputs' (not a view, not in place, not ``out=``) is a new storage, counted once until it is
freed (a ``weakref.finalize`` on the storage: a tensor autograd saves keeps it alive without a
Python object). Storages that existed before (parameters, optimizer moments) are never counted.
Each storage is labelled with the ``phase`` set when it was made, so a peak can be broken down.
The mode is thread-local: enter it on the thread that computes (:meth:`on`).
"""
from __future__ import annotations

import weakref
from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class TensorPeak(TorchDispatchMode):
    """``live``: bytes of the counted storages alive now; ``peak``: the most; ``at_peak``: their
    bytes by (phase, operator) at that moment."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.phase = ""
        self.storages: dict[int, tuple[int, str, str]] = {}  # data_ptr -> (nbytes, phase, op)
        self.at_peak: dict[tuple[str, str], int] = {}
        self.phase_peaks: dict[str, int] = {}  # phase -> the most live while it ran

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        grew = False
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                s = t.untyped_storage()
                key = s.data_ptr()
                if key and key not in inputs and key not in self.storages and s.nbytes():
                    self.storages[key] = (s.nbytes(), self.phase, func.__name__)
                    self.live += s.nbytes()
                    weakref.finalize(s, self._free, key)
                    grew = True
        if grew and self.live > self.phase_peaks.get(self.phase, 0):
            self.phase_peaks[self.phase] = self.live
        if grew and self.live > self.peak:
            self.peak = self.live
            by = defaultdict(int)
            for nbytes, phase, op in self.storages.values():
                by[phase, op] += nbytes
            self.at_peak = dict(by)
        return out

    def _free(self, key: int) -> None:
        nbytes = self.storages.pop(key, (0,))[0]
        self.live -= nbytes

    def reset(self) -> None:
        """Peak from now on (what is live stays counted, as ``reset_peak_memory_stats``)."""
        self.peak, self.at_peak, self.phase_peaks = self.live, {}, {}

    def by_phase(self) -> dict[str, int]:
        """Bytes live at the peak, by the phase that made them."""
        out = defaultdict(int)
        for (phase, _), nbytes in self.at_peak.items():
            out[phase] += nbytes
        return dict(out)

    def on(self, compute) -> "TensorPeak":
        """Enter the mode on a server's compute thread (:class:`~splitlearn.server.engine.compute.ComputeThread`)."""
        compute.run(self.__enter__)
        return self

    def off(self, compute) -> None:
        compute.run(self.__exit__, None, None, None)


def label_phases(tp: TensorPeak, segment, optimizer, monkeypatch) -> None:
    """Name what a training step makes by phase: ``forward`` (the blocks), ``head`` (ln_f and the
    chunked loss with its gradients), ``backward`` (from ln_f's backward on), ``update`` (the
    gradients' norm, :mod:`splitlearn.server.engine.guard`, and the optimizer's step)."""
    from splitlearn.server.engine import guard

    def to(name):
        def hook(*_):
            tp.phase = name
        return hook

    for block in segment.h:
        block.register_forward_pre_hook(to("forward"))
        block.register_full_backward_pre_hook(to("backward"))
    if segment.has_head:
        segment.ln_f.register_forward_pre_hook(to("head"))
        segment.ln_f.register_full_backward_pre_hook(to("backward"))
    optimizer.register_step_pre_hook(to("update"))
    norm = guard.grad_norm

    def grad_norm(params):
        tp.phase = "update"
        return norm(params)

    monkeypatch.setattr(guard, "grad_norm", grad_norm)
