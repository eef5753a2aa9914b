"""transformers' own ``generate()`` on a split model against ``SplitClient.generate`` (and the unsplit model).

    python benchmarks/hf_generate.py            # GPT-2 small shape, both modes (5 rounds: about 17 minutes on 2 cores)
    python benchmarks/hf_generate.py --quick    # the tiny model, a few tokens: the smoke test
    python benchmarks/hf_generate.py --profile  # also cProfile one batch-1 generation of (b) and (c)

Greedy decoding of ``new_tokens`` tokens after a ``prompt_len`` prompt, batch 1 and 8, by

- **(a) unsplit**: ``GPT2LMHeadModel.generate`` in the client's process (the limit);
- **(b) SplitClient**: :meth:`splitlearn.client.SplitClient.generate`. Since issue 30 this is
  transformers' ``generate`` on ``SplitClient.model`` (its own prepacked weights) in every
  cell; batches of two rows or more where the server has cores of its own (the ``pinned`` mode,
  U-shape) run as two row groups in flight inside the model's forward (``RemoteCache.row_groups``),
  as (c) does. Until issue 30 those cells ran a hand-written greedy loop of two groups
  (``splitlearn/client/generation.py``'s ``RemoteDecoder``), and before issue 20 every cell
  did; the figures in benchmarks/README.md from before that change are its "hand loop" column;
- **(c) hf generate**: ``splitlearn.SplitGPT2LMHeadModel.from_pretrained(source, server=url,
  token=...).generate(...)`` (transformers' ``GenerationMixin`` over a ``RemoteCache``), on
  prepacked weights as (b) (``SplitGenerationMixin.packed_weights``, the default);
- **(c) unpacked**: the same with ``packed_weights = False`` (transformers' own kernels: how (c)
  ran before it packed; ``--no-unpacked`` skips it),

against a real ``python -m splitlearn.server`` on loopback, U-shape (cuts 2, 10) and 2-way
(cut 2), float32 wire, in two modes:

- ``shared``: client and server unpinned, every core's torch threads each (``make bench``'s
  generation workload);
- ``pinned``: two devices emulated as ``benchmarks/pinned.py`` does: the server on core 1, the
  client (and the unsplit reference) on core 0, one torch thread each
  (``os.sched_setaffinity``, ``--torch-threads 1``, ``OMP_NUM_THREADS=1``).

Each mode runs in a child process of its own. Rounds are paired: every round runs each system
once, in an order rotated from round to round, so a slow phase of the machine hits all of them;
``repeats`` rounds after one warm-up round (which also checks that (b) and (c) give (a)'s
tokens). Reported per cell: tokens/s from the median time, and the medians over rounds of the
paired ratios (c)/(b) and each system over (a). Writes ``benchmarks/results/cpu/hf_generate.json``
(``--out``); ``benchmarks/README.md`` ("transformers generate vs the hand loop") reads it.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.timing import ONE_THREAD_ENV, run_in_child  # noqa: E402

OUT = Path(__file__).resolve().parent / "results" / "cpu" / "hf_generate.json"
SYSTEMS = ("unsplit", "hand loop", "hf generate", "hf generate, unpacked")


@dataclass
class Config:
    model: str = "random:gpt2"
    u_cuts: tuple[int, int] = (2, 10)
    two_way_cut: int = 2
    prompt_len: int = 32
    new_tokens: int = 64
    batches: tuple[int, ...] = (1, 8)
    shapes: tuple[str, ...] = ("u", "2-way")
    modes: tuple[str, ...] = ("shared", "pinned")
    repeats: int = 5  # paired rounds after one warm-up round
    pinned_cores: tuple[int, int] = (0, 1)  # (client, server)
    profile: bool = False  # cProfile one batch-1 generation of (b) and (c) per mode and shape
    profile_top: int = 25
    unpacked: bool = True  # also (c) with packed_weights=False: what it was before it packed
    seed: int = 0
    extra: dict = field(default_factory=dict)

    @classmethod
    def quick(cls, **kw) -> "Config":
        return replace(cls(model="tiny", u_cuts=(1, 3), two_way_cut=1, prompt_len=8, new_tokens=8,
                           batches=(1, 2), repeats=1), **kw)


def _profile(fn, top: int) -> dict:
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    fn()
    prof.disable()
    wall = time.perf_counter() - t0
    stats = pstats.Stats(prof)
    rows = []
    for (file, line, name), (cc, nc, tt, ct, _) in stats.stats.items():
        rows.append({"function": f"{Path(file).name}:{line}({name})", "calls": nc, "tottime_s": tt,
                     "cumtime_s": ct})
    by_cum = sorted(rows, key=lambda r: -r["cumtime_s"])[:top]
    by_tot = sorted(rows, key=lambda r: -r["tottime_s"])[:top]
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(top)
    return {"wall_s": wall, "by_cumtime": by_cum, "by_tottime": by_tot, "text": s.getvalue()}


def unpacked(split, ids, N):
    """(c) as it ran before ``SplitGenerationMixin.packed_weights``: HF's own kernels."""
    from benchmarks.generation import hf_generate

    split.packed_weights = False
    try:
        return hf_generate(split, ids, N)
    finally:
        del split.packed_weights


def _child(conn, cfg: Config, mode: str) -> None:
    servers = []
    try:
        if mode == "pinned":
            os.environ.update(ONE_THREAD_ENV)
        import torch

        import splitlearn
        from splitlearn import load_model
        from splitlearn.client import SplitClient
        from splitlearn.procs.localserver import LocalServer

        from benchmarks.generation import hf_generate

        threads = 1 if mode == "pinned" else (os.cpu_count() or 1)
        rows, profiles = [], {}
        for shape in cfg.shapes:
            cuts = cfg.u_cuts if shape == "u" else (cfg.two_way_cut,)
            args = ["--model", cfg.model, "--device", "cpu", "--dtype", "float32", "--torch-threads",
                    str(threads), "--seed", str(cfg.seed), "--threads", "16"]
            for c in cuts:
                args += ["--cut", str(c)]
            env = ONE_THREAD_ENV if mode == "pinned" else {"OMP_NUM_THREADS": str(threads),
                                                               "MKL_NUM_THREADS": str(threads)}
            if mode == "pinned":
                os.sched_setaffinity(0, {cfg.pinned_cores[1]})  # the server inherits it
            srv = LocalServer(args, env=env).start()
            servers.append(srv)
            if mode == "pinned":
                os.sched_setaffinity(0, {cfg.pinned_cores[0]})
            torch.set_num_threads(threads)
            model = load_model(cfg.model, dtype="float32", device="cpu", seed=cfg.seed).eval()
            client = SplitClient(srv.url, model, token=srv.token, device="cpu", wire_dtype="float32",
                                 seed=cfg.seed)
            split = splitlearn.SplitGPT2LMHeadModel.from_pretrained(cfg.model, server=srv.url, token=srv.token,
                                                                    seed=cfg.seed)
            N = cfg.new_tokens
            for B in cfg.batches:
                g = torch.Generator().manual_seed(cfg.seed + B)
                ids = torch.randint(0, model.config.vocab_size, (B, cfg.prompt_len), generator=g)
                systems = {"unsplit": lambda: hf_generate(model, ids, N),
                           "hand loop": lambda: client.generate(ids, max_new_tokens=N),
                           "hf generate": lambda: hf_generate(split, ids, N)}
                if cfg.unpacked:
                    systems["hf generate, unpacked"] = lambda: unpacked(split, ids, N)
                with torch.no_grad():
                    ref = systems["unsplit"]()
                    same = {s: bool(torch.equal(fn(), ref)) for s, fn in systems.items()}  # + warm-up
                    times = {s: [] for s in systems}
                    order = list(systems)
                    for r in range(cfg.repeats):
                        k = r % len(order)
                        for s in order[k:] + order[:k]:
                            t0 = time.perf_counter()
                            systems[s]()
                            times[s].append(time.perf_counter() - t0)
                    if cfg.profile and B == cfg.batches[0]:
                        profiles[shape] = {s: _profile(systems[s], cfg.profile_top)
                                           for s in ("hand loop", "hf generate")}
                base, hand = times["unsplit"], times["hand loop"]
                for s, ts in times.items():
                    med = statistics.median(ts)
                    rows.append({"mode": mode, "shape": shape, "cuts": list(cuts), "batch": B, "system": s,
                                 "tokens_per_s": B * N / med, "median_s": med, "runs": ts,
                                 "same_tokens": same[s],
                                 "over_unsplit": statistics.median(u / t for u, t in zip(base, ts)),
                                 "over_hand_loop": statistics.median(h / t for h, t in zip(hand, ts))})
            client.close()
            split.remote.close()
            srv.stop()
            servers.remove(srv)
        conn.send(("ok", {"rows": rows, "profiles": profiles, "threads": threads}))
    except BaseException as e:  # report it to the harness rather than dying silently
        import traceback
        conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        for srv in servers:
            srv.stop()


def run_mode(cfg: Config, mode: str) -> dict:
    if mode == "pinned":
        cores = sorted(os.sched_getaffinity(0))
        if not set(cfg.pinned_cores) <= set(cores) or len(set(cfg.pinned_cores)) < 2:
            print(f"pinned: needs cores {cfg.pinned_cores}, have {cores}: skipped")
            return {"rows": [], "profiles": {}, "skipped": True}
    return run_in_child(_child, (cfg, mode), mode, ONE_THREAD_ENV if mode == "pinned" else None)

def table(rows: list[dict]) -> str:
    """Markdown: one line per mode, shape and batch; tokens/s of every system and the ratios."""
    unpacked = any(r["system"] == SYSTEMS[3] for r in rows)
    out = ["| mode | shape | batch | (a) unsplit | (b) hand loop | (c) hf generate | **(c)/(b)** | (b)/(a) | (c)/(a) |"
           + (" (c) unpacked | (c unpacked)/(b) |" if unpacked else "") + " same tokens |",
           "|---|---|---|---|---|---|---|---|---|" + ("---|---|" if unpacked else "") + "---|"]
    keys = sorted({(r["mode"], r["shape"], r["batch"]) for r in rows},
                  key=lambda k: (["shared", "pinned"].index(k[0]), ["u", "2-way"].index(k[1]), k[2]))
    for m, s, b in keys:
        cell = {r["system"]: r for r in rows if (r["mode"], r["shape"], r["batch"]) == (m, s, b)}
        a, bb, c = (cell[x] for x in SYSTEMS[:3])
        line = (f"| {m} | {s} | {b} | {a['tokens_per_s']:.1f} | {bb['tokens_per_s']:.1f} | "
                f"{c['tokens_per_s']:.1f} | **{c['over_hand_loop']:.3f}** | {bb['over_unsplit']:.3f} | "
                f"{c['over_unsplit']:.3f} |")
        if unpacked:
            u = cell[SYSTEMS[3]]
            line += f" {u['tokens_per_s']:.1f} | {u['over_hand_loop']:.3f} |"
        same = all(r["same_tokens"] for r in cell.values())
        out.append(line + f" {'yes' if same else 'NO'} |")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/hf_generate.py", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="the tiny model, a few tokens: a smoke test")
    p.add_argument("--modes", default=None, help="comma-separated: shared,pinned")
    p.add_argument("--shapes", default=None, help="comma-separated: u,2-way")
    p.add_argument("--batches", default=None, help="comma-separated, e.g. 1,8")
    p.add_argument("--repeats", type=int, help="paired rounds after the warm-up round")
    p.add_argument("--no-unpacked", action="store_true", help="skip (c) with packed_weights=False")
    p.add_argument("--profile", action="store_true", help="cProfile one generation of (b) and (c) per cell")
    p.add_argument("--out", type=Path, help="JSON path (default benchmarks/results/cpu/hf_generate.json; "
                                            "--quick: not written unless given)")
    a = p.parse_args(argv)
    cfg = Config.quick() if a.quick else Config()
    if a.modes:
        cfg.modes = tuple(a.modes.split(","))
    if a.shapes:
        cfg.shapes = tuple(a.shapes.split(","))
    if a.batches:
        cfg.batches = tuple(int(x) for x in a.batches.split(","))
    if a.repeats:
        cfg.repeats = a.repeats
    cfg.profile = a.profile
    cfg.unpacked = not a.no_unpacked
    from benchmarks.timing import command_line, machine_info

    started = time.time()
    machine = machine_info(os.cpu_count() or 1)
    rows, profiles = [], {}
    for mode in cfg.modes:
        print(f"{mode}: measuring {', '.join(cfg.shapes)} x batch {', '.join(map(str, cfg.batches))} ...",
              flush=True)
        res = run_mode(cfg, mode)
        rows += res["rows"]
        if res.get("profiles"):
            profiles[mode] = res["profiles"]
    print(table(rows))
    for mode, per_shape in profiles.items():
        for shape, per_system in per_shape.items():
            for system, prof in per_system.items():
                print(f"\n--- cProfile {mode} {shape} batch {cfg.batches[0]}: {system} ({prof['wall_s']:.3f} s)")
                print(prof["text"])
    out = a.out or (None if a.quick else OUT)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        for per_shape in profiles.values():  # the text is for the terminal; the JSON keeps the rows
            for per_system in per_shape.values():
                for prof in per_system.values():
                    prof.pop("text", None)
        doc = {"command": command_line(), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
               "seconds": time.time() - started, "machine": machine,
               "load_average_at_end": list(os.getloadavg()), "config": asdict(cfg), "rows": rows,
               "table": table(rows), "profiles": profiles}
        out.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {out}")
    bad = [r for r in rows if not r["same_tokens"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
