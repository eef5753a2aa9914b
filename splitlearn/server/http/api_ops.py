"""Operations: ``/v1/health``, ``/v1/ready`` (:mod:`.probes`), ``/metrics`` (:mod:`.metrics`),
``/v1/echo``, ``/v1/info``, ``/v1/openapi.json``, the operator's ``/v1/checkpoint`` and a
client's ``/v1/clients/<id>/weights`` (where the operator allows it)."""
from __future__ import annotations

import functools
import json
import time

from flask import Blueprint, Response, g, jsonify, request

from ...api import protocol as P
from ...errors import BadRequest, Forbidden, PayloadTooLarge
from ..engine.memory import scope as memory_scope
from ..tenants import SEP
from . import probes
from .metrics import operator_exposition
from .routing import bytes_response, client_key, request_body, served

bp = Blueprint("operations", __name__)


bp.get(P.HEALTH)(probes.health)


@bp.get(P.READY)
def ready():
    return probes.ready_answer(*probes.readiness(served().rt))


@bp.get(P.METRICS)
def metrics_text():
    return operator_exposition(served().metrics, "the metrics are the operator's: use the operator's token, or "
                               "scrape --metrics-port on the server's loopback (docs/OPERATIONS.md)")


def check_echo(cfg, size: int) -> None:
    """413 for an echo body over ``max_echo_bytes`` (the app's and the unix door's echo)."""
    if size > cfg.max_echo_bytes:
        raise PayloadTooLarge(f"{P.ECHO} takes bodies up to {cfg.max_echo_bytes} bytes (max_echo_bytes), got {size}")


@bp.post(P.ECHO)
def echo():
    """The body back, untouched, with no tensor work (``client diagnose`` times the link);
    at most ``max_echo_bytes`` (what an echo nobody reads can hold, :mod:`.frontdoor`)."""
    check_echo(served().cfg, request.content_length or 0)
    started, body = time.perf_counter(), request_body()
    check_echo(served().cfg, len(body))
    resp = bytes_response(body)
    resp.headers[P.SERVER_TIME_HEADER] = f"{(time.perf_counter() - started) * 1e3:.3f}"
    return resp


@bp.get(P.INFO)
def info():
    s = served()
    cfg, memory = s.cfg, s.memory
    you = {"tenant": g.tenant.name, "operator": g.tenant.operator, "tenants": len(cfg.tenants),
           "weight_export": cfg.weight_export(g.tenant.operator)}  # GET /v1/clients/<id>/weights allowed
    extra = {"memory": memory.to_dict(g.tenant.name)} if memory is not None else {}
    body = {**s.rt.info(), "lora": cfg.lora.to_dict() if cfg.lora is not None else None, "you": you, **extra}
    return jsonify(body if g.tenant.operator else own_view(body, s.rt, g.tenant.name))


# what a tenant's /v1/info leaves out: counters and timings of the whole server (every tenant's)
SERVER_WIDE = {"priority": ("waits", "preemptions", "held_back"), "generation": ("decode_steps", "decode_forwards"),
               "memory": ("reserved_bytes", "evictions", "refusals"), "offload": ("served",)}


def own_view(body: dict, rt, tenant: str) -> dict:
    """``/v1/info``'s ``body`` as tenant ``tenant`` may see it (docs/SECURITY.md, 'Tenants see their
    own'): ``steps_applied`` and ``generation.sessions`` its own, its memory its own reservation
    and the limits; the server-wide counters and waits (what ``/metrics`` refuses it) left out."""
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in body.items() if k != "waits"}
    for section, keys in SERVER_WIDE.items():
        for k in keys if isinstance(out.get(section), dict) else ():
            out[section].pop(k, None)
    graphs = (out.get("generation") or {}).get("decode_graphs")
    if isinstance(graphs, dict):
        out["generation"]["decode_graphs"] = {"max_batch_sizes": graphs.get("max_batch_sizes")}
    if "steps_applied" in out:
        out["steps_applied"] = tenant_steps(rt.ledger, tenant)
    if isinstance(out.get("generation"), dict) and getattr(rt, "sessions", None) is not None:
        out["generation"]["sessions"] = rt.sessions.usage().get(tenant, (0, 0))[0]
    return out


def tenant_steps(ledger, tenant: str) -> int:
    """Steps applied for ``tenant``'s client ids (each id's last step: its steps are numbered 1, 2, ...)."""
    prefix = tenant + SEP
    for _ in range(10):
        try:  # read beside the compute thread, which may add a client meanwhile: then read again
            return sum(r.step for c, r in list(ledger.clients.items()) if c.startswith(prefix))
        except RuntimeError:
            continue
    return 0


@bp.get(P.OPENAPI)
def openapi_document():
    """This server's routes as OpenAPI 3.1, built from the protocol module (splitlearn/api/openapi.py).
    Without a token: the protocol's document, the same for every server of this kind (none of
    this server's cuts, sizes or limits), made once (docs/SECURITY.md, 'Outsiders')."""
    from ...api.openapi import document
    s = served()
    kind = "offload" if s.cfg.offload else "segment"
    if g.get("tenant") is None:
        return Response(public_document(kind), mimetype="application/json")
    return jsonify(document(s.rt.info(), kind))


@functools.lru_cache(maxsize=None)
def public_document(kind: str) -> bytes:
    """The tokenless ``/v1/openapi.json`` of a server of ``kind``: the protocol's routes only."""
    from ...api.openapi import document

    return json.dumps(document({}, kind)).encode()


# a segment server's only (the offload server serves the routes above and its own)
checkpoints = Blueprint("checkpoints", __name__)


@checkpoints.post(P.CHECKPOINT)
def checkpoint():
    if not g.tenant.operator:
        raise Forbidden("a checkpoint on request is an operator action: use the operator's token "
                        "(the server checkpoints by itself every --checkpoint-every steps)")
    rt = served().rt
    if not rt.cfg.checkpoint_dir:
        raise BadRequest("this server was started without --checkpoint-dir")
    return jsonify(saved=rt.compute.run(rt.checkpoint), steps_applied=rt.steps_applied)


@checkpoints.get(P.CLIENT_WEIGHTS.replace("{client_id}", "<client_id>"))
def client_weights(client_id: str):
    """The segment's weights as they are now (Hugging Face names, the compute dtype) and, on a LoRA
    server, this client's own adapter (peft names; another tenant's id reaches only its own key):
    what ``merge_and_unload`` builds the whole model from. In SplitFed, a member of the open round
    gets its own copy (what it trained since the round opened), anyone else the base. 403 unless
    ``--allow-weight-export`` allows it (default: a server with one tenant, and the operator's
    token). The answer is priced like any route's (its host copy and its encoded bytes): 413 past
    the per-request limit, 503 past the memory account's total, before a tensor is copied."""
    s = served()
    if not s.cfg.weight_export(g.tenant.operator):
        raise Forbidden("this server does not export its weights to its tenants: the operator allows it with "
                        "--allow-weight-export (the default only for a server with one tenant)")
    key = client_key(client_id)
    rt = s.rt
    g_operator, g_tenant = g.tenant.operator, g.tenant.name  # read here: ``read`` runs on the compute thread

    def read(held) -> bytes:
        from ...api.wire import encode

        with held.on_this_thread():
            state = segment_of(rt, key).hf_state_dict()
            adapter = rt.adapters.adapter_for(key, rt.cfg.federation) \
                if rt.adapters is not None and rt.ledger.known(key) else None
            extra = adapter.tensors() if adapter is not None else {}
            size = sum(t.numel() * t.element_size() for t in (*state.values(), *extra.values()))
            rt.budget.check(f"the segment's weights ({size / 2**20:.1f} MiB)", 2 * size)  # copy + encoded
            tensors = {k: v.detach().cpu().contiguous().clone() for k, v in state.items()}
            # a tenant sees its own steps (docs/SECURITY.md, 'Tenants see their own'); the operator all
            steps = rt.steps_applied if g_operator else tenant_steps(rt.ledger, g_tenant)
            meta = {"steps_applied": str(steps)}
            if adapter is not None:
                tensors.update(extra)
                meta["lora"] = json.dumps(rt.adapters.spec.to_dict())
            return encode(tensors, meta)

    with memory_scope(s.memory, g_tenant) as held:  # released once the answer is built
        body = rt.compute.run(lambda: read(held))
    return Response(body, status=200, mimetype=P.CONTENT_TYPE)


def segment_of(rt, key: str):
    """The segment ``key`` trains: in SplitFed, its copy while it is a member of the open round
    (synced or not, until the round closes); else the server's (base) segment."""
    fed = getattr(rt, "federation", None)
    if fed is not None and fed.mode == "splitfed":
        with fed.lock:
            member = fed.round.members.get(key)
        if member is not None:
            return member.segment
    return rt.segment
