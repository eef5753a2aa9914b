"""The Flask app: ``create_app(config)`` -> a WSGI app serving one segment.

The routes are blueprints, one per concern (api_ops, api_training, api_sessions,
api_federation, api_lora, api_offload; routes: docs/INTERNALS.md, 'The server package'),
sharing :mod:`.routing`. Every failure is a :class:`SplitLearnError` turned into ``{"error":
CODE, "message": TEXT}`` with its status by one handler, so a bad request changes nothing;
:mod:`.accesslog`'s hooks time, count and log every request; ``GET /v1/ready`` is :mod:`.probes`.
"""
from __future__ import annotations

import logging
import secrets
from typing import Optional

from flask import Flask, g, request
from werkzeug.exceptions import HTTPException

from ...api import protocol as P
from ...errors import BadRequest, NotFound, PayloadTooLarge, SplitLearnError, Unauthorized, UnsupportedMediaType
from ..config import ServerConfig
from ..engine.memory import MemoryAccount
from ..engine.runtime import SegmentRuntime
from . import accesslog, api_federation, api_lora, api_offload, api_ops, api_sessions, api_training
from .frontdoor import TENANT_KEY
from .metrics import ServerMetrics
from .routing import BODY_KEY, SERVED, Served, error_response, internal_error

log = logging.getLogger(__name__)

_HTTP_CODES = {404: NotFound, 413: PayloadTooLarge, 415: UnsupportedMediaType}
SEGMENT_ROUTES = (api_ops.bp, api_ops.checkpoints, api_training.bp, api_sessions.bp, api_federation.bp, api_lora.bp)
OFFLOAD_ROUTES = (api_ops.bp, api_offload.bp)  # an offload server multiplies masked inputs, nothing else


def create_app(config: Optional[ServerConfig] = None, runtime=None) -> Flask:
    """Build the app around a runtime (given, or built from ``config``: a
    :class:`~splitlearn.server.engine.runtime.SegmentRuntime`, or with ``config.offload`` an
    :class:`~splitlearn.server.engine.offload.OffloadRuntime`)."""
    if runtime is None and config is not None and config.offload:  # issue 22: masked offload
        from ..engine.offload import OffloadRuntime
        runtime = OffloadRuntime(config)
    rt = runtime or SegmentRuntime(config)
    cfg = rt.cfg
    app = Flask("splitlearn.server", static_folder=None)  # no /static/<path> route: every route is in openapi.py
    app.config["MAX_CONTENT_LENGTH"] = cfg.max_body_bytes  # 413 from Content-Length, unread
    app.extensions["splitlearn"] = rt
    memory = getattr(rt, "memory", None)  # what the server holds per tenant (memory.py); none: offload
    memory = memory if isinstance(memory, MemoryAccount) else None  # an offload runtime's is its request limit
    metrics = ServerMetrics(rt, memory)  # this app's own registry (GET /metrics, --metrics-port)
    app.extensions["splitlearn.metrics"] = metrics
    app.extensions[SERVED] = Served(rt, memory, metrics)
    _errors(app)
    if cfg.request_log:  # first of the hooks: the clock and the request id (accesslog.py)
        accesslog.install(app, metrics)
    tenants = cfg.tenants

    @app.before_request
    def _body_in_hand():  # the unix door hands over the whole body (unixdoor.py): read it once, not in 64 KiB reads
        body = request.environ.get(BODY_KEY)
        if body is not None:
            request._cached_data = body  # what request.get_data() returns (werkzeug's cache)

    @app.before_request
    def _authenticate():
        if request.path in (P.HEALTH, P.READY):
            return None
        if request.path == P.OPENAPI and "Authorization" not in request.headers:
            g.tenant = None  # the protocol's document, the same for everyone (api_ops.openapi_document)
            return None
        # the front door (frontdoor.py) found the tenant at the headers; under another server, here
        tenant = request.environ.get(TENANT_KEY) or tenants.authenticate(request.headers.get("Authorization"))
        if tenant is None:
            raise Unauthorized("missing or wrong bearer token (Authorization: Bearer <token>)")
        g.tenant, g.owner = tenant, tenant.digest
        return None

    for bp in OFFLOAD_ROUTES if cfg.offload else SEGMENT_ROUTES:
        app.register_blueprint(bp)
    return app


def _errors(app: Flask) -> None:
    """Every failure as ``{"error", "message"}`` with its status; a 500 names an incident."""

    @app.errorhandler(SplitLearnError)
    def _splitlearn_error(err: SplitLearnError):
        return error_response(err)

    @app.errorhandler(HTTPException)
    def _http_error(err: HTTPException):
        cls = _HTTP_CODES.get(err.code, BadRequest)
        e = cls(f"{err.name}: {err.description}" if err.code != 404 else
                f"no route {request.method} {request.path}")
        e.status = err.code or 400
        return error_response(e)

    @app.errorhandler(Exception)
    def _internal(err: Exception):
        incident = g.incident = secrets.token_hex(6)  # the answer names it; the log has the details
        log.exception("internal error %s on %s %s", incident, request.method, request.path)
        return error_response(internal_error(incident))
