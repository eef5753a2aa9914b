"""``SplitClient.train_step`` of an earlier commit against this tree's, paired, on two emulated devices.

    python benchmarks/before_after.py --before d8780af            # GPT-2 small shape, b8 x 128, U-shape
    python benchmarks/before_after.py --before d8780af --quick    # the tiny model, one round

The earlier commit's ``splitlearn`` package is copied out of git (``git archive``) under the
name ``splitlearn_old`` (the package imports itself relatively), so both versions' clients run
in this one process against one server (this tree's), with ``micro_batches`` 1 and 4. As in
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


def run(a, log=print) -> dict:
    from splitlearn import load_model
    from splitlearn.client import SplitClient as New
    from splitlearn.segments import labels_from_batch
    from splitlearn_old.client import SplitClient as Old

    from benchmarks.timing import pinned_u_server

    src, cuts, (B, T) = ("tiny", (1, 3), (8, 32)) if a.quick else ("random:gpt2", (2, 10), (8, 128))
    srv = pinned_u_server(src, cuts)  # client core 0, server core 1
    try:
        unsplit = load_model(src).train()
        opt = torch.optim.AdamW(unsplit.parameters(), lr=1e-4, weight_decay=0.0)
        clients = {}
        for m in (1, 4):
            for name, cls in (("before", Old), ("after", New)):
                clients[f"{name} m={m}"] = cls(srv.url, src, token=srv.token, lr=1e-4, device="cpu",
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

    def ratio(p: str, q: str) -> float:
        return statistics.median(x / y for x, y in zip(times[p], times[q]))

    from benchmarks.timing import command_line, machine_info

    return {"command": command_line(), "machine": machine_info(1), "before": a.before, "model": src,
            "cuts": list(cuts), "batch": [B, T], "rounds": a.rounds,
            "median_s": {k: statistics.median(v) for k, v in times.items()},
            "after_over_before": {str(m): ratio(f"after m={m}", f"before m={m}") for m in (1, 4)},
            "over_unsplit": {n: ratio(n, "unsplit") for n in names}, "times_s": times}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/before_after.py", description=__doc__.splitlines()[0])
    p.add_argument("--before", required=True, help="the earlier commit (any git revision)")
    p.add_argument("--quick", action="store_true", help="the tiny model, one round")
    p.add_argument("--rounds", type=int)
    p.add_argument("--out", default=str(RESULTS))
    a = p.parse_args(argv)
    a.rounds = a.rounds or (1 if a.quick else 3)
    if (os.cpu_count() or 1) < 2:
        print("needs two cores", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        old_package(a.before, Path(tmp))
        sys.path.insert(0, tmp)
        result = run(a, log=lambda s: print(s, file=sys.stderr, flush=True))
    print(json.dumps({k: result[k] for k in ("median_s", "after_over_before", "over_unsplit")}, indent=2))
    write_result(result, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
