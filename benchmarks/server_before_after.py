"""This tree's client against an earlier commit's *server* and this tree's, paired, on two emulated devices.

    python benchmarks/server_before_after.py --before 73047e9               # GPT-2 small shape, b8 x 128, U (2, 10)
    python benchmarks/server_before_after.py --before 73047e9 --quick       # the tiny model, one round

``before_after.py`` swaps the client and keeps one server; this swaps the server (what the
server-side walls cost an honest client: memory reservations, digests, fair decode, lease
bookkeeping) and keeps one client, this tree's model classes. The earlier commit's
``splitlearn/`` and ``models/`` are copied out of git (``git archive``) and served from that
folder (``python -m splitlearn.server`` with it as the working directory, so its package is the
one imported). Both servers run at once on core 1 (only the one being called computes), the
client on core 0, one torch thread each; every round trains one step against each server, in
an order rotated per round, with ``micro_batches`` 1 and 4; one warm-up round. Reported: median
step seconds and the median of the paired ratios after / before.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import secrets
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(ROOT))

os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")

import torch  # noqa: E402

from benchmarks.timing import command_line, machine_info, write_result  # noqa: E402
from splitlearn.procs.localserver import free_port  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "cpu" / "server_before_after.json"


def start_server(cwd: Path, model: str, cuts, token: str, core: int) -> tuple[subprocess.Popen, str]:
    """``python -m splitlearn.server`` run from ``cwd`` (whose ``splitlearn/`` is imported) on ``core``."""
    port = free_port()
    args = [sys.executable, "-m", "splitlearn.server", "--model", model, "--port", str(port), "--torch-threads",
            "1", "--device", "cpu", "--lr", "1e-4", *[x for c in cuts for x in ("--cut", str(c))]]
    env = {**os.environ, "SPLITLEARN_TOKEN": token, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(cwd)}
    proc = subprocess.Popen(args, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            preexec_fn=lambda: os.sched_setaffinity(0, {core}))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url + "/v1/health", timeout=2).read()
            return proc, url
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(f"the server in {cwd} exited with {proc.returncode}")
            time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"the server in {cwd} did not answer in 180 s")


def run(a, old_tree: Path, log=print) -> dict:
    from splitlearn import SplitGPT2LMHeadModel

    src, cuts, (B, T) = ("tiny", (1, 3), (8, 32)) if a.quick else ("random:gpt2", (2, 10), (8, 128))
    token = secrets.token_urlsafe(24)
    servers = {name: start_server(tree, src, cuts, token, core=1) for name, tree in (("before", old_tree),
                                                                                       ("after", ROOT))}
    os.sched_setaffinity(0, {0})
    torch.set_num_threads(1)
    try:
        models, opts = {}, {}
        for m in (1, 4):
            for name, (_, url) in servers.items():
                key = f"{name} m={m}"
                models[key] = SplitGPT2LMHeadModel.from_pretrained(src, server=url, token=token, client_id=f"c{m}",
                                                                  micro_batches=m).train()
                opts[key] = torch.optim.AdamW(models[key].parameters(), lr=1e-4, weight_decay=0.0)
        names = list(models)
        g = torch.Generator().manual_seed(0)
        times: dict[str, list[float]] = {n: [] for n in names}
        for r in range(a.rounds + 1):
            ids = torch.randint(0, models[names[0]].config.vocab_size, (B, T), generator=g)
            row = {}
            for n in names[r % len(names):] + names[:r % len(names)]:
                t0 = time.perf_counter()
                models[n](input_ids=ids, labels=ids).loss.backward()
                opts[n].step()
                opts[n].zero_grad()
                row[n] = time.perf_counter() - t0
            if r:  # round 0 warms up
                for k, v in row.items():
                    times[k].append(v)
            log(f"round {r}: " + ", ".join(f"{k} {row[k]:.3f}s" for k in names))
        for model in models.values():
            model.remote.close()
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(30)

    def ratio(p: str, q: str) -> float:
        return statistics.median(x / y for x, y in zip(times[p], times[q]))

    return {"command": command_line(), "machine": machine_info(1), "before": a.before, "model": src,
            "cuts": list(cuts), "batch": [B, T], "rounds": a.rounds,
            "median_s": {k: statistics.median(v) for k, v in times.items()},
            "after_over_before": {str(m): ratio(f"after m={m}", f"before m={m}") for m in (1, 4)},
            "times_s": times}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/server_before_after.py",
                                description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--before", required=True, help="the earlier commit whose server is compared (any git revision)")
    p.add_argument("--quick", action="store_true", help="the tiny model, one round")
    p.add_argument("--rounds", type=int)
    p.add_argument("--out", default=str(RESULTS))
    a = p.parse_args(argv)
    a.rounds = a.rounds or (1 if a.quick else 5)
    if (os.cpu_count() or 1) < 2:
        print("needs two cores", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        tar = subprocess.run(["git", "-C", str(ROOT), "archive", a.before, "splitlearn", "models"], check=True,
                             capture_output=True).stdout
        with tarfile.open(fileobj=io.BytesIO(tar)) as t:
            t.extractall(tmp, filter="data")
        result = run(a, Path(tmp), log=lambda s: print(s, file=sys.stderr, flush=True))
    print(json.dumps({k: result[k] for k in ("median_s", "after_over_before")}, indent=2))
    write_result(result, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
