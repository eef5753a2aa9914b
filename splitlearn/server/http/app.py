"""The Flask app: ``create_app(config)`` -> a WSGI app serving one segment.

The routes are blueprints, one per concern (api_ops, api_training, api_sessions,
api_federation, api_lora, api_offload; routes: docs/INTERNALS.md, 'The server package'),
sharing :mod:`.routing`. Every failure is a :class:`SplitLearnError` turned into ``{"error":
CODE, "message": TEXT}`` with its status by one handler (:mod:`.hooks`, with the token check,
shared with the fed server's app), so a bad request changes nothing;
:mod:`.accesslog`'s hooks time, count and log every request; ``GET /v1/ready`` is :mod:`.probes`.
"""
from __future__ import annotations

from typing import Optional

from flask import Flask, request

from ..config import ServerConfig
from ..engine.memory import MemoryAccount
from ..engine.runtime import SegmentRuntime
from . import accesslog, api_federation, api_lora, api_offload, api_ops, api_sessions, api_training
from .hooks import install_auth, install_errors
from .metrics import ServerMetrics
from .routing import BODY_KEY, SERVED, Served

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
    memory = getattr(rt, "memory", None)  # what the server holds per tenant (memory.py)
    if not isinstance(memory, MemoryAccount):  # an offload runtime's is its request limit; its bodies' account:
        memory = getattr(rt, "account", None)
    metrics = ServerMetrics(rt, memory)  # this app's own registry (GET /metrics, --metrics-port)
    app.extensions["splitlearn.metrics"] = metrics
    app.extensions[SERVED] = Served(rt, memory, metrics)
    install_errors(app)
    if cfg.request_log:  # first of the hooks: the clock and the request id (accesslog.py)
        accesslog.install(app, metrics)
    tenants = cfg.tenants

    @app.before_request
    def _body_in_hand():  # the unix door hands over the whole body (unixdoor.py): read it once, not in 64 KiB reads
        body = request.environ.get(BODY_KEY)
        if body is not None:
            request._cached_data = body  # what request.get_data() returns (werkzeug's cache)

    install_auth(app, tenants, "missing or wrong bearer token (Authorization: Bearer <token>)")

    for bp in OFFLOAD_ROUTES if cfg.offload else SEGMENT_ROUTES:
        app.register_blueprint(bp)
    return app
