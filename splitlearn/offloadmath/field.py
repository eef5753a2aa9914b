"""The arithmetic of masked offload: fixed point in two 24-bit prime fields, joined by the CRT::

    p1 = 2^24 - 3, p2 = 2^24 - 17, P = p1 p2 ~ 2^48
    xq = round(x / sx) per row, |xq| <= xmax;  Wq = round(W / sw) per column, |Wq| <= wmax
    server, each prime i:  Zi = (Xi~ Wq) mod pi,  Xi~ = (xq + Ri) mod pi   (Ri uniform)
    client:                yq = CRT((Z1 - U1) mod p1, (Z2 - U2) mod p2),  Ui = Ri Wq mod pi
                           y  = sx * sw * yq  (+ the bias, on the client)

The bounds on ``wmax``/``xmax`` (:func:`limits_for`), the error bound and why two primes:
docs/OFFLOAD.md, 'The scheme'."""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

PRIMES = (16777213, 16777199)  # 2^24 - 3 (Slalom's Freivalds prime), 2^24 - 17: the two largest primes below 2^24
MODULUS = PRIMES[0] * PRIMES[1]  # P ~ 2^48: the range of a recovered product
HALF = (MODULUS - 1) // 2  # |yq| <= HALF is recovered with its sign
EXACT = (1 << 53) - 1  # float64 holds every integer up to this exactly
INV_P1_MOD_P2 = pow(PRIMES[0], -1, PRIMES[1])  # for Garner's CRT
P_COL = torch.tensor(PRIMES, dtype=torch.int64).reshape(2, 1, 1)  # broadcasts over (2, n, m)
LIMB_BITS = 12  # secret vectors are split in 12-bit limbs so their products stay exact (:func:`matmul_mod`)


@dataclass(frozen=True)
class Limits:
    """Fixed-point limits of a product with input width ``n_in``."""

    n_in: int  # input features (the contraction length)
    wmax: int  # |Wq| <= wmax
    xmax: int  # |xq| <= xmax


def limits_for(n_in: int) -> Limits:
    wmax = min(EXACT // (n_in * (PRIMES[0] - 1)), 1 << 23)
    if wmax < 1 << 8:
        raise ValueError(f"input width {n_in} leaves fewer than 8 bits of weight in a 2^24 field")
    return Limits(n_in, wmax, HALF // (n_in * wmax))


def quantise_weight(w: torch.Tensor, wmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """W (in, out) -> (Wq float64 (in, out) of integers in [-wmax, wmax], sw float64 (out,)).

    Correctly rounded float64 only, so client and server derive the same ``Wq``."""
    w = w.detach().to(torch.float64)
    sw = w.abs().amax(dim=0).clamp_min(1e-30) / wmax  # (out,)
    return torch.round(w / sw).clamp_(-wmax, wmax), sw


def quantise_rows(x: torch.Tensor, xmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x (n, in) -> (xq int64 (n, in) in [-xmax, xmax], sx float64 (n, 1))."""
    x = x.detach().to(torch.float64)
    sx = x.abs().amax(dim=1, keepdim=True).clamp_min(1e-30) / xmax  # (n, 1)
    return torch.round(x / sx).clamp_(-xmax, xmax).to(torch.int64), sx


def field_matmul(xt: torch.Tensor, wq: torch.Tensor) -> torch.Tensor:
    """The server's product ``Zi = Xi~ Wq mod pi`` for both primes: xt (2, n, in) integers in
    [0, pi), wq (in, out) float64 within ``limits_for(in)`` -> int32 (2, n, out)."""
    two, n, n_in = xt.shape
    z = (xt.to(torch.float64).reshape(two * n, n_in) @ wq).reshape(two, n, -1)  # (2, n, out), exact
    return z.to(torch.int64).remainder_(P_COL).to(torch.int32)


def mask(xq: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """(xq + Ri) mod pi: xq int64 (n, in), r (2, n, in) uniform pads -> int32 (2, n, in)."""
    return (xq.unsqueeze(0) + r).remainder_(P_COL).to(torch.int32)  # (2, n, in)


def unmask(z: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """(Zi - Ui) mod pi for both primes, joined by the CRT: the signed product yq, int64 (n, out)."""
    y = (z.to(torch.int64) - u).remainder_(P_COL)  # (2, n, out)
    return crt(y[0], y[1])


def crt(y1: torch.Tensor, y2: torch.Tensor) -> torch.Tensor:
    """Garner: the y in (-P/2, P/2] with y = y1 mod p1, y = y2 mod p2 (int64 throughout:
    every intermediate stays below 2^49)."""
    p1, p2 = PRIMES
    h = ((y2 - y1).remainder_(p2) * INV_P1_MOD_P2).remainder_(p2)
    y = y1 + p1 * h  # in [0, P)
    return torch.where(y > HALF, y - MODULUS, y)


def dequantise(yq: torch.Tensor, sx: torch.Tensor, sw: torch.Tensor) -> torch.Tensor:
    """yq int64 (n, out) -> y float32 (n, out) = sx sw yq (float64 on the way)."""
    return (yq.to(torch.float64) * sx * sw).to(torch.float32)


def matmul_mod(a: torch.Tensor, b: torch.Tensor, a_max: int) -> torch.Tensor:
    """``a_i @ b_i mod p_i`` exactly for both primes (Freivalds' thin products): integer ``a``
    (2, n, k) or (n, k) with |entries| <= a_max, ``b`` (2, k, m) in [0, p_i) -> int64 (2, n, m).
    ``b`` is split in 12-bit limbs and the contraction chunked to stay below 2^53."""
    a = a.to(torch.float64)
    b = b.to(torch.int64)
    m, k = b.shape[-1], b.shape[-2]
    limbs = torch.cat([(b >> s) & ((1 << LIMB_BITS) - 1) for s in range(0, 24, LIMB_BITS)], dim=-1)
    limbs = limbs.to(torch.float64)  # (2, k, 2m): low limbs, then high limbs
    chunk = max(1, EXACT // (a_max * ((1 << LIMB_BITS) - 1)))
    acc = None
    for start in range(0, k, chunk):
        part = (a[..., start:start + chunk] @ limbs[:, start:start + chunk]).to(torch.int64)  # exact
        acc = part if acc is None else (acc + part.remainder_(P_COL))
    acc.remainder_(P_COL)  # (2, n, 2m)
    return (acc[..., :m] + (acc[..., m:] << LIMB_BITS)).remainder_(P_COL)


def uniform(shape: tuple[int, ...], p: int) -> torch.Tensor:
    """int32 tensor of ``shape`` exactly uniform over [0, p) (p > 2^23), from ``os.urandom``."""
    need = int(np.prod(shape)) if shape else 1
    out = np.empty(0, dtype=np.uint32)
    while out.size < need:
        m = need - out.size
        draw = np.frombuffer(os.urandom(4 * (m + 16)), dtype=np.uint32) & 0xFFFFFF
        out = np.concatenate([out, draw[draw < p]])
    return torch.from_numpy(out[:need].astype(np.int32)).reshape(shape)


def error_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The largest quantisation error of ``x @ w`` per output element (n, out):
    ``sx/2 ||W_:,j||_1 + sw_j/2 ||x||_1 + in sx sw_j / 4`` (plus float32 rounding)."""
    lim = limits_for(w.shape[0])
    x, w = x.to(torch.float64), w.to(torch.float64)
    sx = x.abs().amax(dim=1, keepdim=True).clamp_min(1e-30) / lim.xmax  # (n, 1)
    sw = w.abs().amax(dim=0).clamp_min(1e-30) / lim.wmax  # (out,)
    return sx / 2 * w.abs().sum(0) + sw / 2 * x.abs().sum(1, keepdim=True) + w.shape[0] * sx * sw / 4
