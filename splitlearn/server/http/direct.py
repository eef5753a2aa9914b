"""The tensor routes without Flask: the unix door's direct dispatch (issue 32).

A decode step over ``unix://`` spent more time in Flask (its request context, URL map, hooks
and ``Response``) than in the frame and the socket (docs/TRANSPORT.md, 'Measured').
For a ``POST`` to a :func:`~.routing.tensor_route` path (and ``/v1/echo``, the link's own
measure), the unix door calls :class:`Direct` instead of the app: the same route code (:func:`.routing.serve`: memory scope, 415, decode,
validation, the handler, the compute thread), the tenant the door authenticated, the same
JSON errors (a 500 names an incident), the same ``X-Server-Time-Ms`` and ``X-Request-Id``, the
same access line and metrics (:func:`.accesslog.record`, after the answer is sent). Every other
request, and every request over TCP, goes through the Flask app.
"""
from __future__ import annotations

import functools
import json
import logging
import secrets
import time
from typing import Callable, Optional

from ...api import protocol as P
from ...errors import SplitLearnError
from ...api.wire import DeviceBody, Encoded, decode
from ..engine.memory import scope as memory_scope
from ..tenants import Tenant
from . import accesslog
from .api_ops import check_echo
from .routing import SERVED, TENSOR_ROUTES, TensorRoute, internal_error, serve

log = logging.getLogger("splitlearn.server.http.app")  # where the app logs its incidents

Answer = tuple[int, list, bytes, Callable[[], None]]  # status, headers, content, after the answer is sent


def _nothing() -> None:
    return None


class Direct:
    """The tensor routes of ``app`` (its blueprints' :data:`~.routing.TENSOR_ROUTES`)."""

    def __init__(self, app):
        self.served = app.extensions[SERVED]
        self.metrics = app.extensions.get("splitlearn.metrics")
        self.request_log = bool(getattr(self.served.cfg, "request_log", True))
        self.routes = [r for name in app.blueprints for r in TENSOR_ROUTES.get(name, ())]
        self.echo = "operations" in app.blueprints and hasattr(self.served.cfg, "max_echo_bytes")

    def match(self, method: str, path: str) -> Optional[tuple[TensorRoute, dict]]:
        """The route of ``POST path`` and its URL arguments; None: the app's business."""
        if method != "POST":
            return None
        if path == P.ECHO and self.echo:
            return ECHO, {}
        for r in self.routes:
            m = r.pattern.fullmatch(path)
            if m is not None:
                return r, m.groupdict()
        return None

    def __call__(self, route: TensorRoute, url_args: dict, headers: dict, body, tenant: Tenant,
                 lazy_above: Optional[int] = None, keep_device: bool = False, body_hold=None) -> Answer:
        """Serve one request (``headers`` with lower-case names) for ``tenant``, as the app
        would. ``body``: bytes, a memoryview of shared memory or a DeviceBody (decoded in place,
        once); ``lazy_above``: an answer larger than this comes as a :class:`~splitlearn.api.wire.Encoded`
        (``keep_device``: its tensors left on the server's GPU); ``body_hold``: the door's
        reservation of an inline body (taken over by the route's)."""
        started = time.perf_counter()
        incident = None
        mimetype = headers.get("content-type", "").split(";", 1)[0].strip().lower()
        try:
            if route is ECHO:
                content, server_ms = self._echo(body)
            else:
                with memory_scope(self.served.memory, tenant.name) as held:  # released once the answer is built
                    content, server_ms = serve(self.served, held, route, tenant, len(body), mimetype,
                                               lambda: body, url_args, lazy_above, keep_device, body_hold)
            status = 200
            out = [["Content-Type", P.CONTENT_TYPE], ["Content-Length", str(len(content))],
                   [P.SERVER_TIME_HEADER, server_ms]]
        except SplitLearnError as e:
            status, out, content = _error(e)
        except Exception:  # noqa: BLE001 - as the app's handler: the answer names an incident
            incident = secrets.token_hex(6)
            log.exception("internal error %s on POST %s", incident, route.rule)
            status, out, content = _error(internal_error(incident))
        if not self.request_log:
            return status, out, content, _nothing
        rid = accesslog.request_id(headers.get(P.REQUEST_ID_HEADER.lower()))
        out.append([P.REQUEST_ID_HEADER, rid])
        access = accesslog.Access(rid, tenant.name, "POST", route.rule, status, len(body), len(content),
                                  time.perf_counter() - started, incident)
        return status, out, content, functools.partial(accesslog.record, access, self.metrics)


    def _echo(self, body) -> tuple[bytes, str]:
        """``POST /v1/echo`` as the app answers it (api_ops.echo): the body back, read out of
        the region once; at most ``max_echo_bytes``. A device body comes back as its tensors,
        through the device region."""
        check_echo(self.served.cfg, len(body))
        started = time.perf_counter()
        if isinstance(body, DeviceBody):
            content = Encoded(*decode(body), keep_device=True)
        else:
            content = body.tobytes() if isinstance(body, memoryview) else bytes(body)
        return content, f"{(time.perf_counter() - started) * 1e3:.3f}"


#: ``POST /v1/echo``: no tensors, served by :meth:`Direct._echo`
ECHO = TensorRoute(P.ECHO, None, False, True, "other", None)


def _error(e: SplitLearnError) -> tuple[int, list, bytes]:
    content = json.dumps(e.to_payload(), separators=(",", ":")).encode() + b"\n"
    out = [["Content-Type", "application/json"], ["Content-Length", str(len(content))]]
    if e.retry_after is not None:
        out.append(["Retry-After", str(int(round(e.retry_after)))])
    return e.status, out, content
