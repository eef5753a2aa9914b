"""Freivalds' check of every product the server returns, per layer and prime ``pi``::

    S_i  uniform over Z_pi, (out, k)          the client's secret, drawn from os.urandom
    V_i = Wq S_i mod pi, (in, k)              precomputed with the client's copy of Wq
    check:  Z_i S_i == X~_i V_i  (mod pi)     against the masked input as sent (no pad needed)

A failure raises :class:`~splitlearn.errors.IntegrityError` and redraws the secrets. False
accept rate and sources: docs/OFFLOAD.md, 'Verification'."""
from __future__ import annotations

import torch

from ..errors import IntegrityError
from ..offloadmath.field import P_COL, PRIMES, matmul_mod, uniform
from ..offloadmath.layers import QuantisedLayer

CHECK_COLUMNS = 2  # k: independent secret columns per layer and prime


class Freivalds:
    def __init__(self, layer: QuantisedLayer, k: int = CHECK_COLUMNS):
        self.layer, self.k = layer, k
        self.checks = 0  # products checked
        self.redraw()

    def redraw(self) -> None:
        """New secret vectors (after a failed check, or at will)."""
        out = self.layer.shape[1]
        self.s = torch.stack([uniform((out, self.k), p) for p in PRIMES])  # (2, out, k)
        self.v = matmul_mod(self.layer.wq, self.s, self.layer.limits.wmax)  # (2, in, k): Wq S_i mod p_i

    def check(self, xt: torch.Tensor, z: torch.Tensor) -> None:
        """Raise IntegrityError unless ``z`` (2, n, out) is ``xt`` (2, n, in) times Wq, mod each prime."""
        n_in, out = self.layer.shape
        n = xt.shape[1]
        if z.dtype != torch.int32 or tuple(z.shape) != (2, n, out):
            raise IntegrityError(f"{self.layer.name}: the server answered {z.dtype} {list(z.shape)}, "
                                 f"expected int32 {[2, n, out]}")
        if bool(((z < 0) | (z >= P_COL)).any()):
            self.redraw()
            raise IntegrityError(f"{self.layer.name}: the server's answer holds values outside Z_p")
        lhs = matmul_mod(z, self.s, PRIMES[0])  # (2, n, k): Z_i S_i
        rhs = matmul_mod(xt, self.v, PRIMES[0])  # (2, n, k): X~_i V_i
        if not torch.equal(lhs, rhs):
            bad = (lhs != rhs).any(dim=2).any(dim=0).nonzero().flatten().tolist()
            self.redraw()
            raise IntegrityError(f"{self.layer.name}: the server's product failed Freivalds' check "
                                 f"(rows {bad[:8]}{'...' if len(bad) > 8 else ''}): its answer is not "
                                 f"X W; no output is produced from it")
        self.checks += 1
