"""Routes, message fields and the protocol version, shared by client and server.

Bodies with tensors are safetensors (:mod:`splitlearn.api.wire`); their ``__metadata__`` holds
the string fields below. JSON is used only for small control messages (info, health,
sessions, errors). ``docs/PROTOCOL.md`` describes every route with its bytes.

============================  =======  ==========================================================
route                          method   what
============================  =======  ==========================================================
/v1/health                     GET      liveness; without a token
/v1/ready                      GET      readiness: model loaded, compute thread alive, checkpoint dir writable (503 if not); without a token
/metrics                       GET      Prometheus text format; operator token (also on --metrics-port, loopback)
/v1/info                       GET      model config, cuts, segment held, dtypes, limits
/v1/openapi.json               GET      OpenAPI 3.1 document of these routes (splitlearn/api/openapi.py)
/v1/clients/<client_id>        GET      the last training step applied for a client
/v1/train/step                 POST     2-way: hidden + labels + loss_scale -> loss + grad (a fused piece)
/v1/train/forward              POST     U-shape: hidden -> trunk output (graph kept)
/v1/train/backward             POST     grad of output -> grad of input (gradients accumulate until the apply)
/v1/train/apply                POST     JSON: apply a step at the client's lr (or: metadata
                                        "apply" of the next step's first request, the same JSON)
/v1/forward                    POST     no-grad forward (evaluation); changes nothing
/v1/checkpoint                 POST     save segment + optimizer + step counters now
/v1/sessions                   POST     open a generation session (KV cache on the server)
/v1/sessions/<sid>/step        POST     [reorder rows, crop] + new positions' hidden + mask -> output
/v1/sessions/<sid>             DELETE   close a session
/v1/echo                       POST     the body back, no tensor work (transport diagnostics)
/v1/federation                 GET      mode, version, round, members, who synced, whose turn
/v1/federation/turn            POST     sequential: {"client_id"} -> take the turn (503: busy)
/v1/federation/sync            POST     client-side weights + client_id, samples (+ ticket) -> status
/v1/federation/weights         GET      the shared client-side weights (meta: version)
/v1/federation/close           POST     fed server: {"record"} the segment server signed -> status
/v1/clients/<cid>/adapter      GET      LoRA: the server side's adapter of a client (its token only)
/v1/clients/<cid>/weights      GET      the segment's weights now (+ the client's own LoRA adapter);
                                        only where the operator allows it (--allow-weight-export)
/v1/offload/linear             POST     --offload servers only: masked products of linear layers (docs/OFFLOAD.md)
============================  =======  ==========================================================
"""
from __future__ import annotations

import hashlib
import math
import os
import re
from dataclasses import dataclass
from typing import Optional
from pathlib import Path

from ..errors import BadRequest, ConfigError


def check_wire_dtype(name: str) -> str:
    """``name`` if it names a wire dtype (:mod:`.wire`), else BadRequest. The wire is imported on
    first use: it needs torch, and the server's ``--help`` reads this module (issue 54)."""
    from .wire import check_wire_dtype as check

    return check(name)


PROTOCOL_VERSION = 2  # 2: /v1/info names the position limit max_position_embeddings (docs/PROTOCOL.md)
CONTENT_TYPE = "application/octet-stream"
SERVER_TIME_HEADER = "X-Server-Time-Ms"  # server compute time of the request, milliseconds

HEALTH = "/v1/health"
READY = "/v1/ready"  # readiness probe, no token (splitlearn/server/http/probes.py)
METRICS = "/metrics"  # Prometheus text format, operator only (splitlearn/server/http/metrics.py)
REQUEST_ID_HEADER = "X-Request-Id"  # a request's id in the access log; a client's own is kept if it fits [A-Za-z0-9_.:-]{1,64}
INFO = "/v1/info"
OPENAPI = "/v1/openapi.json"  # OpenAPI 3.1 document of the server's routes (splitlearn/api/openapi.py)
CLIENT_STATE = "/v1/clients/{client_id}"
TRAIN_STEP = "/v1/train/step"
TRAIN_FORWARD = "/v1/train/forward"
TRAIN_BACKWARD = "/v1/train/backward"
TRAIN_APPLY = "/v1/train/apply"  # JSON {client_id, step, pieces, lr[, clip][, discard]}: see ApplyRequest
FORWARD = "/v1/forward"
CHECKPOINT = "/v1/checkpoint"
SESSIONS = "/v1/sessions"
SESSION = "/v1/sessions/{session_id}"
SESSION_STEP = "/v1/sessions/{session_id}/step"
FEDERATION = "/v1/federation"
FEDERATION_TURN = "/v1/federation/turn"
FEDERATION_SYNC = "/v1/federation/sync"
FEDERATION_WEIGHTS = "/v1/federation/weights"
FEDERATION_CLOSE = "/v1/federation/close"  # fed server: the segment server's signed close record
MAX_SAMPLES = 1 << 40  # rows one member may report for a round: far beyond any real one
MAX_TICKET_CHARS = 2048  # a signed ticket is ~250 characters
CLIENT_ADAPTER = "/v1/clients/{client_id}/adapter"
CLIENT_WEIGHTS = "/v1/clients/{client_id}/weights"  # safetensors: the segment (HF names) + the client's adapter (peft names)
OFFLOAD_LINEAR = "/v1/offload/linear"  # masked offload (splitlearn/offloadmath/layers.py: the bytes)

# tensor names in bodies
MAX_MICROS = 64  # micro-batches in flight: a client's pipeline depth, graphs waiting for their backward
MAX_PIECES = 4096  # pieces of one step (gradient accumulation, applied by TRAIN_APPLY)
MAX_LR = 10.0  # the largest learning rate an apply may carry

HIDDEN, LABELS, MASK, GRAD, LOSS, LOGITS = "hidden", "labels", "attention_mask", "grad", "loss", "logits"
# optional, a session step's: the first segment's position ids of the new positions, (rows, T) or
# (1, T) integers (rotary families recompute their rotary from them; docs/MODELS.md)
POSITIONS = "position_ids"
REORDER = "reorder"  # session step: I64 (R,) rows of the session's cache to keep, in order (index_select)

_CLIENT_ID = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # fullmatch: `$` would accept a trailing "\n"
_RUN = re.compile(r"[A-Za-z0-9]{1,32}")  # a client process's run of a client id (StepMeta.run)


def check_run(run) -> Optional[str]:
    """A request's ``run`` (None: absent), or 400."""
    if run is not None and not (isinstance(run, str) and _RUN.fullmatch(run)):
        raise BadRequest(f"'run' must be 1-32 characters of [A-Za-z0-9], got {run!r}")
    return run


def _int_field(meta: dict, key: str, minimum: int = 0) -> int:
    raw = meta.get(key)
    if raw is None:
        raise BadRequest(f"metadata field {key!r} is missing")
    try:
        value = int(raw)
    except ValueError:
        raise BadRequest(f"metadata field {key!r} must be an integer, got {raw!r}") from None
    if value < minimum:
        raise BadRequest(f"metadata field {key!r} must be >= {minimum}, got {value}")
    return value


@dataclass(frozen=True)
class StepMeta:
    """Fields of every training request: who, which step, and the answer's wire dtype."""

    client_id: str  # 1-64 of [A-Za-z0-9_.-], chosen by the client
    step: int  # 1, 2, 3... per client; a retry repeats the number
    wire_dtype: str = "float32"  # dtype of the tensors in the answer
    fed_version: Optional[int] = None  # version of the shared client-side weights the client holds
    micro: int = 0  # which piece of the (open-ended) step this request carries (0-based)
    loss_scale: float = 1.0  # a fused 2-way piece (TRAIN_STEP): the gradient the client's loss sends into its loss
    apply: Optional["ApplyRequest"] = None  # the previous step's apply, carried (metadata "apply": its JSON body)
    # which run of the client id sent it (a random name per client process): a pending step of
    # another run (a process that died mid-step) is dropped, not answered from, by a new one
    run: Optional[str] = None

    def to_meta(self) -> dict[str, str]:
        # the server scopes client_id as "<tenant>:<id>"; the wire carries the id alone
        meta = {"client_id": self.client_id.rsplit(":", 1)[-1], "step": str(self.step),
                "wire_dtype": self.wire_dtype}
        if self.fed_version is not None:
            meta["fed_version"] = str(self.fed_version)
        meta.update(micro=str(self.micro), micros="0", loss_scale=repr(self.loss_scale))
        if self.run is not None:
            meta["run"] = self.run
        return meta

    @classmethod
    def from_meta(cls, meta: dict) -> "StepMeta":
        client_id = checked_client_id(meta)
        version = _int_field(meta, "fed_version", 0) if "fed_version" in meta else None
        if meta.get("micros") != "0":  # closed steps (micros >= 1, absent: 1) are gone
            raise BadRequest(f"closed training steps (micros >= 1) are gone: send micros=0 (an open-ended "
                             f"step) and apply it with POST {TRAIN_APPLY} or metadata 'apply' on the next "
                             f"step's first request (got micros={meta.get('micros', 'absent')!r})")
        micro = _int_field(meta, "micro", 0) if "micro" in meta else 0
        if micro >= MAX_PIECES:
            raise BadRequest(f"piece {micro} of an open-ended step: need 0 <= micro < {MAX_PIECES}")
        try:
            scale = float(meta.get("loss_scale", "1"))
        except ValueError:
            raise BadRequest(f"metadata field 'loss_scale' must be a number, got {meta['loss_scale']!r}") from None
        if not 0.0 < scale <= 1.0:
            raise BadRequest(f"metadata field 'loss_scale' must be in (0, 1], got {scale}")
        step = _int_field(meta, "step", 1)
        carried = carried_apply(meta["apply"], client_id, step) if "apply" in meta else None
        return cls(client_id, step, check_wire_dtype(meta.get("wire_dtype", "float32")),
                   version, micro, scale, carried, check_run(meta.get("run")))


MAX_APPLY_CHARS = 512  # the JSON of a carried apply ({client_id, step, pieces, lr, clip}: ~120 characters)


def carried_apply(raw, client_id: str, step: int) -> "ApplyRequest":
    """The ``apply`` metadata field of a training request: the previous step's ``POST
    /v1/train/apply`` body as JSON, carried on the next step's first request(s) instead of a
    request of its own. 400 unless it is a valid apply of the same client's step ``step - 1``
    (no ``discard``)."""
    import json

    if not isinstance(raw, str) or len(raw) > MAX_APPLY_CHARS:
        raise BadRequest(f"metadata field 'apply' must be the JSON of an apply body (at most "
                         f"{MAX_APPLY_CHARS} characters)")
    try:
        payload = json.loads(raw)
    except ValueError:
        raise BadRequest("metadata field 'apply' is not JSON: it carries the body of POST "
                         f"{TRAIN_APPLY} ({{\"client_id\", \"step\", \"pieces\", \"lr\", \"clip\"}})") from None
    if not isinstance(payload, dict):
        raise BadRequest("metadata field 'apply' must be a JSON object (the body of POST /v1/train/apply)")
    try:
        req = ApplyRequest.from_json(payload)
    except BadRequest as e:
        raise BadRequest(f"metadata field 'apply': {e.message}") from None
    if req.discard:
        raise BadRequest(f"metadata field 'apply' cannot discard: send {{\"discard\": true}} to {TRAIN_APPLY}")
    if req.client_id != client_id:
        raise BadRequest(f"metadata field 'apply' names client {req.client_id!r}, the request {client_id!r}")
    if req.step != step - 1:
        raise BadRequest(f"metadata field 'apply' names step {req.step}: a request of step {step} carries "
                         f"the apply of step {step - 1}")
    return req


MAX_META_INT_CHARS = 20  # digits of an integer metadata field of a session step (int() of 10^4000 is slow)


def _number(payload: dict, key: str) -> float:
    v = payload.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise BadRequest(f"{key!r} must be a number, got {v!r}")
    v = float(v)
    if not math.isfinite(v):
        raise BadRequest(f"{key!r} must be finite, got {v}")
    return v


@dataclass(frozen=True)
class ApplyRequest:
    """``POST /v1/train/apply``: step the optimizer over a step's accumulated
    gradients (JSON ``{"client_id", "step", "pieces", "lr", "clip", "discard"}``).

    ``pieces``: how many backward pieces of the step the client got answers for (the server
    checks it has exactly those); ``lr``: the learning rate of this step (the client's current
    one, 0 <= lr <= MAX_LR; on state shared between tenants, the segment in ``shared`` and
    ``sequential`` modes, the server applies at most its own ``--lr``); ``clip``: a factor in (0, 1] the gradients are multiplied by first
    (a global-norm clip computed by the client); ``discard``: drop the step's gradients instead
    (``zero_grad`` before a step), nothing is applied and the step number stays free; ``run``:
    the run that sent it (:attr:`StepMeta.run`): a step another run holds is neither applied (409)
    nor discarded.
    """

    client_id: str
    step: int
    pieces: int = 0
    lr: Optional[float] = None
    clip: float = 1.0
    discard: bool = False
    run: Optional[str] = None

    FIELDS = ("client_id", "step", "pieces", "lr", "clip", "discard", "run")

    def to_json(self) -> dict:
        out = {"client_id": self.client_id, "step": self.step, "pieces": self.pieces}
        if self.lr is not None:
            out["lr"] = self.lr
        if self.clip != 1.0:
            out["clip"] = self.clip
        if self.discard:
            out["discard"] = True
        if self.run is not None:
            out["run"] = self.run
        return out

    @classmethod
    def from_json(cls, payload: dict) -> "ApplyRequest":
        extra = set(payload) - set(cls.FIELDS)
        if extra:
            raise BadRequest(f"unknown fields {sorted(extra)}; an apply has {list(cls.FIELDS)}")
        cid = payload.get("client_id")
        if not isinstance(cid, str) or not _CLIENT_ID.fullmatch(cid):
            raise BadRequest("'client_id' must be 1-64 characters of [A-Za-z0-9_.-]")
        ints = {}
        for key, lo, hi in (("step", 1, 1 << 62), ("pieces", 0, MAX_PIECES)):
            v = payload.get(key, 0 if key == "pieces" else None)
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise BadRequest(f"{key!r} must be an integer in {lo}..{hi}, got {v!r}")
            ints[key] = v
        discard = payload.get("discard", False)
        if not isinstance(discard, bool):
            raise BadRequest(f"'discard' must be true or false, got {discard!r}")
        lr = None
        if not discard:
            lr = _number(payload, "lr")
            if not 0.0 <= lr <= MAX_LR:
                raise BadRequest(f"'lr' must be in [0, {MAX_LR:g}], got {lr}")
            if ints["pieces"] < 1:
                raise BadRequest("'pieces' must be >= 1: an apply needs the gradient of at least one piece")
        clip = _number(payload, "clip") if "clip" in payload else 1.0
        if not 0.0 < clip <= 1.0:
            raise BadRequest(f"'clip' must be in (0, 1], got {clip}")
        return cls(cid, ints["step"], ints["pieces"], lr, clip, discard, check_run(payload.get("run")))


@dataclass(frozen=True)
class SessionStepMeta:
    """Fields of a generation step: where the new positions start, the answer's dtype, and
    (optional) the step's number in its session, a crop of the cache before the new positions
    and how many positions' logits a top answers (docs/PROTOCOL.md, "Cache operations")."""

    position: int  # tokens the session has already seen (after ``crop``); must equal the server's count
    wire_dtype: str = "float32"
    step: Optional[int] = None  # 1, 2, 3... per session: a retry of the last step gets its stored answer
    crop: Optional[int] = None  # keep the first ``crop`` cached positions, drop the rest (then position == crop)
    logits: Optional[int] = None  # top: logits of the last ``logits`` new positions, (B, k, V); 0: all

    def to_meta(self) -> dict[str, str]:
        meta = {"position": str(self.position), "wire_dtype": self.wire_dtype}
        for key in ("step", "crop", "logits"):
            if getattr(self, key) is not None:
                meta[key] = str(getattr(self, key))
        return meta

    @classmethod
    def from_meta(cls, meta: dict) -> "SessionStepMeta":
        for key in ("position", "step", "crop", "logits"):
            if len(str(meta.get(key, ""))) > MAX_META_INT_CHARS:
                raise BadRequest(f"metadata field {key!r} is too long ({MAX_META_INT_CHARS} digits at most)")
        opt = lambda key, minimum: _int_field(meta, key, minimum) if key in meta else None  # noqa: E731
        return cls(_int_field(meta, "position", 0), check_wire_dtype(meta.get("wire_dtype", "float32")),
                   opt("step", 1), opt("crop", 0), opt("logits", 0))


@dataclass(frozen=True)
class SyncMeta:
    """Fields of a federation sync: who, the rows it trained (as the client counts them: the
    servers weight by the target tokens they trained for it instead), and,
    to a fed server, the segment server's signed ticket for this sync."""

    client_id: str
    samples: int  # rows trained since the last sync, 1..MAX_SAMPLES; servers weight by their own count
    ticket: Optional[str] = None  # fed server only: the ticket the segment server answered the sync

    def to_meta(self) -> dict[str, str]:
        meta = {"client_id": self.client_id, "samples": str(self.samples)}
        if self.ticket is not None:
            meta["ticket"] = self.ticket
        return meta

    @classmethod
    def from_meta(cls, meta: dict) -> "SyncMeta":
        client_id = checked_client_id(meta)
        raw = str(meta.get("samples", ""))
        if len(raw) > 20:  # int() of a 10^400 string works, and FedAvg's float(sum) overflowed
            raise BadRequest(f"metadata field 'samples' must be in 1..{MAX_SAMPLES}")
        samples = _int_field(meta, "samples", 1)
        if samples > MAX_SAMPLES:
            raise BadRequest(f"metadata field 'samples' must be in 1..{MAX_SAMPLES}, got {samples}")
        ticket = meta.get("ticket")
        if ticket is not None and not (isinstance(ticket, str) and 0 < len(ticket) <= MAX_TICKET_CHARS):
            raise BadRequest(f"metadata field 'ticket' must be the segment server's ticket (1-{MAX_TICKET_CHARS} characters)")
        return cls(client_id, samples, ticket)


def valid_client_id(client_id: str) -> bool:
    return bool(_CLIENT_ID.fullmatch(client_id))


def checked_client_id(meta: dict) -> str:
    """The metadata's ``client_id``; 400 unless it is 1-64 characters of [A-Za-z0-9_.-]."""
    client_id = meta.get("client_id", "")
    if not isinstance(client_id, str) or not _CLIENT_ID.fullmatch(client_id):
        raise BadRequest("metadata field 'client_id' must be 1-64 characters of [A-Za-z0-9_.-]")
    return client_id


# Transport diagnostics (``python -m splitlearn.client diagnose``): the body comes back
# unchanged, with no tensor work on the server (token required, limited by max_body_bytes).
ECHO = "/v1/echo"


def parse_token_line(line: str) -> Optional[tuple[str, str, bool]]:
    """``(name, token, operator)`` of a token-file line; None for blanks and comments.
    A bare token gets an empty name (named from its digest later)."""
    words = line.split()
    if not words or words[0].startswith("#"):
        return None
    if len(words) == 1:
        return "", words[0], False
    if len(words) == 2:
        return words[0], words[1], False
    if len(words) == 3 and words[2] == "operator":
        return words[0], words[1], True
    raise ConfigError(f"a token file line has {len(words)} words: expected '<token>', '<name> <token>' "
                      f"or '<name> <token> operator' (the line is not shown: it may hold a token)")


def read_token_file(path: str) -> tuple[str, ...]:
    """The lines of a token file that carry a token, whitespace-normalised (the format:
    :mod:`splitlearn.server.tenants`; a client takes the token of the first line)."""
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            lines = f.read().decode().splitlines()
    except OSError as e:
        raise ConfigError(f"cannot read --token-file {path}: {e}") from None
    if st.st_uid not in (0, os.geteuid()) or st.st_mode & 0o022:  # docs/SECURITY.md, 'Files and sockets'
        who = f"owned by uid {st.st_uid}" if st.st_uid not in (0, os.geteuid()) else \
            f"writable by group or others (mode {st.st_mode & 0o7777:04o})"
        raise ConfigError(f"--token-file {path} is {who}: another local user could add a token to it or "
                          f"change one; refusing it (make it this user's own, chmod 600)")
    entries = tuple(" ".join(line.split()) for line in lines if parse_token_line(line) is not None)
    if not entries:
        raise ConfigError(f"--token-file {path} holds no token")
    return entries


# -- replicas (splitlearn/cluster, docs/CLUSTER.md) ------------------------------------------

ROUTE_HEADER = "X-Splitlearn-Route"  # what HAProxy hashes (balance hdr + hash-type consistent)
REPLICA_HEADER = "X-Splitlearn-Replica"  # set by the cluster's HAProxy on answers: which replica served


def route_key(token: Optional[str], client_id: str) -> str:
    """The routing key a client sends in :data:`ROUTE_HEADER`: its tenant and client id, so
    every request of one owner (training, its generation sessions) lands on one replica.

    ``<16 hex of sha256(token)>:<client_id>``: the tenant is named by a hash prefix, never
    the token (a proxy's logs may keep headers)."""
    tenant = hashlib.sha256((token or "").encode()).hexdigest()[:16]
    return f"{tenant}:{client_id}"
