"""``unix:///path.sock`` URLs: a client next to its server, over a Unix socket and shared memory.

    python -m splitlearn.server --model gpt2 --cut 2 --cut 10 --listen unix:///run/splitlearn.sock
    model = SplitGPT2LMHeadModel.from_pretrained("gpt2", server="unix:///run/splitlearn.sock", token=tok)

Taken wherever ``http://`` is (the scheme hook of :mod:`.http`); the whole URL path is the
socket file. Frames: :mod:`.unixframe`. Each connection (one per request in flight) registers a
memfd region of ``REGION_BYTES``; bodies over ``INLINE_MAX`` go through it, smaller ones inline.
A connection whose first tensors are on a CUDA device also registers a device region of the
same size (:mod:`.cudaregion`): tensors cross it device to device, never through host memory.
Refused or lost connections are retried by the Transport; no answer within the read timeout is
a :class:`~splitlearn.errors.TransportError`; a socket served by another user (not root, not
listed in ``$SPLITLEARN_UNIX_PEER_UIDS``) is refused before a byte is sent (:func:`check_peer`).
Design: docs/TRANSPORT.md.
"""
from __future__ import annotations

import array
import fcntl
import logging
import mmap
import os
import select
import socket
import struct
import threading
import time
from typing import Optional
from urllib.parse import urlsplit

import torch

from ..errors import ConfigError, TransportError
from ..api.wire import DeviceBody, Encoded
from . import cudaregion
from . import unixframe as F
from .http import AnswerWait, register_scheme

SCHEME = "unix"


log = logging.getLogger(__name__)


class _Refused(Exception):
    """The server refused a connection's region (its HELLO)."""


class _Headers(dict):
    """An answer's headers: ``.get`` is case-insensitive (lower-case keys)."""

    def get(self, key, default=None):
        return super().get(key.lower(), default)


PEER_UIDS_ENV = "SPLITLEARN_UNIX_PEER_UIDS"  # "1001,1002": server users trusted beside this one and root


def trusted_uids() -> set:
    """The users whose server a ``unix://`` client talks to: its own, root, and the uids listed
    in ``$SPLITLEARN_UNIX_PEER_UIDS`` (the explicit option; docs/SECURITY.md)."""
    extra = os.environ.get(PEER_UIDS_ENV, "")
    try:
        listed = {int(x) for x in extra.replace(" ", "").split(",") if x}
    except ValueError:
        raise ConfigError(f"${PEER_UIDS_ENV} must be uids separated by commas, got {extra!r}") from None
    return {os.geteuid(), 0} | listed


def check_peer(sock: socket.socket, path: str) -> None:
    """Refuse (ConfigError, before a byte is sent: the first request carries the token) a socket
    whose listening process runs as another user (``SO_PEERCRED``): a stranger who made the
    path first, or replaced a stale socket, would read every token and tensor sent to it."""
    pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                         struct.calcsize("3i")))
    if uid not in trusted_uids():
        raise ConfigError(f"unix://{path} is served by uid {uid} (pid {pid}), not by this user "
                          f"(uid {os.geteuid()}) or root: refusing to send it a token. If that user's "
                          f"server is the one you mean, allow it: {PEER_UIDS_ENV}={uid}")


def socket_of(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme != SCHEME or parts.netloc or not parts.path:
        raise ConfigError(f"a unix URL is unix:///absolute/path.sock, got {url!r}")
    return parts.path


class Connection(AnswerWait):
    """One connected socket with its registered region; one request at a time."""

    def __init__(self, path: str, connect_timeout_s: float = 5.0, read_timeout_s: float = 300.0,
                 region_bytes: int = F.REGION_BYTES, device=None):
        self.read_timeout_s = read_timeout_s
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(connect_timeout_s)
        self.region: Optional[mmap.mmap] = None
        self.device_region = None  # a cudaregion.DeviceRegion the server mapped too
        self.device_tried = device is not None
        self.size = 0
        self.sent_at, self.expected_s = 0.0, None  # the request in flight; recent waits (spin)
        try:
            self.sock.connect(path)  # FileNotFoundError / ConnectionRefusedError: nobody serves it
        except FileNotFoundError as e:
            self.sock.close()
            raise ConnectionRefusedError(f"no socket at {path}: {e}") from None
        except OSError:
            self.sock.close()
            raise
        try:
            check_peer(self.sock, path)
        except ConfigError:
            self.sock.close()
            raise
        self.sock.settimeout(read_timeout_s)
        self.reader = F.Reader(self.sock)
        if region_bytes:
            try:
                self._register(region_bytes, device)
            except _Refused as e:  # the server closed this connection: a new one, bodies inline
                log.warning("%s; this connection sends its bodies inline", e)
                self.close()
                self.__init__(path, connect_timeout_s, read_timeout_s, region_bytes=0)

    def _register(self, size: int, device=None) -> None:
        fd = os.memfd_create("splitlearn-region", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        fds, meta, dev = [fd], {"version": F.VERSION, "region_bytes": size}, None
        try:
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL)
            self.region = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            if device is not None:
                dev = self._device_region(device, size)
                if dev is not None:
                    fds.append(dev[1])
                    meta["device"] = {"bytes": dev[0].size, "uuid": cudaregion.uuid(device)}
            head = F.pack(F.HELLO, meta)
            self.sock.sendmsg([head], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
        except BaseException:
            if dev is not None:
                dev[0].close()
            raise
        finally:
            for f in fds:
                os.close(f)
        try:
            meta, content = self._read_frame()
        except BaseException:
            if dev is not None:
                dev[0].close()
            raise
        if meta.get("status") != 200:
            if dev is not None:
                dev[0].close()
            raise _Refused(f"the server refused this connection's shared region: "
                           f"{content[:300].decode('utf-8', 'replace')}")
        self.size = size
        if dev is not None:
            if meta.get("device_bytes") == dev[0].size:
                self.device_region = dev[0]
            else:  # a server without a GPU, or on another one: tensors cross through host memory
                dev[0].close()

    @staticmethod
    def _device_region(device, size: int):
        """``(DeviceRegion, fd)`` on ``device``, or None (logged) if the driver offers none."""
        try:
            return cudaregion.DeviceRegion.create(device, size)
        except (OSError, RuntimeError, AttributeError) as e:  # no driver, no virtual memory API
            log.warning("no CUDA region for unix:// (%s): tensors cross through host memory", e)
            return None

    def request(self, method: str, path: str, headers: dict, body: Optional[bytes]):
        self.send(method, path, headers, body)
        return self._read_answer()

    def readable(self, wait_s: float = 0.0) -> bool:
        """True if reading the answer would not wait (or the connection has ended), waiting up
        to ``wait_s`` for it."""
        return bool(self.reader.pending) or bool(select.select([self.sock], [], [], wait_s)[0])

    def send(self, method: str, path: str, headers: dict, body) -> None:
        """Send a request; ``body``: bytes, or a :class:`~splitlearn.api.wire.Encoded` (written
        straight into the region when it goes there: its device region if its tensors are on
        that device)."""
        meta = {"method": method, "path": path, "headers": headers}
        body = body if body is not None else b""
        if self.size:
            meta["answer_region"] = True
        dev = self.device_region
        if dev is not None:
            meta["answer_device"] = True
        if (dev is not None and isinstance(body, Encoded) and body.device == dev.device and body.tensors
                and len(body) - len(body.head) <= dev.size):
            n = body.write_data(dev.tensor)  # the one copy, device to device
            torch.cuda.current_stream(dev.device).synchronize()  # the bytes are there before the server reads
            meta["device"], body = [0, n], body.head
        elif len(body) > F.INLINE_MAX and len(body) <= self.size:
            if isinstance(body, Encoded):
                body.write_into(self.region)  # the one copy into the region, from the tensors
            else:
                self.region[0:len(body)] = body  # the one copy into the region
            meta["region"], body = [0, len(body)], b""
        elif isinstance(body, Encoded):
            body = bytes(body)
        F.send_frame(self.sock, F.pack(F.REQUEST, meta, len(body)), body)
        self.sent_at = time.perf_counter()

    def _read_answer(self, view: bool = False):
        """``(status, headers, content)``; ``view``: an answer in the region comes as a
        ``memoryview`` of it (a :class:`~splitlearn.api.wire.DeviceBody` from the device region),
        valid until this connection's next request (else copied out)."""
        meta, content = self._read_frame()
        try:
            if "region" in meta:
                off, length = F.span(meta["region"], self.size)
                # read in place by the caller (its decode is the one copy out), or copied out here
                content = memoryview(self.region)[off:off + length] if view else self.region[off:off + length]
            elif "device" in meta:
                dev = self.device_region
                off, length = F.span(meta["device"], dev.size if dev is not None else 0)
                data = dev.tensor[off:off + length]
                # decoded on the device (the region is free again once the copies are done), or copied out
                content = DeviceBody(content, data, torch.cuda.current_stream(dev.device).synchronize)
                content = content if view else content.tobytes()
            headers = _Headers({str(k).lower(): str(v) for k, v in meta.get("headers", [])})
            return int(meta["status"]), headers, content
        except (KeyError, TypeError, ValueError) as e:  # not an answer this client can read
            raise F.FrameError(f"malformed answer from the server: {e}") from None

    def _read_frame(self) -> tuple[dict, bytes]:
        """An ANSWER frame's meta and inline body."""
        kind, meta_len, body_len = F.unpack_header(self.reader.take(F.HEADER.size), 1 << 40)
        if kind != F.ANSWER:
            raise F.FrameError(f"the server sent a kind-{kind} frame")
        meta = F.parse_meta(self.reader.take(meta_len))
        return meta, (bytes(self.reader.take(body_len)) if body_len else b"")

    def close(self) -> None:
        try:
            self.sock.close()
        finally:
            if self.device_region is not None:
                self.device_region.close()
                self.device_region = None
            if self.region is not None:
                try:
                    self.region.close()
                except BufferError:  # a view still read elsewhere: unmapped once it is gone
                    pass
                self.region = None


_CORES_TTL_S = 10.0  # a generate() asks before each call: one connection per URL per 10 s, not per call
_cores_seen: dict[str, tuple[float, Optional[set]]] = {}


def server_cores(url: str) -> Optional[set]:
    """The cores the process serving ``url`` may run on (its credentials on the socket,
    ``SO_PEERCRED``, then its affinity), read at most once per ``_CORES_TTL_S``; None if this
    process cannot tell (no server there, another PID namespace, not permitted)."""
    seen = _cores_seen.get(url)
    if seen is not None and time.monotonic() - seen[0] < _CORES_TTL_S:
        return seen[1]
    cores = _ask_cores(url)
    if cores is not None:  # nobody there yet: ask again next time (a refused connect is cheap)
        _cores_seen[url] = (time.monotonic(), cores)
    return cores


def _ask_cores(url: str) -> Optional[set]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(2.0)
        sock.connect(socket_of(url))
        pid, _uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                               struct.calcsize("3i")))
        return set(os.sched_getaffinity(pid)) if pid > 0 else None
    except (OSError, AttributeError, ConfigError):
        return None
    finally:
        sock.close()


class UnixLink:
    """The link of a ``unix://`` URL (:data:`splitlearn.transport.http.LINKS`). A tensor call
    goes on its lane's connection (``send`` now, ``receive`` later: a pipelined caller computes
    while the server works, as on HTTP's lanes); ``request`` (JSON calls) takes an idle
    connection of a pool (or opens one), so concurrent callers never share one."""

    same_host = True  # the server is another process of this host: polls for answers when pinned apart
    takes_encoded = True  # a tensor body comes as wire.Encoded: written into the region (Connection.send)
    takes_device = True  # ... with its CUDA tensors left on their device (the device region)
    server_cores = staticmethod(server_cores)  # whether to poll for answers: shares_cores_with_server

    def __init__(self, url: str, connect_timeout_s: float = 5.0, read_timeout_s: float = 300.0):
        self.url, self.path = url, socket_of(url)
        self.connect_timeout_s, self.read_timeout_s = connect_timeout_s, read_timeout_s
        self._idle: list[Connection] = []
        self._lock = threading.Lock()
        self._lanes: dict[int, Connection] = {}  # a Transport's lanes (one thread uses a Transport's lanes)
        self._sent: dict[int, tuple[str, str]] = {}  # a lane's last request: (method, path), for errors
        self._out: set[int] = set()  # lanes whose answer is not read yet

    def _path(self, path: str) -> str:
        if path.startswith(self.path):  # the Transport puts the URL's path (the socket's) in front
            path = path[len(self.path):] or "/"
        return path

    # -- lanes: a tensor call's connection, sent now and answered later (Transport.start) ------

    def _what(self, lane: int) -> str:
        method, path = self._sent.get(lane, ("", ""))
        return f"{method} {self.url}{path}"

    def send(self, lane: int, method: str, path: str, headers: dict, body: Optional[bytes]) -> None:
        path = self._path(path)
        if lane in self._out:  # its answer would be read as this request's
            raise RuntimeError(f"lane {lane} of {self.url} already has a request in flight ({self._what(lane)}): "
                               f"read its answer first")
        conn = self._lanes.get(lane)
        device = body.device if isinstance(body, Encoded) else None
        if conn is None or (device is not None and conn.device_region is None and not conn.device_tried):
            if conn is not None:  # the lane's first tensors were on the host: now a device region too
                self.drop(lane)
            conn = self._lanes[lane] = Connection(self.path, self.connect_timeout_s, self.read_timeout_s,
                                                  device=device)
        self._sent[lane] = (method, path)
        try:
            conn.send(method, path, headers, body)
            self._out.add(lane)
        except socket.timeout:
            self.drop(lane)
            raise TransportError(f"{self._what(lane)}: the server did not take the request in time") from None
        except BaseException:
            self.drop(lane)
            raise

    def receive(self, lane: int, spin: bool = False):
        """The answer on ``lane``; ``spin``: poll for it near its expected time rather than
        sleep (the server has cores of its own: see :mod:`.http`, "Waking up for the answer")."""
        conn = self._lanes.get(lane)
        if conn is None:
            raise ConnectionResetError(f"lane {lane} has no request in flight")
        try:
            if spin:
                conn.await_answer()
            answer = conn._read_answer(view=True)  # a lane's answer is read before its next request
            self._out.discard(lane)
            conn.answered()
            return answer
        except socket.timeout:
            self.drop(lane)
            raise TransportError(f"{self._what(lane)}: no answer within {self.read_timeout_s:g}s") from None
        except F.FrameError as e:
            self.drop(lane)
            raise TransportError(f"{self._what(lane)}: {e}") from None
        except BaseException:
            self.drop(lane)
            raise

    def readable(self, lane: int) -> bool:
        conn = self._lanes.get(lane)
        return conn is None or conn.readable()

    def drop(self, lane: int) -> None:
        self._out.discard(lane)
        conn = self._lanes.pop(lane, None)
        if conn is not None:
            conn.close()

    # -- requests on the pool (JSON calls, and a tensor call of a caller without lanes) ------

    def request(self, method: str, path: str, headers: dict, body: Optional[bytes]):
        path = self._path(path)
        with self._lock:
            conn = self._idle.pop() if self._idle else None
        if conn is None:
            conn = Connection(self.path, self.connect_timeout_s, self.read_timeout_s)
        try:
            answer = conn.request(method, path, headers, body)
        except socket.timeout:
            conn.close()
            raise TransportError(f"{method} {self.url}{path}: no answer within {self.read_timeout_s:g}s") from None
        except F.FrameError as e:
            conn.close()
            raise TransportError(f"{method} {self.url}{path}: {e}") from None
        except BaseException:
            conn.close()  # ConnectionError (retried by the Transport) and anything else
            raise
        with self._lock:
            self._idle.append(conn)
        return answer

    def close(self) -> None:
        with self._lock:
            conns, self._idle = self._idle, []
        conns += list(self._lanes.values())
        self._lanes.clear()
        self._out.clear()
        for c in conns:
            c.close()


register_scheme(SCHEME, UnixLink)
