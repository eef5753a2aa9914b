"""``SplitClient.generate`` of an earlier commit against this tree's, paired, on two emulated devices.

    python benchmarks/generate_before_after.py --before dc15e96            # GPT-2 small shape, b1 and b8, both shapes
    python benchmarks/generate_before_after.py --before dc15e96 --quick    # the tiny model, one round

The generation twin of ``before_after.py`` (whose package copy and earlier server it reuses):
each version's client generates against a server of its own version, both servers on core 1,
the clients (and the unsplit reference) on core 0, one torch thread each. Greedy decoding of
``--new-tokens`` after a 32-token prompt, batch 1 and 8, U-shape (2, 10) and 2-way (2); every
round runs every system once, in an order rotated per round, after one warm-up round. Reported
per cell: median tokens/s and the median of the paired ratios after / before (> 1: faster now).
The tokens of both versions are checked equal to the unsplit model's.
"""
from __future__ import annotations

import argparse
import json
import os
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

from benchmarks.before_after import old_package, old_server  # noqa: E402
from benchmarks.timing import command_line, machine_info, pinned_u_server, write_result  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "cpu" / "generate_before_after.json"


def cell(a, shape: str, unsplit, src: str) -> list[dict]:
    from splitlearn.client import SplitClient as New
    from splitlearn_old.client import SplitClient as Old

    cuts = ((1, 3) if a.quick else (2, 10)) if shape == "u" else ((1,) if a.quick else (2,))
    new_srv = pinned_u_server(src, cuts)
    old_srv = old_server(src, cuts, a.tmp)
    rows = []
    try:
        clients = {"before": Old(old_srv.url, src, token=old_srv.token, device="cpu"),
                   "after": New(new_srv.url, src, token=new_srv.token, device="cpu")}
        for batch in a.batches:
            ids = torch.randint(0, unsplit.config.vocab_size, (batch, a.prompt_len),
                                generator=torch.Generator().manual_seed(batch))
            systems = {"unsplit": lambda: unsplit.generate(ids, attention_mask=torch.ones_like(ids),
                                                           max_new_tokens=a.new_tokens, do_sample=False,
                                                           pad_token_id=0),
                       **{k: (lambda c=c: c.generate(ids, max_new_tokens=a.new_tokens))
                          for k, c in clients.items()}}
            names, times, tokens = list(systems), {k: [] for k in systems}, {}
            for r in range(a.rounds + 1):
                for n in names[r % len(names):] + names[:r % len(names)]:
                    t0 = time.perf_counter()
                    out = systems[n]()
                    dt = time.perf_counter() - t0
                    tokens[n] = out[:, -a.new_tokens:]
                    if r:  # round 0 warms up
                        times[n].append(dt)
            same = {k: bool(torch.equal(tokens[k], tokens["unsplit"])) for k in clients}
            tok = {k: batch * a.new_tokens / statistics.median(v) for k, v in times.items()}
            ratio = statistics.median(b / n for b, n in zip(times["before"], times["after"]))
            row = {"shape": shape, "cuts": list(cuts), "batch": batch, "tokens_per_s": tok,
                   "after_over_before_speed": ratio, "same_tokens": same, "times_s": times}
            print(f"{shape:>5} b{batch}: unsplit {tok['unsplit']:.1f}, before {tok['before']:.1f}, "
                  f"after {tok['after']:.1f} tok/s; after/before speed {ratio:.3f}; same tokens {same}",
                  file=sys.stderr, flush=True)
            rows.append(row)
        for c in clients.values():
            c.close()
    finally:
        new_srv.stop()
        old_srv.stop()
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/generate_before_after.py",
                                description=__doc__.splitlines()[0])
    p.add_argument("--before", required=True, help="the earlier commit (any git revision)")
    p.add_argument("--quick", action="store_true", help="the tiny model, one round")
    p.add_argument("--rounds", type=int, help="paired rounds after the warm-up (default 3; --quick 1)")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--out", default=str(RESULTS))
    a = p.parse_args(argv)
    a.rounds = a.rounds or (1 if a.quick else 3)
    a.prompt_len, a.batches = (8, (1, 2)) if a.quick else (32, (1, 8))
    if a.rounds < 1 or a.new_tokens < 1:
        p.error("--rounds and --new-tokens must be >= 1")
    if (os.cpu_count() or 1) < 2:
        print("needs two cores", file=sys.stderr)
        return 2
    from splitlearn import load_model

    src = "tiny" if a.quick else "random:gpt2"
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        old_package(a.before, Path(tmp))
        sys.path.insert(0, tmp)
        a.tmp = tmp
        unsplit = load_model(src).eval()
        rows = [r for shape in ("u", "2-way") for r in cell(a, shape, unsplit, src)]
    result = {"command": command_line(), "machine": machine_info(1), "before": a.before, "model": src,
              "rounds": a.rounds, "new_tokens": a.new_tokens, "rows": rows}
    print(json.dumps([{k: r[k] for k in ("shape", "batch", "after_over_before_speed", "same_tokens")}
                      for r in rows], indent=1))
    write_result(result, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
