"""Per-request overhead: what one call costs beyond the server's own computation.

- ``splitlearn health``: ``GET /v1/health`` on the client's keep-alive ``requests.Session``
  (HTTP alone: Flask routing and waitress, no tensors);
- ``splitlearn decode step``: one U-shape decode step of batch 1 (1 x 1 x d float32 out and
  back), timed by the client from sending to having decoded the answer, minus the compute
  time the server reports in ``X-Server-Time-Ms`` (its decode, checks, segment and encode):
  the network, HTTP and thread hand-off cost of a step;
- ``naive JSON ping``: an empty POST with ``requests.post`` (a new connection each time) to
  the Werkzeug development server, as the naive baseline does it;
- ``torch.distributed.rpc ping``: ``rpc_sync`` of a no-op function over TensorPipe.

Value: median milliseconds per call over ``overhead_calls`` calls after warm-up.
"""
from __future__ import annotations

import statistics
import time

import torch

from splitlearn.api import protocol as P
from splitlearn.api.wire import decode, encode, pack

from .config import BenchConfig
from .timing import call_samples, p90


def _row(system, samples_s, **extra) -> dict:
    ms = [1e3 * s for s in samples_s]
    return {"workload": "overhead", "case": "one request", "system": system,
            "value": statistics.median(ms), "unit": "ms/call", "better": "lower",
            "median_s": statistics.median(samples_s), "p90_s": p90(samples_s), "repeats": len(ms), **extra}


def decode_step_overheads(client, calls: int) -> tuple[list[float], list[float]]:
    """Round trip and server-reported compute (seconds) of ``calls`` decode steps, batch 1."""
    d, n_pos = client.info["model_config"]["n_embd"], client.info["limits"]["max_position_embeddings"]
    calls = min(calls, n_pos - 2)
    sid = client.transport.post_json(P.SESSIONS, {"rows": 1})["session_id"]
    path = P.SESSION_STEP.format(session_id=sid)
    g = torch.Generator().manual_seed(0)
    trips, server = [], []
    try:
        for pos in range(calls + 1):
            h = torch.randn(1, 1, d, generator=g)
            body = encode({**pack(P.HIDDEN, h, "float32"), P.MASK: torch.ones(1, 1, dtype=torch.long)},
                          P.SessionStepMeta(pos, "float32").to_meta())
            before = client.stats.server_compute_s
            t0 = time.perf_counter()
            decode(client.transport.post_bytes(path, body))
            trips.append(time.perf_counter() - t0)
            server.append(client.stats.server_compute_s - before)
    finally:
        client.transport.delete(P.SESSION.format(session_id=sid))
    return trips[1:], server[1:]  # the first step is the session's prefill


def run(cfg: BenchConfig, ctx) -> list[dict]:
    n = cfg.overhead_calls
    rows = []
    with ctx.client("u") as client:
        ctx.log("  overhead: splitlearn")
        rows.append(_row("splitlearn health", call_samples(lambda: client.transport.get_json(P.HEALTH), n)))
        trips, server = decode_step_overheads(client, n)
        rows.append(_row("splitlearn decode step", [t - s for t, s in zip(trips, server)],
                         round_trip_ms=1e3 * statistics.median(trips),
                         server_ms=1e3 * statistics.median(server)))
    naive = ctx.naive()
    if naive is not None:
        ctx.log("  overhead: naive JSON")
        rows.append(_row("naive JSON ping", call_samples(naive.ping, n)))
    rpc = ctx.rpc()
    if rpc is not None:
        ctx.log("  overhead: torch.distributed.rpc")
        rows.append(_row("torch.distributed.rpc ping", rpc.ping_samples(n)))
    return rows
