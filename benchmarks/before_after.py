"""``SplitClient.train_step`` of an earlier commit against this tree's, paired, on two emulated devices.

    python benchmarks/before_after.py --before d8780af            # GPT-2 small shape, b8 x 128, U-shape
    python benchmarks/before_after.py --before d8780af --quick    # the tiny model, one round
    python benchmarks/before_after.py --before d8780af --shape 2-way --out ...   # 2-way, cut 2

The earlier commit's ``splitlearn`` package is copied out of git (``git archive``) under the
name ``splitlearn_old`` (the package imports itself relatively), so both versions' clients run
in this one process, each against a server of its own version (the earlier commit's server is
started from ``splitlearn_old``, both pinned to the same core: a protocol may change between the
two, e.g. closed steps went in issue 30), with ``micro_batches`` 1 and 4. As in
``pipelined_training.py``: client on core 0, server on core 1, one torch thread each; the
unsplit model on core 0 as the reference; every round runs every system once, in an order
rotated per round; one warm-up round. Reported: median step seconds, the median of the paired
ratios after / before, and each system over the unsplit step.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(ROOT))

os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")

import torch  # noqa: E402

from benchmarks.timing import write_result  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "cpu" / "splitclient_before_after.json"


def old_package(rev: str, into: Path) -> None:
    """``rev``'s ``splitlearn/`` and ``models/`` as ``into/splitlearn_old`` and ``into/models``."""
    tar = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "splitlearn", "models"], check=True,
                         capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(tar)) as t:
        t.extractall(into, filter="data")
    shutil.move(into / "splitlearn", into / "splitlearn_old")
    for path in (into / "splitlearn_old").rglob("*.py"):  # the few absolute self-imports
        text = path.read_text()
        if "from splitlearn." in text:
            path.write_text(text.replace("from splitlearn.", "from splitlearn_old."))


def old_server(src: str, cuts, tmp: str, core: int = 1):
    """The earlier commit's server (``python -m splitlearn_old.server``) on ``core``, one torch thread."""
    import secrets

    from splitlearn.procs.localserver import ChildServer, free_port

    port, token = free_port(), secrets.token_urlsafe(16)
    os.sched_setaffinity(0, {core})  # the server inherits it
    cmd = [sys.executable, "-m", "splitlearn_old.server", "--model", src, *[x for c in cuts for x in ("--cut", str(c))],
           "--torch-threads", "1", "--device", "cpu", "--lr", "1e-4", "--host", "127.0.0.1", "--port", str(port),
           "--log-level", "WARNING"]
    env = {"OMP_NUM_THREADS": "1", "SPLITLEARN_TOKEN": token,
           "PYTHONPATH": os.pathsep.join([tmp, str(ROOT), os.environ.get("PYTHONPATH", "")])}
    srv = ChildServer(cmd, port, env=env).start()
    srv.token = token
    os.sched_setaffinity(0, {0})
    return srv


def run(a, log=print) -> dict:
    from splitlearn import load_model
    from splitlearn.client import SplitClient as New
    from splitlearn.model.segments import labels_from_batch
    from splitlearn_old.client import SplitClient as Old

    from benchmarks.timing import pinned_u_server

    src, cuts, (B, T) = ("tiny", (1, 3), (8, 32)) if a.quick else ("random:gpt2", (2, 10), (8, 128))
    if a.shape == "2-way":
        cuts = cuts[:1]
    srv = pinned_u_server(src, cuts)  # client core 0, server core 1
    old = old_server(src, cuts, a.tmp)  # the earlier commit's, core 1 too
    try:
        unsplit = load_model(src).train()
        opt = torch.optim.AdamW(unsplit.parameters(), lr=1e-4, weight_decay=0.0)
        clients = {}
        for m in (1, 4):
            for name, cls in (("before", Old), ("after", New)):
                server = old if name == "before" else srv
                clients[f"{name} m={m}"] = cls(server.url, src, token=server.token, lr=1e-4, device="cpu",
                                               micro_batches=m, client_id=f"{name}{m}")
        g = torch.Generator().manual_seed(0)
        names = ["unsplit", *clients]
        times: dict[str, list[float]] = {n: [] for n in names}
        for r in range(a.rounds + 1):
            ids = torch.randint(0, unsplit.config.vocab_size, (B, T), generator=g)
            row = {}
            for n in names[r % len(names):] + names[:r % len(names)]:
                t0 = time.perf_counter()
                if n == "unsplit":
                    opt.zero_grad()
                    unsplit(ids, labels=labels_from_batch(ids, None)).loss.backward()
                    opt.step()
                else:
                    clients[n].train_step(ids)
                row[n] = time.perf_counter() - t0
            if r:  # round 0 warms up
                for k, v in row.items():
                    times[k].append(v)
            log(f"round {r}: " + ", ".join(f"{k} {row[k]:.2f}s" for k in names))
        for c in clients.values():
            c.close()
    finally:
        srv.stop()
        old.stop()

    def ratio(p: str, q: str) -> float:
        return statistics.median(x / y for x, y in zip(times[p], times[q]))

    from benchmarks.timing import command_line, machine_info

    return {"command": command_line(), "machine": machine_info(1), "before": a.before, "model": src, "shape": a.shape,
            "cuts": list(cuts), "batch": [B, T], "rounds": a.rounds,
            "median_s": {k: statistics.median(v) for k, v in times.items()},
            "after_over_before": {str(m): ratio(f"after m={m}", f"before m={m}") for m in (1, 4)},
            "over_unsplit": {n: ratio(n, "unsplit") for n in names}, "times_s": times}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/before_after.py", description=__doc__.splitlines()[0])
    p.add_argument("--before", required=True, help="the earlier commit (any git revision)")
    p.add_argument("--quick", action="store_true", help="the tiny model, one round")
    p.add_argument("--rounds", type=int)
    p.add_argument("--shape", choices=("u", "2-way"), default="u", help="U-shape (2, 10) or 2-way (2)")
    p.add_argument("--out", default=str(RESULTS))
    a = p.parse_args(argv)
    a.rounds = a.rounds or (1 if a.quick else 3)
    if (os.cpu_count() or 1) < 2:
        print("needs two cores", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        old_package(a.before, Path(tmp))
        sys.path.insert(0, tmp)
        a.tmp = tmp
        result = run(a, log=lambda s: print(s, file=sys.stderr, flush=True))
    print(json.dumps({k: result[k] for k in ("median_s", "after_over_before", "over_unsplit")}, indent=2))
    write_result(result, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
