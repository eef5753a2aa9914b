"""The server's API as an OpenAPI 3.1 document, built from :mod:`splitlearn.api.protocol`.

``GET /v1/openapi.json`` answers :func:`document` of the server that serves it ("segment" or
"offload"), with the limits of its ``/v1/info``. What the document holds: docs/PROTOCOL.md,
``GET /v1/openapi.json``. A route constant without an entry here, or a route the app registers
that the document lacks (or vice versa), fails tests/test_openapi.py."""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Optional

from .. import errors as E
from . import protocol as P
from .trust import config_value

OPENAPI_VERSION = "3.1.0"
BEARER = [{"bearer": []}]

# Every error class the server answers with, by status (errors.py; 5xx: only 500 and 503 come
# from a server; 502 is what a client raises for a transport failure).
_ERRORS = (E.BadRequest, E.ConfigError, E.SegmentFileError, E.Unauthorized, E.Forbidden, E.NotFound,
           E.Conflict, E.NotYourTurn, E.StaleWeights, E.RequestTimeout, E.PayloadTooLarge,
           E.UnsupportedMediaType, E.TooManyRequests, E.ServiceUnavailable, E.SplitLearnError)
_WHEN = {400: "a malformed request: body, tensor, shape, dtype, metadata or JSON field (nothing changes)",
         401: "missing or wrong bearer token", 403: "the token may not do this (an operator action)",
         404: "unknown session, adapter or weights (or another tenant's)",
         405: "a method the route does not have",
         408: "the request did not arrive within its deadline",
         409: "a step, position or turn that does not follow the server's state (nothing changes)",
         413: "body over the limit, or a request that would need more memory than the server allows",
         415: "a tensor body not sent as application/octet-stream",
         429: "a tenant's cap (sessions, cached tokens, client ids, steps in flight); see Retry-After",
         500: "a bug: the message names an incident id the operator's log has",
         503: "busy (session cap, a turn or round held by another client); see Retry-After"}
_COMMON = (401, 405, 408, 429, 500, 503)  # any route with a token: the front door and the caps


def error_codes(status: int) -> list[str]:
    return sorted({c.code for c in _ERRORS if c.status == status} or {"bad_request"})


@dataclass(frozen=True)
class Tensors:
    """A safetensors body: tensor name -> what it is; metadata: key -> what it is."""

    tensors: dict[str, str]
    metadata: dict[str, str] = field(default_factory=dict)
    summary: str = ""

    def content(self) -> dict:
        lines = [self.summary] if self.summary else []
        lines += [f"- tensor `{k}`: {v}" for k, v in self.tensors.items()]
        lines += [f"- metadata `{k}`: {v}" for k, v in self.metadata.items()]
        return {P.CONTENT_TYPE: {"schema": {"type": "string", "format": "binary",
                                            "description": "safetensors bytes (docs/PROTOCOL.md)\n" + "\n".join(lines)}}}

    def extension(self) -> dict:
        return {"tensors": dict(self.tensors), "metadata": dict(self.metadata)}


def meta_fields(cls, **notes: str) -> dict[str, str]:
    """The ``__metadata__`` keys of a message dataclass: its fields, their type and default
    (every value travels as a string)."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        kind = getattr(hints[f.name], "__name__", str(hints[f.name])).replace("typing.", "")
        default = "required" if f.default is dataclasses.MISSING else f"default {f.default!r}"
        out[f.name] = f"{kind}, {default}" + (f"; {notes[f.name]}" if f.name in notes else "")
    return out


CLIENT_ID = {"type": "string", "pattern": "^" + P._CLIENT_ID.pattern + "$",
             "description": "1-64 of [A-Za-z0-9_.-]; a client within the caller's tenant"}


def apply_schema() -> dict:
    """``POST /v1/train/apply`` from :class:`~splitlearn.api.protocol.ApplyRequest` and its limits."""
    props = {"client_id": CLIENT_ID,
             "step": {"type": "integer", "minimum": 1, "maximum": 1 << 62},
             "pieces": {"type": "integer", "minimum": 0, "maximum": P.MAX_PIECES},
             "lr": {"type": "number", "minimum": 0, "maximum": P.MAX_LR},
             "clip": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
             "discard": {"type": "boolean"},
             "run": {"type": "string", "pattern": "^" + P._RUN.pattern + "$",
                     "description": "the client process's run (metadata run): another run's step is not touched"}}
    assert tuple(props) == P.ApplyRequest.FIELDS, "ApplyRequest.FIELDS changed: describe the new fields"
    return {"type": "object", "properties": props, "required": ["client_id", "step"],
            "additionalProperties": False,
            "description": (P.ApplyRequest.__doc__ or "").strip()}


def session_schema(max_batch: int) -> dict:
    return {"type": "object", "additionalProperties": False,
            "properties": {"rows": {"type": "integer", "minimum": 1, "maximum": max_batch},
                           "client_id": CLIENT_ID},
            "description": "rows of the session (default 1); client_id: whose LoRA adapter decodes"}


def _json_object(props: Optional[dict] = None, required=(), extra: bool = True, description: str = "") -> dict:
    out = {"type": "object", "properties": props or {}, "additionalProperties": extra}
    if required:
        out["required"] = list(required)
    if description:
        out["description"] = description
    return out


@dataclass(frozen=True)
class Op:
    route: str  # the name of a protocol.py constant
    method: str
    summary: str
    kinds: tuple = ("segment",)  # the servers that register it
    body: object = None  # Tensors, a JSON Schema (dict), "any" (echo), or None
    json_optional: bool = False  # a JSON body that may be left out
    ok: int = 200
    answer: object = None  # Tensors, a JSON Schema, or None (no content)
    errors: tuple = ()
    token: bool = True
    path_params: dict = field(default_factory=dict)
    links: dict = field(default_factory=dict)  # OpenAPI links of the success answer: name -> Link object


def link(route: str, **parameters: str) -> dict:
    """An OpenAPI Link to the operation of ``route`` (its operationId: each route has one method), with
    ``parameters`` from runtime expressions (``$response.body#/session_id``): what a stateful
    fuzzer (schemathesis' state machine, benchmarks/fuzz.py) chains requests by."""
    return {"operationId": route.lower(), "parameters": dict(parameters)}


def operations(info: dict) -> list[Op]:
    """Every operation, with the limits of the server that ``info`` (its ``/v1/info``) describes."""
    limits, model_config = info.get("limits", {}), info.get("model_config", {})
    d = config_value(model_config, "hidden_size") or "d"
    max_batch = limits.get("max_batch", 64)
    npos = limits.get("max_position_embeddings") or config_value(model_config, "max_position_embeddings") or 1024
    hidden = f"activations [B, T, {d}] (B <= {max_batch}, T <= {npos}), F32/BF16/F16, or I8 with `hidden.scale`"
    mask = f"optional I64 [B, T] of 0/1, left padding (absent: no padding)"
    labels = "I64 [B, T], -100 ignored"
    step_meta = {**meta_fields(P.StepMeta, micro=f"< {P.MAX_PIECES}",
                               apply=f"JSON of the previous step's {P.TRAIN_APPLY} body (at most "
                                     f"{P.MAX_APPLY_CHARS} characters), applied first"),
                 "micros": "int, required; 0 (closed steps, micros >= 1, are gone: 400)"}
    tensor_errors = (400, 409, 413, 415)
    status = _json_object(description="the federation's status (docs/FEDERATION.md)")
    sid = {"session_id": {"type": "string", "description": "the id POST /v1/sessions answered"}}
    # a session's life, chained for a stateful fuzzer: open -> step, step, ... -> close (each link
    # reuses the id the open answered; the steps link nowhere, so the fuzzer starts from an open)
    opened = {"step": link("SESSION_STEP", session_id="$response.body#/session_id"),
              "close": link("SESSION", session_id="$response.body#/session_id")}
    cid = {"client_id": CLIENT_ID}
    return [
        Op("HEALTH", "get", "liveness (no token)", ("segment", "offload", "fed"), token=False, errors=(),
           answer=_json_object({"status": {"const": "ok"}, "protocol_version": {"type": "integer"}},
                               ["status", "protocol_version"])),
        Op("READY", "get", "readiness: model loaded, compute thread alive, checkpoint dir writable (the fed "
           "server: its schema and secret) (no token)",
           ("segment", "offload", "fed"), token=False, errors=(503,), answer=_json_object()),
        Op("METRICS", "get", "Prometheus text format (operator token)", ("segment", "offload", "fed"), errors=(403,),
           answer="text/plain"),
        Op("INFO", "get", "model config, cuts, segment, dtypes, limits, counters", ("segment", "offload"),
           answer=_json_object({"protocol_version": {"type": "integer"}, "model_config": {"type": "object"},
                                "limits": {"type": "object"}}, ["protocol_version", "model_config", "limits"])),
        Op("OPENAPI", "get", "this document (no token: the protocol's routes, the same for every server; a "
           "tenant's token: this server's, with its cuts and limits)", ("segment", "offload", "fed"), token=False,
           errors=(401,), answer=_json_object({"openapi": {"type": "string"}, "paths": {"type": "object"}}, ["openapi", "paths"])),
        Op("ECHO", "post", "the body back, no tensor work (transport diagnostics)", ("segment", "offload"),
           body="any", errors=(413,), answer=Tensors({}, summary="the request's bytes, unchanged")),
        Op("CLIENT_STATE", "get", "the last training step applied for a client", path_params=cid, errors=(400,),
           answer=_json_object({"client_id": {"type": "string"}, "step": {"type": "integer"},
                                "durable": {"type": ["integer", "null"]}}, ["client_id", "step"])),
        Op("CLIENT_ADAPTER", "get", "LoRA: the server side's adapter of a client", path_params=cid, errors=(400, 404),
           answer=Tensors({"base_model.model.<layers>.<i>.<module>.lora_A.weight":
                               "(r, in); <layers>: the family's (model.layers for Llama)",
                           "...lora_B.weight": "(out, r)"}, {"lora": "the adapter spec, JSON"})),
        Op("CLIENT_WEIGHTS", "get", "the segment's weights now and the client's own LoRA adapter (403 unless the "
           "operator allows it: --allow-weight-export)", path_params=cid, errors=(400, 403),
           answer=Tensors({"<Hugging Face name>": "the segment's parameters, its compute dtype",
                           "base_model.model.<module>.lora_{A,B}.weight": "LoRA servers: this client's adapter"},
                          {"lora": "the adapter spec, JSON (with an adapter)", "steps_applied": "integer"})),
        Op("TRAIN_STEP", "post", "2-way: hidden + labels -> loss + grad (a fused piece, loss_scale its "
           "loss's gradient)", errors=tensor_errors,
           body=Tensors({P.HIDDEN: hidden, P.LABELS: labels, P.MASK: mask}, step_meta),
           answer=Tensors({P.LOSS: "F32 [1]", P.GRAD: "dL/d hidden, [B, T, d]"},
                          {"grad_norm": "decimal", "accumulated": "integer",
                           "apply": "the carried apply's answer, JSON", "apply_now": "1: apply at once"})),
        Op("TRAIN_FORWARD", "post", "hidden -> trunk output (the graph waits for the backward)", errors=tensor_errors,
           body=Tensors({P.HIDDEN: hidden, P.MASK: mask + " (here: either side)",
                         P.LABELS: "2-way: " + labels}, step_meta),
           answer=Tensors({P.HIDDEN: "trunk output [B, T, d] (U-shape)", P.LOSS: "F32 [1] (2-way piece)"})),
        Op("TRAIN_BACKWARD", "post", "grad of output -> grad of input (accumulated until the apply)",
           errors=tensor_errors,
           body=Tensors({P.GRAD: "[B, T, d] (2-way: F32 [1], the piece loss's gradient)"}, step_meta),
           answer=Tensors({P.GRAD: "dL/d hidden [B, T, d]"}, {"grad_norm": "decimal", "accumulated": "integer"})),
        Op("TRAIN_APPLY", "post", "apply (or discard) a step at the client's lr", body=apply_schema(),
           errors=(400, 409, 415),
           answer=_json_object({"client_id": {"type": "string"}, "step": {"type": "integer"},
                                "applied": {"type": "boolean"}, "discarded": {"type": "boolean"},
                                "pieces": {"type": "integer"}, "lr": {"type": "number"},
                                "grad_norm": {"type": "number"}, "clipped": {"type": "boolean"},
                                "clip_norm": {"type": "number"}, "durable": {"type": "integer"}},
                               ["client_id", "step"])),
        Op("FORWARD", "post", "no-grad forward (evaluation); changes nothing", errors=(400, 413, 415),
           body=Tensors({P.HIDDEN: hidden, P.MASK: mask, P.LABELS: "optional, 2-way: " + labels},
                        {"wire_dtype": "str, default 'float32'", "logits": "'all': every position's logits",
                         "padding": "'any': a mask padded on either side", "client_id": "LoRA: whose adapter"}),
           answer=Tensors({P.HIDDEN: "trunk output", P.LOGITS: "top: [B, V] (or [B, T, V])",
                           P.LOSS: "top, with labels: F32 [1]"})),
        Op("CHECKPOINT", "post", "operator: save segment, optimizer and step counters now", errors=(400, 403),
           answer=_json_object({"saved": {"type": "string"}, "steps_applied": {"type": "integer"}},
                               ["saved", "steps_applied"])),
        Op("SESSIONS", "post", "open a generation session (KV cache on the server)", body=session_schema(max_batch),
           json_optional=True, ok=201, errors=(400, 413), links=opened,
           answer=_json_object({"session_id": {"type": "string"}, "rows": {"type": "integer"},
                                "ttl_s": {"type": "number"}}, ["session_id", "rows", "ttl_s"])),
        Op("SESSION_STEP", "post", "[reorder rows, crop] + new positions' hidden + mask -> output",
           path_params=sid, errors=(400, 404, 409, 413, 415),
           body=Tensors({P.HIDDEN: f"new positions only [B, T_new, {d}]", P.MASK: "optional I64 [B, T_new]",
                         P.REORDER: f"optional I64 [R]: rows of the cache to keep (1 <= R <= {max_batch})"},
                        meta_fields(P.SessionStepMeta)),
           answer=Tensors({P.HIDDEN: "trunk: [B, T_new, d]", P.LOGITS: "top: [B, V] (or [B, k, V] with logits)"})),
        Op("SESSION", "delete", "close a session", path_params=sid, errors=(404,), ok=204),
        Op("FEDERATION", "get", "mode, version, round, members, who synced, whose turn", ("segment", "fed"), answer=status),
        Op("FEDERATION_TURN", "post", "sequential: take the turn", errors=(400, 409, 415),
           body=_json_object({"client_id": CLIENT_ID}, ["client_id"], extra=False), answer=status),
        Op("FEDERATION_SYNC", "post", "client-side weights + client_id, samples (+ ticket) -> status",
           ("segment", "fed"), errors=(400, 403, 409, 413, 415), answer=status,
           body=Tensors({"<Hugging Face name>": "every client-side parameter, F32"},
                        meta_fields(P.SyncMeta, samples=f"1..{P.MAX_SAMPLES}",
                                    ticket=f"1..{P.MAX_TICKET_CHARS} characters"))),
        Op("FEDERATION_CLOSE", "post", "fed server: close the round the segment server's record names", ("fed",),
           errors=(400, 403, 409), answer=status,
           body=_json_object({"record": {"type": "string", "description": "the segment server's last_close"}},
                             ["record"], extra=False)),
        Op("FEDERATION_WEIGHTS", "get", "the shared client-side weights", ("segment", "fed"), errors=(404,),
           answer=Tensors({"<Hugging Face name>": "F32"}, {"version": "integer"})),
        Op("OFFLOAD_LINEAR", "post", "masked products of linear layers (docs/OFFLOAD.md)", ("offload",),
           errors=(400, 413, 415),
           body=Tensors({"x.<k>": "I32 [2, rows, in] per prime (scheme plain: F32 [rows, in])"},
                        {"layers": "1-8 layer names, comma-separated", "scheme": "'masked' or 'plain'"}),
           answer=Tensors({"y.<k>": "I32 [2, rows, out] (plain: F32 [rows, out])"})),
    ]


def _responses(op: Op) -> dict:
    out = {}
    if op.answer is None:
        out[str(op.ok)] = {"description": "done, no content"}
    elif isinstance(op.answer, Tensors):
        out[str(op.ok)] = {"description": "safetensors answer", "content": op.answer.content(),
                           "x-safetensors": op.answer.extension(),
                           "headers": {P.SERVER_TIME_HEADER: {"schema": {"type": "string"},
                                                              "description": "server time, ms"}}}
    elif isinstance(op.answer, str):  # a media type: text
        out[str(op.ok)] = {"description": "text", "content": {op.answer: {"schema": {"type": "string"}}}}
    else:
        out[str(op.ok)] = {"description": "JSON answer", "content": {"application/json": {"schema": op.answer}}}
    if op.links:
        out[str(op.ok)]["links"] = dict(op.links)
    statuses = set(op.errors) | (set(_COMMON) if op.token else {405, 500})
    if op.body is not None:
        statuses |= {400, 413}
    for s in sorted(statuses):
        out[str(s)] = {"$ref": f"#/components/responses/E{s}"}
    return out


def _operation(op: Op) -> dict:
    out = {"operationId": op.route.lower(), "summary": op.summary, "responses": _responses(op)}
    out["security"] = BEARER if op.token else []
    if op.path_params:
        out["parameters"] = [{"name": k, "in": "path", "required": True, "schema": v} for k, v in op.path_params.items()]
    if isinstance(op.body, Tensors):
        out["requestBody"] = {"required": True, "content": op.body.content()}
        out["x-safetensors"] = op.body.extension()
    elif op.body == "any":
        out["requestBody"] = {"required": False, "content": {P.CONTENT_TYPE: {"schema": {"type": "string",
                                                                                         "format": "binary"}}}}
    elif op.body is not None:
        out["requestBody"] = {"required": not op.json_optional, "content": {"application/json": {"schema": op.body}}}
    return out


def flask_rule(route: str) -> str:
    """A protocol route (``{name}``) as a Flask rule (``<name>``)."""
    return route.replace("{", "<").replace("}", ">")


def document(info: dict, kind: str = "segment") -> dict:
    """The OpenAPI 3.1 document of a server of ``kind`` ("segment", "offload", or "fed": the fed
    server of splitlearn/server/federation/fedserver.py) whose ``/v1/info`` is ``info`` (the fed server: ``{}``)."""
    paths: dict[str, dict] = {}
    for op in operations(info):
        route = getattr(P, op.route, None)
        if route is None or kind not in op.kinds:  # a route this protocol version or server lacks
            continue
        paths.setdefault(route, {})[op.method] = _operation(op)
    error = {"type": "object", "required": ["error", "message"], "additionalProperties": False,
             "properties": {"error": {"type": "string"}, "message": {"type": "string"}}}
    responses = {f"E{s}": {"description": w + f" (error: {', '.join(error_codes(s))})",
                           "content": {"application/json": {"schema": {
                               **error, "properties": {**error["properties"],
                                                       "error": {"enum": error_codes(s)}}}}}}
                 for s, w in _WHEN.items()}
    for s in (429, 503):
        responses[f"E{s}"]["headers"] = {"Retry-After": {"schema": {"type": "string"}, "description": "seconds"}}
    return {
        "openapi": OPENAPI_VERSION,
        "info": {"title": "splitlearn server", "version": str(P.PROTOCOL_VERSION),
                 "description": "Split learning for GPT-2: the server's routes (docs/PROTOCOL.md has the bytes). "
                                + (f"This server: {kind}, cuts {info.get('cuts')}, shape {info.get('shape')}."
                                   if info.get("cuts") is not None else f"A {kind} server.")},
        "paths": paths,
        "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer",
                                                      "description": "a tenant's token (--token-file or $SPLITLEARN_TOKEN)"}},
                       "schemas": {"Error": error}, "responses": responses},
        "security": BEARER,
    }


def route_constants() -> dict[str, str]:
    """Every route constant protocol.py defines: NAME -> path."""
    return {k: v for k, v in vars(P).items()
            if k.isupper() and isinstance(v, str) and v.startswith("/") and not k.endswith("_HEADER")}
