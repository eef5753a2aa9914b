"""One decode step's compute under the decode products' rules, against the unsplit model (CPU).

    python benchmarks/decode_products.py               # GPT-2 small U (2, 10), batch 1, 20 rounds
    python benchmarks/decode_products.py --quick       # the tiny model, 3 rounds

In this process, pinned to one core with one torch thread, one new position after a 32-token
prompt: the unsplit model (``GPT2LMHeadModel``, stock products), and the split's three segments
chained without a transport, as

- ``shared``: a server of several tenants (every trunk product packed, batch-invariant between
  owners) and the client head's earlier rule (``F.linear`` or packed, whichever measured faster);
- ``one tenant``: a server of one tenant (each product where it measured fastest) and the client
  head's third choice, its weight copied (in, out) where that measured fastest.

Interleaved rounds, medians, ratios over the unsplit step in the same run: the compute a split
decode step costs before its two round trips (docs/INTERNALS.md, 'Small-batch matrix products
on CPU').
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))

os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")

import torch  # noqa: E402

import splitlearn as sl  # noqa: E402
import splitlearn.model.packed as pk  # noqa: E402
from benchmarks.timing import command_line, machine_info, write_result  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "cpu" / "decode_products.json"


@torch.no_grad()
def run(model_src: str, cuts: tuple[int, int], rounds: int, prompt: int = 32) -> dict:
    torch.manual_seed(0)
    m = sl.load_model(model_src, seed=0).eval()
    parts = sl.partition(m, cuts)
    segs = [parts.bottom.eval(), parts.trunk.eval(), parts.top.eval()]
    V, d = m.config.vocab_size, m.config.n_embd
    caches = [s.new_cache() for s in segs]
    h = torch.randint(0, V, (1, prompt))
    for s, c in zip(segs, caches):
        h = s(h, None, c)
    past = m(torch.randint(0, V, (1, prompt)), use_cache=True).past_key_values
    bottom, top = pk.PackedLinears(segs[0]), pk.PackedLinears(segs[2])
    servers = {"shared": pk.PackedLinears(segs[1], adaptive=False),
               "one tenant": pk.PackedLinears(segs[1], adaptive=True)}
    head = (d, V, 1)

    def split(rule: str) -> float:
        x, t = torch.randint(0, V, (1, 1)), 0.0
        for seg, cache, packed in zip(segs, caches, (bottom, servers[rule], top)):
            if packed is top:
                pk.CHOICE[head] = choice[rule]
            with packed.active():
                t0 = time.perf_counter()
                x = seg(x, None, cache, **({"logits_to_keep": 1} if packed is top else {}))
                t += time.perf_counter() - t0
        return t

    def unsplit() -> float:
        t0 = time.perf_counter()
        m(torch.randint(0, V, (1, 1)), past_key_values=past, use_cache=True, logits_to_keep=1)
        return time.perf_counter() - t0

    choice = {"one tenant": None, "shared": None}
    split("one tenant")  # the head measured on first use as a client measures it: all three ways
    choice["one tenant"] = pk.CHOICE[head]
    choice["shared"] = _measured_without_columns(top, d)
    times = {"unsplit": [], "shared": [], "one tenant": []}
    for _ in range(2):
        split("shared"), split("one tenant"), unsplit()
    for _ in range(rounds):
        times["unsplit"].append(unsplit())
        times["shared"].append(split("shared"))
        times["one tenant"].append(split("one tenant"))
    med = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    return {"model": model_src, "cuts": list(cuts), "rounds": rounds, "head_choice": {k: str(v) for k, v in choice.items()},
            "median_ms": {k: round(v, 2) for k, v in med.items()},
            "split_over_unsplit_time": {k: round(med[k] / med["unsplit"], 3) for k in ("shared", "one tenant")}}


def _measured_without_columns(packed, d: int):
    """The head's choice among F.linear and packed only (the rule before the (in, out) copy)."""
    layer, p = next((layer, p) for layer, p in packed._layers if not p.transposed)
    x2 = torch.randn(1, d)
    original = type(layer).forward.__get__(layer)
    choice, _ = pk._fastest(x2, original, p, layer.bias, None)
    return choice


def main(argv=None) -> int:
    a = argparse.ArgumentParser(prog="python benchmarks/decode_products.py", description=__doc__.splitlines()[0])
    a.add_argument("--quick", action="store_true", help="the tiny model, 3 rounds")
    a.add_argument("--rounds", type=int, default=20)
    a.add_argument("--core", type=int, default=0, help="the core this process is pinned to")
    a.add_argument("--out", default=str(RESULTS))
    args = a.parse_args(argv)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {args.core})
    torch.set_num_threads(1)
    started = time.time()
    res = run("tiny" if args.quick else "random:gpt2", (1, 3) if args.quick else (2, 10), 3 if args.quick else args.rounds)
    res.update(command=command_line(), machine=machine_info(1), seconds=round(time.time() - started, 1))
    print(res["median_ms"], res["split_over_unsplit_time"], "head:", res["head_choice"])
    if not args.quick or args.out != str(RESULTS):
        write_result(res, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
