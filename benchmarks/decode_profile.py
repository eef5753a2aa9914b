"""Where a greedy decode step's host time goes: split minus unsplit, per token, one torch thread.

    python benchmarks/decode_profile.py                    # this tree: the row, and the profiles
    python benchmarks/decode_profile.py --before 3eaa80d   # + an earlier commit's client and server,
                                                           #   measured side by side (paired rounds)
    python benchmarks/decode_profile.py --quick            # fewer rounds: the smoke run

The tiny GPT-2 (4 blocks, d = 32, so compute is a small share and the host's glue shows),
U-shape (1, 3), batch 1, an 8-token prompt, greedy. Systems:

- ``unsplit``: transformers' ``generate`` on the whole model in this process;
- ``split http``: :meth:`splitlearn.client.SplitClient.generate` against a real
  ``python -m splitlearn.server`` on loopback (``http://127.0.0.1``);
- ``split inproc``: the same client against the server's app in this process
  (``inproc://``: Flask's test client, no socket), so one profile sees every layer.

Per-token time of a system: (median time of ``--tokens`` new tokens - median time of 1) /
(``--tokens`` - 1): the decode steps alone (the prefill, the session's open and close cancel).
Rounds are paired (every system once per round, the order rotated), after one warm-up round
that also checks the split tokens equal the unsplit ones. With ``--before REV`` the earlier
commit's package (``benchmarks/before_after.py``'s copy, as ``splitlearn_old``) runs the same
split systems in the same rounds, against its own server. Every process: ``OMP_NUM_THREADS=1``;
client and server unpinned (where they share the cores a user's two processes share them).

Profiles (``--no-profile`` skips them): cProfile of the in-process split generation, the
request thread (client, wire, requests, Flask, the routes) and the server's compute thread
(the engine) each, top functions by own time; the operators of one generation
(``torch.profiler``): the copies, casts and allocations per token.

Writes ``benchmarks/results/cpu/decode_profile.json`` and ``.md`` (``--out``).
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
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))

os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")

import torch  # noqa: E402

from benchmarks.timing import command_line, machine_info, write_result  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "cpu" / "decode_profile.json"
MODEL, CUTS, PROMPT = "tiny", (1, 3), 8


def http_server(pkg: str, tmp: str = ""):
    """A started server of package ``pkg`` (``splitlearn`` or ``splitlearn_old``) on loopback."""
    import secrets

    from splitlearn.procs.localserver import ChildServer, free_port

    port, token = free_port(), secrets.token_urlsafe(16)
    cmd = [sys.executable, "-m", f"{pkg}.server", "--model", MODEL, *[x for c in CUTS for x in ("--cut", str(c))],
           "--torch-threads", "1", "--device", "cpu", "--host", "127.0.0.1", "--port", str(port),
           "--log-level", "WARNING"]
    env = {"OMP_NUM_THREADS": "1", "SPLITLEARN_TOKEN": token,
           "PYTHONPATH": os.pathsep.join(p for p in (tmp, str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    srv = ChildServer(cmd, port, env=env).start()
    srv.token = token
    return srv


class Inproc:
    """The server's app of package ``pkg`` in this process, served at an ``inproc://`` URL."""

    def __init__(self, pkg: str):
        import dataclasses
        import importlib
        import secrets

        create_app = importlib.import_module(f"{pkg}.server.http.app").create_app
        parse_args = importlib.import_module(f"{pkg}.server.http.cli").parse_args
        self.inproc = importlib.import_module(f"{pkg}.transport.inproc")
        cfg = parse_args(["--model", MODEL, *[x for c in CUTS for x in ("--cut", str(c))], "--torch-threads", "1",
                          "--device", "cpu", "--log-level", "WARNING"])
        self.token = secrets.token_urlsafe(16)
        self.app = create_app(dataclasses.replace(cfg, tokens=(self.token,), generated_token=False))
        self.url = self.inproc.serve_inproc(self.app, f"decode-profile-{pkg}")
        self.rt = self.app.extensions["splitlearn"]

    def stop(self) -> None:
        self.inproc.unserve(self.url)
        self.rt.compute.close()


def client(pkg: str, url: str, token: str, model):
    import importlib

    return importlib.import_module(f"{pkg}.client").SplitClient(url, model, token=token, device="cpu")


def run_rounds(systems: dict, ids: torch.Tensor, tokens: int, rounds: int, log) -> dict:
    """{system: {"n": [s...], "1": [s...]}} over ``rounds`` paired rounds after a warm-up one."""
    names = list(systems)
    times = {k: {"n": [], "1": []} for k in names}
    outs = {}
    for r in range(rounds + 1):
        for k in names[r % len(names):] + names[:r % len(names)]:
            for n in (tokens, 1):
                t0 = time.perf_counter()
                out = systems[k](ids, n)
                dt = time.perf_counter() - t0
                if n == tokens:
                    outs[k] = out[:, ids.shape[1]:]
                if r:
                    times[k]["n" if n == tokens else "1"].append(dt)
        if r == 0:
            for k in names:
                if outs[k].shape[1] != tokens or not torch.equal(outs[k], outs["unsplit"]):
                    raise RuntimeError(f"{k}: tokens differ from the unsplit model's ({outs[k].tolist()} vs "
                                       f"{outs['unsplit'].tolist()})")
            log("warm-up done; tokens equal the unsplit model's")
    return times


def per_token_ms(t: dict, tokens: int) -> float:
    return 1e3 * (statistics.median(t["n"]) - statistics.median(t["1"])) / (tokens - 1)


def paired_per_token(t: dict, u: dict, tokens: int) -> float:
    """Median over rounds of (system - unsplit) per token, ms: each round's own difference."""
    return 1e3 * statistics.median((a - a1) - (b - b1) for a, a1, b, b1 in zip(t["n"], t["1"], u["n"], u["1"])) \
        / (tokens - 1)


def breakdown(c, ids, tokens: int, unsplit_ms: float) -> dict:
    """Where one split decode step's time goes (ms a token): the client's transport counts
    (:class:`~splitlearn.transport.http.WireStats`: round trip, the server's own time from its
    ``X-Server-Time-Ms``, encode, decode) over one generation, and the segments' compute alone
    (``benchmarks/profile_decode.py``'s ``step_ms``: a decode step through each, caches filled, no
    transport)."""
    from splitlearn import load_model, partition
    from splitlearn.transport.http import WireStats

    from benchmarks.profile_decode import step_ms

    c.generate(ids, max_new_tokens=tokens)
    t = c.transport
    t.stats = WireStats()
    t0 = time.perf_counter()
    c.generate(ids, max_new_tokens=tokens)
    total = time.perf_counter() - t0
    s, n = t.stats, t.stats.calls
    model = load_model(MODEL, seed=0)
    parts = partition(model, CUTS)
    d = model.config.n_embd
    comp = {k: statistics.median(step_ms(segs, 1, PROMPT, d) for _ in range(3)) for k, segs in
            (("whole", [parts.bottom, parts.trunk, parts.top]), ("bottom", [parts.bottom]),
             ("trunk", [parts.trunk]), ("top", [parts.top]))}
    per = lambda x: 1e3 * x / n  # noqa: E731  ms a step
    return {"steps": n, "generate_ms_per_step": per(total), "round_trip_ms": per(s.round_trip_s),
            "server_ms": per(s.server_compute_s), "wire_and_http_ms": per(s.overhead_s),
            "encode_ms": per(s.serialize_s), "decode_ms": per(s.deserialize_s),
            "client_outside_round_trip_ms": per(total - s.round_trip_s), "compute_ms": comp,
            "unsplit_generate_ms_per_token": unsplit_ms}


def cprofile_inproc(gen, unsplit_gen, ids, tokens: int, rt, top: int) -> dict:
    """cProfile of one split generation in process: the request thread and the compute thread."""
    gen(ids, tokens)  # warm
    main, worker = cProfile.Profile(), cProfile.Profile()
    prof_unsplit = cProfile.Profile()
    prof_unsplit.runcall(unsplit_gen, ids, tokens)
    rt.compute.run(worker.enable)
    try:
        main.runcall(gen, ids, tokens)
    finally:
        rt.compute.run(worker.disable)
    return {"request thread": _stats(main, top, tokens), "compute thread": _stats(worker, top, tokens),
            "unsplit": _stats(prof_unsplit, top, tokens)}


CATEGORIES = (  # (category, substrings of a function's file), the first that matches
    ("waits (locks, queues, sockets)", ("_thread.lock", "_queue.", "socket", "select.")),
    ("torch operators (C)", ("torch._C", "torch._ops", "torch.", "TensorBase")),
    ("wire (api/wire.py, safetensors, numpy)", ("splitlearn/api/wire.py", "safetensors", "numpy")),
    ("answer checks (api/trust.py)", ("splitlearn/api/trust.py",)),
    ("split cache (hf/cache.py, hf/ahead.py)", ("splitlearn/hf/cache.py", "splitlearn/hf/ahead.py")),
    ("client transport (transport/, http.client, requests)", ("splitlearn/transport/", "http/client.py",
                                                              "requests/", "urllib3/", "email/")),
    ("server http (Flask, werkzeug, server/http/)", ("flask/", "werkzeug/", "splitlearn/server/http/")),
    ("server engine (server/engine/)", ("splitlearn/server/engine/",)),
    ("generate's loop (transformers/generation/)", ("transformers/generation/",)),
    ("model modules, Python (transformers, torch.nn, splitlearn model/hf)", ("transformers/", "torch/",
                                                                           "splitlearn/")),
)


def category(func: tuple) -> str:
    file, _, name = func
    where = f"{file}:{name}"
    for cat, marks in CATEGORIES:
        if any(m in where for m in marks):
            return cat
    return "other Python (threading, concurrent.futures, ...)"


def categories(prof: cProfile.Profile, tokens: int) -> dict:
    """Own time by :data:`CATEGORIES`, us a token; a builtin's (file ``~``) that is no torch
    operator and no wait goes to its callers' categories, in their shares."""
    st = pstats.Stats(prof).stats
    out: dict = {}
    for func, (_, _, tt, _, callers) in st.items():
        cat = category(func)
        if func[0] == "~" and cat.startswith(("model", "other")) and callers:
            total = sum(c[2] for c in callers.values()) or 1.0
            for caller, c in callers.items():
                k = category(caller)
                out[k] = out.get(k, 0.0) + tt * c[2] / total
        else:
            out[cat] = out.get(cat, 0.0) + tt
    return {k: 1e6 * v / tokens for k, v in sorted(out.items(), key=lambda kv: -kv[1])}


def _stats(prof: cProfile.Profile, top: int, tokens: int) -> dict:
    st = pstats.Stats(prof)
    rows = []
    for (file, line, fn), (cc, nc, tt, ct, _) in st.stats.items():
        rows.append({"function": f"{_short(file)}:{line}({fn})", "calls_per_token": nc / tokens,
                     "own_us_per_token": 1e6 * tt / tokens, "cum_us_per_token": 1e6 * ct / tokens})
    rows.sort(key=lambda r: -r["own_us_per_token"])
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return {"total_us_per_token": 1e6 * st.total_tt / tokens, "top": rows[:top],
            "categories": categories(prof, tokens)}


def _short(file: str) -> str:
    for mark in ("site-packages/", "splitlearn_old/", "/work/main/"):
        if mark in file:
            return file.split(mark, 1)[1] if mark != "splitlearn_old/" else "splitlearn_old/" + file.split(mark, 1)[1]
    return file.rsplit("/", 1)[-1]


def op_profile(gen, ids, tokens: int, top: int) -> list[dict]:
    """torch operators of one generation (client and server in this process), counts per token."""
    from torch.profiler import ProfilerActivity, profile

    gen(ids, tokens)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        gen(ids, tokens)
    rows = [{"op": e.key, "calls_per_token": e.count / tokens, "us_per_token": e.self_cpu_time_total / tokens}
            for e in prof.key_averages()]
    rows.sort(key=lambda r: -r["us_per_token"])
    return rows[:top]


def markdown(res: dict) -> str:
    L = [f"# Decode step, host side: split minus unsplit ({res['date']})", "",
         f"`{res['command']}`: {res['model']} U-shape {tuple(res['cuts'])}, batch 1, prompt {res['prompt']}, "
         f"{res['tokens']} greedy tokens, one torch thread per process, {res['rounds']} paired rounds; "
         f"load average at start {res['machine']['load_average_at_start']}. Per token: (t({res['tokens']}) - "
         f"t(1)) / {res['tokens'] - 1}; split - unsplit: the median of each round's own difference.", "",
         "| system | per token, ms | split - unsplit, ms/token |", "|---|---|---|"]
    for k, r in res["rows"].items():
        d = "" if k == "unsplit" else f"{r['minus_unsplit_ms']:.3f}"
        L.append(f"| {k} | {r['per_token_ms']:.3f} | {d} |")
    if res.get("after_over_before"):
        L += ["", "Split - unsplit, after / before (paired): " +
              ", ".join(f"{k}: {v:.3f}" for k, v in res["after_over_before"].items())]
    b = res.get("breakdown")
    if b:
        c = b["compute_ms"]
        L += ["", "## One split http step, ms (transport counts over one generation; compute: each segment alone)", "",
              "| what | ms |", "|---|---|",
              f"| split generate, per step (steps: {b['steps']}, the prefill's included) | {b['generate_ms_per_step']:.3f} |",
              f"| round trip (client: send to answer read) | {b['round_trip_ms']:.3f} |",
              f"| of which the server's own time (`X-Server-Time-Ms`: body read to answer built) | {b['server_ms']:.3f} |",
              f"| of which wire + HTTP, both sides (round trip - server's time) | {b['wire_and_http_ms']:.3f} |",
              f"| client, outside the round trip (bottom, top, head, generate, cache, encode, decode) | "
              f"{b['client_outside_round_trip_ms']:.3f} |",
              f"| client encode / decode of the wire | {b['encode_ms']:.3f} / {b['decode_ms']:.3f} |",
              f"| compute alone: whole model / bottom / trunk / top (a decode step, no glue) | {c['whole']:.3f} / "
              f"{c['bottom']:.3f} / {c['trunk']:.3f} / {c['top']:.3f} |",
              f"| unsplit generate, per token | {b['unsplit_generate_ms_per_token']:.3f} |"]
    cp = res.get("cprofile")
    if cp:
        cats = {c for p in cp.values() for c in p["categories"]}
        g = lambda w, c: cp[w]["categories"].get(c, 0.0)  # noqa: E731
        rows = sorted(cats, key=lambda c: (c.startswith("waits"),
                                           -(g("request thread", c) + g("compute thread", c) - g("unsplit", c))))
        L += ["", "## cProfile by category, us a token (own time; inflated by the profiler, compare rows)", "",
              "split inproc: the request thread (client, wire, Flask, routes) and the server's compute thread "
              "(the engine); the waits are each thread's idle time.", "",
              "| category | split, request thread | split, compute thread | unsplit | split - unsplit |",
              "|---|---|---|---|---|"]
        for c in rows:
            a, b, u = g("request thread", c), g("compute thread", c), g("unsplit", c)
            d = "(idle time)" if c.startswith("waits") else f"{a + b - u:+.0f}"
            L.append(f"| {c} | {a:.0f} | {b:.0f} | {u:.0f} | {d} |")
    for where, prof in (res.get("cprofile") or {}).items():
        if where == "unsplit":
            continue
        L += ["", f"## cProfile, split inproc, {where} ({prof['total_us_per_token']:.0f} us/token profiled)", "",
              "| function | calls/token | own us/token | cum us/token |", "|---|---|---|---|"]
        L += [f"| `{r['function']}` | {r['calls_per_token']:.1f} | {r['own_us_per_token']:.1f} | "
              f"{r['cum_us_per_token']:.1f} |" for r in prof["top"]]
    if res.get("ops"):
        L += ["", "## torch operators, split inproc (client and server), per token", "",
              "| op | calls/token | self us/token |", "|---|---|---|"]
        L += [f"| `{r['op']}` | {r['calls_per_token']:.1f} | {r['us_per_token']:.1f} |" for r in res["ops"]]
    return "\n".join(L) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/decode_profile.py", description=__doc__.splitlines()[0])
    p.add_argument("--before", help="an earlier commit: its client and server measured side by side")
    p.add_argument("--tokens", type=int, default=48, help="new tokens (prompt 8 + tokens <= 64)")
    p.add_argument("--rounds", type=int, help="paired rounds after the warm-up (default 7; --quick 2)")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--top", type=int, default=20, help="rows of each profile")
    p.add_argument("--no-profile", action="store_true")
    p.add_argument("--out", default=str(OUT))
    a = p.parse_args(argv)
    a.rounds = a.rounds or (2 if a.quick else 7)
    if not 2 <= a.tokens <= 64 - PROMPT:
        p.error(f"--tokens must lie in [2, {64 - PROMPT}]")
    torch.set_num_threads(1)
    from splitlearn import load_model

    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    torch.manual_seed(0)
    unsplit = load_model(MODEL).eval()
    unsplit.generation_config.eos_token_id = None  # never stop early: every system makes --tokens
    ids = torch.randint(0, 256, (1, PROMPT), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    systems = {"unsplit": lambda x, n: unsplit.generate(x, attention_mask=mask, max_new_tokens=n, do_sample=False,
                                                        pad_token_id=0)}
    stops, clients = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        pkgs = [("", "splitlearn")]
        if a.before:
            from benchmarks.before_after import old_package

            old_package(a.before, Path(tmp))
            sys.path.insert(0, tmp)
            pkgs.insert(0, ("before ", "splitlearn_old"))
        inprocs = {}
        try:
            for label, pkg in pkgs:
                srv = http_server(pkg, tmp)
                stops.append(srv.stop)
                ip = inprocs[label] = Inproc(pkg)
                stops.append(ip.stop)
                for kind, (url, token) in (("http", (srv.url, srv.token)), ("inproc", (ip.url, ip.token))):
                    c = clients[f"{label}split {kind}"] = client(pkg, url, token, MODEL)
                    systems[f"{label}split {kind}"] = lambda x, n, c=c: c.generate(x, max_new_tokens=n)
            times = run_rounds(systems, ids, a.tokens, a.rounds, log)
            rows = {k: {"per_token_ms": per_token_ms(t, a.tokens),
                        **({} if k == "unsplit" else
                           {"minus_unsplit_ms": paired_per_token(t, times["unsplit"], a.tokens)}),
                        "times_s": t} for k, t in times.items()}
            res = {"command": command_line(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                   "machine": machine_info(1), "model": MODEL, "cuts": list(CUTS), "prompt": PROMPT,
                   "tokens": a.tokens, "rounds": a.rounds, "before": a.before, "rows": rows}
            if a.before:
                res["after_over_before"] = {
                    kind: statistics.median(
                        ((x - x1) - (u - u1)) / ((y - y1) - (u - u1))
                        for x, x1, y, y1, u, u1 in zip(times[f"split {kind}"]["n"], times[f"split {kind}"]["1"],
                                                       times[f"before split {kind}"]["n"],
                                                       times[f"before split {kind}"]["1"],
                                                       times["unsplit"]["n"], times["unsplit"]["1"]))
                    for kind in ("http", "inproc")}
            for k, r in rows.items():
                log(f"{k:>22}: {r['per_token_ms']:.3f} ms/token"
                    + ("" if k == "unsplit" else f", minus unsplit {r['minus_unsplit_ms']:.3f}"))
            res["breakdown"] = breakdown(clients["split http"], ids, a.tokens, rows["unsplit"]["per_token_ms"])
            if not a.no_profile:
                gen = systems["split inproc"]
                res["cprofile"] = cprofile_inproc(gen, systems["unsplit"], ids, a.tokens, inprocs[""].rt, a.top)
                res["ops"] = op_profile(gen, ids, a.tokens, a.top)
        finally:
            for c in clients.values():
                c.close()
            for stop in reversed(stops):
                try:
                    stop()
                except Exception as e:  # noqa: BLE001 - stop the rest
                    log(f"stopping: {e}")
    out = Path(a.out)
    write_result(res, out)
    out.with_suffix(".md").write_text(markdown(res))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
