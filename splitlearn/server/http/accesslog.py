"""One access line per request, and the server's log format (``--log-format text|json``).

:func:`begin` (the app's first ``before_request`` hook) starts the clock and names the request;
:func:`finish` (``after_request``) names it in the answer; once the answer is sent (the
response's close) :func:`record` queues it, to be counted in :mod:`.metrics` and logged (within
``DRAIN_S``, or at a scrape) as one line on
``splitlearn.server.http.accesslog`` (INFO) with ``request_id``, ``tenant``, ``method``,
``route``, ``status``, ``bytes_in``, ``bytes_out``, ``ms`` and, on a 500, ``incident``. The
JSON formatter is written by hand (``python-json-logger`` is not a dependency). Fields and
formats: docs/OPERATIONS.md, 'Logs'.
"""
from __future__ import annotations

import atexit
import collections
import dataclasses
import functools
import itertools
import json
import logging
import re
import secrets
import threading
import time
from typing import Optional

from flask import g, request
from flask.testing import FlaskClient

from ...api import protocol as P
from ...errors import ConfigError
from .metrics import ServerMetrics, route_of

log = logging.getLogger(__name__)

FORMATS = ("text", "json")
_REQUEST_ID = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
_RECORD_KEYS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}


class ClosingClient(FlaskClient):
    """The app's test client: each answer is read and closed at once, as a WSGI server closes
    it after sending it, so that :func:`record` runs under tests too."""

    def open(self, *args, buffered: bool = True, **kwargs):
        return super().open(*args, buffered=buffered, **kwargs)


def install(app, metrics: Optional[ServerMetrics]) -> None:
    """The hooks on ``app``: :func:`begin` first, :func:`finish` last; a scrape of ``metrics``
    drains the queued records first."""
    if metrics is not None:
        metrics.before_scrape = drain
    app.before_request(lambda: begin(request, g))
    app.after_request(lambda resp: finish(request._get_current_object(), g, resp, metrics))
    app.test_client_class = ClosingClient


_ENVIRON_KEY = "HTTP_" + P.REQUEST_ID_HEADER.upper().replace("-", "_")
_ids = itertools.count()
_ID_PREFIX = secrets.token_hex(4)  # this process's: ids differ across processes and replicas


def begin(request, g) -> None:
    """At the request's first hook: its clock and its id."""
    g.started = time.perf_counter()
    g.request_id = request_id(request.environ.get(_ENVIRON_KEY))


def request_id(given: Optional[str]) -> str:
    """The caller's ``X-Request-Id`` if it is a sane one, else a new one: 16 hex digits, this
    process's random prefix and a counter (no system call per request)."""
    return given if given and _REQUEST_ID.fullmatch(given) else f"{_ID_PREFIX}{next(_ids) & 0xFFFFFFFF:08x}"


def finish(request, g, resp, metrics: Optional[ServerMetrics]):
    """At the request's last hook: name it in the answer, and count and log it once the answer
    is sent (:func:`record`, on the response's close)."""
    started = g.get("started")
    if started is None:  # a hook before ours failed
        return resp
    tenant = g.get("tenant")
    access = Access(g.request_id, tenant.name if tenant is not None else "-", request.method, route_of(request),
                    resp.status_code, request.content_length or 0, resp.content_length or 0,
                    time.perf_counter() - started, g.get("incident"))
    resp.headers[P.REQUEST_ID_HEADER] = g.request_id
    resp.call_on_close(functools.partial(record, access, metrics))
    return resp


@dataclasses.dataclass
class Access:
    """One answered request, as its access line and its metrics see it."""

    request_id: str
    tenant: str  # the tenant's name ("-": none)
    method: str
    route: str  # the URL rule, never the path (it holds session ids)
    status: int
    bytes_in: int
    bytes_out: int
    seconds: float  # in the app: from the first hook to the answer built
    incident: Optional[str] = None  # a 500's incident id


#: answered requests not yet counted and logged: :func:`drain` empties it (a deque: appends and
#: pops from several threads lose nothing)
_pending: collections.deque = collections.deque()
_drainer: Optional[threading.Thread] = None
_drainer_lock = threading.Lock()
_drain_lock = threading.Lock()
DRAIN_S = 0.05  # the drainer's period: lines reach the log at most this late; a scrape drains first


def record(a: Access, metrics: Optional[ServerMetrics]) -> None:
    """Count ``a`` in ``metrics`` and log its line, soon: called once the answer has been
    handed to the connection (the WSGI server closes the response after writing it; the unix
    door likewise), it only queues ``a``; the drainer thread (every ``DRAIN_S``), a scrape of
    the metrics (:meth:`~.metrics.ServerMetrics.exposition` and ``--metrics-port``) and the
    process's exit do the work, many records at a time, so the next request on the
    connection does not wait for it (benchmarks/observability.py)."""
    _pending.append((a, metrics))
    d = _drainer
    if d is None or (isinstance(d, threading.Thread) and not d.is_alive()):
        _start_drainer()


def _start_drainer() -> None:
    global _drainer
    with _drainer_lock:
        d = _drainer
        if d is None or (isinstance(d, threading.Thread) and not d.is_alive()):
            if d is None:
                atexit.register(drain)
            _drainer = threading.Thread(target=_drain_forever, name="accesslog-drain", daemon=True)
            _drainer.start()


def _drain_forever() -> None:
    """Drain every ``DRAIN_S`` while this thread is the drainer (a test that stops the drainer
    replaces it; the next record starts a new one once this one has ended)."""
    me = threading.current_thread()
    while True:
        time.sleep(DRAIN_S)
        if _drainer is not me:
            return
        drain()


def drain() -> None:
    """Count and log every queued record now, in the order they were answered (one drain at a
    time: the drainer's and a scrape's do not interleave their lines)."""
    with _drain_lock:
        while True:
            try:
                a, metrics = _pending.popleft()
            except IndexError:
                return
            _write(a, metrics)


def _write(a: Access, metrics: Optional[ServerMetrics]) -> None:
    try:
        if metrics is not None:
            metrics.observe(a.route, a.method, a.status, a.tenant, a.seconds, a.bytes_in, a.bytes_out)
        if log.isEnabledFor(logging.INFO):
            fields = {"request_id": a.request_id, "tenant": a.tenant, "method": a.method, "route": a.route,
                      "status": a.status, "bytes_in": a.bytes_in, "bytes_out": a.bytes_out,
                      "ms": round(a.seconds * 1e3, 3)}
            if a.incident is not None:
                fields["incident"] = a.incident
            # made here, not by log.info: its findCaller walks the whole server stack (~40 us a line)
            log.handle(log.makeRecord(log.name, logging.INFO, __file__, 0, "%s %s %d %dB>%dB %.2fms tenant=%s id=%s%s",
                                      (a.method, a.route, a.status, a.bytes_in, a.bytes_out, a.seconds * 1e3,
                                       a.tenant, a.request_id, f" incident={a.incident}" if a.incident else ""),
                                      None, extra={"access": fields}))
    except Exception:  # noqa: BLE001 - after the answer: nobody to tell but the log
        log.exception("access record of %s %s failed", a.method, a.route)


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ts (ISO 8601, UTC, ms), level, logger, message, the access
    fields of an access line, any other ``extra`` that JSON can hold, exc (a traceback)."""

    _second, _stamp = -1, ""  # the last second formatted (strftime costs ~2 us a line)

    def _ts(self, created: float) -> str:
        second = int(created)
        if second != self._second:
            self._second, self._stamp = second, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
        return f"{self._stamp}.{int((created - second) * 1000):03d}Z"

    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": self._ts(record.created), "level": record.levelname, "logger": record.name,
               "message": record.getMessage()}
        access = getattr(record, "access", None)
        if access is not None:  # an access line: its fields, nothing else to look for
            out.update(access)
        else:
            for key, value in vars(record).items():
                if key not in _RECORD_KEYS and isinstance(value, (str, int, float, bool, type(None))):
                    out.setdefault(key, value)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, separators=(",", ":"), default=str)


TEXT_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"


class PrivateFileHandler(logging.FileHandler):
    """A FileHandler whose file is created 0600 and never opened through a link; an existing one
    must be this user's own (:func:`~splitlearn.model.checkpoint.append_private`): tenant names
    and routes are for the operator only."""

    def __init__(self, path: str):
        super().__init__(path, encoding="utf-8", delay=True)
        self.stream = self._open()  # now: a refusal is the operator's error at start

    def _open(self):
        from ...model.checkpoint import append_private

        return append_private(self.baseFilename)


def configure(level: str = "INFO", fmt: str = "text", access_log: Optional[str] = None) -> None:
    """The process's logging (the servers' CLIs): ``fmt`` text or json on stderr, at ``level``;
    the access lines to the file ``access_log``, to stderr for ``"-"``, or nowhere for None (the
    metrics count every request either way; a failure to record one is still logged)."""
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {FORMATS}, got {fmt!r}")
    formatter = JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT)
    handler = logging.StreamHandler()
    handler.setFormatter(formatter)
    logging.basicConfig(level=level.upper(), handlers=[handler])
    for h in [h for h in log.handlers if getattr(h, "access_file", False)]:  # an earlier call's file
        log.removeHandler(h)
        h.close()
    log.propagate = True
    if access_log is None:  # off: a server started in a terminal with & does not write over its user's output
        log.setLevel(logging.WARNING)
        return
    log.setLevel(logging.INFO)  # asked for: whatever --log-level says of the other lines
    if access_log != "-":
        try:
            to_file = PrivateFileHandler(access_log)  # appends; 0600, this user's own (SECURITY.md)
        except OSError as e:
            raise ConfigError(f"--access-log {access_log}: cannot open it for appending: {e}") from None
        except ConfigError as e:
            raise ConfigError(f"--access-log {e}") from None
        to_file.setFormatter(formatter)
        to_file.access_file = True
        log.addHandler(to_file)
        log.propagate = False
