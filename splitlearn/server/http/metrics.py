"""Prometheus metrics of one server (``prometheus-client``): ``GET /metrics`` (operator's token)
and ``--metrics-port`` (127.0.0.1, the operator's token too: docs/SECURITY.md, 'Tenants see their
own').

Each app has its own :class:`~prometheus_client.CollectorRegistry` (never the global one: a
process may hold several apps). Request families are counted in the app's ``after_request``
hook (:mod:`.accesslog`); the state families are read at scrape time (:class:`_StateCollector`);
the fed server passes its own state collector (``state=``). Families, labels, PromQL:
docs/OPERATIONS.md, 'Metrics'.
"""
from __future__ import annotations

import json
import logging
import threading
from socketserver import ThreadingMixIn
from typing import Callable, Optional
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from flask import Response, g, request
from prometheus_client import CollectorRegistry, Counter, Histogram, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import choose_encoder

from ...api import protocol as P
from ...errors import ConfigError, Forbidden, Unauthorized

log = logging.getLogger(__name__)

# seconds; a decode step is ~1-20 ms on CPU, a training step up to seconds
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
WAIT_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)


def operator_exposition(metrics: "ServerMetrics", refusal: str) -> Response:
    """``GET /metrics`` (both servers): the families as text, for the operator's token only
    (403 ``refusal`` for another tenant's)."""
    if not g.tenant.operator:
        raise Forbidden(refusal)
    body, content_type = metrics.exposition(request.headers.get("Accept"))
    return Response(body, status=200, headers={"Content-Type": content_type})


class ServerMetrics:
    """The registry of one app: request counters fed by :meth:`observe`, the server's state
    read from the runtime ``rt`` at each scrape (or by ``state``, a collector of another
    server's: the fed server's, :mod:`.fedapp`)."""

    def __init__(self, rt, memory=None, state=None):
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.before_scrape: Optional[Callable[[], None]] = None  # accesslog.drain: requests answered, counted first
        r.register(_BeforeScrape(self))  # the first collector: any scrape (GET /metrics, --metrics-port) runs it
        self.requests = Counter("splitlearn_requests", "Requests answered by the app",
                                ("route", "method", "status", "tenant"), registry=r)
        self.duration = Histogram("splitlearn_request_duration_seconds", "Time in the app per request",
                                  ("route", "method"), buckets=LATENCY_BUCKETS, registry=r)
        self.bytes = Counter("splitlearn_request_bytes", "Body bytes per route", ("route", "direction"),
                             registry=r)
        self.waits = Histogram("splitlearn_queue_wait_seconds", "Wait for the compute thread per priority class",
                               ("class",), buckets=WAIT_BUCKETS, registry=r)
        r.register(state if state is not None else _StateCollector(rt, memory))
        # label children, kept: .labels() validates and locks on every call (~1.5 us); a dict get does not
        self._children: dict[tuple, tuple] = {}
        self._wait_children = {}
        waits = getattr(rt, "waits", None)
        if waits is not None:
            waits.listeners.append(self.observe_wait)

    def observe(self, route: str, method: str, status: int, tenant: str, seconds: float,
                bytes_in: int, bytes_out: int) -> None:
        """Count one answered request. ``method`` is the client's word (any token passes HTTP
        parsing): one outside :data:`METHODS` is counted as "other", so a client cannot grow the
        registry by a label child per made-up method."""
        method = method if method in METHODS else "other"
        key = (route, method, status, tenant)
        c = self._children.get(key)
        if c is None:
            c = self._children[key] = (self.requests.labels(route, method, str(status), tenant),
                                       self.duration.labels(route, method),
                                       self.bytes.labels(route, "in"), self.bytes.labels(route, "out"))
        c[0].inc()
        c[1].observe(seconds)
        if bytes_in:
            c[2].inc(bytes_in)
        if bytes_out:
            c[3].inc(bytes_out)

    def observe_wait(self, cls: str, seconds: float) -> None:
        h = self._wait_children.get(cls)
        if h is None:
            h = self._wait_children[cls] = self.waits.labels(cls)
        h.observe(seconds)

    def exposition(self, accept: Optional[str] = None) -> tuple[bytes, str]:
        """The metrics in the format the ``Accept`` header asks for (Prometheus' text format
        0.0.4 by default, OpenMetrics if asked) and its content type."""
        encoder, content_type = choose_encoder(accept or "")
        return encoder(self.registry), content_type

    def serve_loopback(self, port: int, tenants):
        """Serve the metrics on 127.0.0.1:``port`` (a daemon thread) to the operator's token of
        ``tenants`` only (401 without a token, 403 for a tenant's: every local user reaches
        loopback, and the families name tenants and their routes); the server, for
        ``shutdown()``."""
        try:
            server = make_server("127.0.0.1", port, _operator_only(make_wsgi_app(self.registry), tenants),
                                 _ThreadingServer, handler_class=_QuietHandler)
        except OSError as e:
            raise ConfigError(f"--metrics-port {port}: cannot listen on 127.0.0.1:{port}: {e}") from None
        threading.Thread(target=server.serve_forever, name="splitlearn-metrics", daemon=True).start()
        log.info("metrics on http://127.0.0.1:%d/metrics (the operator's token)", port)
        return server


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, *args):  # scrapes every few seconds: not the server's log
        pass


def _operator_only(inner, tenants):
    """``inner`` (a WSGI app) behind the operator's ``Authorization: Bearer`` token."""

    def app(environ, start_response):
        tenant = tenants.authenticate(environ.get("HTTP_AUTHORIZATION"))
        if tenant is not None and tenant.operator:
            return inner(environ, start_response)
        err = Unauthorized("the metrics port needs the operator's token (Authorization: Bearer)") if tenant is None \
            else Forbidden("the metrics are the operator's: this token is a tenant's")
        body = json.dumps(err.to_payload()).encode()
        start_response(f"{err.status} {'Unauthorized' if tenant is None else 'Forbidden'}",
                       [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
        return [body]

    return app


class _BeforeScrape:
    """Registered first: runs the metrics' ``before_scrape`` as a scrape begins; no families."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics

    def describe(self):
        return []

    def collect(self):
        if self.metrics.before_scrape is not None:
            self.metrics.before_scrape()
        return []


class _StateCollector:
    """The runtime's state as metric families, read at each scrape (any attribute a runtime
    lacks, an offload server's sessions say, is left out)."""

    def __init__(self, rt, memory=None):
        self.rt, self.memory = rt, memory

    def describe(self):
        return []  # families vary with the runtime: not checked at registration

    def collect(self):
        rt = self.rt
        info = GaugeMetricFamily("splitlearn_server_info", "The server's shape and federation mode",
                                 labels=("shape", "federation", "protocol_version"))
        segment = getattr(rt, "segment", None)
        shape = "offload" if segment is None else ("u" if segment.kind == "trunk" else "2-way")
        info.add_metric((shape, rt.cfg.federation, str(P.PROTOCOL_VERSION)), 1)
        yield info
        compute = getattr(rt, "compute", None)
        if compute is not None:
            yield GaugeMetricFamily("splitlearn_compute_queue", "Work waiting for the compute thread",
                                    value=compute.waiting())
        ledger = getattr(rt, "ledger", None)
        if ledger is not None:
            yield CounterMetricFamily("splitlearn_steps_applied", "Optimizer steps applied",
                                      value=ledger.steps_applied)
        batcher = getattr(rt, "batcher", None)
        if batcher is not None:
            yield CounterMetricFamily("splitlearn_decode_steps", "Decode steps run", value=batcher.items)
            yield CounterMetricFamily("splitlearn_decode_forwards", "Batched decode forwards run",
                                      value=batcher.batches)
        preemptor = getattr(rt, "preemptor", None)
        yield CounterMetricFamily("splitlearn_preemptions", "Times training yielded to decode steps",
                                  value=preemptor.preemptions if preemptor is not None else 0)
        sessions = getattr(rt, "sessions", None)
        if sessions is not None:
            n = GaugeMetricFamily("splitlearn_sessions", "Open generation sessions", labels=("tenant",))
            tok = GaugeMetricFamily("splitlearn_cached_tokens", "Cached tokens (rows x length) of the "
                                    "generation sessions", labels=("tenant",))
            for tenant, (count, tokens) in sorted(sessions.usage().items()):
                n.add_metric((tenant or "-",), count)
                tok.add_metric((tenant or "-",), tokens)
            yield n
            yield tok
        if self.memory is not None:
            yield from self._memory(self.memory)
        federation = getattr(rt, "federation", None)
        if federation is not None:
            yield GaugeMetricFamily("splitlearn_federation_round", "The federation round open now",
                                    value=federation.round.number)
            yield GaugeMetricFamily("splitlearn_federation_version", "Version of the shared client-side weights",
                                    value=federation.version)

    @staticmethod
    def _memory(m):
        held = GaugeMetricFamily("splitlearn_memory_reserved_bytes", "Bytes each tenant holds (memory account)",
                                 labels=("tenant",))
        for tenant, nbytes in sorted(m.by_tenant().items()):
            held.add_metric((tenant or "-",), nbytes)
        yield held
        d = m.to_dict()
        yield GaugeMetricFamily("splitlearn_memory_reserved_total_bytes", "Bytes reserved in total",
                                value=d["reserved_bytes"])
        yield GaugeMetricFamily("splitlearn_memory_limit_bytes", "Bytes the server may hold in all",
                                value=d["limit_bytes"])
        yield GaugeMetricFamily("splitlearn_memory_tenant_limit_bytes", "Bytes one tenant may hold",
                                value=d["tenant_limit_bytes"])
        yield CounterMetricFamily("splitlearn_memory_evictions", "Stored answers evicted to make room",
                                  value=d["evictions"])
        yield CounterMetricFamily("splitlearn_memory_refusals", "Reservations refused (429/503)",
                                  value=d["refusals"])


#: the ``method`` label's values (anything else: "other")
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


def route_of(request) -> str:
    """The ``route`` label: the URL rule matched (never the path: it holds session ids)."""
    rule = request.url_rule
    return rule.rule if rule is not None else "unmatched"
