"""Training: the split steps (``/v1/train/step``, ``forward``, ``backward``, ``apply``), the
evaluation ``/v1/forward`` and a client's ``/v1/clients/<id>/state``."""
from __future__ import annotations

from flask import Blueprint, jsonify, request

from ...api import protocol as P
from ...model.lora import lora_scope
from ...api.wire import check_wire_dtype
from ..engine.ledger import Answer
from ..engine.priority import timed
from ..engine.training import apply_json
from ..tenants import Tenant
from . import validate
from .routing import Served, client_key, hidden_and_mask, scoped, served, tensor_route
from .validate import json_object

bp = Blueprint("training", __name__)


def _piece(s: Served, t: dict, labels: bool):
    """A piece's hidden, mask (any 0/1 padding: a Trainer's collator pads on the right), if
    ``labels`` its labels, and its optional ``position_ids`` (the first segment's: packed
    sequences, positions of the client's own, a padded batch's ``arange``; absent: derived from
    the mask); their values checked and the mask brought to host memory in one read
    (:class:`.validate.Checks`: a GPU server waits for its device once)."""
    checks = validate.Checks()
    h = validate.hidden(t, P.HIDDEN, s.dims[0], s.cfg.max_batch, s.dims[1], checks=checks)
    mask = validate.attention_mask(t, P.MASK, h.shape[0], h.shape[1], s.dims[1], left_padded=False,
                                   checks=checks)
    y = validate.labels(t, P.LABELS, h.shape[0], h.shape[1], s.dims[2], checks=checks) if labels else None
    pos = validate.position_ids(t, P.POSITIONS, h.shape[0], h.shape[1], s.dims[1], checks=checks)
    return h, checks.verify(mask), y, pos


@tensor_route(bp, P.TRAIN_STEP, owner=True, cls="training")
def train_step(s: Served, t: dict, meta: dict, owner: Tenant) -> Answer:
    rt = s.rt
    m = scoped(P.StepMeta.from_meta(meta), owner)
    h, mask, y, pos = _piece(s, t, labels=True)  # a fused piece: loss_scale = its loss's gradient
    rt.budget.train(h.shape[0], h.shape[1], mask)  # 413 before allocating
    return rt.train_step(m, h, y, mask, pos)


@tensor_route(bp, P.TRAIN_FORWARD, owner=True, cls="training")
def train_forward(s: Served, t: dict, meta: dict, owner: Tenant) -> Answer:
    rt = s.rt
    m = scoped(P.StepMeta.from_meta(meta), owner)
    h, mask, y, pos = _piece(s, t, labels=P.LABELS in t)  # labels: 2-way, the server computes the loss
    rt.budget.train_forward(h.shape[0], h.shape[1], mask, loss=y is not None)  # its graph waits for the backward
    return rt.train_forward(m, h, mask, y, pos)


@tensor_route(bp, P.TRAIN_BACKWARD, owner=True, cls="training")
def train_backward(s: Served, t: dict, meta: dict, owner: Tenant) -> Answer:
    rt, (d, npos, _) = s.rt, s.dims
    m = scoped(P.StepMeta.from_meta(meta), owner)
    if not rt.u_shape:  # 2-way: the scalar gradient of the piece's loss
        grad = validate.scalar(t, P.GRAD)
    else:
        grad = validate.hidden(t, P.GRAD, d, s.cfg.max_batch, npos)
    return rt.train_backward(m, grad)


@bp.post(P.TRAIN_APPLY)
def train_apply():
    """JSON in, JSON out: the optimizer step of an open-ended step (``P.ApplyRequest``)."""
    rt = served().rt
    req = P.ApplyRequest.from_json(json_object(request.get_data(cache=False),
                                               '{"client_id", "step", "pieces", "lr", "clip", "discard"}'))
    key = client_key(req.client_id)
    answer = rt.compute.run(timed(rt.waits, "training", rt.train_apply), key, req)
    return jsonify({**apply_json(answer), "client_id": req.client_id, "step": req.step})


@tensor_route(bp, P.FORWARD, owner=True)
def forward(s: Served, t: dict, meta: dict, owner: Tenant) -> Answer:
    rt, cfg, vocab = s.rt, s.cfg, s.dims[2]
    if meta.get("padding") == "any":  # no cache here: padding on either side (splitlearn.hf)
        h, mask, y, pos = _piece(s, t, labels=P.LABELS in t)
    else:
        h, mask = hidden_and_mask(s, t)
        y = validate.labels(t, P.LABELS, h.shape[0], h.shape[1], vocab) if P.LABELS in t else None
        pos = validate.position_ids(t, P.POSITIONS, h.shape[0], h.shape[1], s.dims[1])
    rt.budget.forward(h.shape[0], h.shape[1], mask, labels=y is not None)
    adapter = None
    if rt.adapters is not None and "client_id" in meta:  # LoRA: evaluate with its adapter
        key = scoped(P.StepMeta.from_meta({**meta, "step": "1", "micros": "0"}), owner).client_id
        adapter = rt.adapters.adapter_for(key, cfg.federation)
    all_logits = meta.get("logits") == "all"  # a top: every position's logits (B, T, V)
    if all_logits and not rt.u_shape:
        rt.budget.check(f"the logits of {h.shape[0]} x {h.shape[1]} positions",
                        3 * h.shape[0] * h.shape[1] * vocab * 4)
    with lora_scope(rt.segment, adapter):
        return rt.forward(h, mask, y, check_wire_dtype(meta.get("wire_dtype", "float32")), all_logits, pos)


@bp.get(P.CLIENT_STATE.replace("{client_id}", "<client_id>"))
def client_state(client_id: str):
    rt = served().rt
    key = client_key(client_id)  # another tenant's id reads as one never used
    return jsonify(client_id=client_id, step=rt.client_step(key), durable=rt.ledger.durable_step(key))
