"""Checks on decoded requests, run before anything touches the model.

Each function raises :class:`~splitlearn.errors.BadRequest` naming the tensor and the
problem (shape, dtype, range, NaN/inf) and returns the tensor ready for the segment.
:func:`json_object` is the one parser of JSON request bodies (both servers' control messages).

The checks of values (NaN/inf, 0/1, ids in range) need the tensors' data, which a GPU server
holds on the device (the ``unix://`` device region): each read would wait for the device. Given
a :class:`Checks`, they are left there as flags and the route reads them all back once
(:meth:`Checks.verify`, with the mask, which goes to host memory anyway); the refusals, their
order and their messages are those of checking one after the other.
"""
from __future__ import annotations

import json
from typing import NoReturn, Optional

import torch

from ...errors import BadRequest, PayloadTooLarge
from ...api.wire import unpack
from ..engine.guard import settle

MAX_JSON_BYTES = 4096  # bytes of a JSON control message (a few fields); larger ones are refused unparsed


def json_object(body: bytes, shape: str) -> dict:
    """A small flat JSON object, or 400/413: never a 500 (deep nesting, bad UTF-8, huge bodies).
    ``shape`` describes the expected object in the error message."""
    if len(body) > MAX_JSON_BYTES:
        raise PayloadTooLarge(f"a JSON control message is at most {MAX_JSON_BYTES} bytes; expected {shape}")
    try:
        payload = json.loads(body)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise BadRequest(f"the body must be JSON {shape}") from None
    if not isinstance(payload, dict) or any(isinstance(v, (dict, list)) for v in payload.values()):
        raise BadRequest(f"the body must be a flat JSON object {shape}")
    return payload


class Checks:
    """The value checks of one request, left on the tensors' device as flags and read back at
    once by :meth:`verify` (one copy to the host), in the order they were required: the first
    that fails is refused, as checking one after the other would. A refusal that needs no read
    (a shape, a dtype) reads the flags required before it first (:meth:`refuse`), so its
    message is the one the sequential checks gave too."""

    def __init__(self):
        self._flags: list[tuple[torch.Tensor, str]] = []

    def require(self, ok: torch.Tensor, why: str) -> None:
        """``ok`` (a 0-dim bool, not read now) must hold, else 400 ``why``."""
        self._flags.append((ok, why))

    def refuse(self, why: str) -> NoReturn:
        self.verify()
        raise BadRequest(why)

    def verify(self, mask: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """Read the flags back (400 on the first that fails) with ``mask`` (its values, at most
        a few thousand 0/1): the mask in host memory, int64, where the sessions keep theirs."""
        flags, self._flags = self._flags, []
        if mask is None:
            if flags:
                settle(flags)
            return None
        if not flags and mask.is_cpu:
            return mask.long()
        ok = torch.stack([f for f, _ in flags]).long() if flags else mask.new_zeros(0, dtype=torch.long)
        host = torch.cat([ok, mask.reshape(-1).long()]).cpu()  # the one read
        for good, (_, why) in zip(host[:len(flags)].tolist(), flags):
            if not good:
                raise BadRequest(why)
        return host[len(flags):].reshape(mask.shape)


def hidden(tensors: dict, name: str, d: int, max_batch: int, max_len: int,
           rows: Optional[int] = None, length: Optional[int] = None,
           checks: Optional[Checks] = None) -> torch.Tensor:
    """Activations or gradients (B, T, d), finite, within the limits; dequantised. With
    ``checks``, the finite check waits for :meth:`Checks.verify`."""
    own, checks = checks is None, checks or Checks()
    x = unpack(tensors, name)
    if x.ndim != 3 or x.shape[-1] != d:
        checks.refuse(f"tensor {name!r} must have shape [batch, seq, {d}], got {list(x.shape)}")
    B, T, _ = x.shape
    if not 1 <= B <= max_batch:
        checks.refuse(f"tensor {name!r} has batch {B}; this server takes 1..{max_batch} rows")
    if not 1 <= T <= max_len:
        checks.refuse(f"tensor {name!r} has {T} positions; the model has {max_len} (max_position_embeddings)")
    if rows is not None and B != rows:
        checks.refuse(f"tensor {name!r} has {B} rows, expected {rows}")
    if length is not None and T != length:
        checks.refuse(f"tensor {name!r} has {T} positions, expected {length}")
    checks.require(torch.isfinite(x).all(), f"tensor {name!r} contains NaN or inf")
    if own:
        checks.verify()
    return x


def attention_mask(tensors: dict, name: str, rows: int, length: int,
                   max_len: int, left_padded: bool = True,
                   checks: Optional[Checks] = None) -> Optional[torch.Tensor]:
    """Optional 0/1 mask (rows, length) of integer or bool dtype; padded on the left only
    unless ``left_padded`` is False (open-ended training pieces: any padding). In host memory,
    int64; with ``checks``, the mask as it came, checked and copied by ``checks.verify(mask)``."""
    own, checks = checks is None, checks or Checks()
    m = tensors.get(name)
    if m is None:
        if own:
            checks.verify()
        return None
    if m.dtype not in (torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool):
        checks.refuse(f"tensor {name!r} must be an integer 0/1 mask, got {m.dtype}")
    if list(m.shape) != [rows, length]:
        checks.refuse(f"tensor {name!r} must have shape {[rows, length]}, got {list(m.shape)}")
    if length > max_len:
        checks.refuse(f"sequence of {length} positions is longer than the model's {max_len} (max_position_embeddings)")
    checks.require(((m == 0) | (m == 1)).all(), f"tensor {name!r} must hold only 0 and 1")
    if left_padded:
        checks.require(m[:, -1].bool().all(), f"tensor {name!r}: the last position of every row must "
                                              f"be a real token (pad on the left)")
    # the sessions' masks live in host memory, whatever device the request came on
    return checks.verify(m) if own else m


def scalar(tensors: dict, name: str, checks: Optional[Checks] = None) -> torch.Tensor:
    """One finite float32 value, shape [1] (the gradient of a 2-way piece's loss)."""
    own, checks = checks is None, checks or Checks()
    x = tensors.get(name)
    if x is None:
        checks.refuse(f"the body has no tensor {name!r}")
    if x.dtype != torch.float32 or list(x.shape) != [1]:
        checks.refuse(f"tensor {name!r} must be F32 of shape [1], got {x.dtype} {list(x.shape)}")
    checks.require(torch.isfinite(x).all(), f"tensor {name!r} contains NaN or inf")
    if own:
        checks.verify()
    return x


def position_ids(tensors: dict, name: str, rows: int, length: int, max_len: int,
                 checks: Optional[Checks] = None) -> Optional[torch.Tensor]:
    """Optional integer positions (rows, length) or (1, length) in [0, max_len): None if absent."""
    own, checks = checks is None, checks or Checks()
    p = tensors.get(name)
    if p is None:
        return None
    if p.dtype not in (torch.int64, torch.int32):
        checks.refuse(f"tensor {name!r} must be int64, got {p.dtype}")
    if p.ndim != 2 or p.shape[0] not in (1, rows) or p.shape[1] != length:
        checks.refuse(f"tensor {name!r} must have shape {[rows, length]} or {[1, length]}, got {list(p.shape)}")
    checks.require(((p >= 0) & (p < max_len)).all(), f"tensor {name!r} holds positions outside [0, {max_len})")
    if own:
        checks.verify()
    return p.long()


def labels(tensors: dict, name: str, rows: int, length: int, vocab: int,
           checks: Optional[Checks] = None) -> torch.Tensor:
    """Integer targets (rows, length) in [0, vocab) or -100 (ignored)."""
    own, checks = checks is None, checks or Checks()
    y = tensors.get(name)
    if y is None:
        checks.refuse(f"the body has no tensor {name!r}")
    if y.dtype not in (torch.int64, torch.int32):
        checks.refuse(f"tensor {name!r} must be int64, got {y.dtype}")
    if list(y.shape) != [rows, length]:
        checks.refuse(f"tensor {name!r} must have shape {[rows, length]}, got {list(y.shape)}")
    ok = ((y >= 0) & (y < vocab)) | (y == -100)
    checks.require(ok.all(), f"tensor {name!r} holds ids outside [0, {vocab}) other than -100")
    if own:
        checks.verify()
    return y.long()
