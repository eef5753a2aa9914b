"""One access line per request, and the server's log format (``--log-format text|json``).

:func:`begin` (the app's first ``before_request`` hook) starts the clock and names the request;
:func:`finish` (``after_request``) counts it in :mod:`.metrics` and logs one line on
``splitlearn.server.http.accesslog`` (INFO) with ``request_id``, ``tenant``, ``method``,
``route``, ``status``, ``bytes_in``, ``bytes_out``, ``ms`` and, on a 500, ``incident``. The
JSON formatter is written by hand (``python-json-logger`` is not a dependency). Fields and
formats: docs/OPERATIONS.md, 'Logs'.
"""
from __future__ import annotations

import json
import logging
import re
import secrets
import time
from typing import Optional

from ... import protocol as P
from .metrics import ServerMetrics, route_of

log = logging.getLogger(__name__)

FORMATS = ("text", "json")
_REQUEST_ID = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
_RECORD_KEYS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}


def begin(request, g) -> None:
    """At the request's first hook: its clock and its id."""
    g.started = time.perf_counter()
    given = request.headers.get(P.REQUEST_ID_HEADER)
    g.request_id = given if given and _REQUEST_ID.fullmatch(given) else secrets.token_hex(8)


def finish(request, g, resp, metrics: Optional[ServerMetrics]):
    """At the request's last hook: count it, log its line, name it in the answer."""
    started = g.get("started")
    if started is None:  # a hook before ours failed
        return resp
    seconds = time.perf_counter() - started
    route, status = route_of(request), resp.status_code
    tenant = g.get("tenant")
    name = tenant.name if tenant is not None else "-"
    bytes_in, bytes_out = request.content_length or 0, resp.content_length or 0
    if metrics is not None:
        metrics.observe(route, request.method, status, name, seconds, bytes_in, bytes_out)
    resp.headers[P.REQUEST_ID_HEADER] = g.request_id
    if log.isEnabledFor(logging.INFO):
        fields = {"request_id": g.request_id, "tenant": name, "method": request.method, "route": route,
                  "status": status, "bytes_in": bytes_in, "bytes_out": bytes_out, "ms": round(seconds * 1e3, 3)}
        incident = g.get("incident")
        if incident is not None:
            fields["incident"] = incident
        # made here, not by log.info: its findCaller walks the whole Flask stack (~40 us a line)
        log.handle(log.makeRecord(log.name, logging.INFO, __file__, 0, "%s %s %d %dB>%dB %.2fms tenant=%s id=%s%s",
                                  (request.method, route, status, bytes_in, bytes_out, seconds * 1e3, name,
                                   g.request_id, f" incident={incident}" if incident else ""), None,
                                  extra={"access": fields}))
    return resp


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


def configure(level: str = "INFO", fmt: str = "text") -> None:
    """The process's logging: ``fmt`` text or json on stderr, at ``level`` (the server's CLI)."""
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {FORMATS}, got {fmt!r}")
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler])
