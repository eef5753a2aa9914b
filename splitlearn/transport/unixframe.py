"""The frames of the ``unix://`` transport (both sides): a lean framing, not HTTP.

Every message, either way, is one frame on a Unix stream socket::

    +-------------+---------+----------+-----------+-------------+----------------+----------------+
    | magic 4 B   | kind u8 | flags u8 | rsvd u16  | meta_len u32| body_len u64   | (20 bytes, LE) |
    | b"SLU1"     |         | (0)      | (0)       |             | inline bytes   |                |
    +-------------+---------+----------+-----------+-------------+----------------+----------------+
    | meta: meta_len bytes of UTF-8 JSON (an object)  | body: body_len bytes (inline body)        |
    +-------------------------------------------------+-------------------------------------------+

Kinds and their JSON ``meta``:

- ``HELLO`` (1), client -> server, at most once, first: ``{"version": 1, "region_bytes": N,
  "device": {"bytes": M, "uuid": "GPU-..."}?}``, with the connection's region passed as
  ``SCM_RIGHTS``: a memfd of exactly N bytes sealed with ``F_SEAL_SHRINK`` (anything else is
  refused), then, with ``device``, a CUDA region's descriptor (:mod:`.cudaregion`). Answered
  ``ANSWER`` ``{"status": 200, "headers": [], "region_bytes": N, "device_bytes": M or 0}``
  (0: the server does not map device regions; the client sends from host memory).
- ``REQUEST`` (2), client -> server: ``{"method", "path", "headers": {...}, "region": [offset,
  length]?, "device": [offset, length]?, "answer_region": true?, "answer_device": true?}``
  (``region``: the body lies in the region; ``device``: the inline body is the safetensors
  header only and the tensors' bytes lie in the device region, ready: the client synchronised
  its stream before sending; absent: inline).
- ``ANSWER`` (3), server -> client: ``{"status", "headers": [[name, value], ...], "region"?,
  "device"?}`` (the server uses a region only when the request allowed it; it synchronises
  before answering from the device region).

One request at a time per connection; JSON and raw bytes only (nothing unpickled); every offset
and length is checked against the region's size (out of range: 400). Design and safety:
docs/TRANSPORT.md, 'Frames' and 'Tensor bytes through shared memory'.
"""
from __future__ import annotations

import json
import socket
import struct
import sys
import time
from typing import Optional

from ..api.wire import compact_json

MAGIC = b"SLU1"
HELLO, REQUEST, ANSWER = 1, 2, 3
HEADER = struct.Struct("<4sBBHIQ")
VERSION = 1
MAX_META_BYTES = 64 << 10  # a frame's JSON part (as the front door's header limit)
INLINE_MAX = 16 << 10  # bodies up to this go inline; larger ones through the region
REGION_BYTES = 64 << 20  # the client's region per connection (memfd: pages cost only once touched)


class FrameError(ValueError):
    """A frame that is not ours (bad magic, sizes, JSON): the connection cannot go on."""


def pack(kind: int, meta: dict, body_len: int = 0) -> bytes:
    """The header and JSON part of a frame (its inline body, ``body_len`` bytes, follows)."""
    m = compact_json(meta).encode()
    return HEADER.pack(MAGIC, kind, 0, 0, len(m), body_len) + m


def unpack_header(raw: bytes, max_body: int) -> tuple[int, int, int]:
    """``(kind, meta_len, body_len)`` of a frame header; FrameError unless it is well formed."""
    magic, kind, flags, rsvd, meta_len, body_len = HEADER.unpack(raw)
    if magic != MAGIC:
        raise FrameError(f"not a splitlearn unix frame (magic {magic!r}, expected {MAGIC!r})")
    if kind not in (HELLO, REQUEST, ANSWER) or flags or rsvd:
        raise FrameError(f"unknown frame kind {kind} / flags {flags} / reserved {rsvd}")
    if meta_len > MAX_META_BYTES:
        raise FrameError(f"frame metadata of {meta_len} bytes (at most {MAX_META_BYTES})")
    if body_len > max_body:
        raise FrameError(f"inline body of {body_len} bytes (at most {max_body})")
    return kind, meta_len, body_len


def parse_meta(raw: bytes) -> dict:
    try:
        meta = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise FrameError(f"frame metadata is not JSON: {e}") from None
    if not isinstance(meta, dict):
        raise FrameError("frame metadata must be a JSON object")
    return meta


def span(value, size: int) -> tuple[int, int]:
    """``(offset, length)`` of a ``region`` field, checked against a region of ``size`` bytes
    (ValueError with the reason otherwise)."""
    if (not isinstance(value, list) or len(value) != 2
            or not all(type(v) is int for v in value)):
        raise ValueError(f"region must be [offset, length] (two integers), got {value!r}")
    off, length = value
    if size <= 0:
        raise ValueError("region given, but this connection registered none (HELLO)")
    if off < 0 or length < 0 or off + length > size:
        raise ValueError(f"region [{off}, {length}] lies outside the connection's region of {size} bytes")
    return off, length


class Reader:
    """Buffered reads from a socket: a small frame (header, JSON, inline body) usually comes in
    one ``recv``. ``deadline`` (``time.monotonic()``; None: the socket's own timeout) bounds
    each :meth:`take`; with ``pace`` (bytes/s) it moves on as bytes arrive: the k-th byte is
    due by ``deadline + k / pace``, so a peer that announces a large body and sends nothing is
    cut off at ``deadline``, not at the end of the whole body's allowance. ``fds`` collects
    descriptors passed with the bytes (``SCM_RIGHTS``).
    Reads land in a buffer of the reader's own (``recv_into``): ``recv(n)`` allocates n bytes
    first, and at 256 KiB that cost ~9 us a call against ~1 us (docs/TRANSPORT.md). A large
    take allocates its ``n`` bytes at once (the caller reserves them first: the server's door
    in its memory account) and reads straight into them."""

    CHUNK = 64 << 10

    def __init__(self, sock: socket.socket):
        self.sock, self.pending = sock, bytearray()
        self._into = memoryview(bytearray(self.CHUNK))

    def take(self, n: int, deadline: Optional[float] = None, fds: Optional[list] = None,
             pace: Optional[float] = None) -> bytes:
        if len(self.pending) >= n:
            out = bytes(self.pending[:n])
            del self.pending[:n]
            return out
        if n - len(self.pending) > self.CHUNK:  # a large inline body: straight into its buffer
            buf = bytearray(n)
            have = len(self.pending)
            buf[:have] = self.pending
            self.pending = bytearray()
            view = memoryview(buf)
            while have < n:
                self._timeout(deadline, pace, have)
                k = self.sock.recv_into(view[have:])
                if not k:
                    raise ConnectionResetError(f"connection closed after {have} of {n} bytes")
                have += k
            return buf
        while len(self.pending) < n:
            self._timeout(deadline, pace, len(self.pending))
            if fds is not None:
                data, anc, _flags, _addr = self.sock.recvmsg(self.CHUNK, socket.CMSG_SPACE(16 * 4))
                for level, kind, raw in anc:
                    if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                        fds.extend(int.from_bytes(raw[i:i + 4], sys.byteorder, signed=True)
                                   for i in range(0, len(raw) - len(raw) % 4, 4))
            else:
                k = self.sock.recv_into(self._into)
                data = self._into[:k]
            if not data:
                raise ConnectionResetError(f"connection closed after {len(self.pending)} of {n} bytes")
            self.pending += data
        out = bytes(self.pending[:n])
        del self.pending[:n]
        return out

    def _timeout(self, deadline: Optional[float], pace: Optional[float] = None, have: int = 0) -> None:
        if deadline is not None:
            left = deadline + (have / pace if pace else 0.0) - time.monotonic()
            if left <= 0:
                raise TimeoutError("deadline passed")
            self.sock.settimeout(left)


def recv_exact(sock: socket.socket, n: int) -> bytearray:
    """Exactly ``n`` bytes; ConnectionError if the peer closes first."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            raise ConnectionResetError(f"connection closed after {got} of {n} bytes")
        got += k
    return buf


def send_frame(sock: socket.socket, head: bytes, body: Optional[bytes] = None) -> None:
    """A frame's header+meta, then its inline body (no concatenation of a large body)."""
    if body and len(body) <= INLINE_MAX:
        sock.sendall(head + body)
        return
    sock.sendall(head)
    if body:
        sock.sendall(body)
