"""Pipelined split training on two emulated devices (client core 0, server core 1).

    python benchmarks/pipelined_training.py                 # GPT-2 small shape, b8 x 128, AdamW
    python benchmarks/pipelined_training.py --quick         # tiny model, seconds

Each side gets one core and one torch thread (``os.sched_setaffinity``; the server inherits
core 1 when it starts), as two machines would give it; the reference is the unsplit model
on the client's core with one thread. Every round runs one step of each system (paired, so a
slow phase of the machine hits all of them); medians over rounds after a warm-up round.
Systems: unsplit; the U-shape split (float32 wire) with ``micro_batches`` 1 (client and
server take turns), 2 and 4 (GPipe pipelining, :mod:`splitlearn.hf.pipeline`), both through
``SplitClient.train_step`` (the loss gradient known: the backward runs with the forward, 1F1B) and through
``SplitGPT2LMHeadModel`` in a plain loop (``loss.backward(); opt.step()``: open-ended steps,
all forwards, then the backwards).
The ratio is split step time / unsplit step time (target for the pipelined split: <= 0.7).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")

import torch  # noqa: E402

from splitlearn import load_model  # noqa: E402
from splitlearn.client import SplitClient  # noqa: E402
from benchmarks.timing import pinned_u_server  # noqa: E402
from splitlearn.model.segments import labels_from_batch  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/pipelined_training.py", allow_abbrev=False,
                                description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--micro", default="1,2,4", help="micro_batches values to compare, comma-separated")
    p.add_argument("--json", help="write the results here")
    a = p.parse_args(argv)
    model_src, cuts, (B, T) = ("tiny", (1, 3), (8, 32)) if a.quick else ("random:gpt2", (2, 10), (8, 128))
    if (os.cpu_count() or 1) < 2:
        print("needs two cores", file=sys.stderr)
        return 2
    srv = pinned_u_server(model_src, cuts)  # client core 0, server core 1
    try:
        unsplit = load_model(model_src)
        unsplit.train()
        opt = torch.optim.AdamW(unsplit.parameters(), lr=1e-4, weight_decay=0.0)
        clients = {m: SplitClient(srv.url, model_src, token=srv.token, lr=1e-4, device="cpu", micro_batches=m,
                                  client_id=f"m{m}") for m in map(int, a.micro.split(","))}
        from splitlearn.hf import SplitGPT2LMHeadModel

        models = {m: SplitGPT2LMHeadModel.from_pretrained(model_src, server=srv.url, token=srv.token, micro_batches=m,
                                                          client_id=f"model-m{m}").train() for m in clients}
        optimizers = {m: torch.optim.AdamW(mod.parameters(), lr=1e-4, weight_decay=0.0) for m, mod in models.items()}
        g = torch.Generator().manual_seed(0)
        vocab = unsplit.config.vocab_size
        times: dict[str, list[float]] = {"unsplit": [], **{f"split m={m}": [] for m in clients},
                                         **{f"model class m={m}": [] for m in models}}
        for r in range(a.rounds + 1):
            ids = torch.randint(0, vocab, (B, T), generator=g)
            t0 = time.perf_counter()
            opt.zero_grad()
            unsplit(ids, labels=labels_from_batch(ids, None)).loss.backward()
            opt.step()
            t_unsplit = time.perf_counter() - t0
            row = {"unsplit": t_unsplit}
            for m, c in clients.items():
                t0 = time.perf_counter()
                c.train_step(ids)
                row[f"split m={m}"] = time.perf_counter() - t0
            for m, mod in models.items():
                t0 = time.perf_counter()
                mod(input_ids=ids, labels=ids).loss.backward()
                optimizers[m].step()
                optimizers[m].zero_grad()
                row[f"model class m={m}"] = time.perf_counter() - t0
            if r:  # the first round warms up
                for k, v in row.items():
                    times[k].append(v)
            print(f"round {r}: " + ", ".join(f"{k} {v:.2f}s" for k, v in row.items()), file=sys.stderr)
        base = statistics.median(times["unsplit"])
        result = {"model": model_src, "cuts": list(cuts), "batch": [B, T], "rounds": a.rounds,
                  "median_s": {k: statistics.median(v) for k, v in times.items()},
                  "ratio": {k: statistics.median(v) / base for k, v in times.items()}}
        print(json.dumps(result, indent=2))
        if a.json:
            Path(a.json).write_text(json.dumps(result, indent=2))
    finally:
        srv.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
