"""OpenMP's idle spin and import order: split and unsplit greedy generation at each spin setting.

    python benchmarks/omp_spin.py              # GPT-2 small shape, every variant, one run each
    python benchmarks/omp_spin.py --cycles 2   # every variant twice, interleaved (A B C A B C)
    python benchmarks/omp_spin.py --quick      # the tiny model: the smoke run

As a user's script has it: the script imports **torch first**, then splitlearn, starts
``python -m splitlearn.server`` (its own process) on the same machine and, in the same script,
times :meth:`splitlearn.client.SplitClient.generate` (U-shape (2, 10), batch 1, a 32-token prompt,
32 greedy tokens) against the unsplit model's ``generate`` (transformers' own, in the script),
paired rounds (each system once a round, the order alternating), the median of ``--rounds``.
Both processes share the machine's cores (two here) with torch's default threads (one per core).
Each variant runs as a fresh script process whose whole environment (and so the server's, which
inherits it) holds the variant's setting:

- ``unset, no guard``: no ``GOMP_SPINCOUNT`` exported. The script's libgomp keeps its default
  spin (300,000 iterations: ~7 ms of a core after each parallel operator on this VM's Xeon); the
  server, which imports splitlearn first, gets 20,000 (``splitlearn/procs/openmp.py``); the split
  model's ``quiet_openmp`` off: how every torch-first script ran before the guard;
- ``20000``: ``GOMP_SPINCOUNT=20000`` exported: both processes spin briefly;
- ``unset (default: libgomp's throttle while generating)``: no variable, ``quiet_openmp`` on (the
  default): the split model's ``generate`` sees the long spin and a server on its cores and holds
  libgomp's throttle (``openmp.short_spin``: its workers spin 1,000 iterations, the threads unchanged);
- ``unset, one thread while generating (the guard before)``: the guard of the previous release,
  the client's part on one torch thread;
- ``unset, no guard, server 1 thread``: the first, with the server on one torch thread
  (``--torch-threads 1``): the other way to keep the spinning worker off the server's cores;
- ``unset (default), server GOMP_SPINCOUNT=1000``: the default, the server's own spin 1,000;
- ``1000``: ``GOMP_SPINCOUNT=1000`` exported for both.

Reported per variant: tokens/s of each system and split / unsplit speed (median of the paired
ratios: > 1 the split is faster). Writes ``benchmarks/results/cpu/omp_spin.json`` and ``.md``
(``--out``); docs/PERFORMANCE.md ("Import order") explains the table.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results" / "cpu" / "omp_spin.json"
VARIANTS = {  # name -> (GOMP_SPINCOUNT or None, the split model's guard, the server's torch threads)
    "unset, no guard": (None, None, None),
    "20000": ("20000", "short_spin", None),
    "unset (default: libgomp's throttle while generating)": (None, "short_spin", None),
    "unset, one thread while generating (the guard before)": (None, "one_thread", None),
    "unset, no guard, server 1 thread": (None, None, 1),
    "unset (default), server GOMP_SPINCOUNT=1000": (None, "short_spin", "spin=1000"),
    "1000": ("1000", "short_spin", None),
}


def child(a) -> dict:
    """One variant, in this (fresh) process: torch first, as most scripts do."""
    import torch  # noqa: F401  first: libgomp reads GOMP_SPINCOUNT now

    from splitlearn import load_model  # after torch: its spin default cannot act
    from splitlearn.client import SplitClient
    from splitlearn.procs.localserver import LocalServer

    spin, quiet, server_threads = VARIANTS[a.variant]
    src, cuts = ("tiny", (1, 3)) if a.quick else ("random:gpt2", (2, 10))
    prompt = 8 if a.quick else 32
    args = ["--model", src, *[x for c in cuts for x in ("--cut", str(c))], "--device", "cpu", "--log-level", "WARNING"]
    server_env = {}
    if isinstance(server_threads, str):  # "spin=N": the server's own GOMP_SPINCOUNT, the script's unchanged
        server_env["GOMP_SPINCOUNT"] = server_threads.split("=")[1]
    elif server_threads:
        args += ["--torch-threads", str(server_threads)]
    unsplit = load_model(src, seed=0).eval()
    unsplit.generation_config.eos_token_id = None  # every row makes --tokens
    ids = torch.randint(0, 256, (1, prompt), generator=torch.Generator().manual_seed(0))
    threads = torch.get_num_threads()
    with LocalServer(args, env=server_env) as srv, SplitClient(srv.url, src, token=srv.token, device="cpu", seed=0) as client:
        client.model.quiet_openmp = quiet is not None
        if quiet == "one_thread":  # the guard of stop 56: the client's part on one torch thread
            from splitlearn.hf import generation
            from splitlearn.procs.openmp import one_thread
            generation.quiet_workers = one_thread
        split = lambda: client.generate(ids, max_new_tokens=a.tokens)  # noqa: E731

        systems = {"unsplit": lambda: unsplit.generate(ids, attention_mask=torch.ones_like(ids),
                                                       max_new_tokens=a.tokens, do_sample=False, pad_token_id=0),
                   "split": split}
        times, outs = {k: [] for k in systems}, {}
        for r in range(a.rounds + 1):
            for k in (list(systems) if r % 2 else list(systems)[::-1]):
                t0 = time.perf_counter()
                outs[k] = systems[k]()
                if r:  # round 0 warms up
                    times[k].append(time.perf_counter() - t0)
    return {"variant": a.variant, "GOMP_SPINCOUNT": os.environ.get("GOMP_SPINCOUNT"), "torch_threads": threads,
            "quiet_openmp": quiet, "server_threads": server_threads, "times_s": times,
            "same_tokens": bool(torch.equal(outs["split"], outs["unsplit"])),
            "tokens_per_s": {k: a.tokens / statistics.median(v) for k, v in times.items()},
            "split_over_unsplit_speed": statistics.median(u / s for u, s in zip(times["unsplit"], times["split"]))}


def markdown(res: dict) -> str:
    m = res["machine"]
    L = [f"# OpenMP spin and import order ({res['date']})", "",
         f"`{res['command']}`: {res['model']}, U-shape {tuple(res['cuts'])}, batch 1, {res['tokens']} greedy tokens, "
         f"median of {res['rounds']} paired rounds; the script imports torch first; server and client on the same "
         f"{m['cpu_count']} cores, torch's default threads; load average at start {m['load_average_at_start']}.", "",
         "| variant | script GOMP_SPINCOUNT | unsplit tok/s | split tok/s | split / unsplit | same tokens |",
         "|---|---|---|---|---|---|"]
    for r in res["rows"]:
        L.append(f"| {r['variant']} | {r['GOMP_SPINCOUNT'] or '(libgomp default)'} | {r['tokens_per_s']['unsplit']:.1f} | "
                 f"{r['tokens_per_s']['split']:.1f} | **{r['split_over_unsplit_speed']:.2f}x** | {r['same_tokens']} |")
    return "\n".join(L) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/omp_spin.py", description=__doc__.splitlines()[0])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--cycles", type=int, default=1, help="runs of every variant, interleaved")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--quick", action="store_true", help="the tiny model, 16 tokens")
    p.add_argument("--out", default=str(OUT))
    p.add_argument("--child", dest="variant", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.quick:
        a.tokens = min(a.tokens, 16)
    if a.variant:  # one variant, in a fresh process
        print(json.dumps(child(a)))
        return 0
    sys.path.insert(0, str(ROOT))
    from benchmarks.timing import command_line, machine_info, write_result

    machine = machine_info(0)  # the load average at the start
    rows = []
    for cycle in range(a.cycles):
        for v in a.variants:
            env = {k: x for k, x in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY",
                                                                    "OMP_NUM_THREADS", "MKL_NUM_THREADS")}
            if VARIANTS[v][0] is not None:
                env["GOMP_SPINCOUNT"] = VARIANTS[v][0]
            env["PYTHONPATH"] = os.pathsep.join(x for x in (str(ROOT), env.get("PYTHONPATH", "")) if x)
            cmd = [sys.executable, str(Path(__file__).resolve()), "--child", v, "--rounds", str(a.rounds),
                   "--tokens", str(a.tokens), *(["--quick"] if a.quick else [])]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
            if proc.returncode:
                print(proc.stderr, file=sys.stderr)
                raise SystemExit(f"variant {v!r} failed ({proc.returncode})")
            row = json.loads(proc.stdout.strip().splitlines()[-1])
            row["cycle"] = cycle
            rows.append(row)
            print(f"{v:>24}: unsplit {row['tokens_per_s']['unsplit']:.1f} tok/s, split "
                  f"{row['tokens_per_s']['split']:.1f} tok/s, split/unsplit {row['split_over_unsplit_speed']:.3f}",
                  file=sys.stderr, flush=True)
    res = {"command": command_line(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "machine": machine, "model": "tiny" if a.quick else "random:gpt2",
           "cuts": [1, 3] if a.quick else [2, 10], "tokens": a.tokens, "rounds": a.rounds, "rows": rows}
    write_result(res, a.out)
    Path(a.out).with_suffix(".md").write_text(markdown(res))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
