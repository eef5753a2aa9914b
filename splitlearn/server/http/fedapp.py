"""The fed server's app and command (``python -m splitlearn.server.http.fedapp``): the
routes around its rounds (:class:`~splitlearn.server.federation.fedserver.FedRounds`, its state),
built from the segment server's http pieces: the error answers and the token check
(:mod:`.hooks`), the probes (:mod:`.probes`), the metrics (:mod:`.metrics`, with
:class:`FedCollector`'s families), the access log (:mod:`.accesslog`) and the front door
(:mod:`.frontdoor`). Routes: docs/PROTOCOL.md, 'The fed server'; operating it:
docs/OPERATIONS.md, 'The fed server'.
"""
from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Iterator

if __name__ == "__main__":  # the options first (.fedcli imports no torch): --help and a bad option are
    # answered before the app's imports below (torch: ~8 s on 2 cores)
    from .fedcli import parse_or_exit
    _COMMAND = parse_or_exit()

from flask import Flask, Response, g, jsonify, request

from ...api import protocol as P
from ...errors import BadRequest, SplitLearnError
from ..engine.budget import body_account
from ..engine.memory import MemoryAccount, scope as memory_scope
from ...api.wire import decode, encode
from ..federation.clientside import ClientSide
from ..federation.fedserver import CLOSE_REASONS, FedConfig, FedRounds, FedServe
from ..federation.strategy import strategy_of
from ..tenants import Tenants
from . import accesslog, probes
from .fedcli import parse_args  # noqa: F401 (re-exported: the command line, without torch)
from .frontdoor import make_server
from .hooks import install_auth, install_errors
from .metrics import ServerMetrics, _StateCollector, operator_exposition
from .routing import BODY_HOLD_KEY
from .validate import json_object


class FedCollector:
    """The fed server's rounds as ``splitlearn_fed_*`` metric families, read at each scrape under
    the rounds' lock (families: docs/OPERATIONS.md, 'The fed server')."""

    def __init__(self, rounds: FedRounds, memory: MemoryAccount | None = None):
        self.rounds, self.memory = rounds, memory

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
        if self.memory is not None:  # the bodies' account, as the segment server's families
            yield from _StateCollector._memory(self.memory)


MEMORY = "splitlearn.fedavg.memory"  # app.extensions: the MemoryAccount of the tenants' bodies
BODY_COPIES = 3  # a body held at once: waitress's buffer, the bytes read of it, the tensors decoded


@contextmanager
def held_body(memory: MemoryAccount | None, what: str) -> Iterator[bytes]:
    """The request's body, held in ``memory`` while the route uses it: the door's reservation
    (made at its headers, before a byte was buffered) grown to :data:`BODY_COPIES` times its
    size (429 past the tenant's share, 503 past the total, before it is read)."""
    with memory_scope(memory, g.tenant.name) as held:
        held.hold(BODY_COPIES * (request.content_length or 0), what, adopt=request.environ.get(BODY_HOLD_KEY))
        yield request.get_data(cache=False)


def create_fedavg_app(rounds: FedRounds, tenants: Tenants, request_log: bool = True,
                      memory: MemoryAccount | None = None) -> Flask:
    """The fed server's routes around ``rounds``; ``tenants``: its own tokens; ``request_log``:
    count requests in ``/metrics`` and log their access lines (as the segment server);
    ``memory``: the account the door reserves tenants' bodies in (:func:`app_of` makes it)."""
    app = Flask("splitlearn.fedavg", static_folder=None)  # every route is in openapi.py
    app.extensions["splitlearn.fedavg"] = rounds
    app.extensions[MEMORY] = memory
    metrics = ServerMetrics(None, state=FedCollector(rounds, memory))  # this app's own registry
    app.extensions["splitlearn.metrics"] = metrics
    install_errors(app)  # the segment server's error answers (.hooks)
    if request_log:  # first of the hooks: the clock and the request id (.accesslog)
        accesslog.install(app, metrics)
    install_auth(app, tenants, "missing or wrong bearer token: the fed server's own (fed_token=, "
                               "$SPLITLEARN_FED_TOKEN), not the segment server's")
    app.get(P.HEALTH)(probes.health)

    @app.get(P.READY)
    def ready():  # no token, as the segment server's (.probes)
        return probes.ready_answer(*probes.fed_readiness(rounds))

    @app.get(P.METRICS)
    def metrics_text():
        return operator_exposition(metrics, "the metrics are the operator's: use the operator's fed token (a "
                                   "token-file line '<name> <token> operator', or the only token), or scrape "
                                   "--metrics-port on the fed server's loopback (docs/OPERATIONS.md)")

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
        with held_body(memory, "an upload") as data:
            tensors, meta = decode(data)
            del data
            return jsonify(rounds.upload(g.tenant.name, P.SyncMeta.from_meta(meta), tensors))

    @app.post(P.FEDERATION_CLOSE)
    def close():
        shape = '{"record": "<the last_close of the segment server>"}'
        with held_body(memory, "a close record") as data:
            payload = json_object(data, shape)  # 400/413, never a 500
        if set(payload) != {"record"}:
            raise BadRequest('the body must be JSON {"record": "<the last_close of the segment server>"}')
        return jsonify(rounds.close(g.tenant.name, payload["record"]))

    @app.get(P.FEDERATION_WEIGHTS)
    def weights():
        version, w = rounds.latest()
        return Response(encode(w, {"version": str(version)}), mimetype=P.CONTENT_TYPE)

    return app


def build(cfg: FedConfig, tenants: Tenants, request_log: bool = True, memory: MemoryAccount | None = None) -> Flask:
    from ...model.loading import load_config

    side = ClientSide(load_config(cfg.model), cfg.cuts, model=cfg.model, seed=cfg.seed, lora=cfg.lora)
    return create_fedavg_app(FedRounds(cfg, side, strategy_of(cfg)), tenants, request_log=request_log,
                             memory=memory)


def app_of(serve: FedServe, cfg: FedConfig) -> Flask:
    """The fed server's app as ``python -m ...fedapp`` serves it: its tenants, its body limit,
    the memory account its bodies are reserved in (:func:`..engine.budget.body_account`)."""
    tenants = serve.tenants()
    memory = body_account(len(tenants), serve.max_memory_bytes, serve.max_tenant_memory_bytes)
    app = build(cfg, tenants, request_log=serve.request_log, memory=memory)
    app.config["MAX_CONTENT_LENGTH"] = serve.max_body_bytes
    return app


def main(argv=None) -> int:
    try:
        serve, cfg = parse_args(argv)
    except (SplitLearnError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return run(serve, cfg)


def run(serve: FedServe, cfg: FedConfig) -> int:
    """Serve the fed server of these options until the process is stopped."""
    try:
        accesslog.configure(serve.log_level, serve.log_format, serve.access_log)  # text or JSON lines
        app = app_of(serve, cfg)
        scrape = app.extensions["splitlearn.metrics"].serve_loopback(serve.metrics_port, serve.tenants()) if serve.metrics_port else None
    except (SplitLearnError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # the same front door as the segment server (header-time auth, deadlines): :mod:`.frontdoor`
    server = make_server(app, serve.tenants(), host=serve.host, port=serve.port, threads=8,
                         max_body_bytes=serve.max_body_bytes, ident="splitlearn-fedavg",
                         memory=app.extensions[MEMORY])
    print(f"splitlearn fed server ({cfg.mode}) at http://{serve.host}:{serve.port} (ready)", file=sys.stderr, flush=True)
    try:
        server.run()
    finally:
        if scrape is not None:
            scrape.shutdown()
    return 0


if __name__ == "__main__":  # the fed server's command lives in its wing (http), above its state
    sys.exit(run(*_COMMAND))
