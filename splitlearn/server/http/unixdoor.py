"""The Unix-socket door: the same app, on the same host, without HTTP.

``--listen unix:///run/splitlearn.sock`` (``--no-tcp``: only there) serves the app with the
frames of :mod:`splitlearn.transport.unixframe`; each request goes to the same Flask app
through a WSGI environ built here (no HTTP parsing), the token checked at the frame too; a
tensor route's request to the same route code without Flask (:mod:`.direct`). As the
TCP front door, it enforces the socket file's mode (0600, ``--unix-mode``), ``--max-connections``
(full, with a newcomer waiting: the oldest stranger gives its slot up), the idle and request
deadlines (a body's k-th byte due ``request_timeout_s + k / min_rate`` after its frame's
first), 400/413 on malformed frames (connection closed) or bad fields (connection goes on),
and only sealed memfd regions of bounded size. Without a token only a bodiless ``GET``/``HEAD``
of ``/v1/health`` or ``/v1/ready`` is answered. A tenant's inline body over 64 KiB (and a
region body the app copies out) is reserved in the server's memory account
(:mod:`..engine.memory`) when its frame announces it, before a byte of it is allocated
(429/503 past the share or the total; the connection closes, the body unread), then read
into one buffer of that size: one reservation, no per-chunk bookkeeping, the refusal before
the client sends a byte; the pace above bounds how long an announced body that never comes
holds it. One thread per connection runs its requests one at a time, so concurrent
clients' decode steps still batch.
Design: docs/TRANSPORT.md; guarantees: docs/SECURITY.md, 'The Unix socket'.
"""
from __future__ import annotations

import fcntl
import hmac
import io
import logging
import mmap
import os
import re
import select
import socket
import stat
import sys
import threading
import time
from typing import Optional
from urllib.parse import unquote, unquote_to_bytes

import torch

from ...api import protocol as P
from ...errors import BadRequest, ConfigError, PayloadTooLarge, RequestTimeout, SplitLearnError, Unauthorized
from ...transport import cudaregion
from ...transport import unixframe as F
from ...api.wire import MAX_HEADER, DeviceBody, Encoded
from .direct import Direct
from ..config import DoorLimits
from .frontdoor import TENANT_KEY
from .routing import BODY_HOLD_KEY, BODY_KEY, SERVED

log = logging.getLogger(__name__)

_TOKENLESS = (P.HEALTH, P.READY, P.OPENAPI)  # answered without a token, bodiless GET/HEAD only (as over HTTP)
_MAX_PATH = 8 << 10
_FULL_CHECK_S = 0.25  # full: how often the door looks for a newcomer waiting (a stranger then gives its slot up)


class UnixDoor:
    """Serve ``app`` on the Unix socket at ``path``: :meth:`start` (threads) or :meth:`run`."""

    def __init__(self, app, tenants, path: str, *, max_body_bytes: int, limits: DoorLimits = DoorLimits(),
                 mode: int = 0o600):
        self.app, self.tenants, self.path = app, tenants, path
        self.max_body_bytes, self.limits, self.mode = max_body_bytes, limits, mode
        self.max_region = max(2 * max_body_bytes, 4 * F.REGION_BYTES)  # address space only: pages are the client's
        self.slots = threading.BoundedSemaphore(limits.max_connections)
        # the tensor routes, served without Flask (direct.py); the fed server has none
        self.direct = Direct(app) if SERVED in getattr(app, "extensions", {}) else None
        # a client's CUDA region is mapped when this server computes on the same GPU (cudaregion.py)
        device = getattr(self.direct.served.rt, "device", None) if self.direct is not None else None
        self.device = device if device is not None and torch.device(device).type == "cuda" else None
        # where tenants' inline bodies are reserved before they are read (None: nowhere)
        self.memory = self.direct.served.memory if self.direct is not None else None
        self.sock = self._listen()
        self.closed = False
        self._conns: dict[socket.socket, _Conn] = {}
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None

    def _listen(self) -> socket.socket:
        from ...model.checkpoint import check_parents

        path = self.path
        try:  # a directory a stranger may write: they could swap the socket for their own
            check_parents(path)
        except ConfigError as e:
            raise ConfigError(f"--listen unix://{e}") from None
        if os.path.lexists(path):
            st = os.lstat(path)
            if not stat.S_ISSOCK(st.st_mode):
                raise ConfigError(f"--listen unix://{path}: a file that is not a socket is there")
            if st.st_uid != os.geteuid():
                raise ConfigError(f"--listen unix://{path}: the socket there is owned by uid {st.st_uid}, not "
                                  f"this server's uid {os.geteuid()}: refusing it (another local user made "
                                  f"it); remove it, or listen at a path in a directory of your own")
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(path)
            except (ConnectionRefusedError, FileNotFoundError):
                os.unlink(path)  # stale: nobody listens
            else:
                raise ConfigError(f"--listen unix://{path}: a server already listens there")
            finally:
                probe.close()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # the file is born 0600, never wider
        try:
            sock.bind(path)
        except OSError as e:
            sock.close()
            raise ConfigError(f"--listen unix://{path}: {e}") from None
        finally:
            os.umask(old)
        os.chmod(path, self.mode)
        sock.listen(128)
        return sock

    @property
    def url(self) -> str:
        return "unix://" + self.path

    def start(self) -> "UnixDoor":
        self._thread = threading.Thread(target=self.run, name="unixdoor", daemon=True)
        self._thread.start()
        return self

    def run(self) -> None:
        while not self.closed:
            if not self.slots.acquire(timeout=_FULL_CHECK_S):  # --max-connections: the next one waits in the backlog
                self._make_room()
                continue
            try:
                conn, _ = self.sock.accept()
            except OSError:
                self.slots.release()
                if self.closed:
                    return
                continue
            c = _Conn(self, conn)
            with self._lock:
                self._conns[conn] = c
            threading.Thread(target=self._serve, args=(c,), name="unixdoor-conn", daemon=True).start()

    def _make_room(self) -> None:
        """Full, with a connection waiting to be accepted: the oldest stranger (no valid token
        shown, no request being served) is disconnected and the newcomer takes its slot, so
        tokenless connections never keep a tenant out (the TCP door's rule, frontdoor.py)."""
        try:
            if self.closed or not select.select([self.sock], [], [], 0)[0]:
                return  # nobody waiting: keep everyone
        except (OSError, ValueError):
            return
        with self._lock:
            if any(c.evicted for c in self._conns.values()):
                return  # one is already going
            strangers = [c for c in self._conns.values() if c.stranger()]
            if not strangers:
                return  # full of tenants' connections: the newcomer waits in the backlog
            oldest = min(strangers, key=lambda c: c.created)
            oldest.evicted = True
        log.info("connection limit reached: a unix connection without a token makes room for a new one")
        try:
            oldest.sock.shutdown(socket.SHUT_RDWR)  # its thread's read ends; its slot is released there
        except OSError:
            pass

    def close(self) -> None:
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        with self._lock:
            for c in list(self._conns):
                try:
                    c.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        try:
            if stat.S_ISSOCK(os.lstat(self.path).st_mode):
                os.unlink(self.path)
        except OSError:
            pass

    # -- one connection ------------------------------------------------------------------

    def _serve(self, c: "_Conn") -> None:
        conn = c.sock
        try:
            c.loop()
        except (ConnectionError, OSError, TimeoutError):
            pass
        except Exception:  # noqa: BLE001 - a connection's failure never stops the door
            log.exception("unix connection failed")
        finally:
            c.release()
            with self._lock:
                self._conns.pop(conn, None)
            conn.close()
            self.slots.release()


class _Conn:
    def __init__(self, door: UnixDoor, sock: socket.socket):
        self.door, self.sock = door, sock
        self.region: Optional[mmap.mmap] = None
        self.device_region = None  # the client's CUDA region, mapped here (cudaregion.DeviceRegion)
        self.size = 0
        self.trusted = False  # presented a valid token once: may idle --idle-timeout
        self.accepted: Optional[tuple[bytes, object]] = None  # the last header that authenticated, its tenant
        self.frames = 0
        self.reader = F.Reader(sock)
        self.created = time.monotonic()
        self.serving = False  # a request is being served (not a stranger while it is)
        self.evicted = False  # shut down to make room for a newcomer

    def stranger(self) -> bool:
        """No valid token shown on this connection and nothing being served for it: its slot
        goes to a newcomer when the door is full."""
        return not self.trusted and not self.serving and not self.evicted

    def release(self) -> None:
        if self.device_region is not None:
            self.device_region.close()
            self.device_region = None
        if self.region is not None:
            try:
                self.region.close()
            except BufferError:  # a view of it still alive somewhere: unmapped when it goes
                pass
            self.region = None

    def _recv(self, n: int, deadline: float, fds: Optional[list] = None, pace: Optional[float] = None):
        """``n`` bytes by ``deadline`` (with ``pace``, bytes/s: the k-th by ``deadline + k / pace``;
        TimeoutError after it)."""
        try:
            return self.reader.take(n, deadline, fds, pace)
        except socket.timeout:
            raise TimeoutError from None

    def loop(self) -> None:
        lim = self.door.limits
        while not self.door.closed:
            idle = lim.idle_timeout_s if self.trusted else lim.request_timeout_s
            fds: list[int] = []
            try:
                # the first byte may wait the idle allowance; the header's rest, the request's
                first = self._recv(1, time.monotonic() + idle, fds if self.frames == 0 else None)
            except TimeoutError:
                return  # idle past the allowance: close silently (as waitress does)
            start = time.monotonic()
            try:
                head = first + self._recv(F.HEADER.size - 1, start + lim.request_timeout_s,
                                          fds if self.frames == 0 else None)
                self.frames += 1
                try:
                    kind, meta_len, body_len = F.unpack_header(head, self.door.max_body_bytes)
                except F.FrameError as e:
                    cls = PayloadTooLarge if "inline body" in str(e) else BadRequest
                    self._answer_error(cls(f"malformed frame: {e}"))
                    return
                deadline = start + lim.allowance_s(meta_len)  # the body's first byte; then at the minimum rate
                try:
                    meta = F.parse_meta(self._recv(meta_len, deadline))
                except F.FrameError as e:
                    self._answer_error(BadRequest(f"malformed frame: {e}"))
                    return
                if kind == F.HELLO:
                    if self.frames != 1 or body_len:
                        self._answer_error(BadRequest("malformed frame: HELLO comes first, once, without a body"))
                        return
                    if not self._hello(meta, fds):
                        return
                    continue
                if kind != F.REQUEST:
                    self._answer_error(BadRequest(f"malformed frame: a client sends no kind-{kind} frames"))
                    return
                self.serving = True
                try:
                    if not self._request(meta, body_len, deadline):
                        return
                finally:
                    self.serving = False
            except TimeoutError:
                self._answer_error(RequestTimeout(f"a frame was not complete within its deadline "
                                                  f"({lim.request_timeout_s:g} s + size at "
                                                  f"{lim.min_rate_kib_s:g} KiB/s)"))
                return
            finally:
                for fd in fds:  # descriptors we did not take (sent with another frame, or refused)
                    try:
                        os.close(fd)
                    except OSError:
                        pass

    def _hello(self, meta: dict, fds: list) -> bool:
        """Map the client's region(s) (True), or answer why not (False: the connection closes)."""
        try:
            if meta.get("version") != F.VERSION:
                raise BadRequest(f"unix transport version {meta.get('version')!r} (this server: {F.VERSION})")
            size, device = meta.get("region_bytes"), meta.get("device")
            want = 1 if device is None else 2
            if len(fds) != want:
                raise BadRequest(f"HELLO must carry exactly {'one file descriptor' if want == 1 else 'two file descriptors'} "
                                 f"(SCM_RIGHTS), got {len(fds)}")
            if type(size) is not int or not 0 < size <= self.door.max_region:
                raise BadRequest(f"region_bytes must be 1..{self.door.max_region}, got {size!r}")
            fd = fds[0]
            try:  # the seals first: once it cannot shrink, the size read next stays true
                seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            except OSError:
                seals = 0
            if not seals & fcntl.F_SEAL_SHRINK:
                raise BadRequest("the region must be a memfd sealed against shrinking (F_SEAL_SHRINK)")
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size != size:
                raise BadRequest(f"the region must be a memfd of exactly region_bytes={size} bytes "
                                 f"(got a {'file' if stat.S_ISREG(st.st_mode) else 'non-file'} of {st.st_size})")
            if device is not None:
                self._map_device(device, fds[1])
            try:
                self.region = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            except (OSError, ValueError) as e:
                raise BadRequest(f"the region cannot be mapped read-write: {e}") from None
            self.size = size
        except SplitLearnError as e:
            self._answer_error(e)
            return False
        dev = self.device_region.size if self.device_region is not None else 0
        self._send_answer(200, [], None, extra={"region_bytes": self.size, "device_bytes": dev})
        return True

    def _map_device(self, device, fd: int) -> None:
        """Map the client's CUDA region if this server computes on that GPU (else ignored:
        ``device_bytes`` 0 tells the client to send from host memory); BadRequest if it is not
        a region the driver maps."""
        if not isinstance(device, dict) or set(device) != {"bytes", "uuid"} or not isinstance(device["uuid"], str):
            raise BadRequest('HELLO\'s device must be {"bytes": N, "uuid": "..."}')
        if self.door.device is None:
            return
        if device["uuid"] != cudaregion.uuid(self.door.device):
            return  # another GPU: its memory is not this server's to map
        try:
            self.device_region = cudaregion.DeviceRegion.open(fd, device["bytes"], self.door.device,
                                                              self.door.max_region)
        except (ValueError, RuntimeError) as e:  # cudaregion.CudaError: not a region the driver maps
            raise BadRequest(f"the device region cannot be mapped: {e}") from None

    def _request(self, meta: dict, body_len: int, deadline: float) -> bool:
        """Run one request; False when the connection must close after it (an error answered
        before an inline body was read: what follows on the socket is that body). ``deadline``:
        the inline body's first byte; the rest at the minimum rate."""
        hold = body = None  # hold: the body's reservation in the memory account, released once answered
        try:
            try:
                method, path, query, headers = _fields(meta)
                tenant = self._authenticate(headers.get("authorization"))
                if tenant is None and (path not in _TOKENLESS or method not in ("GET", "HEAD") or body_len
                                       or "region" in meta or "device" in meta):  # refused before its body is read
                    raise Unauthorized("missing or wrong bearer token (Authorization: Bearer <token>); without "
                                       "one, only a bodiless GET or HEAD of /v1/health, /v1/ready or /v1/openapi.json is answered")
                if tenant is not None:
                    self.trusted = True
                if "device" in meta:  # the inline part is the header: read first, so a bad descriptor keeps the connection
                    if not 8 <= body_len <= MAX_HEADER + 8:
                        raise BadRequest(f"a device body's inline part is its safetensors header: "
                                         f"8..{MAX_HEADER + 8} bytes, got {body_len}")
                    hold = self._reserve(tenant, body_len)  # before a byte of it is allocated
                    head, body_len = self._recv_body(body_len, deadline), 0
                    body = self._device_body(meta, head)
                elif "region" in meta:
                    if body_len:
                        raise BadRequest("a request's body is inline or in the region, not both")
                    body = self._region_body(meta["region"])
                else:
                    hold = self._reserve(tenant, body_len)  # before a byte of it is allocated
                    body = self._recv_body(body_len, deadline) if body_len else b""
                    body_len = 0
                direct = self.door.direct
                hit = direct.match(method, unquote(path, errors="replace")) if direct is not None and tenant else None
                if isinstance(body, memoryview) and hit is None:  # the app's copy out of the region: reserved first
                    hold = self._reserve(tenant, len(body))
            except SplitLearnError as e:
                if isinstance(body, memoryview):
                    body.release()
                self._answer_error(e)
                return not body_len
            self._dispatch(meta, method, path, query, headers, body, tenant, hit, hold)
            return True
        finally:
            if hold is not None:
                hold.release()  # a no-op once the route's reservation took it over and ended

    def _reserve(self, tenant, nbytes: int):
        """``nbytes`` of a body reserved for ``tenant`` (None: nothing to reserve, or no account);
        429/503 if they do not fit. A body of at most the reader's chunk (64 KiB) is not: at most
        that much a connection at a time (``--max-connections`` x 64 KiB in all), and a tensor
        route reserves it anyway (routing.serve); the ~3 us a reservation costs stay off the
        small requests (an echo of 1 KiB takes ~150 us)."""
        if self.door.memory is None or tenant is None or nbytes <= F.Reader.CHUNK:
            return None
        return self.door.memory.reserve(tenant.name, nbytes, "a request body")

    def _recv_body(self, n: int, deadline: float):
        """An inline body of ``n`` bytes (reserved), its k-th byte due by ``deadline + k / min rate``."""
        return self._recv(n, deadline, pace=self.door.limits.min_rate_kib_s * 1024)

    def _region_body(self, descriptor) -> memoryview:
        """The body a ``region`` descriptor names, read in place (direct.py) or copied out for the app."""
        try:
            off, length = F.span(descriptor, self.size)
        except ValueError as e:
            raise BadRequest(f"bad region descriptor: {e}") from None
        if length > self.door.max_body_bytes:
            raise PayloadTooLarge(f"request body of {length} bytes (at most {self.door.max_body_bytes})")
        return memoryview(self.region)[off:off + length]

    def _dispatch(self, meta: dict, method: str, path: str, query: str, headers: dict, body, tenant, hit,
                  hold) -> None:
        """Serve the request (a tensor route without Flask, else the app) and send its answer."""
        answer_region = bool(meta.get("answer_region")) and self.region is not None
        answer_device = bool(meta.get("answer_device")) and self.device_region is not None
        view = body if isinstance(body, memoryview) else None
        try:
            if isinstance(body, DeviceBody) and hit is None:
                self._answer_error(BadRequest(f"a body in the device region goes to a tensor route, not {method} {path[:80]}"))
                return
            if hit is not None:  # a tensor route: without Flask (direct.py); decoded from the region in place
                lazy = 0 if answer_device else F.INLINE_MAX if answer_region else None
                status, out_headers, content, after = self.door.direct(*hit, headers, body, tenant, lazy,
                                                                       answer_device, hold)
            else:
                if view is not None:
                    body = view.tobytes()  # the app's copy (reserved: _request)
                status, out_headers, content, after = self._call_app(method, path, query, headers, body, tenant, hold)
        finally:
            if view is not None:
                try:
                    view.release()
                except BufferError:  # still read somewhere: let go when that is gone
                    pass
        try:
            if answer_device and isinstance(content, Encoded) and content.device == self.device_region.device:
                self._send_device_answer(status, out_headers, content)
            else:
                use_region = answer_region and F.INLINE_MAX < len(content) <= self.size
                self._send_answer(status, out_headers, content, use_region)
        finally:
            after()  # the response's close (its access line, its metrics): after the answer, as waitress

    def _authenticate(self, header: Optional[str]):
        """The tenant of ``header`` (None: no valid token). A connection that repeats the header
        it last authenticated with is not hashed again: the tokens never change while the server
        runs, and the comparison is constant-time against what this same connection sent."""
        if header is None:
            return None
        given = header.encode("utf-8", "surrogateescape")
        if self.accepted is not None and hmac.compare_digest(given, self.accepted[0]):
            return self.accepted[1]
        tenant = self.door.tenants.authenticate(header)
        self.accepted = (given, tenant) if tenant is not None else None
        return tenant

    def _device_body(self, meta: dict, head: bytes) -> DeviceBody:
        """A request whose tensors' bytes lie in the device region (``head``: its header)."""
        if self.device_region is None:
            raise BadRequest("device given, but this connection registered no device region (HELLO)")
        if "region" in meta:
            raise BadRequest("a request's body is in the region or the device region, not both")
        try:
            off, length = F.span(meta["device"], self.device_region.size)
        except ValueError as e:
            raise BadRequest(f"bad device descriptor: {e}") from None
        if length > self.door.max_body_bytes:
            raise PayloadTooLarge(f"request body of {length} bytes (at most {self.door.max_body_bytes})")
        return DeviceBody(head, self.device_region.tensor[off:off + length])

    def _send_device_answer(self, status: int, headers: list, content: Encoded) -> None:
        """An answer whose tensors go into the device region (one copy, device to device), its
        header inline; the copies are done before the client hears of them."""
        dev = self.device_region
        if len(content) - len(content.head) > dev.size:
            return self._send_answer(status, headers, content, F.INLINE_MAX < len(content) <= self.size)
        n = content.write_data(dev.tensor)
        torch.cuda.current_stream(dev.device).synchronize()
        self._send_answer(status, headers, content.head, extra={"device": [0, n]})

    def _call_app(self, method, path, query, headers, body: bytes, tenant, hold=None):
        """``(status, headers, content, close)``: call ``close`` once the answer is sent (WSGI).
        ``hold``: the body's reservation, which a tensor route takes over."""
        environ = {
            "REQUEST_METHOD": method, "SCRIPT_NAME": "",
            "PATH_INFO": unquote_to_bytes(path).decode("latin-1"), "QUERY_STRING": query,
            "SERVER_NAME": "localhost", "SERVER_PORT": "0", "SERVER_PROTOCOL": "HTTP/1.1",
            "REMOTE_ADDR": "unix", "REMOTE_PORT": "0",
            "wsgi.version": (1, 0), "wsgi.url_scheme": "http", "wsgi.input": io.BytesIO(body),
            "wsgi.errors": sys.stderr, "wsgi.multithread": True, "wsgi.multiprocess": False,
            "wsgi.run_once": False, "CONTENT_LENGTH": str(len(body)),
            TENANT_KEY: tenant, BODY_KEY: body, BODY_HOLD_KEY: hold,
        }
        for k, v in headers.items():
            if k == "content-type":
                environ["CONTENT_TYPE"] = v
            elif k != "content-length":
                environ["HTTP_" + k.upper().replace("-", "_")] = v
        answer: dict = {}

        def start_response(status, response_headers, exc_info=None):
            answer["status"], answer["headers"] = int(status.split(" ", 1)[0]), response_headers
            return lambda data: chunks.append(data)

        chunks: list[bytes] = []
        result = self.door.app(environ, start_response)
        close = getattr(result, "close", None) or (lambda: None)
        try:
            for chunk in result:
                if chunk:
                    chunks.append(chunk)
        except BaseException:
            close()
            raise
        content = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        return answer["status"], [[k, v] for k, v in answer["headers"]], content, close

    def _send_answer(self, status: int, headers: list, content: Optional[bytes], use_region: bool = False,
                     extra: Optional[dict] = None) -> None:
        meta = {"status": status, "headers": headers, **(extra or {})}
        content = content if content is not None else b""
        inline = content
        if use_region:
            if isinstance(content, Encoded):
                content.write_into(self.region)  # the answer's one copy, from its tensors
            else:
                self.region[0:len(content)] = content
            meta["region"], inline = [0, len(content)], b""
        elif isinstance(content, Encoded):
            inline = bytes(content)
        self.sock.settimeout(self.door.limits.allowance_s(len(inline)))
        F.send_frame(self.sock, F.pack(F.ANSWER, meta, len(inline)), inline)

    def _answer_error(self, e: SplitLearnError) -> None:
        import json
        headers = [["Content-Type", "application/json"]]
        if e.retry_after is not None:
            headers.append(["Retry-After", str(int(round(e.retry_after)))])
        try:
            self._send_answer(e.status, headers, json.dumps(e.to_payload()).encode())
        except OSError:
            pass


_METHOD = re.compile(r"[A-Z]{1,16}")
_PATH = re.compile(r"/[^\x00-\x1f\x7f]*")
_HEADER_NAME = re.compile(r"[A-Za-z0-9_-]+")
_HEADER_VALUE = re.compile(r"[^\r\n\x00]*")


def _utf8(text: str) -> bool:
    """Whether ``text`` is Unicode text (JSON's ``\\ud800`` escapes make lone surrogates, which
    no encoder takes)."""
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _fields(meta: dict) -> tuple[str, str, str, dict]:
    """``(method, path, query, headers)`` of a REQUEST's meta, headers with lower-case names;
    BadRequest naming the field that is wrong."""
    method, target, headers = meta.get("method"), meta.get("path"), meta.get("headers", {})
    if not isinstance(method, str) or not _METHOD.fullmatch(method):
        raise BadRequest(f"malformed request: method {method!r}")
    if (not isinstance(target, str) or len(target) > _MAX_PATH or not _PATH.fullmatch(target)
            or not _utf8(target)):
        raise BadRequest("malformed request: path must be a string starting with '/', without control "
                         "characters or lone surrogates")
    if not isinstance(headers, dict):
        raise BadRequest("malformed request: headers must be an object of strings")
    out = {}
    for k, v in headers.items():
        if not (isinstance(k, str) and isinstance(v, str)):
            raise BadRequest("malformed request: headers must be an object of strings")
        if not _HEADER_NAME.fullmatch(k) or not _HEADER_VALUE.fullmatch(v) or not _utf8(v):
            raise BadRequest(f"malformed request: header {k[:40]!r} (control characters or lone surrogates)")
        out[k.lower()] = v
    path, _, query = target.partition("?")
    return method, path, query, out
