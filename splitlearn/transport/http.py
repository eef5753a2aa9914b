"""HTTP transport of the client: keep-alive connections, retries, statistics.

Every tensor exchange goes through :meth:`Transport.call` (safetensors via
:mod:`splitlearn.api.wire`, counted in :class:`WireStats`); JSON control calls use
:meth:`get_json` / :meth:`post_json`. Plain ``http://`` URLs without a proxy take a lean
``http.client`` path, one keep-alive connection per *lane*, at most one request in flight each
(:meth:`Transport.start` returns a :class:`PendingCall`); a lean wait polls its socket around
the expected answer time (``SPIN_S``) unless client and server share cores
(``TransportConfig.spin``). Only connection failures (and a load balancer's 502/503/504 that is
not a splitlearn error) are retried; other error answers become the :mod:`splitlearn.errors`
class the server raised. Design and measurements: docs/INTERNALS.md, 'The client transport'.
"""
from __future__ import annotations

import http.client
import ipaddress
import json
import logging
import os
import select
import socket
import time
from dataclasses import asdict, dataclass
from typing import Callable, Optional
from urllib.parse import urlsplit

import requests

from ..api import protocol as P
from ..errors import ConfigError, SplitLearnError, TransportError, from_payload
from ..api.wire import DeviceBody, Encoded, decode
from .leanresponse import LeanResponse

log = logging.getLogger(__name__)

# Failures that mean the request did not complete on this connection: reconnect and resend.
_CONNECTION_ERRORS = (ConnectionError, http.client.RemoteDisconnected, http.client.IncompleteRead,
                      http.client.BadStatusLine, http.client.CannotSendRequest,
                      http.client.ResponseNotReady, BrokenPipeError)


class GatewayFailure(ConnectionError):
    """A proxy's 502/503/504 that is not a splitlearn answer: the request did not complete
    behind it (retried as a dropped connection is)."""


def _check_gateway(status: int, content: bytes) -> None:
    """Raise :class:`GatewayFailure` for a proxy's gateway answer (splitlearn's own errors are
    JSON objects with an ``error`` code)."""
    if status not in (502, 503, 504):
        return
    try:
        payload = json.loads(content)
    except ValueError:
        payload = None
    if isinstance(payload, dict) and "error" in payload:
        return
    raise GatewayFailure(f"HTTP {status} from a proxy: {content[:120].decode('utf-8', 'replace')!r}")


SPIN_S = 1e-3  # poll the socket from this long before an answer is expected to as long after

# Ways to reach a server other than TCP, by URL scheme: ``opener(url)`` returns a link whose
# ``request(method, path, headers, body)`` gives ``(status, headers, content)`` (headers with a
# case-insensitive ``.get``), or raises ConnectionError when nothing serves the URL (retried as
# a refused connection is). A link may have lanes too: ``send(lane, method, path, headers, body)``
# sends a tensor POST now, ``receive(lane, spin=...)`` reads its answer, ``readable(lane)``, ``drop(lane)``
# (``unix://``); one without them answers a tensor call when it starts. A link has no proxies; its
# server shares this process's cores unless the link's class says ``same_host = True`` (then as on
# loopback). :mod:`.inproc` registers ``inproc://`` (a server app in this process), :mod:`.unix`
# ``unix://`` (a Unix socket and shared memory).
LINKS: dict[str, Callable[[str], "object"]] = {}


def register_scheme(scheme: str, opener: Callable[[str], "object"]) -> None:
    """Let :class:`Transport` reach ``scheme://...`` URLs through ``opener(url)`` (a link)."""
    LINKS[scheme] = opener


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def shares_cores_with_server(url: str) -> bool:
    """Whether the server at ``url`` may run on this process's cores: a loopback server,
    unless this process is pinned to a subset of the machine's cores; a ``unix://`` server
    whose process is pinned to cores this one may run on (its link's ``server_cores``)."""
    scheme = urlsplit(url).scheme
    if scheme in LINKS and not getattr(LINKS[scheme], "same_host", False):
        return True  # a server in this process (inproc://)
    if scheme not in LINKS and not is_loopback(urlsplit(url).hostname or ""):
        return False  # another host; a same_host link (unix://) is as loopback
    try:
        mine = os.sched_getaffinity(0)
    except AttributeError:  # no affinity API (macOS, Windows): assume shared
        return True
    server_cores = getattr(LINKS.get(scheme), "server_cores", None)
    theirs = server_cores(url) if server_cores is not None else None  # unix://: the peer's own
    if theirs is not None:
        return bool(mine & theirs)
    return len(mine) >= (os.cpu_count() or 1)


@dataclass
class TransportConfig:
    url: str  # server base URL, e.g. http://127.0.0.1:8000
    token: Optional[str] = None  # bearer token
    connect_timeout_s: float = 5.0  # seconds to open a TCP connection
    read_timeout_s: float = 300.0  # seconds to wait for an answer
    retries: int = 6  # extra attempts after a connection failure
    backoff_s: float = 0.1  # first wait between attempts; doubles each time (0.1 .. 3.2 s)
    max_backoff_s: float = 5.0  # the longest wait between two attempts
    spin: Optional[bool] = None  # poll for answers near their expected time (None: if the server has its own cores)

    def __post_init__(self):
        self.url = self.url.rstrip("/")
        if not self.url.startswith(("http://", "https://", *(s + "://" for s in LINKS))):
            raise ConfigError(f"server URL must start with http:// or https://, got {self.url!r}")
        if not urlsplit(self.url).hostname and urlsplit(self.url).scheme not in LINKS:  # unix:///path: none
            raise ConfigError(f"server URL {self.url!r} has no host")
        if self.retries < 0 or self.backoff_s < 0:
            raise ConfigError("retries and backoff_s must be >= 0")
        if not (self.connect_timeout_s > 0 and self.read_timeout_s > 0):
            raise ConfigError("connect_timeout_s and read_timeout_s must be > 0")


@dataclass
class WireStats:
    """Per-client call statistics (the ones seed 001's RPC server kept)."""

    calls: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    serialize_s: float = 0.0  # encoding request bodies
    deserialize_s: float = 0.0  # decoding answers
    round_trip_s: float = 0.0  # from sending a request to having its answer
    server_compute_s: float = 0.0  # what the server reported spending (X-Server-Time-Ms)
    retries: int = 0
    # bytes of tensor data this client's transport copied through host memory, both ways
    # (a device-to-host copy counts): one copy each way over TCP, 0 over a unix:// device region
    host_copy_bytes: int = 0

    @property
    def overhead_s(self) -> float:
        """Round trips minus server compute: what the network and HTTP cost."""
        return self.round_trip_s - self.server_compute_s

    def as_dict(self) -> dict:
        return {**asdict(self), "overhead_s": self.overhead_s}


class AnswerWait:
    """When to look for a lane's answer: a lane has ``sent_at``, ``expected_s`` and ``readable``."""

    def await_answer(self) -> None:
        """Sleep until ``SPIN_S`` before the answer is expected, then poll up to ``SPIN_S``
        past it (see the module docstring); returns early when the answer is there."""
        if self.expected_s is None:
            return
        due = self.sent_at + self.expected_s
        nap = due - SPIN_S - time.perf_counter()
        if nap > 0 and self.readable(nap):
            return
        stop = due + SPIN_S
        while time.perf_counter() < stop and not self.readable():
            pass

    def answered(self) -> None:
        """The answer is readable: fold this wait into the expected one."""
        wait = time.perf_counter() - self.sent_at
        self.expected_s = wait if self.expected_s is None else 0.5 * (self.expected_s + wait)


class _Lane(AnswerWait):
    """One keep-alive ``http.client`` connection (plain HTTP); one request in flight."""

    def __init__(self, host: str, port: int, cfg: TransportConfig):
        self.host, self.port, self.cfg = host, port, cfg
        self.conn: Optional[http.client.HTTPConnection] = None
        self.sent_at = 0.0  # when the request in flight went out
        self.expected_s: Optional[float] = None  # average of recent waits for an answer
        self.out = False  # a request was sent whose answer is not read yet
        self.generation = 0  # connections opened so far: a request is answered on its own only

    def _connect(self) -> http.client.HTTPConnection:
        if self.conn is None:
            conn = http.client.HTTPConnection(self.host, self.port, timeout=self.cfg.connect_timeout_s)
            conn.response_class = LeanResponse  # headers read without the email package: ~40 us a call
            conn.connect()
            conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.sock.settimeout(self.cfg.read_timeout_s)
            self.conn = conn
            self.generation += 1
        return self.conn

    def send(self, path: str, body: bytes, headers: dict) -> None:
        if self.out:  # one connection, answers in order: its answer would be read as this request's
            log.warning("a request on a lane to %s:%s whose answer is unread (a call abandoned): its connection "
                        "is closed, this request goes on a new one", self.host, self.port)
            self.close()  # the abandoned call, if read later, is sent again (PendingCall.generation)
        conn = self._connect()
        self.out = True  # from the first byte: a request cut short closes the connection (below)
        conn.putrequest("POST", path, skip_accept_encoding=True)
        for k, v in headers.items():
            conn.putheader(k, v)
        conn.putheader("Content-Length", str(len(body)))
        try:
            conn.endheaders(body)  # headers, then the body as is (no copy)
        except BaseException:
            self.close()
            raise
        self.sent_at = time.perf_counter()

    def readable(self, wait_s: float = 0.0) -> bool:
        """True if the answer (or the connection's end) can be read without blocking, waiting
        up to ``wait_s`` for it."""
        if self.conn is None or self.conn.sock is None:
            return True  # nothing to wait for: reading reconnects or fails at once
        return bool(select.select([self.conn.sock], [], [], wait_s)[0])

    def receive(self) -> tuple[int, Callable[[str], Optional[str]], bytes]:
        """The answer of the request in flight. Anything that stops the read short (a timeout,
        an interrupt, a malformed answer) closes the connection: an answer left unread on it
        would be read as the next request's."""
        if self.conn is None or not self.out:
            raise ConnectionResetError("no request in flight on this lane")
        try:
            resp = self.conn.getresponse()
            content = resp.read()
        except BaseException:
            self.close()
            raise
        self.out = False
        if resp.will_close:
            self.close()
        return resp.status, resp.getheader, content

    def close(self) -> None:
        self.out = False
        if self.conn is not None:
            self.conn.close()
            self.conn = None


class _LinkAnswer:
    """A link's answer, as much of a ``requests.Response`` as :class:`Transport` reads."""

    def __init__(self, status_code: int, headers, content: bytes):
        self.status_code, self.headers, self.content = status_code, headers, content

    def json(self):
        return json.loads(self.content)


class PendingCall:
    """A tensor POST on its way; ``result()`` waits for the answer's bytes (once). Through a
    link (``Transport.link``) the request runs now and ``answer`` holds its answer."""

    def __init__(self, transport: "Transport", lane: int, path: str, body: bytes):
        self.transport, self.lane, self.path, self.body = transport, lane, path, body
        self.t0 = time.perf_counter()
        link = transport.link  # a link with lanes (``send``: unix://) sends now and answers in result()
        self.answer = None if link is None or hasattr(link, "send") else transport._link_request(
            "POST", path, transport._headers, body)
        self.sent = transport._try_send(lane, path, body)
        self.generation = transport._lanes[lane].generation if self.sent and lane in transport._lanes else None

    def result(self) -> bytes:
        return self.transport._finish(self)

    def ready(self) -> bool:
        """True if :meth:`result` would not wait for the server (an answer has arrived, or
        the request must be resent); always True off the lean path, where sending waits."""
        if self.answer is not None or not self.sent:
            return True
        link = self.transport.link
        return link.readable(self.lane) if link is not None else self.transport._lane(self.lane).readable()


class Transport:
    def __init__(self, cfg: TransportConfig):
        self.cfg = cfg
        self.stats = WireStats()
        parts = urlsplit(cfg.url)
        self.http = requests.Session()
        self.http.headers["User-Agent"] = "splitlearn-client"
        self._headers = {"User-Agent": "splitlearn-client", "Content-Type": P.CONTENT_TYPE}
        if cfg.token:
            self.http.headers["Authorization"] = f"Bearer {cfg.token}"
            self._headers["Authorization"] = f"Bearer {cfg.token}"
        if is_loopback(parts.hostname or ""):
            self.http.trust_env = False  # no proxy or .netrc applies to loopback: ~0.2 ms a call
        self._base_path = parts.path
        self.link = LINKS[parts.scheme](cfg.url) if parts.scheme in LINKS else None
        # The lean path: plain HTTP that no proxy of the environment applies to.
        self.lean = (parts.scheme == "http" and not parts.username
                     and not requests.utils.get_environ_proxies(cfg.url))
        self._host, self._port = parts.hostname, parts.port or 80
        self._lanes: dict[int, _Lane] = {}
        self.spin = (not shares_cores_with_server(cfg.url)) if cfg.spin is None else cfg.spin

    def set_route(self, key: Optional[str]) -> None:
        """Send ``key`` in :data:`~splitlearn.api.protocol.ROUTE_HEADER` on every request (None:
        none), so a cluster's HAProxy pins this client to one replica (docs/CLUSTER.md)."""
        for headers in (self.http.headers, self._headers):
            if key is None:
                headers.pop(P.ROUTE_HEADER, None)
            else:
                headers[P.ROUTE_HEADER] = key

    def close(self) -> None:
        self.http.close()
        if self.link is not None and hasattr(self.link, "close"):
            self.link.close()
        for lane in self._lanes.values():
            lane.close()
        self._lanes.clear()

    # -- JSON control calls (requests) ---------------------------------------------------

    def _send(self, method: str, path: str, **kw) -> requests.Response:
        if self.link is not None:
            return self._link_send(method, path, **kw)
        url = self.cfg.url + path
        timeout = (self.cfg.connect_timeout_s, self.cfg.read_timeout_s)
        for attempt in range(self.cfg.retries + 1):
            try:
                resp = self.http.request(method, url, timeout=timeout, **kw)
                if attempt < self.cfg.retries:
                    _check_gateway(resp.status_code, resp.content)
                break
            except (requests.ConnectionError, requests.exceptions.ChunkedEncodingError, GatewayFailure) as e:
                if attempt == self.cfg.retries:
                    raise TransportError(f"cannot reach {url} after {attempt + 1} attempts: {e}") from None
                self._backoff(attempt, method, path, e)
            except requests.Timeout as e:
                raise TransportError(f"{method} {url}: no answer in time ({e})") from None
        if resp.status_code >= 400:
            raise self._error(resp.status_code, resp.headers.get, resp.content)
        return resp

    def _link_send(self, method: str, path: str, **kw) -> "_LinkAnswer":
        """:meth:`_send` through the link: the headers and body ``requests`` would send."""
        headers, body = {**self.http.headers, **kw.get("headers", {})}, kw.get("data")
        if kw.get("json") is not None:
            body, headers["Content-Type"] = json.dumps(kw["json"]).encode(), "application/json"
        answer = _LinkAnswer(*self._link_request(method, path, headers, body))
        if answer.status_code >= 400:
            raise self._error(answer.status_code, answer.headers.get, answer.content)
        return answer

    def _link_request(self, method: str, path: str, headers: dict, body: Optional[bytes]):
        for attempt in range(self.cfg.retries + 1):
            try:
                return self.link.request(method, self._base_path + path, headers, body)
            except ConnectionError as e:
                if attempt == self.cfg.retries:
                    raise TransportError(f"cannot reach {self.cfg.url + path} after {attempt + 1} attempts: "
                                         f"{e}") from None
                self._backoff(attempt, method, path, e)
        raise AssertionError("unreachable")

    def _link_lane_answer(self, p: PendingCall):
        """The answer of ``p`` on its link lane, resending it after a lost connection."""
        sent = p.sent
        for attempt in range(self.cfg.retries + 1):
            try:
                if not sent:
                    self.link.send(p.lane, "POST", self._base_path + p.path, self._headers, p.body)
                return self.link.receive(p.lane, spin=self.spin)
            except ConnectionError as e:
                self.link.drop(p.lane)
                sent = False
                if attempt == self.cfg.retries:
                    raise TransportError(f"cannot reach {self.cfg.url + p.path} after {attempt + 1} attempts: "
                                         f"{e}") from None
                self._backoff(attempt, "POST", p.path, e)
        raise AssertionError("unreachable")

    def _backoff(self, attempt: int, method: str, path: str, e: Exception) -> None:
        self.stats.retries += 1
        wait = min(self.cfg.backoff_s * (2 ** attempt), self.cfg.max_backoff_s)
        log.warning("%s %s failed (%s); retrying in %.1fs", method, path, type(e).__name__, wait)
        time.sleep(wait)

    @staticmethod
    def _error(status: int, header: Callable[[str], Optional[str]], content: bytes) -> SplitLearnError:
        retry_after = header("Retry-After")
        try:
            payload = json.loads(content)
            if not isinstance(payload, dict):
                raise ValueError
        except ValueError:
            text = content[:200].decode("utf-8", "replace")
            payload = {"error": "transport", "message": f"HTTP {status}: {text}"}
        return from_payload(status, payload, float(retry_after) if retry_after else None)

    def get_json(self, path: str) -> dict:
        return self._send("GET", path).json()

    def wait_until_up(self, deadline: float, timeout_s: float) -> None:
        """Poll ``GET /v1/health`` every 0.5 s until the server answers (a crashed server coming
        back); ``TransportError`` at ``deadline`` (``time.monotonic()``; ``timeout_s``: the window
        it closes, for the message)."""
        while True:
            try:
                self.get_json(P.HEALTH)
                return
            except TransportError:
                if time.monotonic() > deadline:
                    raise TransportError(f"the server at {self.cfg.url} did not come back within "
                                         f"{timeout_s:g}s (reconnect_timeout_s)") from None
                time.sleep(0.5)

    def post_json(self, path: str, payload: dict) -> dict:
        return self._send("POST", path, json=payload).json()

    def get_bytes(self, path: str) -> bytes:
        """GET a binary (safetensors) answer."""
        return self._send("GET", path).content

    def post_bytes_json(self, path: str, body: bytes) -> dict:
        """POST a safetensors body whose answer is JSON (federation sync)."""
        return self._send("POST", path, data=body, headers={"Content-Type": P.CONTENT_TYPE}).json()

    def delete(self, path: str) -> None:
        self._send("DELETE", path)

    # -- tensor calls --------------------------------------------------------------------

    def call(self, path: str, tensors: dict, meta: Optional[dict] = None) -> dict:
        """POST ``tensors`` (+ string ``meta``) as safetensors; return the answer's tensors."""
        return self.finish_call(self.start_call(path, tensors, meta))

    def start_call(self, path: str, tensors: dict, meta: Optional[dict] = None, lane: int = 0) -> PendingCall:
        """Encode and send ``tensors`` on ``lane`` now; :meth:`finish_call` gets the answer."""
        t0 = time.perf_counter()
        if getattr(self.link, "takes_encoded", False):
            # a link into shared memory (unix://) writes the body there itself: the one copy
            body = enc = Encoded(tensors, meta, keep_device=getattr(self.link, "takes_device", False))
        else:  # a socket: each tensor copied once into host memory (from a GPU: into pinned memory)
            lean = self.lean and self.link is None  # http.client sends a memoryview as it is
            enc = Encoded(tensors, meta, keep_device=lean)
            body = enc.host_body() if lean else bytes(enc)
        self.stats.serialize_s += time.perf_counter() - t0
        pending = self.start(path, body, lane)
        self.stats.host_copy_bytes += enc.host_copied  # once the link has written it
        return pending

    def finish_call(self, pending: PendingCall) -> dict:
        return self.finish_call_meta(pending)[0]

    def call_meta(self, path: str, tensors: dict, meta: Optional[dict] = None, lane: int = 0) -> tuple[dict, dict]:
        """:meth:`call` (on ``lane``), also returning the answer's string metadata."""
        return self.finish_call_meta(self.start_call(path, tensors, meta, lane))

    def finish_call_meta(self, pending: PendingCall) -> tuple[dict, dict]:
        answer = self._finish(pending, view=True)  # shared memory (unix://): read in place, once
        t0 = time.perf_counter()
        try:
            out, meta = decode(answer, repeats=True)  # a decode step's answers share one header
        finally:
            if isinstance(answer, (memoryview, DeviceBody)):
                answer.release()
        self.stats.deserialize_s += time.perf_counter() - t0
        if not isinstance(answer, DeviceBody):  # decoded out of host memory: one copy a tensor
            self.stats.host_copy_bytes += sum(t.numel() * t.element_size() for t in out.values())
        return out, meta

    def post_bytes(self, path: str, body: bytes) -> bytes:
        """POST a safetensors body; return the answer's bytes, counting everything."""
        return self.start(path, body).result()

    def start(self, path: str, body: bytes, lane: int = 0) -> PendingCall:
        """Send a safetensors body on ``lane`` (one request in flight per lane)."""
        return PendingCall(self, lane, path, body)

    def drop_lane(self, lane: int) -> None:
        """Close ``lane``'s connection (an answer on it was not its request's: whatever else is
        on it is not to be read); the next request on it opens a new one."""
        if self.link is not None and hasattr(self.link, "drop"):
            self.link.drop(lane)
        elif lane in self._lanes:
            self._lanes[lane].close()

    def _lane(self, lane: int) -> _Lane:
        if lane not in self._lanes:
            self._lanes[lane] = _Lane(self._host, self._port, self.cfg)
        return self._lanes[lane]

    def _try_send(self, lane: int, path: str, body: bytes) -> bool:
        """Send now on the lean path or a link's lane; False if it failed (``_finish`` retries)
        or is not used."""
        if self.link is not None and hasattr(self.link, "send"):
            try:
                self.link.send(lane, "POST", self._base_path + path, self._headers, body)
                return True
            except ConnectionError:
                self.link.drop(lane)
                return False
        if not self.lean:
            return False
        try:
            self._lane(lane).send(self._base_path + path, body, self._headers)
            return True
        except (*_CONNECTION_ERRORS, OSError):
            self._lane(lane).close()
            return False

    def _finish(self, p: PendingCall, view: bool = False) -> bytes:
        """The answer's bytes; ``view``: a link's shared memory may come as a ``memoryview``,
        valid until the lane's next request (the caller decodes it at once)."""
        if p.answer is not None:
            status, headers, content = p.answer
            header = headers.get
        elif self.link is not None:  # a link with lanes
            status, headers, content = self._link_lane_answer(p)
            header = headers.get
        elif not self.lean:
            resp = self._send("POST", p.path, data=p.body, headers={"Content-Type": P.CONTENT_TYPE})
            status, header, content = resp.status_code, resp.headers.get, resp.content
        else:
            status, header, content = self._lean_answer(p)
        if isinstance(content, (memoryview, DeviceBody)) and (not view or status >= 400):
            body, content = content, content.tobytes()
            if isinstance(body, DeviceBody):
                body.release()
        if status >= 400:
            raise self._error(status, header, content)
        s = self.stats
        s.round_trip_s += time.perf_counter() - p.t0
        s.calls += 1
        s.bytes_sent += len(p.body)
        s.bytes_received += len(content)
        s.server_compute_s += float(header(P.SERVER_TIME_HEADER) or 0.0) / 1e3
        return content

    def _lean_answer(self, p: PendingCall):
        lane, url = self._lane(p.lane), self.cfg.url + p.path
        # sent on the connection the lane still has: else its answer went with that one (resend)
        sent = p.sent and lane.out and lane.generation == p.generation
        for attempt in range(self.cfg.retries + 1):
            try:
                if not sent:
                    lane.send(self._base_path + p.path, p.body, self._headers)
                if self.spin:
                    lane.await_answer()
                answer = lane.receive()
                lane.answered()
                if attempt < self.cfg.retries:
                    _check_gateway(answer[0], answer[2])
                return answer
            except (socket.timeout, TimeoutError) as e:
                lane.close()
                raise TransportError(f"POST {url}: no answer in time ({e})") from None
            except (*_CONNECTION_ERRORS, OSError) as e:
                lane.close()
                sent = False
                if attempt == self.cfg.retries:
                    raise TransportError(f"cannot reach {url} after {attempt + 1} attempts: {e}") from None
                self._backoff(attempt, "POST", p.path, e)
        raise AssertionError("unreachable")
