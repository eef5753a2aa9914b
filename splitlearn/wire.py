"""The wire format: safetensors bytes, never pickle.

Every body that carries tensors is one safetensors buffer (``application/octet-stream``)::

    +----------+---------------------------------+-------------------------------------+
    | N: u64le | header: N bytes of UTF-8 JSON   | data: the tensors' raw bytes,       |
    |          | {"__metadata__": {str: str},    | little-endian, row-major, packed    |
    |          |  NAME: {"dtype": "F32",         | in the order of their data_offsets  |
    |          |         "shape": [B, T, d],     |                                     |
    |          |         "data_offsets": [a, b]}}|                                     |
    +----------+---------------------------------+-------------------------------------+

``__metadata__`` carries the message fields as strings. Wire dtypes, chosen per request:
``float32`` (F32), ``bfloat16`` (BF16), ``float16`` (F16): the tensor, cast; ``int8``
(activations and gradients only): ``NAME`` is I8 and ``NAME.scale`` F32 of shape (..., 1),
``scale = max|x| / 127`` per row, ``q = round(x / scale)``, ``x ~ q * scale``.

Encoding writes the layout itself in one copy (docs/INTERNALS.md, 'Tensor codecs'); decoding
checks the header before any tensor is built: malformed, truncated or unknown dtypes raise
:class:`~splitlearn.errors.BadRequest`. See docs/PROTOCOL.md."""
from __future__ import annotations

import json
import struct
import sys
from typing import Optional

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from .errors import BadRequest

WIRE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
               "int8": torch.int8}
_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int8: "I8",
              torch.uint8: "U8", torch.int16: "I16", torch.int32: "I32", torch.int64: "I64",
              torch.float64: "F64", torch.bool: "BOOL"}
WIRE_DTYPE_NAMES = tuple(WIRE_DTYPES)  # the names every command line and config offers
ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1}
SCALE_BYTES = 4  # int8: one float32 absmax scale per row
MAX_HEADER = 1 << 20  # bytes; a header this large is not ours
SCALE = ".scale"


def check_wire_dtype(name: str) -> str:
    if name not in WIRE_DTYPES:
        raise BadRequest(f"unknown wire dtype {name!r}; choose one of {', '.join(WIRE_DTYPES)}")
    return name


def tensor_bytes(wire_dtype: str, elements: int, rows: int) -> int:
    """Bytes of a tensor of ``elements`` values in ``rows`` rows on the wire (no header)."""
    extra = SCALE_BYTES * rows if wire_dtype == "int8" else 0
    return elements * ELEMENT_BYTES[wire_dtype] + extra


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row absmax int8: x (..., d) -> q int8 (..., d), scale float32 (..., 1)."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / 127.0  # (..., 1)
    q = torch.round(xf / scale).clamp_(-127, 127).to(torch.int8)  # (..., d)
    return q, scale


def pack(name: str, x: torch.Tensor, wire_dtype: str) -> dict[str, torch.Tensor]:
    """The entries that carry activation/gradient ``x`` in ``wire_dtype``."""
    x = x.detach()
    if wire_dtype == "int8":
        q, scale = quantize_int8(x)
        return {name: q.cpu(), name + SCALE: scale.cpu()}
    return {name: x.to(dtype=WIRE_DTYPES[wire_dtype]).cpu().contiguous()}


def unpack(tensors: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """Rebuild activation/gradient ``name`` (dequantising int8); raises BadRequest if absent."""
    if name not in tensors:
        raise BadRequest(f"the body has no tensor {name!r} (it has {sorted(tensors)})")
    x = tensors[name]
    if x.dtype == torch.int8:
        scale = tensors.get(name + SCALE)
        if scale is None or scale.dtype != torch.float32 or scale.shape != (*x.shape[:-1], 1):
            raise BadRequest(f"int8 tensor {name!r} needs a float32 {name + SCALE!r} of shape "
                             f"{[*x.shape[:-1], 1]}")
        return x.float() * scale
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise BadRequest(f"tensor {name!r} has dtype {x.dtype}; activations travel as "
                         f"float32, bfloat16, float16 or int8")
    return x


def encode(tensors: dict[str, torch.Tensor], metadata: Optional[dict] = None) -> bytes:
    """Tensors (on any device) + string metadata -> safetensors bytes."""
    meta = {str(k): str(v) for k, v in (metadata or {}).items()}
    cpu = {str(k): v.detach().cpu().contiguous() for k, v in tensors.items()}
    if sys.byteorder != "little" or any(v.dtype not in _ST_DTYPES for v in cpu.values()):
        return st_save(cpu, metadata=meta)  # the library handles the rest
    header: dict = {"__metadata__": meta} if meta else {}
    offset = 0
    for name, v in cpu.items():
        n = v.numel() * v.element_size()
        header[name] = {"dtype": _ST_DTYPES[v.dtype], "shape": list(v.shape),
                        "data_offsets": [offset, offset + n]}
        offset += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    parts = [struct.pack("<Q", len(head)), head]
    parts += [memoryview(v.reshape(-1).view(torch.uint8).numpy()) for v in cpu.values() if v.numel()]
    return b"".join(parts)  # the one copy of each tensor


def read_metadata(body: bytes) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors buffer, checking the header's framing."""
    if len(body) < 8:
        raise BadRequest(f"body of {len(body)} bytes is not safetensors (no 8-byte header length)")
    (n,) = struct.unpack("<Q", body[:8])
    if n > MAX_HEADER or 8 + n > len(body):
        raise BadRequest(f"body is not safetensors or is truncated: header of {n} bytes "
                         f"in a body of {len(body)}")
    try:
        header = json.loads(body[8:8 + n])
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadRequest(f"body is not safetensors: header is not JSON ({e})") from None
    meta = header.get("__metadata__", {}) if isinstance(header, dict) else None
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise BadRequest("safetensors __metadata__ must map strings to strings")
    return meta


def decode(body: bytes) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """safetensors bytes -> (tensors on cpu, metadata); BadRequest on anything malformed."""
    meta = read_metadata(body)
    try:
        tensors = st_load(body if isinstance(body, bytes) else bytes(body))
    except (SafetensorError, ValueError, RuntimeError, TypeError) as e:
        raise BadRequest(f"body is not valid safetensors: {e}") from None
    return tensors, meta
