"""Masked offload (issue 22) against the client alone and plain offload: seed 000's table, measured.

    python benchmarks/offload.py            # GPT-2 small shape (random:gpt2): prefill 128, decode 32, b1
    python benchmarks/offload.py --quick    # the tiny model, seconds: the smoke test

Three systems run the same greedy loop (prefill ``--prompt`` tokens with ``logits_to_keep=1``,
then ``--new`` decode steps on the KV cache), batch 1, on loopback:

- **client alone**: ``load_model(M)`` in this process (what the owner could not afford, on a GPU);
- **plain offload**: ``OffloadGPT2LMHeadModel(scheme="plain")``: every linear layer's float32
  input sent as is, ``x W`` returned (no masking, no check: the unprotected baseline);
- **masked offload**: ``scheme="masked"``: fixed point, one-time pads, Freivalds' check.

For the offload systems each phase's time is split as seed 000's table: server compute (the
server's ``X-Server-Time-Ms``: decode, validate, product, encode), transfers and
synchronisation (time blocked on answers less server compute), (de)serialisation, masking,
unmasking (pads off, CRT, dequantise, bias), verification, and client compute (the rest: the
non-linear layers, attention, the KV cache, Python). Also requests and bytes per token, and
the offline cost of the pads (their precompute, timed separately between runs). The pads are
refilled to capacity before each run (no refill thread competes with the measurement).
Results: ``benchmarks/results/cpu/offload.json``; the figures are in benchmarks/README.md.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

import splitlearn as sl
from splitlearn.procs.localserver import LocalServer
from splitlearn.offload import OffloadGPT2LMHeadModel

STAT_KEYS = ("products", "requests", "rows", "mask_s", "unmask_s", "verify_s", "wait_s", "codec_s", "send_s",
             "bytes_sent", "bytes_received", "server_s", "pads_late")


@torch.no_grad()
def greedy(model, ids: torch.Tensor, new: int, stats=None) -> dict:
    """Prefill then ``new`` decode steps; wall seconds and stats deltas per phase, tokens."""
    out = {}
    snap = stats() if stats else None
    t0 = time.perf_counter()
    res = model(ids, use_cache=True, logits_to_keep=1)
    tok = res.logits[:, -1].argmax(-1, keepdim=True)  # (1, 1)
    out["prefill"] = {"wall_s": time.perf_counter() - t0}
    if stats:
        out["prefill"].update(delta(snap, stats()))
        snap = stats()
    past, tokens = res.cache, [int(tok)]
    t0 = time.perf_counter()
    for _ in range(new):
        res = model(tok, cache=past, use_cache=True)
        past, tok = res.cache, res.logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(int(tok))
    out["decode"] = {"wall_s": time.perf_counter() - t0}
    if stats:
        out["decode"].update(delta(snap, stats()))
    out["tokens"] = tokens
    return out


def delta(a: dict, b: dict) -> dict:
    return {k: b[k] - a[k] for k in STAT_KEYS}


def breakdown(phase: dict, tokens: int) -> dict:
    """Seed 000's rows from one phase's wall time and stats (ms per phase; see the docstring)."""
    wall = phase["wall_s"]
    rows = {"server compute": phase["server_s"], "transfers + sync": phase["wait_s"] - phase["server_s"],
            "sending": phase["send_s"], "(de)serialisation": phase["codec_s"], "masking": phase["mask_s"],
            "unmasking": phase["unmask_s"], "verification": phase["verify_s"]}
    rows["client compute"] = wall - sum(rows.values())
    return {**{k: v * 1e3 for k, v in rows.items()}, "total": wall * 1e3,
            "server utilisation": phase["server_s"] / wall, "requests per token": phase["requests"] / tokens,
            "bytes per token": (phase["bytes_sent"] + phase["bytes_received"]) / tokens}


def median_of(runs: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


@torch.no_grad()
def quantisation_error(model_name: str, ids: torch.Tensor) -> dict:
    """The masked scheme's logits against the model's, in-process: each linear layer replaced by
    ``sx sw (xq Wq) + b`` in float64 (what unmasking returns, exactly: tests/test_offload_field.py),
    no server. Max |logit difference| over the prompt, and whether greedy next tokens agree."""
    from splitlearn.offloadmath import field as F
    from splitlearn.model.arch import arch_of
    from splitlearn.offload.model import linear_modules
    from splitlearn.offloadmath.layers import linear_weights

    model = sl.load_model(model_name)
    want = model(ids).logits  # (1, T, V)

    class Emulated(torch.nn.Module):
        def __init__(self, w, b):
            super().__init__()
            self.lim = F.limits_for(w.shape[0])
            self.wq, self.sw = F.quantise_weight(w, self.lim.wmax)
            self.b = b

        def forward(self, x):
            xq, sx = F.quantise_rows(x.reshape(-1, x.shape[-1]), self.lim.xmax)
            y = ((xq.double() @ self.wq) * sx * self.sw).float()  # exact integers below 2^53, then scaled
            y = y + self.b if self.b is not None else y
            return y.reshape(*x.shape[:-1], -1)

    paths = arch_of(model.config).linear_paths(model)
    for name, (w, b) in linear_weights(linear_modules(model)).items():
        model.set_submodule(paths[name], Emulated(w.detach(), None if b is None else b.detach()))
    got = model(ids).logits
    return {"max_abs_logit_diff": (got - want).abs().max().item(),
            "logit_scale": want.abs().max().item(),
            "greedy_next_tokens_equal": bool(torch.equal(got.argmax(-1), want.argmax(-1)))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="random:gpt2")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="tiny model, 16 + 8 tokens, 1 repeat")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads of the client and of the server (1: robust on a shared machine)")
    ap.add_argument("--out", default="benchmarks/results/cpu/offload.json")
    ap.add_argument("--error-only", action="store_true",
                    help="only the in-process quantisation error, merged into an existing --out")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    if a.quick:
        a.model, a.prompt, a.new, a.repeats = "tiny", 16, 8, 1
    ids = torch.randint(0, 256, (1, a.prompt), generator=torch.Generator().manual_seed(0))
    if a.error_only:
        result = json.loads(Path(a.out).read_text())
        result["quantisation_error"] = quantisation_error(a.model, ids)
        Path(a.out).write_text(json.dumps(result, indent=1))
        print(result["quantisation_error"])
        return 0
    started = time.perf_counter()
    alone = sl.load_model(a.model)
    greedy(alone, ids, 2)  # warm-up
    runs = [greedy(alone, ids, a.new) for _ in range(a.repeats)]
    want = runs[0]["tokens"]
    result = {"config": vars(a), "machine": {"cpus": torch.get_num_threads(), "platform": platform.platform(),
                                             "torch": torch.__version__, "device": "cpu (no GPU lent)"},
              "client alone": {ph: statistics.median(r[ph]["wall_s"] for r in runs) * 1e3 for ph in ("prefill", "decode")}}
    del alone
    with LocalServer(["--model", a.model, "--offload", "--offload-plain", "--threads", "4",
                      "--torch-threads", str(a.threads)], startup_timeout_s=600,
                     env={"OMP_NUM_THREADS": str(a.threads)}) as srv:
        for scheme in ("plain", "masked"):
            t0 = time.perf_counter()
            model = OffloadGPT2LMHeadModel.from_pretrained(
                a.model, server=srv.url, token=srv.token, scheme=scheme, refill="none",
                pad_rows=a.prompt + a.new + 2, head_pad_rows=a.new + 3)
            setup_s = time.perf_counter() - t0
            stats = lambda: model.offload_stats  # noqa: E731
            greedy(model, ids[:, : min(16, a.prompt)], 1)  # warm-up (connections, first products)
            runs, precompute = [], []
            for _ in range(a.repeats):
                t0 = time.perf_counter()
                made = sum(p.refill() for p in model.offload_pools)  # offline: not in the run's time
                if made:
                    precompute.append({"s": time.perf_counter() - t0, "rows": made})
                runs.append(greedy(model, ids, a.new, stats))
            same = all(r["tokens"] == want for r in runs)
            entry = {"setup_s": setup_s, "tokens_equal": same,
                     "pads_precompute_at_setup_s": getattr(model, "offload_precompute_s", 0.0)}
            for ph, n in (("prefill", a.prompt), ("decode", a.new)):
                entry[ph] = median_of([breakdown(r[ph], n) for r in runs])
                entry[ph]["pads late"] = max(r[ph]["pads_late"] for r in runs)
            if precompute:
                entry["pads_precompute_per_run"] = precompute
            result[scheme] = entry
            model.close()
            print(scheme, json.dumps(entry, indent=1), file=sys.stderr)
    result["client alone"]["tokens"] = want
    result["quantisation_error"] = quantisation_error(a.model, ids)
    result["wall_s"] = time.perf_counter() - started
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1))
    print(report(result))
    return 0


def report(r: dict) -> str:
    """Markdown: the three systems, then seed 000's table for both offload schemes. Client-side
    rows add up to the wall time (waiting = blocked on answers); server compute is the server's
    own time, which overlaps the client's work when two row groups are in flight (prefill)."""
    alone = r["client alone"]
    lines = ["| b1, ms | client alone | plain offload | masked offload | masked ÷ plain | masked ÷ alone |",
             "|---|---|---|---|---|---|"]
    for ph in ("prefill", "decode"):
        pl, ma = r["plain"][ph]["total"], r["masked"][ph]["total"]
        lines.append(f"| {ph} ({r['config']['prompt'] if ph == 'prefill' else r['config']['new']} tokens) | "
                     f"{alone[ph]:.0f} | {pl:.0f} | {ma:.0f} | {ma / pl:.2f}x | {ma / alone[ph]:.1f}x |")
    lines += ["", "| ms (per phase) | plain prefill | masked prefill | plain decode | masked decode |",
              "|---|---|---|---|---|"]
    rows = [("client compute (non-linear layers, attention, cache)", lambda e: e["client compute"]),
            ("masking (quantise, add pads)", lambda e: e["masking"]),
            ("unmasking (remove pads, CRT, dequantise, bias)", lambda e: e["unmasking"]),
            ("verification (Freivalds)", lambda e: e["verification"]),
            ("(de)serialisation (safetensors)", lambda e: e["(de)serialisation"]),
            ("sending requests (socket writes)", lambda e: e.get("sending", 0.0)),
            ("waiting for answers (sync points)", lambda e: e["server compute"] + e["transfers + sync"]),
            ("**total (wall)**", lambda e: e["total"]),
            ("server compute (its own clock)", lambda e: e["server compute"]),
            ("server utilisation (server compute / wall)", lambda e: 100 * e["server utilisation"]),
            ("requests per token", lambda e: e["requests per token"]),
            ("KiB on the wire per token", lambda e: e["bytes per token"] / 1024)]
    for label, f in rows:
        vals = [f(r[s][ph]) for ph in ("prefill", "decode") for s in ("plain", "masked")]
        vals = [vals[0], vals[1], vals[2], vals[3]]
        fmt = "{:.0f}%" if "utilisation" in label else "{:.2f}" if label == "requests per token" else "{:.0f}"
        lines.append(f"| {label} | " + " | ".join(fmt.format(v) for v in vals) + " |")
    m = r["masked"]
    pre = m.get("pads_precompute_per_run") or []
    if pre:
        full = [x for x in pre if x["rows"] == max(y["rows"] for y in pre)]  # a whole run's rows
        per_row = statistics.median(x["s"] / x["rows"] for x in full)
        lines += ["", f"Pads, offline: {statistics.median(x['s'] for x in full):.1f} s to make one run's "
                  f"{full[0]['rows']} pad rows over all layers ({per_row * 1e3:.2f} ms a row); pads late during "
                  f"the runs: {m['prefill']['pads late'] + m['decode']['pads late']}. Tokens equal to the client "
                  f"alone: plain {r['plain']['tokens_equal']}, masked {m['tokens_equal']}."]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
