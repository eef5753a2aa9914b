"""What every app of the server installs, the segment server's and the fed server's alike:
:func:`install_errors` (every failure as ``{"error": CODE, "message": TEXT}`` with its status,
a 500 naming an incident) and :func:`install_auth` (the bearer token, constant-time:
:meth:`~splitlearn.server.tenants.Tenants.authenticate`; the front door found the tenant at
the headers already, :mod:`.frontdoor`)."""
from __future__ import annotations

import logging
import secrets

from flask import Flask, g, request
from werkzeug.exceptions import HTTPException

from ...api import protocol as P
from ...errors import BadRequest, NotFound, PayloadTooLarge, SplitLearnError, Unauthorized, UnsupportedMediaType
from .frontdoor import TENANT_KEY
from .routing import error_response, internal_error

log = logging.getLogger(__name__)

_HTTP_CODES = {404: NotFound, 413: PayloadTooLarge, 415: UnsupportedMediaType}


def install_errors(app: Flask) -> None:
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


def install_auth(app: Flask, tenants, refusal: str) -> None:
    """Every route but the probes needs a token of ``tenants`` (401 ``refusal`` without one);
    ``/v1/openapi.json`` without one is the protocol's document (``g.tenant`` None)."""

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
            raise Unauthorized(refusal)
        g.tenant, g.owner = tenant, tenant.digest
        return None
