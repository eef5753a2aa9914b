"""Checks on decoded requests, run before anything touches the model.

Each function raises :class:`~splitlearn.errors.BadRequest` naming the tensor and the
problem (shape, dtype, range, NaN/inf) and returns the tensor ready for the segment.
:func:`json_object` is the one parser of JSON request bodies (both servers' control messages).
"""
from __future__ import annotations

import json
from typing import Optional

import torch

from ...errors import BadRequest, PayloadTooLarge
from ...api.wire import unpack

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


def hidden(tensors: dict, name: str, d: int, max_batch: int, max_len: int,
           rows: Optional[int] = None, length: Optional[int] = None) -> torch.Tensor:
    """Activations or gradients (B, T, d), finite, within the limits; dequantised."""
    x = unpack(tensors, name)
    if x.ndim != 3 or x.shape[-1] != d:
        raise BadRequest(f"tensor {name!r} must have shape [batch, seq, {d}], got {list(x.shape)}")
    B, T, _ = x.shape
    if not 1 <= B <= max_batch:
        raise BadRequest(f"tensor {name!r} has batch {B}; this server takes 1..{max_batch} rows")
    if not 1 <= T <= max_len:
        raise BadRequest(f"tensor {name!r} has {T} positions; the model's n_positions is {max_len}")
    if rows is not None and B != rows:
        raise BadRequest(f"tensor {name!r} has {B} rows, expected {rows}")
    if length is not None and T != length:
        raise BadRequest(f"tensor {name!r} has {T} positions, expected {length}")
    if not bool(torch.isfinite(x).all()):
        raise BadRequest(f"tensor {name!r} contains NaN or inf")
    return x


def attention_mask(tensors: dict, name: str, rows: int, length: int,
                   max_len: int, left_padded: bool = True) -> Optional[torch.Tensor]:
    """Optional 0/1 mask (rows, length) of integer or bool dtype; padded on the left only
    unless ``left_padded`` is False (open-ended training pieces: any padding)."""
    m = tensors.get(name)
    if m is None:
        return None
    if m.dtype not in (torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool):
        raise BadRequest(f"tensor {name!r} must be an integer 0/1 mask, got {m.dtype}")
    if list(m.shape) != [rows, length]:
        raise BadRequest(f"tensor {name!r} must have shape {[rows, length]}, got {list(m.shape)}")
    if length > max_len:
        raise BadRequest(f"sequence of {length} positions is longer than n_positions={max_len}")
    if not bool(((m == 0) | (m == 1)).all()):
        raise BadRequest(f"tensor {name!r} must hold only 0 and 1")
    if left_padded and not bool(m[:, -1].bool().all()):
        raise BadRequest(f"tensor {name!r}: the last position of every row must be a real token "
                         f"(pad on the left)")
    return m.long().cpu()  # the sessions' masks live in host memory, whatever device the request came on


def scalar(tensors: dict, name: str) -> torch.Tensor:
    """One finite float32 value, shape [1] (the gradient of a 2-way piece's loss)."""
    x = tensors.get(name)
    if x is None:
        raise BadRequest(f"the body has no tensor {name!r}")
    if x.dtype != torch.float32 or list(x.shape) != [1]:
        raise BadRequest(f"tensor {name!r} must be F32 of shape [1], got {x.dtype} {list(x.shape)}")
    if not bool(torch.isfinite(x).all()):
        raise BadRequest(f"tensor {name!r} contains NaN or inf")
    return x


def labels(tensors: dict, name: str, rows: int, length: int, vocab: int) -> torch.Tensor:
    """Integer targets (rows, length) in [0, vocab) or -100 (ignored)."""
    y = tensors.get(name)
    if y is None:
        raise BadRequest(f"the body has no tensor {name!r}")
    if y.dtype not in (torch.int64, torch.int32):
        raise BadRequest(f"tensor {name!r} must be int64, got {y.dtype}")
    if list(y.shape) != [rows, length]:
        raise BadRequest(f"tensor {name!r} must have shape {[rows, length]}, got {list(y.shape)}")
    ok = ((y >= 0) & (y < vocab)) | (y == -100)
    if not bool(ok.all()):
        raise BadRequest(f"tensor {name!r} holds ids outside [0, {vocab}) other than -100")
    return y.long()
