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

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from ..errors import BadRequest

WIRE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
               "int8": torch.int8}
_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int8: "I8",
              torch.uint8: "U8", torch.int16: "I16", torch.int32: "I32", torch.int64: "I64",
              torch.float64: "F64", torch.bool: "BOOL"}
WIRE_DTYPE_NAMES = tuple(WIRE_DTYPES)  # the names every command line and config offers
ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1}
SCALE_BYTES = 4  # int8: one float32 absmax scale per row
MAX_HEADER = 1 << 20  # bytes; a header this large is not ours
MAX_DIMS = 64  # a tensor's dimensions at most (numpy's limit; no body of ours has more than 3)
# elements of a tensor's shape, its zero dimensions left out, at most: an empty tensor's other
# dimensions are bounded too ([0, 2**70] made numpy's reshape raise), and times any itemsize it fits
# the int64 that numpy and torch compute sizes in
MAX_ELEMENTS = 1 << 48
SCALE = ".scale"
#: JSON without spaces, its encoder built once (``json.dumps(..., separators=...)`` builds one a call)
compact_json = json.JSONEncoder(separators=(",", ":"), check_circular=False).encode


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
    x = x.detach() if x.requires_grad else x  # left on its device: the encoder moves it (to host memory, or a device region)
    if wire_dtype == "int8":
        q, scale = quantize_int8(x)
        return {name: q, name + SCALE: scale}
    dtype = WIRE_DTYPES[wire_dtype]
    x = x if x.dtype == dtype else x.to(dtype=dtype)
    return {name: x if x.is_contiguous() else x.contiguous()}


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


def _ready(v: torch.Tensor, device) -> torch.Tensor:
    """``v`` as it is written: without autograd, contiguous, on ``device`` (None: host memory).
    Each torch call is skipped where it would change nothing: a decode step's body is a few small
    tensors, whose cost is the calls themselves (docs/TRANSPORT.md, 'Measured')."""
    if v.requires_grad:
        v = v.detach()
    if device is None:
        if not v.is_cpu:
            v = v.cpu()
    elif v.device != device:
        v = v.to(device)
    return v if v.is_contiguous() else v.contiguous()


def _host_array(v: torch.Tensor):
    """A numpy array over the bytes of the contiguous tensor ``v`` (copied to host memory first
    if needed); bfloat16, which numpy lacks, as int16."""
    if not v.is_cpu:
        v = v.cpu()
    return (v.view(torch.int16) if v.dtype == torch.bfloat16 else v).numpy()


class Encoded:
    """Tensors + string metadata laid out as a safetensors body, written where it goes:
    ``bytes(e)`` (one copy of each tensor), or :meth:`write_into` a buffer (the unix
    transport's shared memory: the one copy there). ``len(e)`` is the body's size.
    ``keep_device``: tensors on a CUDA device stay there (:attr:`device`), for a link that
    writes them into a device region (:meth:`write_data`); anything else copies them out."""

    __slots__ = ("head", "tensors", "nbytes", "device", "host_copied")

    def __init__(self, tensors: dict[str, torch.Tensor], metadata: Optional[dict] = None,
                 keep_device: bool = False):
        meta = {str(k): str(v) for k, v in (metadata or {}).items()}
        self.device = next((v.device for v in tensors.values() if v.is_cuda), None) if keep_device else None
        # bytes of tensor data copied through host memory so far (a copy out of a device counts)
        self.host_copied = sum(v.numel() * v.element_size() for v in tensors.values()
                               if self.device is None and not v.is_cpu)
        moved = {str(k): _ready(v, self.device) for k, v in tensors.items()}
        if sys.byteorder != "little" or any(v.dtype not in _ST_DTYPES for v in moved.values()):
            moved = {k: v.cpu() for k, v in moved.items()}
            self.head, self.tensors, self.device = st_save(moved, metadata=meta), [], None  # the library handles the rest
            self.nbytes = len(self.head)
            return
        header: dict = {"__metadata__": meta} if meta else {}
        offset = 0
        for name, v in moved.items():
            n = v.numel() * v.element_size()
            header[name] = {"dtype": _ST_DTYPES[v.dtype], "shape": list(v.shape),
                            "data_offsets": [offset, offset + n]}
            offset += n
        head = compact_json(header).encode()
        head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        self.head = struct.pack("<Q", len(head)) + head
        self.tensors = [v for v in moved.values() if v.numel()]  # contiguous, in data order
        self.nbytes = len(self.head) + offset

    def __len__(self) -> int:
        return self.nbytes

    def _data_bytes(self) -> int:
        return self.nbytes - len(self.head)

    def __bytes__(self) -> bytes:
        # numpy arrays are joined as their bytes (C-contiguous): one copy, one torch call a tensor
        self.host_copied += self._data_bytes()
        return b"".join([self.head, *(_host_array(v) for v in self.tensors)])

    def host_body(self):
        """The body in host memory, for a socket, each tensor copied once: tensors left on a
        CUDA device (``keep_device``) go device-to-host straight into one pinned buffer of the
        body's size (the copies queued together, one wait), which comes back as a ``memoryview``;
        tensors in host memory are joined into ``bytes`` (:meth:`__bytes__`). Either way one copy
        of the data (:attr:`host_copied`), none by Python."""
        if self.device is None:
            return bytes(self)
        buf = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=True)  # torch caches pinned blocks
        buf[:len(self.head)].copy_(torch.frombuffer(bytearray(self.head), dtype=torch.uint8))
        end = len(self.head)
        for v in self.tensors:
            n = v.numel() * v.element_size()
            buf[end:end + n].copy_(v.reshape(-1).view(torch.uint8), non_blocking=True)  # device to pinned host
            end += n
        torch.cuda.current_stream(self.device).synchronize()  # the bytes are there before the socket reads them
        self.host_copied += self._data_bytes()
        return memoryview(buf.numpy())  # keeps ``buf`` alive

    def write_into(self, buf, offset: int = 0) -> int:
        """Write the body into the writable buffer ``buf`` at ``offset``; its size."""
        self.host_copied += self._data_bytes()
        end = offset + len(self.head)
        buf[offset:end] = self.head
        for v in self.tensors:
            n = v.numel() * v.element_size()
            torch.frombuffer(buf, dtype=torch.uint8, count=n, offset=end).copy_(v.reshape(-1).view(torch.uint8))
            end += n
        return end - offset

    def write_data(self, dst: torch.Tensor) -> int:
        """Copy the tensors' bytes (the body after :attr:`head`) into the uint8 tensor ``dst``
        (a device region: one device-to-device copy each); their size."""
        end = 0
        for v in self.tensors:
            n = v.numel() * v.element_size()
            dst[end:end + n].copy_(v.reshape(-1).view(torch.uint8), non_blocking=True)
            end += n
        return end


class DeviceBody:
    """A body whose header is in host memory and whose data is a uint8 device tensor (the
    unix transport's device region): :func:`decode` copies each tensor out of ``data`` once,
    on the device. ``release``: called once it is decoded."""

    __slots__ = ("head", "data", "release")

    def __init__(self, head: bytes, data: torch.Tensor, release=None):
        self.head, self.data, self.release = head, data, release or (lambda: None)

    def __len__(self) -> int:
        return len(self.head) + self.data.numel()

    def tobytes(self) -> bytes:
        """The whole body in host memory (as ``memoryview.tobytes``)."""
        return self.head + self.data.cpu().numpy().tobytes()


def encode(tensors: dict[str, torch.Tensor], metadata: Optional[dict] = None) -> bytes:
    """Tensors (on any device) + string metadata -> safetensors bytes."""
    return bytes(Encoded(tensors, metadata))  # the one copy of each tensor


def _header(body) -> tuple[object, int]:
    """The JSON header of a safetensors buffer and where its data starts, checking the framing."""
    if len(body) < 8:
        raise BadRequest(f"body of {len(body)} bytes is not safetensors (no 8-byte header length)")
    (n,) = struct.unpack("<Q", body[:8])
    if n > MAX_HEADER or 8 + n > len(body):
        raise BadRequest(f"body is not safetensors or is truncated: header of {n} bytes "
                         f"in a body of {len(body)}")
    try:
        header = json.loads(bytes(body[8:8 + n]))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadRequest(f"body is not safetensors: header is not JSON ({e})") from None
    return header, 8 + n


def read_metadata(body: bytes) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors buffer, checking the header's framing."""
    return _metadata(_header(body)[0])


def _metadata(header) -> dict[str, str]:
    meta = header.get("__metadata__", {}) if isinstance(header, dict) else None
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise BadRequest("safetensors __metadata__ must map strings to strings")
    return meta


def decode(body, repeats: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """safetensors bytes (``bytes``, ``bytearray`` or a ``memoryview`` of shared memory) ->
    (tensors on cpu, metadata); BadRequest on anything malformed. See :func:`decode_view`.
    ``repeats``: the caller's bodies often repeat a header (a client's answers to its decode
    steps), so the checked form of the last few is kept per process and reused. A client's
    option only: a server shared by tenants would let one time another's headers."""
    if isinstance(body, DeviceBody):
        return decode_device(body)
    if sys.byteorder == "little":
        return decode_view(body, repeats)
    meta = read_metadata(body)
    try:
        tensors = st_load(body if isinstance(body, bytes) else bytes(body))
    except (SafetensorError, ValueError, RuntimeError, TypeError) as e:
        raise BadRequest(f"body is not valid safetensors: {e}") from None
    return tensors, meta


_DTYPE_OF = {v: k for k, v in _ST_DTYPES.items()}
_NUMPY = {torch.float32: np.float32, torch.float16: np.float16, torch.int8: np.int8, torch.uint8: np.uint8,
          torch.int16: np.int16, torch.int32: np.int32, torch.int64: np.int64, torch.float64: np.float64,
          torch.bool: np.bool_}  # little-endian host: numpy's native dtypes are the wire's


def _spans(header: dict, size: int) -> list:
    """The tensors of a safetensors header over ``size`` bytes of data, checked as safetensors
    checks them (known dtypes, shapes of non-negative integers, each tensor's bytes inside the
    data, not overlapping: nothing allocated beyond the data's size), and more: at most
    ``MAX_DIMS`` dimensions and ``MAX_ELEMENTS`` elements, zero dimensions left out (what numpy
    and torch can reshape):
    ``[(begin, end, name, dtype, shape, count)]`` in data order."""
    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise BadRequest(f"body is not valid safetensors: tensor {name[:40]!r} must have dtype, shape, data_offsets")
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        dtype = _DTYPE_OF.get(dtype) if isinstance(dtype, str) else None
        if dtype is None:
            raise BadRequest(f"body is not valid safetensors: tensor {name[:40]!r} has dtype {str(info['dtype'])[:20]!r}")
        if not isinstance(shape, list) or not all(type(x) is int and x >= 0 for x in shape):
            raise BadRequest(f"body is not valid safetensors: tensor {name[:40]!r} has shape {str(shape)[:60]}")
        if len(shape) > MAX_DIMS:
            raise BadRequest(f"tensor {name[:40]!r} has {len(shape)} dimensions (at most {MAX_DIMS})")
        count = extent = 1
        for x in shape:
            count, extent = count * x, extent * max(x, 1)
        if extent > MAX_ELEMENTS:
            raise BadRequest(f"body is not valid safetensors: tensor {name[:40]!r} has shape {str(shape)[:60]} "
                             f"(more than 2**48 elements, its zero dimensions left out)")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(x) is int for x in offsets)
                and 0 <= offsets[0] <= offsets[1] <= size):
            raise BadRequest(f"body is not valid safetensors: tensor {name[:40]!r} lies outside the data")
        if offsets[1] - offsets[0] != count * dtype.itemsize:
            raise BadRequest(f"body is not valid safetensors: tensor {name[:40]!r} of shape {shape} "
                             f"does not fill its {offsets[1] - offsets[0]} bytes")
        spans.append((offsets[0], offsets[1], name, dtype, shape, count))
    spans.sort()
    for (_, end, *_), (begin, *_) in zip(spans, spans[1:]):
        if begin < end:
            raise BadRequest("body is not valid safetensors: tensors overlap")
    return spans


def decode_view(body, repeats: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """:func:`decode` of a buffer read where it lies (bytes, or shared memory: not copied first):
    the header checked (:func:`_spans`), then each tensor copied out of ``body`` once into memory
    of its own, by numpy (one torch call a tensor). Written by hand: the safetensors library
    reads only ``bytes`` (a copy of the whole body first) and costs several torch calls a
    tensor, the most of a decode step's small body (docs/TRANSPORT.md, 'Measured').
    ``repeats``: see :func:`decode`."""
    meta, spans, start = _checked(body, repeats)
    out = {}
    for begin, _, name, dtype, shape, count in spans:
        np_dtype = _NUMPY.get(dtype, np.int16)  # bfloat16: numpy has none; its bits as int16
        t = torch.from_numpy(np.frombuffer(body, np_dtype, count, start + begin).reshape(shape).copy())
        out[name] = t if t.dtype == dtype else t.view(dtype)
    return out, meta


_REPEATED: dict[bytes, tuple] = {}  # a header's bytes -> its checked form (decode(..., repeats=True))
_REPEATED_MAX = 64  # headers kept, each at most _REPEATED_HEADER_MAX bytes (a decode step's: ~150)
_REPEATED_HEADER_MAX = 4096


def _checked(body, repeats: bool) -> tuple[dict, list, int]:
    """``(metadata, spans, data start)`` of a safetensors buffer, checked (:func:`_header`,
    :func:`_spans`); with ``repeats``, a header met before over a body of the same size is not
    parsed again (headers up to ``_REPEATED_HEADER_MAX`` bytes are kept: 256 KiB at most)."""
    raw = None
    if repeats and len(body) >= 8:
        (n,) = struct.unpack_from("<Q", body)
        if n <= _REPEATED_HEADER_MAX and 8 + n <= len(body):  # (else _header refuses it below)
            raw = bytes(body[8:8 + n])
            seen = _REPEATED.get(raw)
            if seen is not None and seen[0] == len(body):
                return dict(seen[1]), seen[2], 8 + n
    header, start = _header(body)
    meta = _metadata(header)
    spans = _spans(header, len(body) - start)
    if raw is not None:
        if len(_REPEATED) >= _REPEATED_MAX:
            _REPEATED.clear()
        _REPEATED[raw] = (len(body), dict(meta), spans)
    return meta, spans, start


def decode_device(body: DeviceBody) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """:func:`decode` of a :class:`DeviceBody`: the header checked as :func:`decode_view` checks
    it, each tensor copied out of the device region once (a new allocation: aligned for its
    dtype, and the region may be rewritten once this returns)."""
    header, start = _header(body.head)
    meta = _metadata(header)
    if start != len(body.head):
        raise BadRequest(f"a device body's inline part is its safetensors header only "
                         f"({start} bytes), got {len(body.head)}")
    out, data = {}, body.data
    for begin, end, name, dtype, shape, count in _spans(header, data.numel()):
        out[name] = data[begin:end].clone().view(dtype).reshape(shape)
    return out, meta
