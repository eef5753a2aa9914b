"""Soak: clients training and generating while the servers are killed with SIGKILL and restarted.

    python benchmarks/soak.py                        # 10 minutes, a kill every ~2 minutes
    python benchmarks/soak.py --minutes 3 --kill-every 30

Two servers on loopback, both killed (SIGKILL) and restarted from their checkpoint
directories every ``--kill-every`` seconds (jittered):

- T, ``tiny-demo`` U-shape, ``--checkpoint-every 7``: ``--trainers`` clients train in threads
  (shared mode), each with its own journal directory;
- G, the same model, never trained: a generating client runs greedy generation of fixed
  prompts over and over; every output must equal the unsplit model's ``generate``.

Reported (targets 0, 0, 0, 0, < 5%): steps lost (a client's acknowledged steps missing on the
server), steps applied twice (the server's count above the clients'), client errors,
generations that differ from the unsplit model, and server T's RSS growth between the first
and the last restart (VmRSS a few seconds after each restart).
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from splitlearn import ByteTokenizer, load_corpus, load_model  # noqa: E402
from splitlearn.api import protocol as P  # noqa: E402
from splitlearn.client import SplitClient  # noqa: E402
from splitlearn.model.data import lm_batches  # noqa: E402
from splitlearn.procs.localserver import LocalServer  # noqa: E402

MODEL, CUTS = "tiny-demo", ("--cut", "2", "--cut", "4")
PROMPTS = ["Once upon a time", "The little dog"]


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/soak.py", allow_abbrev=False,
                                description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--kill-every", type=float, default=120.0, help="seconds between kills (jittered +-20%%)")
    p.add_argument("--trainers", type=int, default=3)
    p.add_argument("--json", help="write the report here")
    a = p.parse_args(argv)
    tok = ByteTokenizer()
    data = tok.encode(load_corpus())
    reference = {t: load_model(MODEL).generate(torch.tensor([tok.encode(t)]), max_new_tokens=24,
                                               do_sample=False).tolist() for t in PROMPTS}
    tmp = Path(tempfile.mkdtemp(prefix="splitlearn-soak-"))
    T = LocalServer(["--model", MODEL, *CUTS, "--checkpoint-dir", str(tmp / "T"), "--checkpoint-every", "7",
                     "--threads", "8"])
    G = LocalServer(["--model", MODEL, *CUTS, "--checkpoint-dir", str(tmp / "G")])
    T.start(), G.start()
    deadline = time.monotonic() + 60 * a.minutes
    errors: list[str] = []
    counts = {"generations": 0, "generations_differ": 0}
    clients = [SplitClient(T.url, MODEL, token=T.token, lr=1e-3, device="cpu", client_id=f"trainer-{i}",
                           journal_dir=tmp / f"client-{i}", reconnect_timeout_s=120) for i in range(a.trainers)]

    def train(c: SplitClient, i: int) -> None:
        batches = lm_batches(data, 4, 32, seed=i)
        while time.monotonic() < deadline:
            try:
                c.train_step(next(batches))
            except Exception as e:  # noqa: BLE001 - the soak counts every failure
                errors.append(f"{c.client_id}: {type(e).__name__}: {e}")
                return

    def generate() -> None:
        g = SplitClient(G.url, MODEL, token=G.token, device="cpu", reconnect_timeout_s=120, retries=12)
        while time.monotonic() < deadline:
            for text in PROMPTS:
                try:
                    out = g.generate(torch.tensor([tok.encode(text)]), max_new_tokens=24).tolist()
                except Exception as e:  # noqa: BLE001
                    errors.append(f"generator: {type(e).__name__}: {e}")
                    return
                counts["generations"] += 1
                counts["generations_differ"] += out != reference[text]

    threads = [threading.Thread(target=train, args=(c, i)) for i, c in enumerate(clients)]
    threads.append(threading.Thread(target=generate))
    for t in threads:
        t.start()
    rss, kills, rng = [], 0, random.Random(0)
    time.sleep(5)
    rss.append(rss_kib(T.proc.pid))
    while time.monotonic() < deadline - a.kill_every * 0.5:
        time.sleep(min(a.kill_every * rng.uniform(0.8, 1.2), max(deadline - time.monotonic(), 0)))
        for srv in (T, G):
            srv.kill()
        kills += 1
        time.sleep(rng.uniform(0.2, 2.0))
        T.start(), G.start()
        time.sleep(5)
        rss.append(rss_kib(T.proc.pid))
    for t in threads:
        t.join()
    server_steps = {c.client_id: clients[0].transport.get_json(P.CLIENT_STATE.format(client_id=c.client_id))["step"]
                    for c in clients}
    applied = clients[0].transport.get_json(P.INFO)["steps_applied"]
    client_steps = {c.client_id: c.step for c in clients}
    report = {
        "minutes": a.minutes, "kills": kills, "client_steps": client_steps, "server_steps": server_steps,
        "steps_lost": sum(max(client_steps[k] - server_steps[k], 0) for k in client_steps),
        "steps_applied_twice": max(applied - sum(client_steps.values()), 0)
        + sum(max(server_steps[k] - client_steps[k], 0) for k in client_steps),
        "server_steps_applied": applied, "client_errors": len(errors), "errors": errors[:5],
        "generations": counts["generations"], "generations_differ": counts["generations_differ"],
        "recoveries": {c.client_id: len(c.recoveries) for c in clients},
        "rss_kib_after_restarts": rss,
        "rss_growth": (rss[-1] - rss[1]) / rss[1] if len(rss) > 2 else None,
    }
    for srv in (T, G):
        srv.stop()
    print(json.dumps(report, indent=2))
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=2))
    ok = (report["steps_lost"] == 0 and report["steps_applied_twice"] == 0 and not errors
          and counts["generations_differ"] == 0)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
