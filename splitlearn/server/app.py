"""The Flask app: ``create_app(config)`` -> a WSGI app serving one segment.

Every route that carries tensors has the same shape, written once in :func:`tensor_route`::

    WSGI thread:     read the body (415 unless application/octet-stream)
    compute thread:  decode (safetensors, never pickle) -> validate (:mod:`.validate`)
                     -> the runtime's method -> an Answer, or a future of one (decode steps)
    WSGI thread:     wait for the future, encode the Answer, add X-Server-Time-Ms

so requests are decoded and answers encoded at this one layer, and this layer is the only one
that hands work to the runtime's compute thread (``rt.compute.run``; every tensor operation
on the model runs there: see :mod:`.compute`); the runtime's methods assume they run on it.
One exception, for the decode step's latency: a generation step's body of at most
``INLINE_BODY_BYTES`` is decoded and validated on the WSGI thread (a tensor that small never
starts OpenMP threads), and a decode step goes straight to the batcher's queue, which is safe
from any thread; that saves a hand-off to the compute thread and back (about 0.3 ms a step,
see benchmarks/README.md). Every failure is a :class:`SplitLearnError` turned into ``{"error": CODE,
"message": TEXT}`` with its HTTP status by one handler, so a bad request changes nothing and
the server keeps serving. Around every request, :mod:`.accesslog`'s first and last hooks time it,
count it in the app's own Prometheus registry (:mod:`.metrics`, ``GET /metrics``) and log its
access line; ``GET /v1/ready`` is :mod:`.probes`.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import secrets
import time
from concurrent.futures import Future
from typing import Callable, Optional

from flask import Flask, Response, g, jsonify, request
from werkzeug.exceptions import HTTPException

from .. import protocol as P
from ..errors import (BadRequest, Forbidden, NotFound, PayloadTooLarge, SplitLearnError, Unauthorized,
                      UnsupportedMediaType)
from ..lora import lora_scope
from ..wire import check_wire_dtype, decode
from . import accesslog, validate
from .validate import json_object
from .config import ServerConfig
from .frontdoor import TENANT_KEY
from .ledger import Answer
from .memory import MemoryAccount, scope as memory_scope
from .metrics import ServerMetrics
from .probes import readiness
from .runtime import SegmentRuntime
from .sessions import step_budget, step_ops
from .priority import timed
from .tenants import Tenant

log = logging.getLogger(__name__)

_HTTP_CODES = {404: NotFound, 413: PayloadTooLarge, 415: UnsupportedMediaType}
# Generation-step bodies up to this size are decoded on the WSGI thread: under 16 Ki float32
# values, below torch's grain size (32768) for running an operator on several threads.
INLINE_BODY_BYTES = 64 << 10


def error_response(err: SplitLearnError) -> Response:
    resp = jsonify(err.to_payload())
    resp.status_code = err.status
    if err.retry_after is not None:
        resp.headers["Retry-After"] = str(int(round(err.retry_after)))
    return resp


def _body() -> bytes:
    """The request's safetensors bytes; 415 for another content type."""
    if request.mimetype != P.CONTENT_TYPE:
        raise UnsupportedMediaType(f"send tensors as {P.CONTENT_TYPE} (safetensors), "
                                   f"not {request.mimetype or 'no content type'}")
    return request.get_data(cache=False)


def session_rows(body: bytes, max_batch: int) -> int:
    """``rows`` of a ``POST /v1/sessions`` body: JSON ``{"rows": N}``; an empty body means 1."""
    if not body.strip():
        return 1
    payload = json_object(body, '{"rows": <int>, "client_id": <str, LoRA>} (or empty for one row)')
    if set(payload) - {"rows", "client_id"}:
        raise BadRequest(f'the body must be a JSON object {{"rows": <int>}}, got {str(payload)[:80]}')
    rows = payload.get("rows", 1)
    if not isinstance(rows, int) or isinstance(rows, bool):
        raise BadRequest(f"'rows' must be an integer, got {rows!r}")
    if not 1 <= rows <= max_batch:
        raise BadRequest(f"rows must be in 1..{max_batch}, got {rows}")
    return rows


def session_client_id(body: bytes) -> Optional[str]:
    """``client_id`` of a ``POST /v1/sessions`` body (LoRA: whose adapter); None if absent."""
    payload = json_object(body, '{"rows": <int>, "client_id": <str>}') if body.strip() else {}
    cid = payload.get("client_id")
    if cid is not None and not (isinstance(cid, str) and P.valid_client_id(cid)):
        raise BadRequest("'client_id' must be 1-64 characters of [A-Za-z0-9_.-]")
    return cid


def create_app(config: Optional[ServerConfig] = None,
               runtime: Optional[SegmentRuntime] = None) -> Flask:
    """Build the app around a runtime (given, or built from ``config``)."""
    if runtime is None and config is not None and config.offload:  # issue 22: masked offload
        from .offload import OffloadRuntime
        runtime = OffloadRuntime(config)
    rt = runtime or SegmentRuntime(config)
    cfg = rt.cfg
    app = Flask("splitlearn.server", static_folder=None)  # no /static/<path> route: every route is in openapi.py
    app.config["MAX_CONTENT_LENGTH"] = cfg.max_body_bytes  # 413 from Content-Length, unread
    app.extensions["splitlearn"] = rt
    tenants = cfg.tenants
    memory = getattr(rt, "memory", None)  # what the server holds per tenant (memory.py); none: offload
    memory = memory if isinstance(memory, MemoryAccount) else None  # an offload runtime's is its request limit
    d, npos, vocab = rt.config.n_embd, rt.config.n_positions, rt.config.vocab_size

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
        return error_response(SplitLearnError(f"internal server error (incident {incident}: the "
                                              f"operator's log has the details)"))

    metrics = ServerMetrics(rt, memory)  # this app's own registry (GET /metrics, --metrics-port)
    app.extensions["splitlearn.metrics"] = metrics
    if cfg.request_log:  # first of the hooks: the clock and the request id (accesslog.py)
        app.before_request(lambda: accesslog.begin(request, g))
        app.after_request(lambda resp: accesslog.finish(request, g, resp, metrics))

    @app.before_request
    def _authenticate():
        if request.path in (P.HEALTH, P.READY):
            return None
        # the front door (frontdoor.py) found the tenant at the headers; under another server, here
        tenant = request.environ.get(TENANT_KEY) or tenants.authenticate(request.headers.get("Authorization"))
        if tenant is None:
            raise Unauthorized("missing or wrong bearer token (Authorization: Bearer <token>)")
        g.tenant, g.owner = tenant, tenant.digest
        return None

    def scoped(m, tenant: Tenant):
        """The request's metadata with its client id scoped to the caller's tenant: every
        server state is keyed by ``<tenant>:<client_id>`` (:mod:`.tenants`)."""
        return dataclasses.replace(m, client_id=tenant.key(m.client_id))

    def tensor_route(rule: str, *, owner: bool = False, inline: bool = False, cls: str = "other") -> Callable:
        """Register ``handler(tensors, meta, **url_args) -> Answer | Future[Answer]`` as a POST
        route taking and answering safetensors (see the module docstring). ``owner=True``
        also passes ``owner``, the caller's :class:`~.tenants.Tenant` (Flask's ``g`` does not
        reach the compute thread). ``inline=True``: bodies up to ``INLINE_BODY_BYTES`` are decoded
        and the handler called on the WSGI thread; the handler hands its model work to the
        compute thread itself."""

        def register(handler: Callable) -> Callable:
            @functools.wraps(handler)
            def view(**url_args) -> Response:
                with memory_scope(memory, g.tenant.name) as held:  # released once the answer is built
                    return serve(held, **url_args)

            def serve(held, **url_args) -> Response:
                started = time.perf_counter()
                held.hold(2 * (request.content_length or 0), "a request body")  # server's copy + ours
                body = _body()
                if owner:
                    url_args["owner"] = g.tenant

                def work():  # on the compute thread; the route's price is reserved for `held` (budget.py)
                    with held.on_this_thread():
                        tensors, meta = decode(body)
                        return handler(tensors, meta, **url_args)

                if inline and len(body) <= INLINE_BODY_BYTES:
                    answer = work()
                else:  # `cls`: the priority class whose wait for the compute thread is counted
                    answer = rt.compute.run(timed(rt.waits, cls, work))
                if isinstance(answer, Future):  # a decode step waits for its batch
                    answer = answer.result()
                resp = Response(answer.encode(), status=200, mimetype=P.CONTENT_TYPE)
                resp.headers[P.SERVER_TIME_HEADER] = f"{(time.perf_counter() - started) * 1e3:.3f}"
                return resp

            app.add_url_rule(rule, endpoint=handler.__name__, view_func=view, methods=["POST"])
            return handler

        return register

    def hidden_and_mask(t: dict, name: str = P.HIDDEN):
        h = validate.hidden(t, name, d, cfg.max_batch, npos)
        B, T, _ = h.shape
        return h, validate.attention_mask(t, P.MASK, B, T, npos)

    @app.get(P.HEALTH)
    def health():
        return jsonify(status="ok", protocol_version=P.PROTOCOL_VERSION)

    @app.get(P.READY)
    def ready():
        ok, checks = readiness(rt)
        return jsonify(ready=ok, checks=checks), 200 if ok else 503

    @app.get(P.METRICS)
    def metrics_text():
        if not g.tenant.operator:
            raise Forbidden("the metrics are the operator's: use the operator's token, or scrape "
                            "--metrics-port on the server's loopback (docs/OPERATIONS.md)")
        body, content_type = metrics.exposition(request.headers.get("Accept"))
        return Response(body, status=200, headers={"Content-Type": content_type})

    @app.post(P.ECHO)
    def echo():
        """The body back, untouched, with no tensor work (``client diagnose`` times the link);
        at most ``max_echo_bytes`` (what an echo nobody reads can hold, :mod:`.frontdoor`)."""
        cap = cfg.max_echo_bytes
        if (request.content_length or 0) > cap:
            raise PayloadTooLarge(f"{P.ECHO} takes bodies up to {cap} bytes (max_echo_bytes), got {request.content_length}")
        started, body = time.perf_counter(), request.get_data(cache=False)
        if len(body) > cap:
            raise PayloadTooLarge(f"{P.ECHO} takes bodies up to {cap} bytes (max_echo_bytes), got {len(body)}")
        resp = Response(body, status=200, mimetype=P.CONTENT_TYPE)
        resp.headers[P.SERVER_TIME_HEADER] = f"{(time.perf_counter() - started) * 1e3:.3f}"
        return resp

    @app.get(P.INFO)
    def info():
        you = {"tenant": g.tenant.name, "operator": g.tenant.operator, "tenants": len(tenants)}
        extra = {"memory": memory.to_dict(g.tenant.name)} if memory is not None else {}
        return jsonify({**rt.info(), "lora": cfg.lora.to_dict() if cfg.lora is not None else None,
                        "you": you, **extra})

    @app.get(P.OPENAPI)
    def openapi_document():
        """This server's routes as OpenAPI 3.1, built from the protocol module (splitlearn/openapi.py)."""
        from ..openapi import document
        return jsonify(document(rt.info(), "offload" if cfg.offload else "segment"))

    if cfg.offload:  # an offload server multiplies masked inputs and serves nothing else
        from .offload import register_routes
        register_routes(tensor_route, rt)
        return app

    def client_key(client_id: str) -> str:
        if not P.valid_client_id(client_id):
            raise BadRequest("client ids are 1-64 characters of [A-Za-z0-9_.-]")
        key = g.tenant.key(client_id)
        rt.claim(key)  # replicas: the newest state of a client that arrives from another one
        return key

    @app.get(P.CLIENT_ADAPTER.replace("{client_id}", "<client_id>"))
    def client_adapter(client_id: str):
        if rt.adapters is None:
            raise NotFound("this server has no LoRA adapters (started without --lora-r)")
        key = client_key(client_id)
        body = rt.compute.run(rt.adapters.adapter_bytes, key, cfg.federation, rt.ledger.known(key))
        return Response(body, status=200, mimetype=P.CONTENT_TYPE)

    @app.get(P.CLIENT_STATE.replace("{client_id}", "<client_id>"))
    def client_state(client_id: str):
        key = client_key(client_id)  # another tenant's id reads as one never used
        return jsonify(client_id=client_id, step=rt.client_step(key),
                       durable=rt.ledger.durable_step(key))

    @tensor_route(P.TRAIN_STEP, owner=True, cls="training")
    def train_step(t: dict, meta: dict, owner: Tenant) -> Answer:
        m = scoped(P.StepMeta.from_meta(meta), owner)
        h, mask = hidden_and_mask(t)
        y = validate.labels(t, P.LABELS, h.shape[0], h.shape[1], vocab)
        rt.budget.train(h.shape[0], h.shape[1], mask)  # 413 before allocating
        return rt.train_step(m, h, y, mask)

    @tensor_route(P.TRAIN_FORWARD, owner=True, cls="training")
    def train_forward(t: dict, meta: dict, owner: Tenant) -> Answer:
        m = scoped(P.StepMeta.from_meta(meta), owner)
        if m.open_ended:  # any 0/1 padding (a Trainer's collator pads on the right)
            h = validate.hidden(t, P.HIDDEN, d, cfg.max_batch, npos)
            mask = validate.attention_mask(t, P.MASK, h.shape[0], h.shape[1], npos, left_padded=False)
        else:
            h, mask = hidden_and_mask(t)
        y = None
        if P.LABELS in t:  # 2-way open-ended pieces: the server computes the loss
            if not m.open_ended:
                raise BadRequest(f"labels go to {P.TRAIN_FORWARD} only in open-ended pieces (micros=0)")
            y = validate.labels(t, P.LABELS, h.shape[0], h.shape[1], vocab)
        # its graph waits for the backward, with its step's other micro-batches' (GPipe)
        rt.budget.train(h.shape[0], h.shape[1], mask, graphs=max(m.micros, 1))
        return rt.train_forward(m, h, mask, y)

    @tensor_route(P.TRAIN_BACKWARD, owner=True, cls="training")
    def train_backward(t: dict, meta: dict, owner: Tenant) -> Answer:
        m = scoped(P.StepMeta.from_meta(meta), owner)
        if not rt.u_shape and m.open_ended:  # 2-way: the scalar gradient of the piece's loss
            grad = validate.scalar(t, P.GRAD)
        else:
            grad = validate.hidden(t, P.GRAD, d, cfg.max_batch, npos)
        return rt.train_backward(m, grad)

    @app.post(P.TRAIN_APPLY)
    def train_apply():
        """JSON in, JSON out: the optimizer step of an open-ended step (``P.ApplyRequest``)."""
        req = P.ApplyRequest.from_json(json_object(request.get_data(cache=False),
                                                   '{"client_id", "step", "pieces", "lr", "clip", "discard"}'))
        key = client_key(req.client_id)
        answer = rt.compute.run(timed(rt.waits, "training", rt.train_apply), key, req)
        out = {"client_id": req.client_id, "step": req.step}
        for k, v in answer.meta.items():
            if k in ("pieces", "durable"):
                out[k] = int(v)
            elif k in ("lr", "grad_norm"):
                out[k] = float(v)
            elif k in ("applied", "discarded"):
                out[k] = v == "1"
        return jsonify(out)

    @tensor_route(P.FORWARD, owner=True)
    def forward(t: dict, meta: dict, owner: Tenant) -> Answer:
        if meta.get("padding") == "any":  # no cache here: padding on either side (splitlearn.hf)
            h = validate.hidden(t, P.HIDDEN, d, cfg.max_batch, npos)
            mask = validate.attention_mask(t, P.MASK, h.shape[0], h.shape[1], npos, left_padded=False)
        else:
            h, mask = hidden_and_mask(t)
        y = validate.labels(t, P.LABELS, h.shape[0], h.shape[1], vocab) if P.LABELS in t else None
        rt.budget.forward(h.shape[0], h.shape[1], mask, labels=y is not None)
        adapter = None
        if rt.adapters is not None and "client_id" in meta:  # LoRA: evaluate with its adapter
            key = scoped(P.StepMeta.from_meta({**meta, "step": "1"}), owner).client_id
            adapter = rt.adapters.adapter_for(key, cfg.federation)
        all_logits = meta.get("logits") == "all"  # a top: every position's logits (B, T, V)
        if all_logits and not rt.u_shape:
            rt.budget.check(f"the logits of {h.shape[0]} x {h.shape[1]} positions",
                            3 * h.shape[0] * h.shape[1] * vocab * 4)
        with lora_scope(rt.segment, adapter):
            return rt.forward(h, mask, y, check_wire_dtype(meta.get("wire_dtype", "float32")), all_logits)

    @tensor_route(P.SESSION_STEP.replace("{session_id}", "<session_id>"), owner=True, inline=True, cls="prefill")
    def session_step(t: dict, meta: dict, session_id: str, owner: Tenant) -> Future:
        sess = rt.sessions.get(owner.digest, session_id)
        m = P.SessionStepMeta.from_meta(meta)
        ops = step_ops(t, m, sess, cfg.max_batch)  # reorder rows / crop first (sessions.py); 400 if bad
        rows = sess.rows if ops.index is None else int(ops.index.numel())
        h = validate.hidden(t, P.HIDDEN, d, cfg.max_batch, npos, rows=rows)
        if m.position + h.shape[1] > npos:
            raise BadRequest(f"position {m.position} + {h.shape[1]} new tokens passes n_positions={npos}")
        mask = validate.attention_mask(t, P.MASK, rows, h.shape[1], npos)  # new positions only
        step_budget(rt.budget, rows, m.position, h.shape[1], mask, m.logits, rt.segment.has_head,
                    grows=rows > sess.rows, max_tokens=min(rows * npos, cfg.max_tokens_per_client))
        args = (sess, m.position, h, mask, m.wire_dtype, ops, m.step, m.logits)
        if h.shape[1] == 1:  # a decode step: queued for the batcher, from whichever thread
            return rt.session_step(*args)
        return rt.compute.run(timed(rt.waits, "prefill", rt.session_step), *args)

    @app.get(P.FEDERATION)
    def federation():
        """The federation as the caller's tenant may see it: its own client ids, others counted."""
        return jsonify(rt.compute.run(rt.federation.status, g.tenant.name))

    @app.post(P.FEDERATION_TURN)
    def take_turn():
        shape = '{"client_id": "<1-64 of [A-Za-z0-9_.-]>"}'
        payload = json_object(request.get_data(cache=False), shape)
        client_id = payload.get("client_id")
        if set(payload) != {"client_id"} or not isinstance(client_id, str) or not P.valid_client_id(client_id):
            raise BadRequest('the body must be JSON {"client_id": "<1-64 of [A-Za-z0-9_.-]>"}')
        return jsonify(rt.compute.run(rt.federation.take_turn, g.tenant.key(client_id)))

    @app.post(P.FEDERATION_SYNC)
    def sync():
        started, body, tenant = time.perf_counter(), _body(), g.tenant

        def work() -> dict:
            tensors, meta = decode(body)
            cid = meta.get("client_id", "")
            try:
                key = tenant.key(P.SyncMeta.from_meta(meta).client_id)
            except BadRequest as e:  # bad counts: a member's failure of its round (Federation.refuse)
                if P.valid_client_id(cid):
                    rt.federation.refuse(tenant.key(cid), e)
                raise
            return rt.sync(key, tensors)

        status = rt.compute.run(work)
        log.info("sync: version %s, round %s (%.0f ms)", status["version"], status["round"],
                 (time.perf_counter() - started) * 1e3)
        return jsonify(status)

    @app.get(P.FEDERATION_WEIGHTS)
    def shared_weights():
        answer = rt.compute.run(rt.shared_weights)
        return Response(answer.encode(), status=200, mimetype=P.CONTENT_TYPE)

    @app.post(P.CHECKPOINT)
    def checkpoint():
        if not g.tenant.operator:
            raise Forbidden("a checkpoint on request is an operator action: use the operator's token "
                            "(the server checkpoints by itself every --checkpoint-every steps)")
        if not cfg.checkpoint_dir:
            raise BadRequest("this server was started without --checkpoint-dir")
        return jsonify(saved=rt.compute.run(rt.checkpoint), steps_applied=rt.steps_applied)

    @app.post(P.SESSIONS)
    def open_session():
        body = request.get_data(cache=False)
        rows, client_id = session_rows(body, cfg.max_batch), session_client_id(body)
        rt.budget.session(rows, min(rows * npos, cfg.max_tokens_per_client))  # the KV cache it may grow to
        sess = rt.open_session(g.owner, rows, g.tenant.name)
        sess.client_id = None if client_id is None else g.tenant.key(client_id)  # LoRA: its adapter
        return jsonify(session_id=sess.id, rows=sess.rows, ttl_s=cfg.session_ttl_s), 201

    @app.delete(P.SESSION.replace("{session_id}", "<session_id>"))
    def close_session(session_id: str):
        rt.close_session(g.owner, session_id)
        return Response(status=204)

    return app
