"""The client side of masked offload: one product of a linear layer, remote, masked, checked.

:class:`OffloadChannel` turns ``x (n, in) float32`` into ``x W`` (no bias) through the
server; :class:`RemoteLinear` stands in for a linear layer (``nn.Linear``, ``Conv1D``, the LM
head) and adds the bias.
One product of scheme ``masked``::

    client                                                       server (--offload)
    xq, sx = quantise(x)            (n, in) int, (n, 1)
    R, U   = pool.take(n)           pads made offline (.pads)
    X~     = xq + R mod pi          int32 (2, n, in)   --POST /v1/offload/linear-->  Z = X~ Wq mod pi
    Freivalds: Z S == X~ V mod pi   (.verify)          <--------- int32 (2, n, out)
    yq     = CRT(Z - U mod pi)      int64 (n, out)
    y      = sx sw yq               float32 (n, out)   (+ bias in RemoteLinear)

A product of at least ``overlap_rows`` rows goes as ``lanes`` row groups, one request each
on its own connection (docs/OFFLOAD.md, 'Overlap and fewer synchronisation points').
Scheme ``plain``: float32 ``x`` out, ``x W`` back (a measurement baseline)."""
from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from typing import Optional

import torch
from torch import nn

from ..api import protocol as P
from ..transport import Transport
from ..errors import IntegrityError
from ..api.wire import decode, encode
from ..offloadmath import field
from ..offloadmath.layers import MAX_PRODUCTS, QuantisedLayer
from .pads import PadPool
from .verify import Freivalds

log = logging.getLogger(__name__)


@dataclass
class OffloadStats:
    products: int = 0  # layer products computed remotely
    requests: int = 0  # HTTP requests (a product split in row groups makes several; siblings share one)
    ahead: int = 0  # products sent with a sibling on the same input, before they were called
    rows: int = 0  # input rows multiplied
    mask_s: float = 0.0  # quantising + adding pads (client)
    unmask_s: float = 0.0  # removing pads + CRT + dequantising + bias (client)
    verify_s: float = 0.0  # Freivalds' checks (client)
    send_s: float = 0.0  # writing requests to the socket (loopback: the kernel's copy, waking the server)
    wait_s: float = 0.0  # blocked waiting for the server's answers (transfers + server compute)
    codec_s: float = 0.0  # encoding requests and decoding answers (safetensors)

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class _Layer:
    q: QuantisedLayer
    pool: Optional[PadPool]  # None for the plain scheme
    check: Optional[Freivalds]  # None when verify=False (measurement only)
    w: Optional[torch.Tensor] = None  # float32 (in, out): the plain scheme's weight on the client side


def _version(t: torch.Tensor) -> Optional[int]:
    try:
        return t._version  # bumped by every in-place change
    except RuntimeError:  # an inference-mode tensor keeps no version counter (and cannot be changed in place
        return None       # outside inference mode)


class OffloadChannel:
    """Remote products of the layers in ``layers`` over ``transport`` (one per model).

    ``siblings``: layers called one after another on the very same input tensor (a Llama's q, k,
    v; gate, up) are learned as a group on the first forward; from then on the first of a group to
    be called sends the whole group's products in one request (fresh pads and a check each), and
    the others' results wait until they are called with that same tensor, unchanged (else they are
    computed afresh): fewer synchronisation points, the same products."""

    def __init__(self, transport: Transport, layers: dict[str, _Layer], scheme: str = "masked",
                 lanes: int = 2, overlap_rows: int = 16, siblings: bool = True):
        self.transport, self.layers, self.scheme = transport, layers, scheme
        self.lanes, self.overlap_rows = max(1, lanes), overlap_rows
        self.siblings = siblings
        self.stats = OffloadStats()
        self.groups: dict[str, tuple[str, ...]] = {}  # layer -> its group, in call order (learned)
        self._last: Optional[tuple] = None  # (input tensor, its version, layer) of the last product
        self._ahead: dict[str, tuple] = {}  # layer -> (input tensor, version, its product) sent ahead

    def _learn(self, name: str, src: torch.Tensor, version: int) -> None:
        last = self._last
        if self.siblings and last is not None and last[0] is src and last[1] == version and last[2] != name:
            group = self.groups.get(last[2], (last[2],))
            if name not in group and len(group) < MAX_PRODUCTS:
                group = group + (name,)
                for n in group:
                    self.groups[n] = group
        self._last = (src, version, name)

    def product(self, name: str, x: torch.Tensor, source: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``x (n, in) @ W (in, out)`` of layer ``name``, computed by the server; float32.
        ``source``: the tensor ``x`` was reshaped from (siblings are recognised by it)."""
        src = x if source is None else source
        version = _version(src)
        hit = self._ahead.pop(name, None)
        self._learn(name, src, version)
        if hit is not None and hit[0] is src and hit[1] == version:
            return hit[2]  # sent with a sibling on this very input
        group = self.groups.get(name, (name,)) if self.siblings else (name,)
        names = (name,) + group[group.index(name) + 1:]
        n = x.shape[0]
        groups = self.lanes if n >= self.overlap_rows else 1
        bounds = [round(n * g / groups) for g in range(groups + 1)]
        st = self.stats
        st.products += len(names)
        st.rows += n * len(names)
        st.ahead += len(names) - 1
        sent = []
        for g in range(groups):  # mask group g while group g-1 is on its way
            sent.append(self._send(names, x[bounds[g]:bounds[g + 1]], lane=g))
        done = [self._finish(names, s) for s in sent]  # [row group][product]
        ys = [torch.cat([d[k] for d in done]) if groups > 1 else done[0][k] for k in range(len(names))]
        for k, other in enumerate(names[1:], 1):
            self._ahead[other] = (src, version, ys[k])
        return ys[0]

    def _send(self, names: tuple, x: torch.Tensor, lane: int):
        st = self.stats
        t0 = time.perf_counter()
        tensors, states = {}, []
        for k, name in enumerate(names):
            layer = self.layers[name]
            if self.scheme == "plain":
                tensors[f"x.{k}"] = x.detach().to(torch.float32).contiguous()
                states.append(None)
                continue
            xq, sx = field.quantise_rows(x, layer.q.limits.xmax)  # (n, in) int64, (n, 1)
            pads = layer.pool.take(x.shape[0])  # fresh rows, never handed out before
            xt = field.mask(xq, pads.r)  # (2, n, in) int32, uniform over Z_p1 x Z_p2
            tensors[f"x.{k}"] = xt
            states.append((xt, pads.u, sx))
        t1 = time.perf_counter()
        st.mask_s += t1 - t0
        body = encode(tensors, {"layers": ",".join(names), "scheme": self.scheme})
        t2 = time.perf_counter()
        st.codec_s += t2 - t1
        pending = self.transport.start(P.OFFLOAD_LINEAR, body, lane=lane)  # sent now; answered later
        st.send_s += time.perf_counter() - t2
        st.requests += 1
        return pending, states

    def _finish(self, names: tuple, sent) -> list:
        pending, states = sent
        st = self.stats
        t0 = time.perf_counter()
        body = pending.result()  # blocks until the server has answered
        t1 = time.perf_counter()
        st.wait_s += t1 - t0
        tensors, _ = decode(body)
        st.codec_s += time.perf_counter() - t1
        out = []
        for k, name in enumerate(names):
            z = tensors.get(f"y.{k}")
            if z is None:
                raise IntegrityError(f"{name}: the server's answer has no product y.{k} (tensors {sorted(tensors)[:10]})")
            if self.scheme == "plain":
                out.append(z)
                continue
            layer, (xt, u, sx) = self.layers[name], states[k]
            t2 = time.perf_counter()
            if layer.check is not None:
                layer.check.check(xt, z)  # raises IntegrityError; nothing below runs on a bad answer
            t3 = time.perf_counter()
            st.verify_s += t3 - t2
            out.append(field.dequantise(field.unmask(z, u), sx, layer.q.sw))  # (n, out) float32
            st.unmask_s += time.perf_counter() - t3
        return out


class RemoteLinear(nn.Module):
    """Stands in for a linear layer (``nn.Linear``, ``Conv1D``, the LM head): ``y = remote(x W) + b``,
    same shapes; keeps the original ``weight``/``bias`` parameters (state dicts and weight tying
    unchanged, the layout the family's: ``nn.Linear`` (out, in), ``Conv1D`` (in, out))."""

    def __init__(self, name: str, channel: OffloadChannel, weight: nn.Parameter,
                 bias: Optional[nn.Parameter], n_out: int):
        super().__init__()
        self.name, self.channel, self.nf = name, channel, n_out
        self.weight = weight
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = self.channel.product(self.name, x.reshape(-1, x.shape[-1]), source=x)  # (n, out)
        if self.bias is not None:
            t0 = time.perf_counter()
            y = y + self.bias.detach()
            self.channel.stats.unmask_s += time.perf_counter() - t0
        return y.to(x.dtype).reshape(*lead, self.nf)

    def extra_repr(self) -> str:
        return f"{self.name}, out={self.nf}, remote"
