"""``PackedLinears``: few-row inference on oneDNN prepacked weights (CPU, float32).

Inside ``with packed.active():`` the no-grad forwards of every ``Conv1D`` and ``nn.Linear`` of
a module run on a prepacked copy of their weight (repacked after the weight changes) when
they multiply at least :func:`min_rows` rows (measured on this host); with gradients on they
run as before. Off (``PackedLinears.usable`` False) without oneDNN, off the
CPU and for dtypes other than float32. Why, the measured speed-up and the memory cost:
docs/INTERNALS.md, 'Small-batch matrix products on CPU'."""
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

    def __init__(self, module: nn.Module):
        self.module = module
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
        self._forwards = [_packed_forward(layer, p) for layer, p in self._layers] if self.usable else []

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


#: the fewest rows a product runs on the packed weight with; None: measured on first use
#: (:func:`min_rows`); set it to fix the choice
MIN_ROWS: Optional[int] = None


def min_rows() -> int:
    """The fewest rows for which a prepacked product beats ``torch.addmm`` on this host,
    measured once per process on a 768 x 3072 product at 1, 2 and 4 rows (8 if neither wins).
    Hosts differ: on the AMD EPYC VM of docs/INTERNALS.md prepacked won from one row, on an
    Intel Xeon VM only from four (one row: 0.42 against 0.34 ms, the LM head 12 against 9 ms)."""
    global MIN_ROWS
    if MIN_ROWS is None:
        import time

        g = torch.Generator().manual_seed(0)
        w = torch.randn(3072, 768, generator=g)
        wt, b = w.t().contiguous(), torch.zeros(3072)
        pw = torch.ops.mkldnn._reorder_linear_weight(w, None)

        def median_s(f) -> float:
            f()
            times = []
            for _ in range(9):
                t0 = time.perf_counter()
                f()
                times.append(time.perf_counter() - t0)
            return sorted(times)[4]

        MIN_ROWS = 8
        with torch.no_grad():
            for rows in (1, 2, 4):
                x = torch.randn(rows, 768, generator=g)
                if median_s(lambda: torch.ops.mkldnn._linear_pointwise(x, pw, b, "none", [], "")) \
                        < 0.95 * median_s(lambda: torch.addmm(b, x, wt)):
                    MIN_ROWS = rows
                    break
    return MIN_ROWS


def _packed_forward(layer: nn.Module, packed: _Packed):
    original = type(layer).forward.__get__(layer)
    bias = layer.bias
    fewest = min_rows()

    def forward(x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., out)
        if torch.is_grad_enabled() or x.dtype != torch.float32 or x.device.type != "cpu" \
                or x.numel() < fewest * x.shape[-1]:
            return original(x)
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), packed.current(), bias, "none", [], "")
        return y.view(*x.shape[:-1], y.shape[-1])

    return forward
