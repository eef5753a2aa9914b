"""The GPU table of issue 42 in one command: every split case against the unsplit model, one run.

    python benchmarks/gpu.py                          # on the GPU: at most ~7 minutes on an H100
    python benchmarks/gpu.py --device cpu --smoke     # the tiny model, a few steps (a smoke test)

Every case runs the split model over both transports of one server process, TCP loopback and
``unix://`` (on CUDA: the device region, tensors never on the host), interleaved with the
unsplit model in this process, so both see the same GPU and the same load:

- ``train-small-bf16`` / ``-f32`` / ``-bf16-mb4``: ``SplitClient.train_step`` (AdamW), GPT-2
  small's shape, U (2, 10), 8 x 1024, bfloat16 compute; the wire bfloat16 or float32, one or 4
  micro-batches;
- ``train-xl-bf16`` / ``-bf16-mb4``: GPT-2 XL's shape, U (2, 46), 4 x 1024;
  ratio (training): the median over rounds of the split step over the unsplit step of its round;
- ``greedy-b1`` / ``greedy-b8``: greedy decoding of ``--new-tokens`` (``SplitClient.generate``,
  float32 wire) against stock ``generate``; the unsplit model with a static cache and
  ``torch.compile`` (transformers compiles a static cache's decode on CUDA) is a second
  reference row; ratio: the split's tokens/s over the stock ``generate``'s;
- ``seed001``: seed 001's workload (:func:`benchmarks.unix_transport.seed_workload`, float32);
  ratio: the split's generation time over the unsplit one's;
- ``decode overhead``: a batch-1 decode step's round trip minus the server's compute
  (:func:`benchmarks.unix_transport.decode_overheads`), milliseconds.

Writes ``benchmarks/results/gpu/<date>.json`` (every row), ``latest.json`` (the summary: rows
``{"case", "transport", "ratio", "device", "date"}``) and ``latest.md`` (the table, naming the
device) to ``--out``; ``--smoke`` writes to a temporary directory unless ``--out`` is given.
"""
from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from splitlearn.api import protocol as P  # noqa: E402
from splitlearn.model.checkpoint import make_optimizer  # noqa: E402
from splitlearn.client import SplitClient  # noqa: E402
from splitlearn.hf.pipeline import Chooser  # noqa: E402
from splitlearn.procs.localserver import LocalServer  # noqa: E402
from splitlearn.transport import Transport, TransportConfig  # noqa: E402

from benchmarks import unix_transport  # noqa: E402
from benchmarks.config import BenchConfig  # noqa: E402
from benchmarks.context import BenchContext  # noqa: E402
from benchmarks.generation import hf_generate, prompts  # noqa: E402
from benchmarks.timing import command_line, measure, p90  # noqa: E402
from benchmarks.training import unsplit_step  # noqa: E402

TRANSPORTS = ("tcp", "unix")


@dataclass(frozen=True)
class Train:
    """One training case: the model, its U-shape cuts, the shape of a step, the wire, micro-batches."""

    case: str
    model: str
    cuts: tuple[int, int]
    batch: int
    seq: int
    wire: str
    micro: int = 1


def plan(smoke: bool) -> dict:
    """The cases and their sizes; ``smoke``: the tiny model everywhere, a few steps."""
    small, xl = ("tiny", (1, 3)), ("tiny", (1, 3))
    if not smoke:
        small, xl = ("random:gpt2", (2, 10)), ("random:gpt2-xl", (2, 46))
    B, T = (2, 16) if smoke else (8, 1024)
    xB = 2 if smoke else 4
    return {
        "train": [Train("train-small-bf16", *small, B, T, "bfloat16"),
                  Train("train-small-f32", *small, B, T, "float32"),
                  Train("train-small-bf16-mb4", *small, B, T, "bfloat16", micro=4),
                  Train("train-xl-bf16", *xl, xB, T, "bfloat16"),
                  Train("train-xl-bf16-mb4", *xl, xB, T, "bfloat16", micro=4)],
        "generate": small,  # greedy batches 1 and 8, float32 wire
        "seed": small, "seed_tokens": 40 if smoke else 1024, "seed_prompt": 8 if smoke else 24,
        "decode_calls": 10 if smoke else 200,
    }


class Servers:
    """One server process per (model, cuts, dtype), listening on TCP and ``unix://``, kept until
    :meth:`stop` (a model's phase ends with it: the GPU's memory goes to the next)."""

    def __init__(self, ctx: BenchContext, extra: Optional[list] = None):
        self.ctx, self.dir, self.started = ctx, tempfile.mkdtemp(prefix="sl-gpu-"), 0
        self.extra = list(extra or [])  # --server-args: flags for every server
        self.running: dict[tuple, tuple[LocalServer, str]] = {}

    def urls(self, model: str, cuts: tuple[int, ...], dtype: str) -> tuple[dict, str]:
        key = (model, tuple(cuts), dtype)
        if key not in self.running:
            self.started += 1
            sock = os.path.join(self.dir, f"s{self.started}.sock")  # a fresh name: never a stale socket's
            args = self.ctx.server_args("u", model=model, cuts=tuple(cuts)) + ["--listen", "unix://" + sock] + self.extra
            args[args.index("--dtype") + 1] = dtype
            self.ctx.log(f"  starting server: {model} {cuts} {dtype}")
            self.running[key] = (LocalServer(args, env=self.ctx.env).start(), sock)
        srv, sock = self.running[key]
        return {"tcp": srv.url, "unix": "unix://" + sock}, srv.token

    def stop(self) -> None:
        for srv, _ in self.running.values():
            srv.stop()
        self.running.clear()


def _free(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()  # what this process no longer uses goes back to the server's side


def training(cfg: BenchConfig, ctx: BenchContext, servers: Servers, cases: list[Train], rounds: int) -> list[dict]:
    """Cases of one model, interleaved with its unsplit step: one step of every system per round."""
    model = ctx.model(cases[0].model)
    first = cases[0]
    ids = prompts(cfg, first.batch, model.config.vocab_size, first.seq).to(cfg.device)  # (B, T)
    opt = make_optimizer(model.parameters(), "adamw", cfg.lr, 0.0)
    base = ("-".join(first.case.split("-")[:2]), "unsplit")  # train-small, train-xl
    steps = {base: lambda: unsplit_step(model, opt, ids)}
    owner = {}  # (case, transport) -> its client
    for c in cases:
        urls, token = servers.urls(c.model, c.cuts, cfg.dtype)
        for kind in TRANSPORTS:
            client = SplitClient(urls[kind], model, token=token, device=cfg.device, wire_dtype=c.wire,
                                 seed=cfg.seed, lr=cfg.lr, micro_batches=c.micro)
            owner[(c.case, kind)] = client
            steps[(c.case, kind)] = (lambda client=client: client.train_step(ids))
    for key, fn in steps.items():  # micro-batches past the chooser's trials (pipeline.Chooser)
        client = owner.get(key)
        if client is not None and client.micro_batches > 1 and client._model.choose_micro_batches:
            for _ in range(2 * (Chooser.WARMUP + Chooser.TRIALS)):
                fn()
    ctx.log(f"  training {first.model}: {len(steps)} systems, {cfg.warmup} + {rounds} rounds")
    runs = {k: [] for k in steps}
    for r in range(cfg.warmup + rounds):
        for k, fn in steps.items():
            t = measure(fn, 1, 0, cfg.device).median_s
            if r >= cfg.warmup:
                runs[k].append(t)
            _free(cfg.device)
    chosen = {}
    for c in owner.values():
        chooser = c._model.__dict__.get("_micro_chooser")
        chosen[id(c)] = None if chooser is None else chooser.choice
        c.close()
    rows = []
    for (case, kind), times in runs.items():
        client = owner.get((case, kind))
        extra = {"micro_chosen": chosen.get(id(client))} if client is not None and chosen.get(id(client)) else {}
        rows.append({**extra, "case": case, "transport": kind, "model": first.model, "batch": first.batch, "seq": first.seq,
                     "median_ms": round(1e3 * statistics.median(times), 2), "p90_ms": round(1e3 * p90(times), 2),
                     "ratio": round(statistics.median(a / b for a, b in zip(times, runs[base])), 3),
                     "rounds": len(times)})
    del steps, opt, owner
    return rows


def compiled_generate(model, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Stock ``generate`` on a static cache; transformers compiles its decode step on CUDA
    (``torch.compile``, its ``CompileConfig``: CUDA graphs), not on the CPU."""
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
                          cache_implementation="static")


def greedy(cfg: BenchConfig, ctx: BenchContext, servers: Servers, model_name: str, cuts, compile_ref: bool) -> list[dict]:
    model = ctx.model(model_name)
    urls, token = servers.urls(model_name, cuts, cfg.dtype)
    clients = {k: SplitClient(urls[k], model, token=token, device=cfg.device, wire_dtype="float32", seed=cfg.seed)
               for k in TRANSPORTS}
    N, rows = cfg.new_tokens, []
    static = "static cache + torch.compile" if cfg.device == "cuda" else "static cache"
    for B in (1, 8):
        ids = prompts(cfg, B, model.config.vocab_size).to(cfg.device)  # (B, prompt_len)
        systems = {"unsplit": lambda: hf_generate(model, ids, N)}
        if compile_ref:
            systems[f"unsplit, {static}"] = lambda: compiled_generate(model, ids, N)
        for k, c in clients.items():
            systems[k] = (lambda c=c: c.generate(ids, max_new_tokens=N))
        with torch.no_grad():
            reference = hf_generate(model, ids, N).cpu()
            for name, fn in systems.items():
                ctx.log(f"  greedy batch {B}: {name}")
                try:
                    same = bool(torch.equal(fn().cpu(), reference))  # and a warm-up (compiles)
                    t = measure(fn, cfg.repeats, cfg.warmup, cfg.device)
                except Exception as e:  # a reference this transformers cannot run is a row that says so
                    rows.append({"case": f"greedy-b{B}", "transport": name, "error": f"{type(e).__name__}: {e}"})
                    continue
                rows.append({"case": f"greedy-b{B}", "transport": name, "batch": B, "new_tokens": N,
                             "tokens_per_s": round(B * N / t.median_s, 2), "same_tokens": same})
        base = next(r for r in rows if r["case"] == f"greedy-b{B}" and r["transport"] == "unsplit")
        for r in rows:
            if r["case"] == f"greedy-b{B}" and "tokens_per_s" in r:
                r["ratio"] = round(r["tokens_per_s"] / base["tokens_per_s"], 3)
    for c in clients.values():
        c.close()
    return rows


def decode_overhead(cfg: BenchConfig, servers: Servers, model_name: str, cuts, calls: int) -> list[dict]:
    urls, token = servers.urls(model_name, cuts, cfg.dtype)
    rows = []
    for kind in TRANSPORTS:
        t = Transport(TransportConfig(urls[kind], token))
        try:
            d = t.get_json(P.INFO)["model_config"]["n_embd"]
            unix_transport.decode_overheads(t, d, max(3, calls // 10), device=cfg.device)  # warm-up
            ms = sorted(1e3 * s for s in unix_transport.decode_overheads(t, d, calls, device=cfg.device))
        finally:
            t.close()
        rows.append({"case": "decode overhead", "transport": kind, "median_ms": round(statistics.median(ms), 3),
                     "p90_ms": round(ms[(9 * len(ms)) // 10], 3), "calls": len(ms)})
    return rows


def seed001(cfg: BenchConfig, servers: Servers, model_name: str, cuts, tokens: int, prompt: int) -> list[dict]:
    urls, token = servers.urls(model_name, cuts, "float32")  # the workload's dtype (unix_transport.py)
    rows = unix_transport.seed_workload(urls["tcp"], urls["unix"], token, model_name, cfg.seed, tokens, prompt,
                                        device=cfg.device)
    base = next(r["generate_s"] for r in rows if r["transport"] == "unsplit")
    out = []
    for r in rows:
        out.append({**{k: v for k, v in r.items() if k != "seed_001"}, "case": "seed001",
                    "ratio": round(r["generate_s"] / base, 3), "workload": r["case"]})
    return out


def phase(ctx: BenchContext, name: str, fn, rows: list, done=None) -> None:
    ctx.log(f"[{name}]")
    t0 = time.perf_counter()
    rows += fn()
    ctx.log(f"[{name}] {time.perf_counter() - t0:.0f} s")
    if done is not None:  # the results so far, written: a run cut short keeps its finished phases
        done()


def device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device == "cuda" else "cpu"


def run(args, out: Optional[Path] = None) -> dict:
    smoke, p = args.smoke, plan(args.smoke)
    cfg = BenchConfig(device=args.device, dtype="bfloat16" if args.device == "cuda" else "float32", threads=1,
                      repeats=1 if smoke else args.repeats, warmup=1 if smoke else 2,
                      new_tokens=4 if smoke else args.new_tokens, prompt_len=8 if smoke else 32)
    started = dt.datetime.now(dt.timezone.utc)
    t0, rows = time.perf_counter(), []
    rounds = 1 if smoke else args.rounds

    def result() -> dict:
        import transformers
        return {"device": device_name(cfg.device), "device_type": cfg.device,
                "date": started.isoformat(timespec="seconds"), "seconds": round(time.perf_counter() - t0, 1),
                "command": command_line(), "smoke": smoke, "server_args": args.server_args or "", "torch": torch.__version__,
                "transformers": transformers.__version__, "rows": rows}

    def done() -> None:
        if out is not None:
            write(result(), out)
    with BenchContext(cfg) as ctx:
        servers = Servers(ctx, shlex.split(args.server_args or ""))
        try:
            # generation first, on servers no training step has changed: the split's tokens are
            # the unsplit model's (same_tokens); each phase's servers go before the next (GPU memory)
            want = set(args.phases.split(",")) if args.phases else None
            if want is None or "seed001" in want:
                phase(ctx, "seed001", lambda: seed001(replace(cfg, dtype="float32"), servers, *p["seed"],
                                                  p["seed_tokens"], p["seed_prompt"]), rows, done)
            if not smoke:
                servers.stop()  # seed 001's float32 server
            if want is None or "greedy" in want:
                phase(ctx, "greedy", lambda: greedy(cfg, ctx, servers, *p["generate"], not args.no_compile), rows,
                      done)
            if want is None or "decode" in want:
                phase(ctx, "decode overhead",
                      lambda: decode_overhead(cfg, servers, *p["generate"], p["decode_calls"]), rows, done)
            for size in ("small", "xl"):
                if want is not None and f"train-{size}" not in want:
                    continue
                cases = [c for c in p["train"] if f"-{size}-" in c.case]
                phase(ctx, f"train-{size}", lambda: training(cfg, ctx, servers, cases, rounds), rows, done)
                if not smoke:  # the next model has the GPU to itself
                    servers.stop()
                    ctx.drop_models()
                    _free(cfg.device)
        finally:
            servers.stop()
    return result()


SUMMARY_CASES = ("train-small-bf16", "train-small-f32", "train-small-bf16-mb4", "train-xl-bf16", "train-xl-bf16-mb4",
                 "greedy-b1", "greedy-b8", "seed001")


def summary(result: dict) -> list[dict]:
    """``latest.json``: one row per (case, transport) of the split over the unsplit model."""
    return [{"case": r["case"], "transport": r["transport"], "ratio": r["ratio"], "device": result["device"],
             "date": result["date"]}
            for r in result["rows"] if r["case"] in SUMMARY_CASES and r["transport"] in TRANSPORTS and "ratio" in r]


def markdown(result: dict) -> str:
    lines = [f"# The GPU table (issue 42) on {result['device']}", "",
             f"{result['date']}, {result['seconds']:.0f} s, torch {result['torch']}, transformers "
             f"{result['transformers']}{' (smoke: the tiny model)' if result['smoke'] else ''}.", "",
             f"`{result['command']}`", "",
             "| case | system | time | tokens/s | ratio | same tokens |", "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        time_ms = r.get("median_ms", r.get("generate_s") and f"{r['generate_s']} s")
        lines.append(f"| {r['case']} | {r['transport']} | {time_ms if time_ms is not None else ''}"
                     f"{' ms' if 'median_ms' in r else ''} | {r.get('tokens_per_s', '')} | {r.get('ratio', '')} | "
                     f"{r.get('same_tokens', r.get('error', ''))} |")
    lines += ["", "ratio: training and seed001, the split's time over the unsplit one's (lower is better); "
              "greedy, the split's tokens/s over stock `generate`'s (higher is better); decode overhead: "
              "the round trip minus the server's compute.", ""]
    return "\n".join(lines)


def write(result: dict, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    stamp = result["date"].replace(":", "").replace("+0000", "Z")
    paths = [out / f"{stamp}.json", out / "latest.json", out / "latest.md"]
    paths[0].write_text(json.dumps(result, indent=1) + "\n")
    paths[1].write_text(json.dumps(summary(result), indent=1) + "\n")
    paths[2].write_text(markdown(result))
    return paths


def main(argv=None) -> int:
    a = argparse.ArgumentParser(prog="python benchmarks/gpu.py", description=__doc__.splitlines()[0])
    a.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    a.add_argument("--smoke", action="store_true", help="the tiny model, one round of each case (seconds)")
    a.add_argument("--rounds", type=int, default=5, help="interleaved training rounds (median reported)")
    a.add_argument("--repeats", type=int, default=3, help="timed generations per system")
    a.add_argument("--new-tokens", type=int, default=64)
    a.add_argument("--no-compile", action="store_true", help="without the static cache + torch.compile reference")
    a.add_argument("--phases", help="comma-separated subset of seed001,greedy,decode,train-small,train-xl "
                   "(default: all)")
    a.add_argument("--server-args", help='flags added to every server, e.g. "--decode-graphs 4"')
    a.add_argument("--out", help="results directory (default: benchmarks/results/gpu; --smoke: a temporary one)")
    args = a.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        a.error("--device cuda: no CUDA device is available (--device cpu --smoke runs without one)")
    out = Path(args.out) if args.out else (Path(tempfile.mkdtemp(prefix="sl-gpu-smoke-")) if args.smoke else
                                           Path(__file__).resolve().parent / "results" / "gpu")
    result = run(args, out)
    for r in result["rows"]:
        print(json.dumps(r))
    print(markdown(result))
    print("wrote " + ", ".join(str(p) for p in write(result, out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
