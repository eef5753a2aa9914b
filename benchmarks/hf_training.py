"""Training through the model classes against ``SplitClient.train_step`` and the unsplit model.

    python benchmarks/hf_training.py            # GPT-2 small shape, b8 x 128, both shapes (a few minutes on 2 cores)
    python benchmarks/hf_training.py --quick    # the tiny model: the smoke test

One AdamW step (lr 1e-4) on the same batch, by

- **(a) unsplit**: ``GPT2LMHeadModel`` in this process: ``loss.backward(); opt.step()``;
- **(b) SplitClient**: :meth:`splitlearn.client.SplitClient.train_step` (the fused step
  protocol: 2-way one round trip per step, the labels and the loss on the server; U-shape two);
- **(c) model class**: ``SplitGPT2LMHeadModel`` in a plain loop: the forward and the backward
  each cross the wire (autograd over the wire), then ``POST /v1/train/apply`` when the
  optimizer steps: 2 tensor round trips + 1 small JSON call per step in either shape,

against a real ``python -m splitlearn.server`` on loopback (client and server on the same
cores, every core's threads each), U-shape (cuts 2, 10) and 2-way (cut 2), float32 wire.
Rounds are paired: each round runs every system once, in an order rotated per round; one
warm-up round, then ``--repeats``. Reported: median step seconds per system and the medians
of the paired ratios (c)/(b) and (b)/(a), (c)/(a). Writes ``benchmarks/results/cpu/hf_training.json``.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from splitlearn import load_model  # noqa: E402
from splitlearn.procs.localserver import LocalServer  # noqa: E402
from benchmarks.timing import write_result  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "cpu" / "hf_training.json"
LR = 1e-4


def run(a, log=print) -> dict:
    from splitlearn.client import SplitClient
    from splitlearn.hf import SplitGPT2LMHeadModel

    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, load_model(a.model).config.vocab_size - 1, (a.batch, a.seq), generator=g)
    rows = []
    for cuts in a.shapes:
        args = ["--model", a.model, "--optimizer", "adamw", "--lr", str(LR)]
        for c in cuts:
            args += ["--cut", str(c)]
        with LocalServer(args) as srv:
            unsplit = load_model(a.model).train()
            u_opt = torch.optim.AdamW(unsplit.parameters(), lr=LR, weight_decay=0.0)
            client = SplitClient(srv.url, a.model, token=srv.token, lr=LR, device="cpu", client_id="fused")
            model = SplitGPT2LMHeadModel.from_pretrained(a.model, server=srv.url, token=srv.token,
                                                         client_id="classes").train()
            m_opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)

            def step_unsplit():
                loss = unsplit(x, labels=x).loss
                loss.backward()
                u_opt.step()
                u_opt.zero_grad()

            def step_model():
                loss = model(input_ids=x, labels=x).loss
                loss.backward()
                m_opt.step()
                m_opt.zero_grad()

            systems = {"unsplit": step_unsplit, "SplitClient.train_step": lambda: client.train_step(x),
                       "model class loop": step_model}
            names = list(systems)
            times = {n: [] for n in names}
            for r in range(a.repeats + 1):
                order = names[r % len(names):] + names[:r % len(names)]
                for n in order:
                    t0 = time.perf_counter()
                    systems[n]()
                    if r:  # round 0: warm-up
                        times[n].append(time.perf_counter() - t0)
            med = {n: statistics.median(v) for n, v in times.items()}
            ratio = lambda p, q: statistics.median(a_ / b_ for a_, b_ in zip(times[p], times[q]))
            row = {"shape": "u" if len(cuts) == 2 else "2-way", "cuts": list(cuts), "batch": [a.batch, a.seq],
                   "step_s": med, "times_s": times,
                   "classes_over_client": ratio("model class loop", "SplitClient.train_step"),
                   "client_over_unsplit": ratio("SplitClient.train_step", "unsplit"),
                   "classes_over_unsplit": ratio("model class loop", "unsplit")}
            rows.append(row)
            log(f"{row['shape']:>5}: unsplit {med['unsplit']:.3f} s, SplitClient {med['SplitClient.train_step']:.3f} s,"
                f" model class {med['model class loop']:.3f} s; (c)/(b) {row['classes_over_client']:.2f}")
            client.close()
            model.remote.close()
    from benchmarks.timing import command_line, machine_info

    return {"command": command_line(), "machine": machine_info(torch.get_num_threads()), "model": a.model,
            "repeats": a.repeats, "rows": rows}


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python benchmarks/hf_training.py", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="the tiny model, b2 x 16, 2 rounds")
    p.add_argument("--model", help="default random:gpt2 (--quick: tiny)")
    p.add_argument("--batch", type=int)
    p.add_argument("--seq", type=int)
    p.add_argument("--repeats", type=int)
    p.add_argument("--out", default=str(RESULTS))
    a = p.parse_args(argv)
    a.model = a.model or ("tiny" if a.quick else "random:gpt2")
    a.batch = a.batch or (2 if a.quick else 8)
    a.seq = a.seq or (16 if a.quick else 128)
    a.repeats = a.repeats or (2 if a.quick else 3)
    a.shapes = [(1, 3), (2,)] if a.quick else [(2, 10), (2,)]
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    result = run(a, log=lambda s: print(s, file=sys.stderr, flush=True))
    write_result(result, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
