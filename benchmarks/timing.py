"""Timing: medians after warm-up, the machine a run was made on, and the command that made it."""
from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import splitlearn  # noqa: F401  first: its OpenMP spin (splitlearn/procs/openmp.py) before torch loads libgomp
import torch  # noqa: E402

from splitlearn.analysis.timing import percentile


@dataclass
class Timing:
    median_s: float
    p90_s: float
    runs: list[float]

    def as_dict(self) -> dict:
        return asdict(self)


def p90(values: list[float]) -> float:
    """90th percentile, linear interpolation: the same definition as the analyzer's."""
    return percentile(sorted(values), 90)


def measure(fn: Callable[[], object], repeats: int, warmup: int,
            device: Optional[str] = None) -> Timing:
    """Run ``fn`` ``warmup`` times untimed, then ``repeats`` times timed (CUDA synchronised)."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        runs.append(time.perf_counter() - t0)
    return Timing(statistics.median(runs), p90(runs), runs)


def call_samples(fn: Callable[[], object], calls: int, warmup: int = 10) -> list[float]:
    """Seconds of each of ``calls`` calls of ``fn`` after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def machine_info(threads: int) -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__,
            "platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "torch_threads": threads,
            "load_average_at_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None}
    try:
        import transformers
        info["transformers"] = transformers.__version__
    except ImportError:  # pragma: no cover - transformers is a dependency
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def command_line() -> str:
    return " ".join(["python", *([os.path.relpath(sys.argv[0])] if sys.argv else []), *sys.argv[1:]])


ONE_THREAD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}  # read by a process when it starts


def run_in_child(target: Callable, args: Sequence, what: str, env: Optional[dict] = None,
                 timeout_s: float = 3600.0, context: str = "spawn"):
    """Run ``target(conn, *args)`` in a fresh ("spawn") process started with ``env`` added to
    this process's environment (restored right after the start); ``target`` sends one
    ``("ok", value)`` or ``("error", message)`` on ``conn``. Returns the value, raises
    ``RuntimeError`` naming ``what`` on an error or after ``timeout_s`` without an answer.
    ``context="forkserver"``: forked from multiprocessing's fork server instead, whose environment
    the child gets (``env`` does not reach it: a target that needs it sets it itself)."""
    import multiprocessing as mp

    ctx = mp.get_context(context)
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child, *args))
    saved = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})  # the child reads them when it starts
    try:
        proc.start()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    try:
        if not parent.poll(timeout_s):
            raise RuntimeError(f"{what}: no answer in {timeout_s:g} s")
        status, value = parent.recv()
    finally:
        proc.join(60)
        if proc.is_alive():
            proc.kill()
    if status != "ok":
        raise RuntimeError(f"{what} failed: {value}")
    return value


def pinned_u_server(model: str, cuts: Sequence[int], client_core: int = 0, server_core: int = 1):
    """Two emulated devices: a started ``LocalServer`` of ``model`` (U-shape, or 2-way for one
    cut) on ``server_core`` (it inherits the affinity, one torch thread), this process on
    ``client_core`` with one torch thread. The caller stops the server."""
    from splitlearn.procs.localserver import LocalServer

    torch.set_num_threads(1)
    os.sched_setaffinity(0, {server_core})  # the server inherits it
    srv = LocalServer(["--model", model, *[a for c in cuts for a in ("--cut", str(c))], "--torch-threads", "1",
                       "--device", "cpu", "--lr", "1e-4"], env={"OMP_NUM_THREADS": "1"}).start()
    os.sched_setaffinity(0, {client_core})
    return srv


def write_result(result: dict, out) -> Path:
    """Write a benchmark's JSON result to ``out`` (its folder made if needed); prints and
    returns the path."""
    import json

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return out
