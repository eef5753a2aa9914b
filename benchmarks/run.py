"""``make bench``: splitlearn against the unsplit model and the baselines, side by side in one run.

    python benchmarks/run.py                       # everything, on a GPU if there is one
    python benchmarks/run.py --workloads codec,overhead --repeats 5
    python benchmarks/run.py --quick               # the tiny model, seconds (smoke test)
    python benchmarks/run.py --baselines naive     # without the torch.distributed.rpc baseline

Writes ``results.json``, ``results.md`` and ``summary.png`` to ``benchmarks/results/<device>/``
(or ``--out``). See ``benchmarks/README.md`` for what each workload measures.
"""
from __future__ import annotations

import argparse
import datetime as dt
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks import (codec, concurrency, generation, int8_drift, overhead, pinned, report,  # noqa: E402
                        server_batching, training)
from benchmarks.config import BASELINES, WIRE_DTYPES, WORKLOADS, BenchConfig  # noqa: E402
from benchmarks.context import BenchContext  # noqa: E402
from benchmarks.timing import command_line, machine_info  # noqa: E402

RUNNERS = {"codec": codec.run, "overhead": overhead.run, "generation": generation.run,
           "training": training.run, "int8_drift": int8_drift.run, "concurrency": concurrency.run,
           "pinned": pinned.run, "server_batching": server_batching.run}


def parse_args(argv=None) -> tuple[BenchConfig, Path]:
    p = argparse.ArgumentParser(prog="python benchmarks/run.py", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny model, one repeat: a smoke test in seconds")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--model", help="model source for every system (default: random:gpt2, GPT-2 small)")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated: {','.join(WORKLOADS)}")
    p.add_argument("--wire-dtypes", default=",".join(WIRE_DTYPES))
    p.add_argument("--baselines", default=",".join(BASELINES),
                   help=f"comma-separated, or empty for none: {','.join(BASELINES)}")
    p.add_argument("--repeats", type=int, help="timed runs per measurement (median reported)")
    p.add_argument("--warmup", type=int, help="untimed runs first")
    p.add_argument("--threads", type=int, help="torch threads per process (default: all cores)")
    p.add_argument("--out", help="results directory (default: benchmarks/results/<device>)")
    p.add_argument("--mp-context", choices=["spawn", "forkserver"],
                   help="how client processes start (default spawn: a fresh interpreter each)")
    a = p.parse_args(argv)
    device = a.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available")
    over = {k: v for k, v in dict(model=a.model, repeats=a.repeats, warmup=a.warmup, threads=a.threads,
                                          mp_context=a.mp_context).items()
            if v is not None}
    over.update(workloads=tuple(w for w in a.workloads.split(",") if w),
                wire_dtypes=tuple(w for w in a.wire_dtypes.split(",") if w),
                baselines=tuple(b for b in a.baselines.split(",") if b), device=device)
    if device == "cuda":  # the GPU workload of the issue: bf16 training, batch 8 x seq 1024
        over.setdefault("threads", 1)
        over.update(dtype="bfloat16", train_batch=8, train_seq=1024)
    try:
        cfg = BenchConfig.quick(**over) if a.quick else BenchConfig(**over)
    except (TypeError, ValueError) as e:
        p.error(str(e))
    out = Path(a.out) if a.out else Path(__file__).resolve().parent / "results" / device
    return cfg, out


def run(cfg: BenchConfig, log=print) -> dict:
    started = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    t0 = time.perf_counter()
    rows = []
    with BenchContext(cfg, log=log) as ctx:
        for name in cfg.workloads:
            log(f"[{name}]")
            w0 = time.perf_counter()
            rows += RUNNERS[name](cfg, ctx)
            if cfg.restart_between_workloads:  # afresh for the next workload: their memory goes
                ctx.close()
            log(f"[{name}] {time.perf_counter() - w0:.0f} s")
    return {"device": cfg.device, "command": command_line(), "started": started,
            "seconds": time.perf_counter() - t0, "machine": machine_info(cfg.threads),
            "config": cfg.as_dict(), "rows": rows}


def main(argv=None) -> int:
    cfg, out = parse_args(argv)
    result = run(cfg)
    paths = report.write(result, out)
    for t in report.targets(result):
        print(f"  {'met ' if t['met'] else 'MISS'}  {t['target']}: {t['measured']}")
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
