"""The Flask app: ``create_app(config)`` -> a WSGI app serving one segment.

Each route reads its request's bytes on the WSGI thread, then decodes and validates them
completely (:mod:`.validate`) and calls the :class:`~.runtime.SegmentRuntime`, all on the
runtime's compute thread (every tensor operation runs there: see :mod:`.compute`). Every
failure is a :class:`SplitLearnError` turned into ``{"error": CODE, "message": TEXT}`` with its HTTP status by one handler, so a bad
request changes nothing and the server keeps serving.
"""
from __future__ import annotations

import hmac
import logging
import time
from typing import Optional

from flask import Flask, Response, g, jsonify, request
from werkzeug.exceptions import HTTPException

from .. import protocol as P
from ..errors import (BadRequest, NotFound, PayloadTooLarge, SplitLearnError, Unauthorized,
                      UnsupportedMediaType)
from ..wire import check_wire_dtype, decode
from . import validate
from .config import ServerConfig
from .runtime import SegmentRuntime
from .sessions import owner_of

log = logging.getLogger(__name__)

_HTTP_CODES = {404: NotFound, 413: PayloadTooLarge, 415: UnsupportedMediaType}


def _error_response(err: SplitLearnError) -> Response:
    resp = jsonify(err.to_payload())
    resp.status_code = err.status
    if err.retry_after is not None:
        resp.headers["Retry-After"] = str(int(round(err.retry_after)))
    return resp


def _binary(body: bytes, started: float, status: int = 200) -> Response:
    resp = Response(body, status=status, mimetype=P.CONTENT_TYPE)
    resp.headers[P.SERVER_TIME_HEADER] = f"{(time.perf_counter() - started) * 1e3:.3f}"
    return resp


def _body() -> bytes:
    """The request's safetensors bytes; 415 for another content type."""
    if request.mimetype != P.CONTENT_TYPE:
        raise UnsupportedMediaType(f"send tensors as {P.CONTENT_TYPE} (safetensors), "
                                   f"not {request.mimetype or 'no content type'}")
    return request.get_data(cache=False)


def create_app(config: Optional[ServerConfig] = None,
               runtime: Optional[SegmentRuntime] = None) -> Flask:
    """Build the app around a runtime (given, or built from ``config``)."""
    rt = runtime or SegmentRuntime(config)
    cfg = rt.cfg
    app = Flask("splitlearn.server")
    app.config["MAX_CONTENT_LENGTH"] = cfg.max_body_bytes  # 413 from Content-Length, unread
    app.extensions["splitlearn"] = rt
    tokens = [t.encode() for t in cfg.tokens]
    d, npos, vocab = rt.config.n_embd, rt.config.n_positions, rt.config.vocab_size

    @app.errorhandler(SplitLearnError)
    def _splitlearn_error(err: SplitLearnError):
        return _error_response(err)

    @app.errorhandler(HTTPException)
    def _http_error(err: HTTPException):
        cls = _HTTP_CODES.get(err.code, BadRequest)
        e = cls(f"{err.name}: {err.description}" if err.code != 404 else
                f"no route {request.method} {request.path}")
        e.status = err.code or 400
        return _error_response(e)

    @app.errorhandler(Exception)
    def _internal(err: Exception):
        log.exception("internal error on %s %s", request.method, request.path)
        return _error_response(SplitLearnError(f"internal server error: {type(err).__name__}: {err}"))

    @app.before_request
    def _authenticate():
        if request.path == P.HEALTH:
            return None
        header = request.headers.get("Authorization", "")
        given = header[7:].encode() if header.startswith("Bearer ") else b""
        if not given or not any(hmac.compare_digest(given, t) for t in tokens):
            raise Unauthorized("missing or wrong bearer token (Authorization: Bearer <token>)")
        g.owner = owner_of(given.decode())
        return None

    @app.get(P.HEALTH)
    def health():
        return jsonify(status="ok", protocol_version=P.PROTOCOL_VERSION)

    @app.post(P.ECHO)
    def echo():  # transport diagnostics: the body back as is, no tensor work (see diagnose)
        started = time.perf_counter()
        return _binary(request.get_data(cache=False), started)

    @app.get(P.INFO)
    def info():
        return jsonify(rt.info())

    @app.get(P.CLIENT_STATE.replace("{client_id}", "<client_id>"))
    def client_state(client_id: str):
        if not P.valid_client_id(client_id):
            raise BadRequest("client ids are 1-64 characters of [A-Za-z0-9_.-]")
        return jsonify(client_id=client_id, step=rt.client_step(client_id))

    def _hidden_and_mask(t: dict, name: str = P.HIDDEN):
        h = validate.hidden(t, name, d, cfg.max_batch, npos)
        B, T, _ = h.shape
        return h, validate.attention_mask(t, P.MASK, B, T, npos)

    def _computed(work) -> Response:
        """Read the body here, then decode, validate and run ``work(body)`` on the compute thread."""
        started, body = time.perf_counter(), _body()
        return _binary(rt.compute.run(work, body), started)

    @app.post(P.TRAIN_STEP)
    def train_step():
        def work(body: bytes) -> bytes:
            t, meta = decode(body)
            m = P.StepMeta.from_meta(meta)
            h, mask = _hidden_and_mask(t)
            y = validate.labels(t, P.LABELS, h.shape[0], h.shape[1], vocab)
            return rt.train_step(m, h, y, mask)

        return _computed(work)

    @app.post(P.TRAIN_FORWARD)
    def train_forward():
        def work(body: bytes) -> bytes:
            t, meta = decode(body)
            m = P.StepMeta.from_meta(meta)
            h, mask = _hidden_and_mask(t)
            return rt.train_forward(m, h, mask)

        return _computed(work)

    @app.post(P.TRAIN_BACKWARD)
    def train_backward():
        def work(body: bytes) -> bytes:
            t, meta = decode(body)
            m = P.StepMeta.from_meta(meta)
            grad = validate.hidden(t, P.GRAD, d, cfg.max_batch, npos)
            return rt.train_backward(m, grad)

        return _computed(work)

    @app.post(P.FORWARD)
    def forward():
        def work(body: bytes) -> bytes:
            t, meta = decode(body)
            h, mask = _hidden_and_mask(t)
            y = validate.labels(t, P.LABELS, h.shape[0], h.shape[1], vocab) if P.LABELS in t else None
            wire = check_wire_dtype(meta.get("wire_dtype", "float32"))
            return rt.forward(h, mask, y, wire)

        return _computed(work)

    @app.post(P.CHECKPOINT)
    def checkpoint():
        if not cfg.checkpoint_dir:
            raise BadRequest("this server was started without --checkpoint-dir")
        return jsonify(saved=rt.checkpoint(), steps_applied=rt.steps_applied)

    @app.post(P.SESSIONS)
    def open_session():
        payload = request.get_json(silent=True) or {}
        rows = payload.get("rows", 1)
        if not isinstance(rows, int) or isinstance(rows, bool):
            raise BadRequest(f"'rows' must be an integer, got {rows!r}")
        sess = rt.open_session(g.owner, rows)
        return jsonify(session_id=sess.id, rows=sess.rows, ttl_s=cfg.session_ttl_s), 201

    @app.post(P.SESSION_STEP.replace("{session_id}", "<session_id>"))
    def session_step(session_id: str):
        started = time.perf_counter()
        sess = rt.sessions.get(g.owner, session_id)
        body = _body()

        def work():  # -> a future of the answer: decode steps wait for their batch
            t, meta = decode(body)
            m = P.SessionStepMeta.from_meta(meta)
            h = validate.hidden(t, P.HIDDEN, d, cfg.max_batch, npos, rows=sess.rows)
            total = m.position + h.shape[1]
            if total > npos:
                raise BadRequest(f"position {m.position} + {h.shape[1]} new tokens passes n_positions={npos}")
            mask = validate.attention_mask(t, P.MASK, sess.rows, h.shape[1], npos)  # new positions only
            return rt.session_step(sess, m.position, h, mask, m.wire_dtype)

        return _binary(rt.compute.run(work).result(), started)

    @app.delete(P.SESSION.replace("{session_id}", "<session_id>"))
    def close_session(session_id: str):
        rt.sessions.close(g.owner, session_id)
        return Response(status=204)

    return app
