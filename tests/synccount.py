"""Counting what a request makes the host wait for, on any device (a test tool).

On a GPU every host read of a device tensor (``.item()``, ``float(t)``, ``bool(t)``, ``int(t)``:
``aten::_local_scalar_dense``; ``.tolist()``, ``.cpu()``: a device-to-host copy) blocks the Python
thread until the device's queue has drained, so the launches of the next work cannot run ahead;
and every aten op dispatched is at least one kernel launch. :class:`Counts` counts both, per
thread, with a ``TorchDispatchMode`` (a mode is thread-local: :func:`counting` enters one on the
calling thread and one on the server's compute thread, :mod:`splitlearn.server.engine.compute`).

On the CPU every tensor is in host memory, so the tool plays a GPU server fed by the ``unix://``
device region (the worst case: every request tensor arrives on the device): a tensor is on the
"device" unless it is known to be in host memory, i.e. it came out of ``.cpu()`` or ``torch.tensor``
(Python data: ``aten::lift_fresh``, as AdamW's step counters, which stay on the host on CUDA too),
or out of an op whose tensor inputs all are. A request's tensors (decoded by
:func:`splitlearn.api.wire.decode_view`) are on the device. A scalar read of a host tensor is no sync (counted
under ``host``). ``.cpu()`` and ``.tolist()`` of a host tensor dispatch nothing, so they are counted
where they are called (patched ``torch.Tensor`` methods). Factories (``torch.zeros`` ...) count as
device tensors. Not counted: the answer's own bytes (:mod:`splitlearn.api.wire` reads them with
``.numpy()``): that copy is the crossing itself.
"""
from __future__ import annotations

import threading
from collections import Counter
from contextlib import contextmanager
from typing import Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from splitlearn.api import wire

SCALAR = torch.ops.aten._local_scalar_dense.default
LIFT = torch.ops.aten.lift_fresh.default
_HOST = "_synccount_host"  # the attribute that marks a tensor as held in host memory


def on_host(t) -> bool:
    return isinstance(t, torch.Tensor) and getattr(t, _HOST, False)


def _mark(out) -> None:
    for t in out if isinstance(out, (tuple, list)) else (out,):
        if isinstance(t, torch.Tensor):
            setattr(t, _HOST, True)
_COPIES = {torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default}


def _device_to_host(func, args, kwargs, out) -> bool:
    """A copy whose source is on a device and whose result is in host memory."""
    if func not in _COPIES:
        return False
    src = args[1] if func is torch.ops.aten.copy_.default else args[0]
    dst = out if isinstance(out, torch.Tensor) else args[0]
    return isinstance(src, torch.Tensor) and not src.is_cpu and dst.is_cpu


class Counts:
    """Syncs (scalar reads + device-to-host copies + host reads of a tensor) and aten ops."""

    def __init__(self):
        self.ops: Counter = Counter()  # aten overload name -> calls
        self.reads: Counter = Counter()  # what made the host wait -> calls
        self.regions: dict[str, Counter] = {}  # :meth:`region` name -> its ops
        self._region: Optional[str] = None
        self._lock = threading.Lock()

    @property
    def syncs(self) -> int:
        """Host waits for a device (host reads of host tensors left out)."""
        return sum(n for what, n in self.reads.items() if what != "host")

    @property
    def n_ops(self) -> int:
        return sum(self.ops.values())

    def region_ops(self, name: str) -> int:
        return sum(self.regions.get(name, Counter()).values())

    def op(self, name: str) -> None:
        with self._lock:
            self.ops[name] += 1
            if self._region is not None:
                self.regions.setdefault(self._region, Counter())[name] += 1

    def read(self, what: str) -> None:
        with self._lock:
            self.reads[what] += 1

    @contextmanager
    def region(self, name: str):
        """Ops dispatched inside are also counted under ``name`` (:meth:`region_ops`)."""
        outer, self._region = self._region, name
        try:
            yield
        finally:
            self._region = outer


class _Mode(TorchDispatchMode):
    def __init__(self, counts: Counts):
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.counts.op(str(func.overloadpacket.__name__))
        inputs = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        if func is LIFT or (inputs and all(on_host(a) for a in inputs)):
            _mark(out)
        if func is SCALAR:
            self.counts.read("host" if on_host(args[0]) else "_local_scalar_dense")
        elif _device_to_host(func, args, kwargs or {}, out):
            self.counts.read("device_to_host")
        return out


def _on_device(decode_view):
    """The wire's decoder, its tensors unmarked: a request's tensors arrive on the device."""
    def decoded(*a, **kw):
        tensors, meta = decode_view(*a, **kw)
        for t in tensors.values():
            t.__dict__.pop(_HOST, None)
        return tensors, meta
    return decoded


def _patched(counts: Counts):
    """``Tensor.cpu`` and ``Tensor.tolist`` counted where they are called (host tensors included)."""
    saved = {name: getattr(torch.Tensor, name) for name in ("cpu", "tolist")}

    def wrap(name, fn):
        def counted(self, *a, **kw):
            counts.read("host" if on_host(self) else name)
            out = fn(self, *a, **kw)
            if name == "cpu":
                if out is self:  # a host tensor's .cpu() is itself: the copy an alias, ``self`` stays
                    out = self.view_as(self)
                _mark(out)
            return out
        return counted

    for name, fn in saved.items():
        setattr(torch.Tensor, name, wrap(name, fn))
    return saved


_ACTIVE: list[Counts] = []  # counting() blocks open, innermost last


def active() -> Optional[Counts]:
    """The innermost :func:`counting` block's counts (None outside one)."""
    return _ACTIVE[-1] if _ACTIVE else None


@contextmanager
def counting(rt=None):
    """Count on this thread and, given a runtime ``rt``, on its compute thread; yields :class:`Counts`."""
    counts = Counts()
    here = _Mode(counts)
    there = _Mode(counts) if rt is not None else None
    saved = _patched(counts)
    decode_view = wire.decode_view
    wire.decode_view = _on_device(decode_view)
    here.__enter__()
    if there is not None:
        rt.compute.run(there.__enter__)
    _ACTIVE.append(counts)
    try:
        yield counts
    finally:
        _ACTIVE.pop()
        if there is not None:
            rt.compute.run(there.__exit__, None, None, None)
        here.__exit__(None, None, None)
        wire.decode_view = decode_view
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)
