"""Concurrency: N generation clients at once on one server, aggregate tokens/s.

Each client is its own process (as separate users would be) holding its own segments, one
torch thread each; all N start together on a shared clock and greedily generate
``concurrency_new_tokens`` tokens from their own prompt (batch 1). Aggregate tokens/s =
N x new tokens / (last finish - first start); ``ratio`` is over one client alone on the same
server. Each shape runs against a server that batches concurrent sessions' decode steps into
one forward (:mod:`splitlearn.server.engine.batching`) and against one started with
``--no-batching``, so the gain of batching is measured, not assumed.

On a machine where clients and server share the cores (as here), the clients' own compute
competes with the server's: the 2-way split, whose server holds most of the model and the
LM head, shows what batching buys; the U-shape keeps the LM head on every client.
"""
from __future__ import annotations

import multiprocessing as mp
import statistics
import time

import torch

from .config import BenchConfig
from .generation import prompts


def _worker(conn, model_src: str, seed: int, device: str) -> None:
    torch.set_num_threads(1)
    from splitlearn import load_model
    from splitlearn.client import SplitClient

    model = load_model(model_src, seed=seed, device=device)
    clients = {}
    conn.send("ready")
    while True:
        msg = conn.recv()
        if msg is None:
            break
        if msg[0] == "connect":
            _, url, token = msg
            if url not in clients:
                clients[url] = SplitClient(url, model, token=token, device=device, seed=seed)
            conn.send("connected")
        else:
            _, url, ids, new_tokens, start_at = msg
            while time.monotonic() < start_at:
                time.sleep(0.0005)
            t0 = time.monotonic()
            clients[url].generate(ids, max_new_tokens=new_tokens)
            conn.send((t0, time.monotonic()))
    for c in clients.values():
        c.close()


class ClientPool:
    """``n`` client processes, each with its own copy of the model."""

    def __init__(self, n: int, model_src: str, seed: int, device: str, context: str = "spawn"):
        ctx = mp.get_context(context)
        self.conns, self.procs = [], []
        for _ in range(n):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(child, model_src, seed, device), daemon=True)
            p.start()
            self.conns.append(parent)
            self.procs.append(p)
        for c in self.conns:
            if c.recv() != "ready":
                raise RuntimeError("a benchmark client process failed to start")

    def connect(self, url: str, token: str) -> None:
        for c in self.conns:
            c.send(("connect", url, token))
        for c in self.conns:
            c.recv()

    def generate(self, n: int, url: str, ids: list, new_tokens: int) -> float:
        """``n`` clients generate at once; seconds from the first start to the last finish."""
        start_at = time.monotonic() + 0.2
        for c, x in zip(self.conns[:n], ids):
            c.send(("run", url, x, new_tokens, start_at))
        spans = [c.recv() for c in self.conns[:n]]
        return max(e for _, e in spans) - min(s for s, _ in spans)

    def close(self) -> None:
        for c in self.conns:
            c.send(None)
        for p in self.procs:
            p.join(30)


def run(cfg: BenchConfig, ctx) -> list[dict]:
    most = max(cfg.concurrency)
    vocab = ctx.model().config.vocab_size
    ids = [prompts(cfg, 100 + i, vocab, cfg.concurrency_prompt_len)[:1] for i in range(most)]
    new = cfg.concurrency_new_tokens
    repeats = max(1, min(cfg.repeats, 2))
    ctx.log(f"  concurrency: starting {most} client processes")
    pool = ClientPool(most, cfg.model, cfg.seed, cfg.device, cfg.mp_context)
    rows = []
    try:
        for shape in ("2-way", "u"):
            for batching in (True, False):
                srv = ctx.server(shape, batching=batching)
                pool.connect(srv.url, srv.token)
                pool.generate(most, srv.url, ids, min(new, 4))  # warm-up: sessions, caches, threads
                system = f"splitlearn {shape} {'batched' if batching else 'unbatched'}"
                for n in cfg.concurrency:
                    ctx.log(f"  concurrency: {system}, {n} clients")
                    spans = [pool.generate(n, srv.url, ids, new) for _ in range(repeats)]
                    span = statistics.median(spans)
                    rows.append({"workload": "concurrency", "case": f"{n} clients x batch 1, {new} new tokens",
                                 "clients": n, "system": system, "shape": shape, "batching": batching,
                                 "value": n * new / span, "unit": "tokens/s (all clients)", "better": "higher",
                                 "median_s": span, "runs": spans})
    finally:
        pool.close()
    for r in rows:
        one = next(b for b in rows if b["system"] == r["system"] and b["clients"] == min(cfg.concurrency))
        r["ratio"] = r["value"] / one["value"]
    return rows
