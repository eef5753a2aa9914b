"""SplitFed rounds with K = 1, 2, 4, 8 clients on one server: round time, memory, bytes per sync.

    python benchmarks/federation.py                  # GPT-2 small shape, U-shape (2, 10)
    python benchmarks/federation.py --quick          # tiny model

For each K a fresh ``--federation splitfed --clients-per-round K`` server (SGD, so a member's
copy is the segment's parameters only); K clients in threads each run ``steps`` training steps
then ``sync()`` (upload, wait for the round, download the average), for ``rounds`` rounds.
Reported per K: median round time (first round excluded), server RSS at the end of a round's
training (its K copies alive) minus its RSS before the first round, divided by K (memory per
client), and the bytes of one sync upload (the client-side weights).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from splitlearn.client import SplitClient  # noqa: E402
from splitlearn.hf.fedsync import untied_weights  # noqa: E402
from splitlearn.procs.localserver import LocalServer  # noqa: E402
from splitlearn.api.wire import encode  # noqa: E402


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def one_k(model: str, cuts, k: int, rounds: int, steps: int, B: int, T: int) -> dict:
    srv = LocalServer(["--model", model, "--cut", str(cuts[0]), "--cut", str(cuts[1]), "--optimizer", "sgd",
                       "--lr", "1e-3", "--federation", "splitfed", "--clients-per-round", str(k),
                       "--device", "cpu", "--threads", str(max(4, 2 * k))]).start()
    try:
        clients = [SplitClient(srv.url, model, token=srv.token, optimizer="sgd", lr=1e-3, device="cpu",
                               client_id=f"c{i}") for i in range(k)]
        vocab = clients[0].bottom.config.vocab_size
        base_rss = rss_bytes(srv.proc.pid)
        peak, times = 0, []
        for r in range(rounds):
            trained = threading.Barrier(k + 1)

            def run(c, i):
                g = torch.Generator().manual_seed(1000 * r + i)
                for _ in range(steps):
                    c.train_step(torch.randint(0, vocab, (B, T), generator=g))
                trained.wait()
                c.sync()

            threads = [threading.Thread(target=run, args=(c, i)) for i, c in enumerate(clients)]
            t0 = time.perf_counter()
            for t in threads:
                t.start()
            trained.wait()  # every member has trained: its copy is alive
            peak = max(peak, rss_bytes(srv.proc.pid))
            for t in threads:
                t.join()
            times.append(time.perf_counter() - t0)
        sync_bytes = len(encode(untied_weights(clients[0].segments), {"client_id": "c0", "samples": "1"}))
        for c in clients:
            c.close()
    finally:
        srv.stop()
    return {"k": k, "round_s": statistics.median(times[1:] or times), "rounds": rounds,
            "server_mib_per_client": (peak - base_rss) / k / 2 ** 20, "sync_bytes": sync_bytes}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/federation.py", allow_abbrev=False,
                                description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--ks", default="1,2,4,8")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json")
    a = p.parse_args(argv)
    model, cuts, B, T, steps = ("tiny", (1, 3), 2, 16, 1) if a.quick else ("random:gpt2", (2, 10), 2, 64, 1)
    rows = [one_k(model, cuts, int(k), a.rounds, steps, B, T) for k in a.ks.split(",")]
    for r in rows:
        print(f"K={r['k']}: round {r['round_s']:.2f}s, server {r['server_mib_per_client']:.0f} MiB/client, "
              f"sync {r['sync_bytes'] / 2 ** 20:.1f} MiB", file=sys.stderr)
    out = {"model": model, "cuts": list(cuts), "batch": [B, T], "steps_per_round": steps, "rows": rows}
    print(json.dumps(out, indent=2))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
