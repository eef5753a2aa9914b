"""Replicas behind HAProxy: aggregate LoRA training and generation throughput, R = 1 and R = 2.

    python benchmarks/cluster.py                 # GPT-2 small shape (random:gpt2), 2-way cut 2
    python benchmarks/cluster.py --quick         # the tiny model, seconds: the smoke test

For each R, ``python -m splitlearn.cluster --replicas R --cores-per-replica 1`` (replica i
pinned to core i, one torch thread) serves per-client LoRA (r=8 on c_attn, c_proj) of a
2-way split: the server holds blocks 2-11 and the LM head, so the server's compute dominates
a step, which is what replicas divide. ``--owners`` LoRA owners (threads of this process,
one torch thread each), chosen so that each replica gets the same number (the ring spreads
many owners evenly on average; a handful can land unevenly), then:

1. training: every owner takes ``--steps`` AdamW steps at once; aggregate steps/s;
2. generation: every owner generates ``--new-tokens`` greedy tokens at once from a 16-token
   prompt (its own adapter); aggregate tokens/s.

Each measured ``--repeats`` times after a warm-up step and generation; medians. The clients
run on the same machine as the replicas: on a machine with as many cores as replicas they
compete with them, which this benchmark reports rather than hides.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests
import torch

from splitlearn.api import protocol as P
from splitlearn.client import SplitClient
from splitlearn.procs.localserver import free_port

TOKEN = "bench-cluster-5f0c9e1a7b3d"


def start_cluster(replicas: int, server_args: list[str], run_dir: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "splitlearn.cluster", "--replicas", str(replicas), "--port", str(port),
           "--run-dir", str(run_dir), "--cores-per-replica", "1", "--log-level", "WARNING", "--",
           *server_args, "--torch-threads", "1", "--log-level", "WARNING"]
    proc = subprocess.Popen(cmd, env={**os.environ, "SPLITLEARN_TOKEN": TOKEN, "OMP_NUM_THREADS": "1"})
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 600
    while not (run_dir / "replicas.json").is_file():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the cluster did not start (exit code {proc.poll()}); logs in {run_dir}")
        time.sleep(0.2)
    return proc, url


def balanced_owners(url: str, owners: int, replicas: int) -> list[str]:
    """Client ids, ``owners // replicas`` on each replica (by the answer's replica header)."""
    per: dict[str, list[str]] = {}
    for i in range(1000):
        cid = f"owner{i}"
        # HAProxy routes on the Authorization header and the client id (splitlearn/cluster/haproxy.py)
        r = requests.get(url + P.HEALTH, headers={"Authorization": f"Bearer {TOKEN}",
                                                  P.ROUTE_HEADER: P.route_key(TOKEN, cid)}, timeout=10)
        name = r.headers[P.REPLICA_HEADER]
        if len(per.setdefault(name, [])) < owners // replicas:
            per[name].append(cid)
        if sum(map(len, per.values())) == owners:
            return [c for ids in per.values() for c in ids]
    raise SystemExit("could not place the owners evenly")


def at_once(fns) -> float:
    """Run the callables in threads at once; seconds until the last one ends."""
    errors: list[str] = []

    def wrap(fn):
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - reported
            errors.append(repr(e))

    threads = [threading.Thread(target=wrap, args=(fn,)) for fn in fns]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise SystemExit(f"a client failed: {errors}")
    return time.perf_counter() - t0


def measure(replicas: int, a, server_args: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = start_cluster(replicas, server_args, Path(tmp) / "run")
        try:
            ids = balanced_owners(url, a.owners, replicas)
            clients = [SplitClient(url, a.model, token=TOKEN, client_id=c, lora="server", device="cpu",
                                   optimizer="adamw", lr=1e-4) for c in ids]
            g = torch.Generator().manual_seed(0)
            batch = torch.randint(0, clients[0].bottom.config.vocab_size - 1, (a.batch, a.seq), generator=g)
            prompt = batch[:1, :16]
            for c in clients:  # warm-up: adapters made, weights packed
                c.train_step(batch)
                c.generate(prompt, max_new_tokens=2)
            train, gen = [], []
            for _ in range(a.repeats):
                s = at_once([lambda c=c: [c.train_step(batch) for _ in range(a.steps)] for c in clients])
                train.append(a.owners * a.steps / s)
                s = at_once([lambda c=c: c.generate(prompt, max_new_tokens=a.new_tokens) for c in clients])
                gen.append(a.owners * a.new_tokens / s)
            for c in clients:
                c.close()
        finally:
            proc.terminate()
            proc.wait(120)
    return {"replicas": replicas, "train_steps_s": train, "gen_tokens_s": gen,
            "train_median": statistics.median(train), "gen_median": statistics.median(gen)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--quick", action="store_true", help="the tiny model (smoke test)")
    p.add_argument("--model", default="random:gpt2")
    p.add_argument("--cut", type=int, default=2, help="2-way cut: the server holds the blocks after it")
    p.add_argument("--owners", type=int, default=4)
    p.add_argument("--steps", type=int, default=4, help="training steps per owner per repeat")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    a = p.parse_args(argv)
    if a.quick:
        a.model, a.cut, a.steps, a.seq, a.repeats = "tiny", 2, 3, 16, 1
    torch.set_num_threads(1)
    server_args = ["--model", a.model, "--cut", str(a.cut), "--optimizer", "adamw", "--lr", "1e-4",
                   "--lora-r", "8", "--lora-alpha", "16", "--lora-targets", "c_attn,c_proj", "--threads", "8",
                   "--checkpoint-every", "100"]
    results = [measure(r, a, server_args) for r in (1, 2)]
    base = results[0]
    print(f"{a.model}, 2-way cut {a.cut}, {a.owners} LoRA owners, batch {a.batch}x{a.seq}, "
          f"{os.cpu_count()} cores; medians of {a.repeats}")
    print("| replicas | training steps/s | x R=1 | generation tokens/s | x R=1 |")
    print("|---|---|---|---|---|")
    for r in results:
        print(f"| {r['replicas']} | {r['train_median']:.2f} | {r['train_median'] / base['train_median']:.2f} "
              f"| {r['gen_median']:.1f} | {r['gen_median'] / base['gen_median']:.2f} |")
    if a.out:
        Path(a.out).write_text(json.dumps({"args": vars(a), "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
