"""Generation: ``/v1/sessions`` (open), ``/v1/sessions/<id>`` (close) and their steps (prefill,
decode: batched across sessions, :mod:`splitlearn.server.engine.batching`)."""
from __future__ import annotations

from concurrent.futures import Future
from typing import Optional

from flask import Blueprint, Response, g, jsonify, request

from ...api import protocol as P
from ...errors import BadRequest
from ..engine.priority import timed
from ..engine.sessions import step_budget, step_ops
from ..tenants import Tenant
from . import validate
from .routing import Served, served, tensor_route
from .validate import json_object

bp = Blueprint("sessions", __name__)


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


@bp.post(P.SESSIONS)
def open_session():
    rt, cfg, (_, npos, _) = (s := served()).rt, s.cfg, s.dims
    body = request.get_data(cache=False)
    rows, client_id = session_rows(body, cfg.max_batch), session_client_id(body)
    rt.budget.session(rows, min(rows * npos, cfg.max_tokens_per_client))  # the KV cache it may grow to
    sess = rt.open_session(g.owner, rows, g.tenant.name)
    sess.client_id = None if client_id is None else g.tenant.key(client_id)  # LoRA: its adapter
    return jsonify(session_id=sess.id, rows=sess.rows, ttl_s=cfg.session_ttl_s), 201


@bp.delete(P.SESSION.replace("{session_id}", "<session_id>"))
def close_session(session_id: str):
    served().rt.close_session(g.owner, session_id)
    return Response(status=204)


@tensor_route(bp, P.SESSION_STEP.replace("{session_id}", "<session_id>"), owner=True, inline=True, cls="prefill")
def session_step(s: Served, t: dict, meta: dict, session_id: str, owner: Tenant) -> Future:
    rt, cfg, (d, npos, _) = s.rt, s.cfg, s.dims
    sess = rt.sessions.get(owner.digest, session_id)
    m = P.SessionStepMeta.from_meta(meta)
    ops = step_ops(t, m, sess, cfg.max_batch)  # reorder rows / crop first (sessions.py); 400 if bad
    rows = sess.rows if ops.index is None else int(ops.index.numel())
    checks = validate.Checks()  # the values' checks and the mask: one read (validate.py)
    h = validate.hidden(t, P.HIDDEN, d, cfg.max_batch, npos, rows=rows, checks=checks)
    if m.position + h.shape[1] > npos:
        checks.refuse(f"position {m.position} + {h.shape[1]} new tokens passes the model's {npos} positions "
                      f"(max_position_embeddings)")
    positions = validate.position_ids(t, P.POSITIONS, rows, h.shape[1], npos, checks=checks)  # optional
    mask = checks.verify(validate.attention_mask(t, P.MASK, rows, h.shape[1], npos, checks=checks))  # new positions only
    step_budget(rt.budget, rows, m.position, h.shape[1], mask, m.logits, rt.segment.has_head,
                grows=rows > sess.rows, max_tokens=min(rows * npos, cfg.max_tokens_per_client))
    args = (sess, m.position, h, mask, m.wire_dtype, ops, m.step, m.logits, positions)
    if h.shape[1] == 1:  # a decode step: queued for the batcher, from whichever thread
        return rt.session_step(*args)
    return rt.compute.run(timed(rt.waits, "prefill", rt.session_step), *args)
