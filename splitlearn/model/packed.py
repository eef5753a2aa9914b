"""``PackedLinears``: few-row inference on oneDNN prepacked weights (CPU, float32).

Inside ``with packed.active():`` the no-grad forwards of every ``Conv1D`` and ``nn.Linear`` of
a module run where that measured faster on this host for the product's shape and rows
(:data:`CHOICE`, measured on first use): on a prepacked copy of their weight (repacked after
the weight changes), on the layer's own product, or, for an ``nn.Linear`` (the LM head), on a
copy of its weight laid out (in, out), which MKL multiplies a few rows by faster than the (out,
in) weight ``F.linear`` reads; with gradients on they run as before. Off (``PackedLinears.usable``
False) without oneDNN, off the CPU and for dtypes other than float32. Why, the measured speed-up
and the memory cost: docs/INTERNALS.md, 'Small-batch matrix products on CPU'."""
from __future__ import annotations

import threading
import weakref
from contextlib import contextmanager
from typing import Iterator, Optional

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D


def usable(module: nn.Module) -> bool:
    """Whether ``module``'s linear layers can run on prepacked oneDNN weights."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    p = next(module.parameters(), None)
    return p is not None and p.device.type == "cpu" and p.dtype == torch.float32


class _Packed:
    """One weight's prepacked copy, and what it was packed from (held weakly)."""

    def __init__(self, weight: torch.Tensor, transposed: bool):
        self._weight, self.transposed = weakref.ref(weight), transposed
        self.key: Optional[tuple] = None
        self.packed: Optional[torch.Tensor] = None
        self._columns: Optional["_Columns"] = None

    def columns(self) -> "_Columns":
        """The weight's (in, out) copy (an ``nn.Linear``'s), shared like the packed one."""
        if self._columns is None:
            self._columns = _Columns(self.weight)
        return self._columns

    @property
    def weight(self) -> torch.Tensor:
        return self._weight()

    def current(self) -> torch.Tensor:
        """The packed weight, packed (again) first if the weight changed since (an optimizer
        step bumps the tensor's version counter) or was never packed."""
        weight = self.weight
        key = (weight._version, weight.data_ptr())
        if key != self.key:
            with torch.no_grad():
                w = weight.detach()
                w = w.t().contiguous() if self.transposed else w.contiguous()  # (out, in)
                self.packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
            self.key = key
        return self.packed


class _Columns:
    """An ``nn.Linear`` weight's copy laid out (in, out) (held weakly, made again after the weight
    changes): ``torch.mm`` of a few rows by it is MKL's fast path where ``F.linear`` on the (out,
    in) weight is not (GPT-2 small's LM head, one row: 20.5 against 27.1 ms on this project's
    Intel VM, loaded; docs/INTERNALS.md)."""

    def __init__(self, weight: torch.Tensor):
        self._weight, self.key, self.copy = weakref.ref(weight), None, None

    def current(self) -> torch.Tensor:
        weight = self._weight()
        key = _key(weight)
        if key != self.key:
            with torch.no_grad():
                self.copy = weight.detach().t().contiguous()  # (in, out)
            self.key = key
        return self.copy

    def drop(self) -> None:
        self.copy, self.key = None, None


def _key(weight: torch.Tensor) -> tuple:
    return (weight._version, weight.data_ptr())


class Restep:
    """The prepacked copies across an optimizer step taken in parts (:func:`~splitlearn.server.
    engine.priority.step_in_parts`): the old copies stay valid while the old values are put
    back between parts (:meth:`kept`), the new values are packed ahead with a preemption point
    after each (:meth:`pack_new`), and go in with them (:meth:`install`). Without it the first
    decode step after each training step packed the whole trunk again (~0.3 s, GPT-2 small)."""

    key = staticmethod(_key)  # what a copy was made from: (version, storage)

    def __init__(self):
        self._ahead: list[tuple[torch.Tensor, _Packed, torch.Tensor]] = []

    @staticmethod
    def kept(weight: torch.Tensor, before: tuple) -> None:
        """``weight`` holds the values it had at ``before`` (its key) again: its copy still holds."""
        with _LOCK:
            p = _STORE.get(id(weight))
            if p is not None and p.weight is weight and p.key == before:
                p.key = _key(weight)

    @property
    def made(self) -> int:
        return len(self._ahead)

    def pack_new(self, weight: torch.Tensor, new: torch.Tensor) -> bool:
        """Pack ``new`` (the values ``weight`` takes at the step's end) if ``weight`` has a copy
        (whether it had)."""
        p = _STORE.get(id(weight))
        if p is None or p.weight is not weight or p.packed is None:
            return False
        with torch.no_grad():
            w = new.detach()
            w = w.t().contiguous() if p.transposed else w.contiguous()
            self._ahead.append((weight, p, torch.ops.mkldnn._reorder_linear_weight(w, None)))
        return True

    def install(self) -> None:
        """After the new values went in: their copies with them."""
        with _LOCK:
            for weight, p, packed in self._ahead:
                p.packed, p.key = packed, _key(weight)
        self._ahead.clear()


_STORE: dict[int, _Packed] = {}  # id(weight) -> its copy, dropped when the weight is
_ACTIVE: dict[int, int] = {}  # id(layer) -> active() blocks open over it, in any PackedLinears
# re-entrant: a weight's finalizer (_forget) runs whenever the garbage collector does, which can be
# inside a block that holds the lock (setting a layer's forward allocates), on the same thread
_LOCK = threading.RLock()


def _packed_for(weight: torch.Tensor, transposed: bool) -> _Packed:
    with _LOCK:
        p = _STORE.get(id(weight))
        if p is None or p.weight is not weight:
            p = _STORE[id(weight)] = _Packed(weight, transposed)
            weakref.finalize(weight, _forget, id(weight), p)
        return p


def _forget(key: int, packed: _Packed) -> None:
    with _LOCK:
        if _STORE.get(key) is packed:
            del _STORE[key]


class PackedLinears:
    """Prepacked copies of ``module``'s ``Conv1D`` / ``nn.Linear`` weights; see the module docstring."""

    def __init__(self, module: nn.Module, adaptive: bool = True):
        """``adaptive``: each product on the path measured faster (:data:`CHOICE`); False (a
        server): every product on the packed weight, whose result for a row does not depend on
        the rows batched beside it (``addmm``'s does: one row runs another kernel than two), so
        an owner's decode answer is the same whoever else is in the server's batch."""
        self.module, self.adaptive = module, adaptive
        self.usable = usable(module)
        self._layers: list[tuple[nn.Module, Optional[_Packed]]] = []
        for layer in module.modules():
            if isinstance(layer, Conv1D):
                transposed = True  # Conv1D keeps its weight as (in, out)
            elif isinstance(layer, nn.Linear):
                transposed = False  # (out, in) already
            else:
                continue
            self._layers.append((layer, _packed_for(layer.weight, transposed) if self.usable else None))
        self._weights = list({id(p): p for _, p in self._layers if p is not None}.values())
        self._forwards = [_packed_forward(layer, p, adaptive) for layer, p in self._layers] if self.usable else []

    def __len__(self) -> int:
        return len(self._layers)

    @contextmanager
    def active(self) -> Iterator["PackedLinears"]:
        """Within the block, no-grad forwards of the layers use the packed weights."""
        if not self.usable:
            yield self
            return
        with _LOCK:  # nested blocks, other generators, other objects over the same layers
            for (layer, _), forward in zip(self._layers, self._forwards):
                n = _ACTIVE.get(id(layer), 0)
                if n == 0:
                    layer.forward = forward  # an instance attribute shadows the class's
                _ACTIVE[id(layer)] = n + 1
        try:
            yield self
        finally:
            with _LOCK:
                for layer, _ in self._layers:
                    n = _ACTIVE.pop(id(layer)) - 1
                    if n:
                        _ACTIVE[id(layer)] = n
                    else:
                        del layer.forward


#: ``(in, out, rows bucket) -> True`` where the packed weight is the faster, False where the layer's
#: own product is, :data:`COLUMNS` where an ``nn.Linear``'s (in, out) copy is; measured on first use
#: (:func:`_fastest`); tests may fill it to fix the choice
CHOICE: dict[tuple[int, int, int], object] = {}
COLUMNS = "columns"
_TRIES = 3  # products timed of each kind, on first use of a (shape, rows bucket)


def _bucket(rows: int) -> int:
    """Rows rounded up to a power of two, at most 64: products of one bucket choose alike."""
    b = 1
    while b < rows and b < 64:
        b *= 2
    return b


def _fastest(x2: torch.Tensor, original, packed: "_Packed", bias, columns: Optional[_Columns]):
    """Time ``_TRIES`` products each way on ``x2`` (the call's own rows): the choice that was the
    fastest (True: packed, False: the layer's own, :data:`COLUMNS`: the (in, out) copy, tried for
    an ``nn.Linear`` only), and one output. Hosts differ: on the AMD EPYC VM of docs/INTERNALS.md
    the packed weight won from one row; on an Intel Xeon VM ``addmm`` won the 768 x 3072
    products at 1-8 rows and the 768 x 50257 LM head at one row (8.0 against 11.9 ms), the packed
    weight the head from 2 rows (13.8 against 20.2 ms at 4)."""
    import time

    w = packed.current()
    ways = {True: lambda: torch.ops.mkldnn._linear_pointwise(x2, w, bias, "none", [], ""),
            False: lambda: original(x2)}
    if columns is not None:
        cw = columns.current()
        ways[COLUMNS] = lambda: _columns_product(x2, cw, bias)
    timed, out = {k: float("inf") for k in ways}, None
    for _ in range(_TRIES):  # interleaved, the best of each: a burst of load hits all of them
        for k, f in ways.items():
            t0 = time.perf_counter()
            y = f()
            timed[k] = min(timed[k], time.perf_counter() - t0)
            out = y if k is True else out
    return min(timed, key=timed.get), out


def _columns_product(x2: torch.Tensor, w: torch.Tensor, bias) -> torch.Tensor:
    """(rows, in) @ (in, out) [+ bias]."""
    return torch.mm(x2, w) if bias is None else torch.addmm(bias, x2, w)


def _packed_forward(layer: nn.Module, packed: _Packed, adaptive: bool = True):
    original = type(layer).forward.__get__(layer)
    bias = layer.bias
    n_in, n_out = (layer.weight.shape if packed.transposed else layer.weight.shape[::-1])
    # an nn.Linear's (in, out) copy: a client's candidate only (a server's products stay packed)
    columns = packed.columns() if adaptive and not packed.transposed else None

    def forward(x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., out)
        if torch.is_grad_enabled() or x.dtype != torch.float32 or x.device.type != "cpu":
            return original(x)
        x2 = x.reshape(-1, x.shape[-1])
        key = (n_in, n_out, _bucket(x2.shape[0]))
        choice = CHOICE.get(key) if adaptive else True
        if choice is None:  # first product of this shape and size: measure them, keep the fastest
            choice, y = _fastest(x2, original, packed, bias, columns)
            CHOICE[key] = choice
            if columns is not None and COLUMNS not in {v for k, v in CHOICE.items() if k[:2] == key[:2]}:
                columns.drop()  # no size of this shape takes it: not kept
            return y.view(*x.shape[:-1], y.shape[-1])
        if choice is False:
            return original(x)
        if choice == COLUMNS and columns is not None:
            y = _columns_product(x2, columns.current(), bias)
        elif choice == COLUMNS:
            return original(x)
        else:
            y = torch.ops.mkldnn._linear_pointwise(x2, packed.current(), bias, "none", [], "")
        return y.view(*x.shape[:-1], y.shape[-1])

    return forward
