"""Server batching on its own: light clients replay precomputed activations, no client compute.

Each of N clients (a thread with its own connection, as :class:`~splitlearn.client.SplitClient`
makes one) opens a generation session, sends a prompt's hidden states, then sends
``server_batching_new_tokens`` decode steps of precomputed (1, 1, d) activations, each as
soon as the previous answer is back, as a real client would. The bodies are encoded before
the clock starts, so what is timed is the server: HTTP, validation, the segment and the
cross-session batching of decode steps (:mod:`splitlearn.server.engine.batching`).

Value: server decode tokens/s = N x steps / (last finish - first start); ``ratio``: over one
session on the same server. Each shape runs on a server that batches and on one started with
``--no-batching``. The target (issue 15): 8 sessions >= 4x one session, batched.
"""
from __future__ import annotations

import statistics
import threading
import time

import torch

from splitlearn.api import protocol as P
from splitlearn.transport import Transport, TransportConfig
from splitlearn.api.wire import encode, pack

from .config import BenchConfig


class ReplayClient:
    """One session's precomputed bodies, replayed on a connection of its own."""

    def __init__(self, url: str, token: str, d: int, prompt_len: int, steps: int, seed: int):
        self.transport = Transport(TransportConfig(url, token))
        g = torch.Generator().manual_seed(seed)
        prompt = torch.randn(1, prompt_len, d, generator=g)  # (1, P, d)
        self.prefill = encode({**pack(P.HIDDEN, prompt, "float32")},
                              P.SessionStepMeta(0, "float32").to_meta())
        self.steps = [encode({**pack(P.HIDDEN, torch.randn(1, 1, d, generator=g), "float32"),  # (1, 1, d)
                              P.MASK: torch.ones(1, 1, dtype=torch.long)},
                             P.SessionStepMeta(prompt_len + i, "float32").to_meta()) for i in range(steps)]
        self.span = (0.0, 0.0)

    def run(self, start: threading.Barrier) -> None:
        sid = self.transport.post_json(P.SESSIONS, {"rows": 1})["session_id"]
        path = P.SESSION_STEP.format(session_id=sid)
        self.transport.post_bytes(path, self.prefill)
        start.wait()
        t0 = time.perf_counter()
        for body in self.steps:
            self.transport.post_bytes(path, body)
        self.span = (t0, time.perf_counter())
        self.transport.delete(P.SESSION.format(session_id=sid))

    def close(self) -> None:
        self.transport.close()


def replay(url: str, token: str, d: int, n: int, prompt_len: int, steps: int, seed: int) -> float:
    """``n`` sessions at once; seconds from the first decode step sent to the last answer."""
    clients = [ReplayClient(url, token, d, prompt_len, steps, seed + i) for i in range(n)]
    start = threading.Barrier(n)
    threads = [threading.Thread(target=c.run, args=(start,), daemon=True) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for c in clients:
        c.close()
    if any(c.span == (0.0, 0.0) for c in clients):
        raise RuntimeError("a replay client failed (see the log)")
    return max(c.span[1] for c in clients) - min(c.span[0] for c in clients)


def run(cfg: BenchConfig, ctx) -> list[dict]:
    d = ctx.model().config.n_embd
    steps, plen = cfg.server_batching_new_tokens, cfg.server_batching_prompt_len
    repeats = max(1, cfg.repeats)
    rows = []
    for shape in ("2-way", "u"):
        for batching in (True, False):
            srv = ctx.server(shape, batching=batching)
            system = f"splitlearn {shape} {'batched' if batching else 'unbatched'}"
            replay(srv.url, srv.token, d, max(cfg.server_batching_clients), plen, min(steps, 4), cfg.seed)  # warm-up
            for n in cfg.server_batching_clients:
                ctx.log(f"  server batching: {system}, {n} replay clients")
                spans = [replay(srv.url, srv.token, d, n, plen, steps, cfg.seed) for _ in range(repeats)]
                span = statistics.median(spans)
                rows.append({"workload": "server_batching",
                             "case": f"{n} sessions x batch 1, {steps} decode steps, replayed",
                             "clients": n, "system": system, "shape": shape, "batching": batching,
                             "value": n * steps / span, "unit": "server decode tokens/s", "better": "higher",
                             "median_s": span, "runs": spans,
                             "ms_per_round": 1e3 * span / steps})
    for r in rows:
        one = next(b for b in rows if b["system"] == r["system"] and b["clients"] == min(cfg.server_batching_clients))
        r["ratio"] = r["value"] / one["value"]
    return rows
