"""Cross-session decode batching on a Llama of GPT-2 small's size (issue 52, item 7).

    python benchmarks/family_batching.py            # random:llama-small and random:gpt2, U (2, 10)
    python benchmarks/family_batching.py --quick    # tiny-llama and tiny, seconds

The server's trunk (layers 2-10) on one torch thread, prepacked as a server of several tenants
packs it (``PackedLinears(adaptive=False)``). Four sessions, each with its own KV cache after a
32-position prefill, decode ``--steps`` tokens: **batched** (every step of the four in one
``batched_decode``: Llama through the layers' own call with per-session caches, GPT-2 through its
hand-written block) against **one at a time** (each session's step alone, as ``--no-batching``
runs them). Each round times both, paired (the order alternates), so a slow phase of the machine
hits both; the gain is the median over the rounds of one-at-a-time ÷ batched. GPT-2 small's gain,
measured the same way beside it, is the reference.

The Llama (``models/llama-small.json``): hidden 768, 12 layers, 12 heads / 4 KV heads, a gated MLP
of 2,048 (GPT-2 small's MLP parameters), vocabulary 32,000; random weights.
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")

import torch  # noqa: E402

from benchmarks.timing import write_result  # noqa: E402
from splitlearn import load_model, partition  # noqa: E402
from splitlearn.model.packed import PackedLinears  # noqa: E402
from splitlearn.server.engine.batching import DecodeItem, batched_decode  # noqa: E402

OUT = Path(__file__).resolve().parent / "results" / "cpu" / "family_batching.json"
SESSIONS, PROMPT = 4, 32


def _setup(src: str, cuts):
    seg = partition(load_model(src), cuts).trunk.eval()
    d = seg.config.hidden_size
    g = torch.Generator().manual_seed(0)
    caches = [seg.new_cache() for _ in range(SESSIONS)]
    with torch.no_grad():
        for c in caches:
            seg(torch.randn(1, PROMPT, d, generator=g), None, c)
    return seg, caches, g


def _decode(seg, caches, steps, g, batched: bool) -> float:
    """Seconds for ``steps`` tokens of every session (tokens of all sessions: steps x SESSIONS)."""
    d = seg.config.hidden_size
    xs = [[torch.randn(1, 1, d, generator=g) for _ in caches] for _ in range(steps)]
    t0 = time.perf_counter()
    with torch.no_grad():
        for x in xs:
            items = [DecodeItem(c, h) for c, h in zip(caches, x)]
            if batched:
                batched_decode(seg, items)
            else:
                for it in items:
                    batched_decode(seg, [it])
    return time.perf_counter() - t0


def measure(src: str, cuts, steps: int, rounds: int) -> dict:
    seg, prefilled, g = _setup(src, cuts)
    packed = PackedLinears(seg, adaptive=False)
    times = {"batched": [], "one at a time": []}
    with packed.active():
        _decode(seg, copy.deepcopy(prefilled), 2, g, True)  # warm-up (packs the weights)
        _decode(seg, copy.deepcopy(prefilled), 2, g, False)
        for r in range(rounds):
            order = ("batched", "one at a time") if r % 2 == 0 else ("one at a time", "batched")
            for mode in order:
                fresh = copy.deepcopy(prefilled)  # the same context length in every round and mode
                times[mode].append(_decode(seg, fresh, steps, g, mode == "batched"))
    tokens = steps * SESSIONS
    gains = [a / b for a, b in zip(times["one at a time"], times["batched"])]
    return {"model": src, "cuts": list(cuts), "sessions": SESSIONS, "prompt": PROMPT, "steps": steps,
            "rounds": rounds,
            "tokens_per_s": {m: round(tokens / statistics.median(v), 1) for m, v in times.items()},
            "gain_median": round(statistics.median(gains), 3), "gains": [round(x, 3) for x in gains]}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=str(OUT))
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    models = (("tiny-llama", (1, 3)), ("tiny", (1, 3))) if a.quick else (
        ("random:llama-small", (2, 10)), ("random:gpt2", (2, 10)))
    rows = [measure(src, cuts, 4 if a.quick else a.steps, 2 if a.quick else a.rounds) for src, cuts in models]
    result = {"what": "cross-session decode batching: 4 sessions' steps in one pass vs one at a time, the "
                      "server's trunk on one thread, prepacked (issue 52 item 7)",
              "torch_threads": 1, "load": os.getloadavg(), "rows": rows}
    out = write_result(result, a.out)
    md = ["| model | trunk | sessions | tokens/s batched | tokens/s one at a time | gain (median) |",
          "|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['model']} | {tuple(r['cuts'])} | {r['sessions']} | {r['tokens_per_s']['batched']} | "
                  f"{r['tokens_per_s']['one at a time']} | {r['gain_median']}x |")
    md.append(f"\nload average at the end: {result['load'][0]:.1f} (a 2-core machine shared with other "
              f"engineers' runs: ratios measured side by side, absolute figures noisy)")
    out.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
