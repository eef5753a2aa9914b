"""A separate "fed server" for client-side weights: the segment server never sees them.

SplitFed proper (Thapa et al., AAAI 2022) averages the clients' client-side weights on a fed
server of their own, apart from the server that trains the segment; sharing client-side
weights with the segment server raises what it can learn from the activations it sees (see
docs/FEDERATION.md). Run one beside a ``--federation splitfed --client-weights external``
(or ``sequential``) segment server::

    python -m splitlearn.server.fedavg --mode splitfed --clients-per-round 3 --port 8001
    SplitClient(url, model, client_id="alice", fed_url="http://127.0.0.1:8001")

Clients then sync their weights here (``POST /v1/federation/sync``, the same body as to a
segment server) and download the average here (``GET /v1/federation/weights``); to the
segment server they send only their sample count. Both servers close a round after the same
K syncs, so their versions advance together. The fed server holds no model: it checks each
upload against the first one of the round (same names, shapes, float dtype, finite).
"""
from __future__ import annotations

import argparse
import logging
import sys
import threading
import time
from typing import Optional

import torch
from flask import Flask, Response, jsonify, request

from .. import protocol as P
from ..errors import BadRequest, Conflict, NotFound, SplitLearnError, Unauthorized
from ..wire import decode, encode
from .federation import weighted_average

log = logging.getLogger(__name__)


class WeightAverager:
    """Rounds of ``k`` syncs (splitfed: FedAvg weighted by samples) or turns (sequential:
    the last upload wins); thread-safe."""

    def __init__(self, mode: str, k: int, round_timeout_s: float):
        if mode not in ("sequential", "splitfed"):
            raise BadRequest(f"a fed server runs sequential or splitfed, not {mode!r}")
        self.mode, self.k, self.round_timeout_s = mode, k, round_timeout_s
        self.version, self.round = 0, 1
        self.weights: Optional[dict[str, torch.Tensor]] = None
        self.pending: dict[str, tuple[int, dict[str, torch.Tensor]]] = {}
        self.first_sync: Optional[float] = None
        self.lock = threading.Lock()

    def _check(self, weights: dict[str, torch.Tensor]) -> None:
        ref = self.weights or next((w for _, w in self.pending.values()), None)
        for name, t in weights.items():
            if t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
                raise BadRequest(f"weight {name!r} has dtype {t.dtype}; send float32, bfloat16 or float16")
            if not bool(torch.isfinite(t).all()):
                raise BadRequest(f"weight {name!r} contains NaN or inf")
        if ref is not None:
            if set(ref) != set(weights):
                raise BadRequest(f"the weights must have the same names as the others': missing "
                                 f"{sorted(set(ref) - set(weights))[:5]}, unexpected {sorted(set(weights) - set(ref))[:5]}")
            for name, t in weights.items():
                if t.shape != ref[name].shape:
                    raise BadRequest(f"weight {name!r} has shape {list(t.shape)}, expected {list(ref[name].shape)}")

    def sync(self, client_id: str, samples: int, weights: dict[str, torch.Tensor]) -> dict:
        with self.lock:
            self._check(weights)
            if self.mode == "sequential":
                self.weights, self.version = weights, self.version + 1
                return self._status()
            self._close_if_timed_out()
            self.pending[client_id] = (samples, weights)
            self.first_sync = self.first_sync or time.monotonic()
            if len(self.pending) >= self.k:
                self._close()
            return self._status()

    def _close_if_timed_out(self) -> None:
        if self.first_sync is not None and time.monotonic() - self.first_sync > self.round_timeout_s:
            log.warning("round %d timed out with %d of %d syncs", self.round, len(self.pending), self.k)
            self._close()

    def _close(self) -> None:
        ids = list(self.pending)
        self.weights = weighted_average([self.pending[c][1] for c in ids], [self.pending[c][0] for c in ids])
        self.version, self.round = self.version + 1, self.round + 1
        self.pending, self.first_sync = {}, None

    def latest(self) -> tuple[int, dict[str, torch.Tensor]]:
        with self.lock:
            if self.weights is None:
                raise NotFound("no client has synced its weights yet")
            return self.version, self.weights

    def _status(self) -> dict:
        return {"mode": self.mode, "version": self.version, "round": self.round,
                "clients_per_round": self.k if self.mode == "splitfed" else None,
                "synced": sorted(self.pending), "members": [], "turn": None,
                "round_timeout_s": self.round_timeout_s, "fed_server": True}

    def status(self) -> dict:
        with self.lock:
            if self.mode == "splitfed":
                self._close_if_timed_out()
            return self._status()


def create_fedavg_app(averager: WeightAverager, tokens: tuple[str, ...]) -> Flask:
    app = Flask("splitlearn.fedavg")
    app.extensions["splitlearn.fedavg"] = averager

    @app.errorhandler(SplitLearnError)
    def _error(err: SplitLearnError):
        resp = jsonify(err.to_payload())
        resp.status_code = err.status
        return resp

    @app.before_request
    def _authenticate():
        if request.path == P.HEALTH:
            return None
        header = request.headers.get("Authorization", "")
        if not header.startswith("Bearer ") or header[7:] not in tokens:
            raise Unauthorized("missing or wrong bearer token (Authorization: Bearer <token>)")
        return None

    @app.get(P.HEALTH)
    def health():
        return jsonify(status="ok", protocol_version=P.PROTOCOL_VERSION)

    @app.get(P.FEDERATION)
    def status():
        return jsonify(averager.status())

    @app.post(P.FEDERATION_SYNC)
    def sync():
        if request.mimetype != P.CONTENT_TYPE:
            raise BadRequest(f"send the weights as {P.CONTENT_TYPE} (safetensors)")
        tensors, meta = decode(request.get_data(cache=False))
        m = P.SyncMeta.from_meta(meta)
        if not tensors:
            raise Conflict("a fed server takes the weights themselves; an empty sync is for the segment server")
        return jsonify(averager.sync(m.client_id, m.samples, tensors))

    @app.get(P.FEDERATION_WEIGHTS)
    def weights():
        version, w = averager.latest()
        return Response(encode(w, {"version": str(version)}), mimetype=P.CONTENT_TYPE)

    return app


def main(argv=None) -> int:
    import os

    import waitress

    p = argparse.ArgumentParser(prog="python -m splitlearn.server.fedavg", allow_abbrev=False,
                                description="a fed server: averages client-side weights apart from the segment server")
    p.add_argument("--mode", default="splitfed", choices=["splitfed", "sequential"])
    p.add_argument("--clients-per-round", type=int, default=2)
    p.add_argument("--round-timeout", type=float, default=300.0)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8001)
    p.add_argument("--max-body-mb", type=float, default=2048.0)
    a = p.parse_args(argv)
    tokens = tuple(t.strip() for t in os.environ.get("SPLITLEARN_TOKEN", "").split(",") if t.strip())
    if not tokens or a.clients_per_round < 1:
        print("error: set SPLITLEARN_TOKEN and give --clients-per-round >= 1", file=sys.stderr)
        return 2
    limit = int(a.max_body_mb * (1 << 20))
    app = create_fedavg_app(WeightAverager(a.mode, a.clients_per_round, a.round_timeout), tokens)
    app.config["MAX_CONTENT_LENGTH"] = limit
    print(f"splitlearn fed server ({a.mode}) at http://{a.host}:{a.port} (ready)", file=sys.stderr, flush=True)
    waitress.serve(app, host=a.host, port=a.port, threads=8, inbuf_overflow=limit, outbuf_overflow=limit,
                   max_request_body_size=limit, ident="splitlearn-fedavg")
    return 0


if __name__ == "__main__":
    sys.exit(main())
