"""A separate "fed server" for client-side weights: the segment server never sees them.

SplitFed proper (Thapa et al., AAAI 2022) averages the clients' client-side weights on a fed
server of their own, apart from the server that trains the segment; sharing client-side
weights with the segment server raises what it can learn from the activations it sees (see
docs/FEDERATION.md). Run one beside a ``--federation splitfed --client-weights external``
(or ``sequential``) segment server, with the same model, cuts, LoRA options and a secret
the two share::

    python -m splitlearn.server.fedavg --model tiny-demo --cut 2 --cut 4 --mode splitfed \\
        --fed-secret-file fed.secret --token-file fed-tokens.txt --port 8001
    SplitClient(url, model, client_id="alice", fed_url="http://127.0.0.1:8001", fed_token=...)

Who may upload what. The fed server has its own tokens (``--token-file``, or
``$SPLITLEARN_FED_TOKEN``), one per tenant, named as on the segment server; a client never
sends it the segment server's token. It takes an upload only with the ticket the segment
server answered that member's sync (:mod:`.tickets`): signed with the shared secret, for
the round being collected (splitfed) or the latest version (sequential: the turn holder's
sync), from the tenant the ticket names, once per member and round. The FedAvg weight is the
ticket's samples (the target tokens the segment server trained for the member, no member above
``--max-member-share`` of the round), the schema is this
server's own (:mod:`.clientside`: from ``--model``/``--cut``/``--lora-*``, never the first
upload), and each update is bounded and combined by the same :mod:`.strategy` as on the
segment server.

When a round closes. The segment server's status carries a signed close record once its
round (or turn) closed; clients forward it (``POST /v1/federation/close``). The fed server
closes its round when it holds the uploads of all the record's members, when a ticket of a
later round arrives (the segment server moved on), or ``--upload-timeout`` seconds after the
record if a member's upload never comes (a client that died between its two syncs); a ticketed
member whose upload is refused (schema, NaN) is a failure of the round and not waited for (as
Flower's ``accept_failures``); its version is then the segment server's. State is in memory (a restart forgets the average).
"""
from __future__ import annotations

import argparse
import logging
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

import torch
from flask import Flask, Response, g, jsonify, request

from .. import protocol as P
from ..errors import BadRequest, ConfigError, Conflict, Forbidden, NotFound, SplitLearnError, Unauthorized
from ..lora import LoraSpec
from ..wire import decode, encode
from . import tickets
from .clientside import ClientSide
from .strategy import AGGREGATIONS, DEFAULT_MAX_MEMBER_SHARE, DEFAULT_MAX_UPDATE_NORM, Strategy, coordinate_median, make_strategy
from .tenants import Tenants
from .validate import json_object

log = logging.getLogger(__name__)

Weights = dict[str, torch.Tensor]


@dataclass
class FedConfig:
    model: str  # the segment server's --model: the client-side schema and initial weights
    cuts: tuple[int, ...]  # the segment server's --cut(s)
    secret: bytes = field(repr=False)  # shared with the segment server (--fed-secret-file), >= 32 bytes
    mode: str = "splitfed"  # splitfed | sequential: the segment server's --federation
    seed: int = 0  # the seed of random inits, as the segment server's
    lora: Optional[LoraSpec] = None  # the segment server's --lora-* (client-side adapters only)
    aggregation: str = "fedavg"  # fedavg | median | trimmed-mean (splitlearn/server/strategy.py)
    max_update_norm: Optional[float] = DEFAULT_MAX_UPDATE_NORM  # L2 bound of one member's update (None: off)
    trim_beta: float = 0.2  # trimmed-mean: fraction of the members dropped at each end
    upload_timeout_s: float = 60.0  # seconds a closed round waits for its members' uploads
    max_member_share: float = DEFAULT_MAX_MEMBER_SHARE  # fedavg: largest fraction of a round's weight one member holds (1: no cap)

    def __post_init__(self):
        if self.mode not in ("splitfed", "sequential"):
            raise ConfigError(f"a fed server runs sequential or splitfed, not {self.mode!r}")
        if not self.upload_timeout_s > 0:
            raise ConfigError(f"--upload-timeout must be > 0 seconds, got {self.upload_timeout_s}")
        tickets.check_secret(self.secret)
        self.cuts = tuple(self.cuts)


class FedRounds:
    """The shared client-side weights and the uploads of the round (splitfed) or turn
    (sequential) being collected; thread-safe."""

    def __init__(self, cfg: FedConfig, side: ClientSide, strategy: Strategy):
        self.cfg, self.side, self.strategy = cfg, side, strategy
        self.version = 0  # equals the segment server's once a round closes here too
        self.weights: Optional[Weights] = None
        self.round: Optional[int] = None  # splitfed: the segment server's round being collected
        self.round_version = 0  # the version that round's members trained from
        self.uploads: dict[str, tuple[Weights, int]] = {}  # "<tenant>:<client>" -> (weights, samples)
        self.failed: set[str] = set()  # members whose upload was refused: out of the round (accept_failures)
        self.expected: Optional[int] = None  # members of the closed round (its close record)
        self.target: Optional[int] = None  # the version the segment server reached (a close record)
        self.target_seen = 0.0  # time.monotonic() that record first came
        self.last_round: dict = {}
        self.lock = threading.Lock()

    # -- uploads and close records ----------------------------------------------------

    def upload(self, tenant: str, meta: P.SyncMeta, weights: Weights) -> dict:
        """A member's client-side weights with its ticket (see the module docstring)."""
        if meta.ticket is None:
            raise BadRequest("an upload needs the ticket the segment server answered this sync "
                             "(metadata 'ticket'); SplitClient sends it")
        t = tickets.verify(self.cfg.secret, meta.ticket, tickets.Ticket)
        if t.mode != self.cfg.mode:
            raise BadRequest(f"a {t.mode} ticket, but this fed server runs {self.cfg.mode}")
        if t.tenant != tenant:
            raise Forbidden("this ticket was given to another tenant's member: upload with your own")
        if t.client_id != meta.client_id:
            raise BadRequest(f"the ticket is client {t.client_id!r}'s, the upload says {meta.client_id!r}")
        try:
            self.side.check(weights)
        except BadRequest:
            if self.cfg.mode == "splitfed":  # a ticketed member's bad upload: its failure of the round
                with self.lock:
                    self._expire()
                    key = f"{tenant}:{t.client_id}"
                    if t.version >= self.version and self._collect(t) and key not in self.uploads:
                        self.failed.add(key)
                        self._maybe_close()
            raise
        with self.lock:
            self._expire()
            if t.version < self.version:
                raise Conflict(f"the fed server holds version {self.version}: the round or turn of this "
                               f"ticket (version {t.version}) closed without this upload")
            if self.cfg.mode == "sequential":  # the turn holder's weights, bounded, are the latest
                agg = self._aggregate([(weights, 1)])
                self.version = t.version + 1
                self.target = None if self.target is not None and self.target <= self.version else self.target
                return {**self._status(tenant), "clipped": agg.clipped[0]}
            if not self._collect(t):
                raise Conflict(f"round {t.round} is closed here; this fed server collects round {self.round}")
            key = f"{tenant}:{t.client_id}"
            if key in self.failed:
                raise Conflict(f"client {t.client_id!r}'s upload was refused in round {t.round}: it is out "
                               f"of this round")
            self.uploads.setdefault(key, (weights, t.samples))  # a retry changes nothing
            self._maybe_close()
            return self._status(tenant)

    def _collect(self, t: tickets.Ticket) -> bool:
        """Make ``t``'s round the one collected (a later round closes the current one); False
        if that round is closed here already."""
        if self.round is not None and t.round != self.round:
            if t.round < self.round:
                return False
            self._close(f"a ticket of round {t.round} came")
        if self.round is None:
            self._open(t.round, t.version)
        return True

    def close(self, tenant: str, record: object) -> dict:
        """The segment server's signed word that a round or turn closed (any member sends it)."""
        c = tickets.verify(self.cfg.secret, record, tickets.Close)
        if c.mode != self.cfg.mode:
            raise BadRequest(f"a {c.mode} close record, but this fed server runs {self.cfg.mode}")
        with self.lock:
            self._expire()
            if c.version > self.version and (self.round is None or c.round >= self.round):
                if self.round is not None and c.round > self.round:
                    self._close(f"the segment server closed round {c.round}")
                if self.cfg.mode == "splitfed" and self.round is None:
                    self._open(c.round, c.version - 1)
                if self.target != c.version:
                    self.target, self.target_seen = c.version, time.monotonic()
                self.expected = c.synced if self.cfg.mode == "splitfed" else None
                self._maybe_close()
            return self._status(tenant)

    def _open(self, number: int, version: int) -> None:
        self.round, self.round_version, self.uploads, self.expected = number, version, {}, None
        self.failed = set()

    def _maybe_close(self) -> None:
        if self.expected is not None and len(self.uploads) + len(self.failed) >= self.expected:
            self._close("every member's upload is here (or was refused)")

    def _expire(self) -> None:
        if self.target is not None and time.monotonic() - self.target_seen > self.cfg.upload_timeout_s:
            if self.cfg.mode == "splitfed":
                self._close(f"uploads still missing {self.cfg.upload_timeout_s:g}s after the close record")
            else:
                log.warning("the turn holder's upload for version %d never came: keeping version %d's weights",
                            self.target - 1, self.version)
                self.version, self.target = max(self.version, self.target), None

    def _close(self, why: str) -> None:
        if self.uploads:
            agg = self._aggregate(list(self.uploads.values()))
            self.last_round = {"round": self.round, "members": len(self.uploads),
                               "samples": sum(n for _, n in self.uploads.values()), "clipped": sum(agg.clipped)}
            self.version = max(self.version, self.round_version + 1)
        if self.target is not None:
            self.version = max(self.version, self.target)
        log.info("round %s closed (%s): %d uploads, version %d", self.round, why, len(self.uploads), self.version)
        self.round, self.uploads, self.expected, self.target, self.failed = None, {}, None, None, set()

    def _aggregate(self, uploads: list[tuple[Weights, int]]):
        ref = self.weights if self.weights is not None else self.side.initial()
        if ref is None:
            ref = coordinate_median([w for w, _ in uploads])
        agg = self.strategy.aggregate(ref, uploads)
        self.weights = agg.weights
        self.side.forget_initial()
        log.info("update norms %s, clipped %s", [round(x, 4) for x in agg.norms], agg.clipped)
        return agg

    # -- reading ---------------------------------------------------------------------

    def latest(self) -> tuple[int, Weights]:
        with self.lock:
            if self.weights is None:
                raise NotFound("no member has uploaded its weights yet")
            return self.version, self.weights

    def status(self, tenant: str) -> dict:
        with self.lock:
            self._expire()
            return self._status(tenant)

    def _status(self, tenant: str) -> dict:
        mine = sorted(k.split(":", 1)[1] for k in self.uploads if k.split(":", 1)[0] == tenant)
        return {"mode": self.cfg.mode, "version": self.version, "round": self.round, "fed_server": True,
                "synced": mine, "synced_count": len(self.uploads), "failed_count": len(self.failed),
                "expected": self.expected,
                "upload_timeout_s": self.cfg.upload_timeout_s, "last_round": self.last_round,
                **self.strategy.describe()}


def create_fedavg_app(rounds: FedRounds, tenants: Tenants) -> Flask:
    """The fed server's routes around ``rounds``; ``tenants``: its own tokens."""
    app = Flask("splitlearn.fedavg", static_folder=None)  # every route is in openapi.py
    app.extensions["splitlearn.fedavg"] = rounds

    @app.errorhandler(SplitLearnError)
    def _error(err: SplitLearnError):
        resp = jsonify(err.to_payload())
        resp.status_code = err.status
        return resp

    @app.before_request
    def _authenticate():  # constant-time (Tenants.authenticate); the front door checked it already
        if request.path == P.HEALTH:
            return None
        g.tenant = tenants.authenticate(request.headers.get("Authorization"))
        if g.tenant is None:
            raise Unauthorized("missing or wrong bearer token: the fed server's own (fed_token=, "
                               "$SPLITLEARN_FED_TOKEN), not the segment server's")
        return None

    @app.get(P.HEALTH)
    def health():
        return jsonify(status="ok", protocol_version=P.PROTOCOL_VERSION)

    @app.get(P.OPENAPI)
    def openapi_document():
        from ..openapi import document
        return jsonify(document({}, "fed"))

    @app.get(P.FEDERATION)
    def status():
        return jsonify(rounds.status(g.tenant.name))

    @app.post(P.FEDERATION_SYNC)
    def sync():
        if request.mimetype != P.CONTENT_TYPE:
            raise BadRequest(f"send the weights as {P.CONTENT_TYPE} (safetensors)")
        tensors, meta = decode(request.get_data(cache=False))
        return jsonify(rounds.upload(g.tenant.name, P.SyncMeta.from_meta(meta), tensors))

    @app.post(P.FEDERATION_CLOSE)
    def close():
        shape = '{"record": "<the last_close of the segment server>"}'
        payload = json_object(request.get_data(cache=False), shape)  # 400/413, never a 500
        if set(payload) != {"record"}:
            raise BadRequest('the body must be JSON {"record": "<the last_close of the segment server>"}')
        return jsonify(rounds.close(g.tenant.name, payload["record"]))

    @app.get(P.FEDERATION_WEIGHTS)
    def weights():
        version, w = rounds.latest()
        return Response(encode(w, {"version": str(version)}), mimetype=P.CONTENT_TYPE)

    return app


def parse_args(argv=None) -> tuple[argparse.Namespace, FedConfig]:
    p = argparse.ArgumentParser(prog="python -m splitlearn.server.fedavg", allow_abbrev=False,
                                description="a fed server: averages client-side weights apart from the segment server")
    p.add_argument("--model", required=True, help="the segment server's --model (the client-side schema)")
    p.add_argument("--cut", type=int, action="append", required=True, dest="cuts", help="the segment server's --cut(s)")
    p.add_argument("--seed", type=int, default=0, help="the segment server's --seed")
    p.add_argument("--mode", default="splitfed", choices=["splitfed", "sequential"])
    p.add_argument("--fed-secret-file", required=True, help="the secret shared with the segment server (>= 32 bytes)")
    p.add_argument("--token-file", help="this server's tenants, '<name> <token>' per line, named as on the segment "
                                        "server (default: $SPLITLEARN_FED_TOKEN, comma-separated)")
    p.add_argument("--allow-weak-tokens", action="store_true", help="accept tokens under 16 characters (tests only)")
    p.add_argument("--aggregation", default="fedavg", choices=list(AGGREGATIONS))
    p.add_argument("--max-update-norm", default=str(DEFAULT_MAX_UPDATE_NORM),
                   help="L2 bound of one member's update around the shared weights ('none': unbounded)")
    p.add_argument("--trim-beta", type=float, default=0.2)
    p.add_argument("--max-member-share", type=float, default=DEFAULT_MAX_MEMBER_SHARE,
                   help="largest fraction of a round's FedAvg weight one member may hold (1: no cap)")
    p.add_argument("--upload-timeout", type=float, default=60.0,
                   help="seconds a closed round waits for a member's upload before closing without it")
    p.add_argument("--lora-r", type=int, default=None, help="the segment server's --lora-r (adapters only)")
    p.add_argument("--lora-alpha", type=float, default=None)
    p.add_argument("--lora-targets", default="c_attn")
    p.add_argument("--lora-dropout", type=float, default=0.0)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8001)
    p.add_argument("--max-body-mb", type=float, default=2048.0)
    p.add_argument("--log-level", default="INFO")
    a = p.parse_args(argv)
    lora = None if a.lora_r is None else LoraSpec(a.lora_r, 2.0 * a.lora_r if a.lora_alpha is None else a.lora_alpha,
                                                   a.lora_targets, a.lora_dropout)
    norm = None if a.max_update_norm.strip().lower() == "none" else float(a.max_update_norm)
    cfg = FedConfig(a.model, tuple(a.cuts), tickets.read_secret_file(a.fed_secret_file), a.mode, a.seed, lora,
                    a.aggregation, norm, a.trim_beta, a.upload_timeout, a.max_member_share)
    return a, cfg


def build(cfg: FedConfig, tenants: Tenants) -> Flask:
    from ..loading import load_config

    side = ClientSide(load_config(cfg.model), cfg.cuts, model=cfg.model, seed=cfg.seed, lora=cfg.lora)
    strategy = make_strategy(cfg.aggregation, cfg.max_update_norm, cfg.trim_beta, cfg.max_member_share)
    return create_fedavg_app(FedRounds(cfg, side, strategy), tenants)


def main(argv=None) -> int:
    import os

    from .frontdoor import make_server
    from .tenants import read_token_file

    try:
        a, cfg = parse_args(argv)
        logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
        tokens = (read_token_file(a.token_file) if a.token_file else
                  tuple(t.strip() for t in os.environ.get("SPLITLEARN_FED_TOKEN", "").split(",") if t.strip()))
        app = build(cfg, Tenants(tokens, allow_weak=a.allow_weak_tokens))
    except (SplitLearnError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    limit = int(a.max_body_mb * (1 << 20))
    app.config["MAX_CONTENT_LENGTH"] = limit
    # the same front door as the segment server (header-time auth, deadlines): splitlearn/server/frontdoor.py
    server = make_server(app, Tenants(tokens, allow_weak=a.allow_weak_tokens), host=a.host, port=a.port, threads=8,
                         max_body_bytes=limit, ident="splitlearn-fedavg")
    print(f"splitlearn fed server ({a.mode}) at http://{a.host}:{a.port} (ready)", file=sys.stderr, flush=True)
    server.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
