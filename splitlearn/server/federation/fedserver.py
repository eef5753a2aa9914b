"""A separate "fed server" for client-side weights: the segment server never sees them.

Runs beside a ``--client-weights external`` segment server with the same model, cuts, LoRA
options and a shared secret::

    python -m splitlearn.server.federation.fedserver --model tiny-demo --cut 2 --cut 4 --mode splitfed \\
        --fed-secret-file fed.secret --token-file fed-tokens.txt --port 8001

Takes an upload only with the segment server's ticket (:mod:`.tickets`) for the round being
collected, from the tenant it names, once per member, in its own schema (:mod:`.clientside`);
combines with the same :mod:`.strategy`. A round closes on the forwarded close record's members
all uploaded, a later round's ticket, or ``--upload-timeout``. State is in memory.
Design and trust: docs/FEDERATION.md, 'Who sees the client-side weights'; operating it and
its metrics: docs/OPERATIONS.md, 'The fed server'.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Optional

import torch
from flask import Flask, Response, g, jsonify, request

from ...api import protocol as P
from ...errors import BadRequest, ConfigError, Conflict, Forbidden, NotFound, SplitLearnError, Unauthorized
from ...model.lora import LoraSpec
from ...api.wire import decode, encode
from . import tickets
from .clientside import ClientSide
from .rounds import aggregate
from .strategy import Strategy, coordinate_median
from ..config import MiB, LoraOptions, Observability, StrategyOptions
from ..engine.tenants import Tenants
from ..options import add_options, opt, options_of
from ...api.protocol import read_token_file
from ..http import accesslog
from ..http.metrics import ServerMetrics
from ..http.probes import fed_readiness
from ..http.validate import json_object

log = logging.getLogger(__name__)

Weights = dict[str, torch.Tensor]


@dataclass
class FedConfig(StrategyOptions):
    """What the fed server shares with its segment server"""

    model: str = opt(help="the segment server's --model (the client-side schema)")
    cuts: tuple[int, ...] = opt(help="the segment server's --cut(s)", flag="--cut")
    secret: bytes = opt(help="the secret shared with the segment server (>= 32 bytes)", flag="--fed-secret-file",
                        parse=tickets.read_secret_file, repr=False)
    mode: str = opt("splitfed", "the segment server's --federation", choices=("splitfed", "sequential"))
    seed: int = opt(0, "the segment server's --seed")
    lora: Optional[LoraSpec] = opt(None, cli=False)  # the segment server's --lora-* (client-side adapters only)
    upload_timeout_s: float = opt(60.0, "seconds a closed round waits for a member's upload before closing "
                                        "without it")

    def __post_init__(self):
        self.strategy()  # ConfigError if invalid
        if self.mode not in ("splitfed", "sequential"):
            raise ConfigError(f"a fed server runs sequential or splitfed, not {self.mode!r}")
        if not self.upload_timeout_s > 0:
            raise ConfigError(f"--upload-timeout must be > 0 seconds, got {self.upload_timeout_s}")
        tickets.check_secret(self.secret)
        self.cuts = tuple(self.cuts)


@dataclass(kw_only=True)
class FedServe(Observability):
    """Where the fed server listens, and its own tenants (and, from Observability: --log-level,
    --log-format, --access-log, --metrics-port, --no-request-log, as on the segment server)"""

    tokens: tuple[str, ...] = opt((), "this server's tenants, '<name> <token>' per line, named as on the segment "
                                      "server (default: $SPLITLEARN_FED_TOKEN, comma-separated)",
                                  flag="--token-file", parse=read_token_file, metavar="TOKEN_FILE")
    allow_weak_tokens: bool = opt(False, "accept tokens under 16 characters (tests only)")
    host: str = opt("127.0.0.1", "address to listen on")
    port: int = opt(8001, "port to listen on")
    max_body_bytes: int = opt(2048 * MiB, "larger request bodies get 413 (MiB)", flag="--max-body-mb", unit=MiB)

    def __post_init__(self):
        if self.log_format not in ("text", "json"):
            raise ConfigError(f"--log-format must be text or json, got {self.log_format!r}")
        if self.metrics_port is not None and not (0 < self.metrics_port < 65536 and self.metrics_port != self.port):
            raise ConfigError(f"--metrics-port must be in 1..65535 and not --port, got {self.metrics_port}")

    def tenants(self) -> Tenants:
        tokens = self.tokens or tuple(t.strip() for t in os.environ.get("SPLITLEARN_FED_TOKEN", "").split(",")
                                      if t.strip())
        return Tenants(tokens, allow_weak=self.allow_weak_tokens)


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
        self.closed = dict.fromkeys(CLOSE_REASONS, 0)  # rounds closed here, by why (/metrics)
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
            self._close(f"a ticket of round {t.round} came", "later_round")
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
                    self._close(f"the segment server closed round {c.round}", "later_round")
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
            self._close("every member's upload is here (or was refused)", "complete")

    def _expire(self) -> None:
        if self.target is not None and time.monotonic() - self.target_seen > self.cfg.upload_timeout_s:
            if self.cfg.mode == "splitfed":
                self._close(f"uploads still missing {self.cfg.upload_timeout_s:g}s after the close record", "timeout")
            else:
                log.warning("the turn holder's upload for version %d never came: keeping version %d's weights",
                            self.target - 1, self.version)
                self.version, self.target = max(self.version, self.target), None

    def _close(self, why: str, reason: str) -> None:
        self.closed[reason] += 1
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
        agg = aggregate(self.strategy, ref, uploads)  # the round closes as every round does (.rounds)
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


CLOSE_REASONS = ("complete", "later_round", "timeout")  # every upload in; a later round's ticket or record; --upload-timeout


class FedCollector:
    """The fed server's rounds as ``splitlearn_fed_*`` metric families, read at each scrape under
    the rounds' lock (families: docs/OPERATIONS.md, 'The fed server')."""

    def __init__(self, rounds: FedRounds):
        self.rounds = rounds

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        fr = self.rounds
        with fr.lock:
            fr._expire()  # a round past --upload-timeout is closed, as a status read closes it
            version, number, expected = fr.version, fr.round, fr.expected
            held, failed, closed, last = len(fr.uploads), len(fr.failed), dict(fr.closed), dict(fr.last_round)
        info = GaugeMetricFamily("splitlearn_server_info", "The server's shape and federation mode",
                                 labels=("shape", "federation", "protocol_version"))
        info.add_metric(("fed", fr.cfg.mode, str(P.PROTOCOL_VERSION)), 1)
        yield info
        yield GaugeMetricFamily("splitlearn_federation_version", "Version of the shared client-side weights",
                                value=version)
        yield GaugeMetricFamily("splitlearn_fed_round", "The segment server's round being collected (0: none)",
                                value=number or 0)
        uploads = GaugeMetricFamily("splitlearn_fed_uploads", "Uploads held for the round being collected",
                                    labels=("state",))
        uploads.add_metric(("accepted",), held)
        uploads.add_metric(("failed",), failed)
        yield uploads
        yield GaugeMetricFamily("splitlearn_fed_expected_uploads", "Members the close record names (0: none yet)",
                                value=expected or 0)
        closes = CounterMetricFamily("splitlearn_fed_rounds_closed", "Rounds closed here, by reason",
                                     labels=("reason",))
        for reason in CLOSE_REASONS:
            closes.add_metric((reason,), closed[reason])
        yield closes
        yield GaugeMetricFamily("splitlearn_fed_last_round_members", "Members averaged in the last round",
                                value=last.get("members", 0))
        yield GaugeMetricFamily("splitlearn_fed_last_round_samples", "Samples (target tokens) of the last round",
                                value=last.get("samples", 0))


def create_fedavg_app(rounds: FedRounds, tenants: Tenants, request_log: bool = True) -> Flask:
    """The fed server's routes around ``rounds``; ``tenants``: its own tokens; ``request_log``:
    count requests in ``/metrics`` and log their access lines (as the segment server)."""
    app = Flask("splitlearn.fedavg", static_folder=None)  # every route is in openapi.py
    app.extensions["splitlearn.fedavg"] = rounds
    metrics = ServerMetrics(None, state=FedCollector(rounds))  # this app's own registry
    app.extensions["splitlearn.metrics"] = metrics
    if request_log:  # first of the hooks: the clock and the request id (..http.accesslog)
        accesslog.install(app, metrics)

    @app.errorhandler(SplitLearnError)
    def _error(err: SplitLearnError):
        resp = jsonify(err.to_payload())
        resp.status_code = err.status
        return resp

    @app.before_request
    def _authenticate():  # constant-time (Tenants.authenticate); the front door checked it already
        if request.path in (P.HEALTH, P.READY) or (request.path == P.OPENAPI and "Authorization" not in request.headers):
            return None  # /v1/openapi.json: the protocol's document, the same for everyone
        g.tenant = tenants.authenticate(request.headers.get("Authorization"))
        if g.tenant is None:
            raise Unauthorized("missing or wrong bearer token: the fed server's own (fed_token=, "
                               "$SPLITLEARN_FED_TOKEN), not the segment server's")
        return None

    @app.get(P.HEALTH)
    def health():
        return jsonify(status="ok", protocol_version=P.PROTOCOL_VERSION)

    @app.get(P.READY)
    def ready():  # no token, as the segment server's (..http.probes)
        ok, checks = fed_readiness(rounds)
        return jsonify(ready=ok, checks=checks), 200 if ok else 503

    @app.get(P.METRICS)
    def metrics_text():
        if not g.tenant.operator:
            raise Forbidden("the metrics are the operator's: use the operator's fed token (a token-file line "
                            "'<name> <token> operator', or the only token), or scrape --metrics-port on the "
                            "fed server's loopback (docs/OPERATIONS.md)")
        body, content_type = metrics.exposition(request.headers.get("Accept"))
        return Response(body, status=200, headers={"Content-Type": content_type})

    @app.get(P.OPENAPI)
    def openapi_document():
        from ...api.openapi import document
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


def parse_args(argv=None) -> tuple[FedServe, FedConfig]:
    """The command line, generated from :class:`FedServe`, :class:`FedConfig` and the
    segment server's LoRA options."""
    p = argparse.ArgumentParser(prog="python -m splitlearn.server.federation.fedserver", allow_abbrev=False,
                                description="a fed server: averages client-side weights apart from the segment server")
    for group in (FedConfig, LoraOptions, FedServe):
        add_options(p, group)
    a = p.parse_args(argv)
    serve = FedServe(**options_of(FedServe, a))
    cfg = FedConfig(**options_of(FedConfig, a), lora=LoraOptions(**options_of(LoraOptions, a)).spec())
    return serve, cfg


def build(cfg: FedConfig, tenants: Tenants, request_log: bool = True) -> Flask:
    from ...model.loading import load_config

    side = ClientSide(load_config(cfg.model), cfg.cuts, model=cfg.model, seed=cfg.seed, lora=cfg.lora)
    return create_fedavg_app(FedRounds(cfg, side, cfg.strategy()), tenants, request_log=request_log)


def app_of(serve: FedServe, cfg: FedConfig) -> Flask:
    """The fed server's app as ``python -m ...fedserver`` serves it: its tenants, its body limit."""
    app = build(cfg, serve.tenants(), request_log=serve.request_log)
    app.config["MAX_CONTENT_LENGTH"] = serve.max_body_bytes
    return app


def main(argv=None) -> int:
    from ..http.frontdoor import make_server

    try:
        serve, cfg = parse_args(argv)
        accesslog.configure(serve.log_level, serve.log_format, serve.access_log)  # text or JSON lines
        app = app_of(serve, cfg)
        scrape = app.extensions["splitlearn.metrics"].serve_loopback(serve.metrics_port) if serve.metrics_port else None
    except (SplitLearnError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # the same front door as the segment server (header-time auth, deadlines): splitlearn/server/http/frontdoor.py
    server = make_server(app, serve.tenants(), host=serve.host, port=serve.port, threads=8,
                         max_body_bytes=serve.max_body_bytes, ident="splitlearn-fedavg")
    print(f"splitlearn fed server ({cfg.mode}) at http://{serve.host}:{serve.port} (ready)", file=sys.stderr, flush=True)
    try:
        server.run()
    finally:
        if scrape is not None:
            scrape.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
