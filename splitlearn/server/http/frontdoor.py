"""The front door: waitress, with every request that has no business here refused before it costs.

All on waitress's event loop (no WSGI thread, no body buffer):

- **Header-time auth**: a request without a valid token (bodiless ``GET /v1/health``,
  ``/v1/ready`` and ``/v1/openapi.json`` excepted) is answered 401 before its body is buffered; over-limit
  Content-Length: 413; malformed headers: 400. After the answer the write side is shut and
  what the client still sends is dropped for at most :data:`LINGER_S` or the announced length.
- **Bodies reserved before they are buffered**: a tenant's Content-Length is reserved in the
  server's memory account (:mod:`..engine.memory`) at its headers, before waitress buffers a
  byte of it (429 past the tenant's share, 503 past the total, JSON with Retry-After; the
  connection lingers as after a 401); a chunked body grows its reservation as it arrives. The
  route's own reservation of the body takes it over (:func:`.routing.serve`); it is released
  when the request ends, answered, refused or cut off.
- **Connection slots**: a tenant holds at most its own cap of connections (``DoorLimits.
  tenant_connections``: ``--max-tenant-connections``, default ``--max-connections`` shared
  equally), counted from the request whose token names it (429 at that request's headers
  beyond, ``Connection: close``), and all tenants together at most ``--max-connections`` (503).
  The server accepts :data:`~..config.PROBE_SLOTS` connections beyond that, which only
  tokenless connections can hold, the oldest of them making room when a newcomer waits: a
  health check (HAProxy's ``GET /v1/ready``) always finds a slot, whatever tenants hold.
- **Deadlines in**: headers by ``request_timeout_s`` after the first byte, the body's k-th byte
  by ``request_timeout_s + k / min_rate`` (a body announced and not sent holds its reservation
  ``request_timeout_s`` at most); a connection without a valid token may idle
  ``request_timeout_s`` only. Cut off: 408.
- **Deadlines out**: an answer must be read by ``request_timeout_s + size / min_rate`` from
  when it was written, else the connection is closed (freeing a WSGI thread blocked on it).
- **Limits stated**: :class:`DoorLimits` (``/v1/info`` "limits"); deadlines are checked once a
  second from waitress's maintenance hook (``cleanup_interval=1``).

The app reads the tenant from ``environ[TENANT_KEY]`` (it still checks the token itself under
another WSGI server). :func:`make_server` builds the waitress server for ``python -m
splitlearn.server`` and the fed server alike. Why, waitress's internals, cost measured:
docs/INTERNALS.md, 'waitress and the front door'; guarantees: docs/SECURITY.md, 'Outsiders'.
"""
from __future__ import annotations

import functools
import json
import logging
import select
import socket
import threading
import time
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Optional

from waitress.channel import HTTPChannel
from waitress.parser import HTTPRequestParser
from waitress.server import create_server
from waitress.task import ErrorTask, WSGITask
from waitress.utilities import Error, build_http_date

from ...api import protocol as P
from ...errors import ServiceUnavailable, SplitLearnError, TooManyRequests, from_status
from ..engine.memory import Hold, MemoryAccount
from ..config import LINGER_S, MAX_HEADER_BYTES, PROBE_SLOTS, DoorLimits
from ..tenants import Tenants
from .routing import BODY_HOLD_KEY, SERVED

log = logging.getLogger(__name__)

TENANT_KEY = "splitlearn.tenant"  # WSGI environ: the Tenant the door admitted (no client can set it)
RECV_BYTES = 256 << 10  # per read; waitress's default 8 KiB made a 1.5 MB body take 190 reads (echo 8.8 -> 6.3 ms)


class _DoorError(Error):
    """A refusal of the door's own; its body is the whole message."""


class _Unauthorized(_DoorError):
    code, reason = 401, "Unauthorized"


class _RequestTimeout(_DoorError):
    code, reason = 408, "Request Timeout"


class _Refused(_DoorError):
    """A splitlearn error answered by the door (a body the memory account cannot hold: 429/503)."""

    def __init__(self, e: SplitLearnError):
        super().__init__(str(e))
        self.code, self.reason = e.status, HTTPStatus(e.status).phrase
        self.retry_after = e.retry_after


def error_payload(e: Error) -> bytes:
    """splitlearn's JSON ``{"error", "message"}`` for waitress error ``e`` (ours or waitress's own)."""
    message = e.body if isinstance(e, _DoorError) else f"{e.reason}: {e.body}"
    return json.dumps(from_status(e.code, message).to_payload()).encode()


def error_bytes(e: Error, version: str = "1.1", ident: str = "splitlearn") -> bytes:
    """A whole ``Connection: close`` HTTP answer carrying :func:`error_payload`."""
    body = error_payload(e)
    head = [f"HTTP/{'1.1' if version == '1.1' else '1.0'} {e.code} {e.reason}", "Connection: close",
            f"Content-Length: {len(body)}", "Content-Type: application/json",
            f"Date: {build_http_date(time.time())}", f"Server: {ident}"]
    if e.code == 401:
        head.append('WWW-Authenticate: Bearer realm="splitlearn"')
    if getattr(e, "retry_after", None) is not None:
        head.append(f"Retry-After: {int(round(e.retry_after))}")
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body


class JsonErrorTask(ErrorTask):
    """waitress's own error answers (a chunked body over the limit, bad chunking) as JSON."""

    def execute(self):
        e = self.request.error
        body = error_payload(e)
        self.status = f"{e.code} {e.reason}"
        self.response_headers.append(("Content-Type", "application/json"))
        if e.code == 401:
            self.response_headers.append(("WWW-Authenticate", 'Bearer realm="splitlearn"'))
        if getattr(e, "retry_after", None) is not None:
            self.response_headers.append(("Retry-After", str(int(round(e.retry_after)))))
        self.set_close_on_finish()
        self.content_length = len(body)
        self.write(body)


class DoorTask(WSGITask):
    """waitress's WSGI task, handing the app the tenant the door found (``environ[TENANT_KEY]``),
    so the app does not hash the token a second time, and the body's reservation
    (``environ[BODY_HOLD_KEY]``), which the route takes over."""

    def get_environment(self):
        environ = super().get_environment()
        environ[TENANT_KEY] = self.request.tenant
        environ[BODY_HOLD_KEY] = self.request.hold
        return environ


class DoorParser(HTTPRequestParser):
    """waitress's parser, plus the checks at the end of the headers (token, the body's
    reservation), this request's deadline, and a chunked body's reservation as it grows."""

    tenant = None  # the Tenant of a valid token
    hold: Optional[Hold] = None  # the body's reservation in the memory account (released at close)

    def __init__(self, adj, channel: "DoorChannel"):
        super().__init__(adj)
        self.channel = channel
        self.started = channel.last_activity  # made on the request's first bytes, just read: no clock call
        self.deadline = self.started + channel.limits.allowance_s(0)  # for the headers

    def received(self, data: bytes) -> int:
        in_headers = not self.headers_finished and not self.completed
        consumed = super().received(data)
        if not in_headers:  # body bytes: a chunked body's reservation grows with them
            if self.hold is None or not self.chunked or self.error is not None:
                return consumed
            self.error = self.channel.reserve(self, self.body_bytes_received)
            return consumed if self.error is None else self._refuse(data)
        if not (self.headers_finished or self.completed) or self.empty:
            return consumed
        if self.error is None:
            self.error = self.channel.admit(self)
        if self.error is None and self.tenant is not None and (self.content_length or self.chunked):
            self.error = self.channel.reserve(self, self.content_length)  # before a byte of it is buffered
        if self.error is None:
            size = self.adj.max_request_body_size if self.chunked else self.content_length
            self.deadline = self.started + self.channel.limits.allowance_s(size)
            return consumed
        return self._refuse(data)

    def _refuse(self, data: bytes) -> int:
        self.completed, self.expect_continue = True, False  # never "100 Continue" a refused body
        self.channel.refuse(self)
        return len(data)  # the rest of this read is body (or garbage): never parsed

    def close(self) -> None:
        super().close()
        if self.hold is not None:
            self.hold.release()  # a no-op once the route's reservation took it over and ended

    def behind(self, now: float) -> bool:
        """Late (``now``: ``time.time()``): past the whole request's deadline, or a body's bytes
        behind the minimum rate (the k-th due ``request_timeout_s + k / min_rate`` after the
        first byte of the request)."""
        if now > self.deadline:
            return True
        return self.headers_finished and now > self.started + self.channel.limits.allowance_s(self.body_bytes_received)


class DoorChannel(HTTPChannel):
    """One connection: admits or refuses requests at their headers; :meth:`overdue` says when
    a deadline has passed (the server asks every second, :func:`make_server`)."""

    task_class = DoorTask
    error_task_class = JsonErrorTask
    authenticated = False  # a request with a valid token came on this connection
    owner: Optional[str] = None  # the tenant whose slot this connection holds (its last request's)
    linger_until: Optional[float] = None  # refused: dropping input until then
    linger_left = 0  # ... or until the announced body has been dropped
    out_deadline: Optional[float] = None  # the answer now waiting must be read by then
    out_seen = 0  # bytes waiting at the last check
    expired = False  # a deadline passed: closed at the next loop turn (:meth:`readable`)

    def __init__(self, server, sock, addr, adj, map=None):
        self.door: Door = server.door
        self.limits = self.door.limits
        super().__init__(server, sock, addr, adj, map)
        self.parser_class = functools.partial(DoorParser, channel=self)

    def admit(self, req: DoorParser) -> Optional[_DoorError]:
        """None if ``req`` (headers complete) may send its body: a valid token whose tenant has a
        connection slot (this one, or one free under its cap), or a bodiless health or readiness
        check or a read of the protocol's OpenAPI document; else the refusal."""
        req.tenant = self.door.tenants.authenticate(req.headers.get("AUTHORIZATION"))
        if req.tenant is not None:
            refused = self.door.take_slot(self, req.tenant.name)
            if refused is not None:
                return _Refused(refused)
            self.authenticated = True
            return None
        if (req.path in (P.HEALTH, P.READY, P.OPENAPI) and req.command in ("GET", "HEAD") and not req.chunked
                and req.content_length == 0):
            req.headers["CONNECTION"] = "close"  # one tokenless answer, then the slot is free
            return None
        return _Unauthorized("missing or wrong bearer token (Authorization: Bearer <token>)")

    def reserve(self, req: DoorParser, nbytes: int) -> Optional[_DoorError]:
        """Reserve (or grow to) ``nbytes`` of ``req``'s body for its tenant in the memory
        account; the refusal to answer if they do not fit (None: reserved, or no account)."""
        memory = self.door.memory
        if memory is None:
            return None
        try:
            if req.hold is None:
                req.hold = memory.reserve(req.tenant.name, nbytes, "a request body")
            else:
                req.hold.resize(nbytes)
        except SplitLearnError as e:
            return _Refused(e)
        return None

    def stranger(self) -> bool:
        """No valid token was shown on this connection and nothing is being computed for it:
        its slot goes to a new connection when the server is full (:func:`make_server`)."""
        return not self.authenticated and not self.requests

    def refuse(self, req: DoorParser) -> None:
        """Answer ``req.error`` now from the event loop and linger; with answers still ahead of it
        on this connection, leave it to waitress's error task (answers stay in order)."""
        if self.requests:
            return
        req.empty = True  # waitress drops it: no task, no thread
        req.close()  # its reservation and anything buffered go now
        answer = error_bytes(req.error, req.version, self.adj.ident)
        with self.outbuf_lock:
            self.outbufs[-1].append(answer)
            self.current_outbuf_count += len(answer)
            self.total_outbufs_len += len(answer)
        self.linger_until = time.time() + LINGER_S
        self.linger_left = req.content_length if req.headers_finished and not req.chunked else 1 << 62
        log.debug("refused %s %s from %s: %d %s", getattr(req, "command", "?"), getattr(req, "path", "?"),
                  self.addr, req.error.code, req.error.reason)

    # -- the event loop ---------------------------------------------------------------------

    def received(self, data: bytes) -> bool:
        return False if self.linger_until is not None else super().received(data)

    def readable(self) -> bool:
        # Closed here, where the loop asks this channel what to wait for (closing it from the
        # server's check would leave its fd in this turn's select()); never via will_close: a
        # client that reads nothing never makes the channel writable.
        if self.expired and self._fileno is not None:
            self.handle_close()
        if self._fileno is None:
            return False
        return True if self.linger_until is not None else super().readable()

    def writable(self) -> bool:
        return self._fileno is not None and super().writable()

    def handle_read(self) -> None:
        if self.linger_until is None:
            return super().handle_read()
        try:
            n = len(self.recv(self.adj.recv_bytes))  # dropped; b"" (closed) closes the channel
        except OSError:
            n, self.linger_left = 0, 0
        self.linger_left -= n
        if self.linger_left <= 0 and not self.total_outbufs_len and self._fileno is not None:
            self.handle_close()

    def handle_write(self) -> None:
        super().handle_write()
        if self.linger_until is not None and not self.total_outbufs_len and self._fileno is not None:
            try:
                self.socket.shutdown(socket.SHUT_WR)  # the answer is out: FIN, keep reading a while
            except OSError:
                self.linger_left = 0
            if self.linger_left <= 0:
                self.handle_close()

    def handle_close(self) -> None:
        super().handle_close()
        self.door.give_slot(self)
        req, self.request = self.request, None
        if req is not None:
            req.close()  # a body half received: its buffer goes now, not at the next garbage collection

    # -- deadlines (every second, from the server) ------------------------------------------

    def overdue(self, now: float) -> bool:
        """Whether this connection must be closed now (``now``: ``time.time()``); cuts off a
        request that is late (answering 408 and lingering) on the way."""
        if self.linger_until is not None:
            return now > self.linger_until
        pending = self.total_outbufs_len
        if not pending:
            self.out_deadline, self.out_seen = None, 0
        else:  # the send timeout: grace plus each new byte at the minimum rate
            if self.out_deadline is None:
                self.out_deadline = now + self.limits.allowance_s(0)
            if pending > self.out_seen:  # more written since: its bytes at the minimum rate
                self.out_deadline += self.limits.at_min_rate_s(pending - self.out_seen)
            self.out_seen = pending
            if now > self.out_deadline:
                log.info("%s did not read its answer (%d bytes left): disconnected", self.addr, pending)
                return True
            return False
        if self.requests:  # we are computing: no client deadline runs
            return False
        req = self.request
        if req is not None:
            if req.behind(now):
                log.info("%s sent a request too slowly: cut off", self.addr)
                self.cut_off(req)
            return False
        # no valid token yet: no long idle either
        return not self.authenticated and now - self.last_activity > self.limits.request_timeout_s

    def cut_off(self, req: DoorParser) -> None:
        with self.requests_lock:
            self.request = None
        req.error = _RequestTimeout(f"the request did not arrive within its deadline ({self.limits.request_timeout_s:g} s "
                                    f"+ its size at {self.limits.min_rate_kib_s:g} KiB/s)")
        self.refuse(req)
        req.close()


@dataclass
class Door:
    """What the door checks against; hung on the waitress server for its channels. Counts the
    connections each tenant holds (a connection is its last authenticated request's tenant's)."""

    tenants: Tenants
    limits: DoorLimits
    memory: Optional[MemoryAccount] = None  # where tenants' bodies are reserved (None: nowhere)
    held: dict = field(default_factory=dict)  # tenant -> connections it holds now
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def tenant_cap(self) -> int:
        return self.limits.tenant_connections(len(self.tenants))

    def take_slot(self, channel: "DoorChannel", tenant: str) -> Optional[SplitLearnError]:
        """Count ``channel`` as ``tenant``'s (moved from the tenant of its last request, if
        another's); the refusal if the tenant holds its cap already (429), or all tenants
        together ``--max-connections`` (503): the connection is then answered and closed."""
        with self._lock:
            if channel.owner == tenant:
                return None
            mine, cap = self.held.get(tenant, 0), self.tenant_cap
            if mine >= cap:
                return TooManyRequests(
                    f"this tenant holds {mine} open connections, its cap (--max-tenant-connections {cap}): "
                    f"send on those (keep-alive) or close one", retry_after=1.0)
            total = sum(self.held.values()) - (channel.owner is not None)
            if total >= self.limits.max_connections:
                return ServiceUnavailable(
                    f"tenants hold {total} open connections, this server's --max-connections: try again later",
                    retry_after=1.0)
            self._drop(channel)
            self.held[tenant] = mine + 1
            channel.owner = tenant
            return None

    def give_slot(self, channel: "DoorChannel") -> None:
        """``channel`` closed: its tenant's slot is free."""
        with self._lock:
            self._drop(channel)

    def _drop(self, channel: "DoorChannel") -> None:
        owner, channel.owner = channel.owner, None
        if owner is not None:
            left = self.held.get(owner, 0) - 1
            if left > 0:
                self.held[owner] = left
            else:
                self.held.pop(owner, None)


def make_server(app, tenants: Tenants, *, host: str, port: int, threads: int, max_body_bytes: int,
                limits: DoorLimits = DoorLimits(), ident: str = "splitlearn", memory: Optional[MemoryAccount] = None):
    """A waitress server for ``app`` behind the door; ``.run()`` serves, ``.close()`` stops.
    Tenants' bodies are reserved, as they are announced, in ``memory`` (the fed server's),
    else the app's memory account (a segment or offload server's)."""
    server = create_server(
        app, host=host, port=port, threads=threads,
        inbuf_overflow=max_body_bytes, outbuf_overflow=max_body_bytes, max_request_body_size=max_body_bytes,
        recv_bytes=RECV_BYTES, max_request_header_size=MAX_HEADER_BYTES,
        channel_timeout=max(1, int(round(limits.idle_timeout_s))), connection_limit=limits.max_connections,
        cleanup_interval=1, ident=ident)
    # --max-connections counts clients (the listener and waitress's wake-up pipe are in the map too),
    # plus the probes' slots, which no tenant holds (Door.take_slot)
    server.adj.connection_limit = limits.max_connections + PROBE_SLOTS + len(server._map)
    if memory is None and hasattr(app, "extensions"):
        memory = getattr(app.extensions.get(SERVED), "memory", None)
    server.door = Door(tenants, limits, memory)
    server.channel_class = DoorChannel
    idle_check = server.maintenance  # waitress's: keep-alive connections idle past channel_timeout

    def maintenance(now: float) -> None:  # called from the loop at most once a second (cleanup_interval)
        idle_check(now)
        for channel in list(server.active_channels.values()):
            if isinstance(channel, DoorChannel) and not channel.expired and channel.overdue(now):
                channel.expired = True

    server.maintenance = maintenance
    accepts = server.readable  # waitress's: False while the connection limit is reached

    def readable() -> bool:
        """Full, with a connection waiting to be accepted: the oldest stranger (no valid token
        yet, nothing in flight) is closed this loop turn and the newcomer takes its slot, so
        tokenless connections never keep a tenant out. Checked when full, at each loop turn
        (<= 1 s, waitress's select timeout)."""
        if accepts() or not server.accepting:
            return server.accepting
        if not select.select([server.socket], [], [], 0)[0]:
            return False  # nobody waiting: keep everyone
        strangers = [c for c in server.active_channels.values() if isinstance(c, DoorChannel) and c.stranger()]
        if any(c.expired for c in strangers):
            return True  # one already goes this turn
        if not strangers:
            return False  # tenants hold at most --max-connections: the rest are tokenless answers in flight
        oldest = min(strangers, key=lambda c: c.creation_time)
        log.info("connection limit reached: %s (no token) makes room for a new connection", oldest.addr)
        oldest.expired = True  # closed in its readable(), this turn, before the accept
        return True

    server.readable = readable
    return server
