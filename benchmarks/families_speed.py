"""GPT-2 small beside a Llama of its size, on two emulated devices (issue 52, item 7).

    python benchmarks/families_speed.py                # random:gpt2 and configs/llama-small.json, U (2, 10)
    python benchmarks/families_speed.py --quick        # tiny-varied and configs/tiny-llama.json, seconds

Client on core 0, server on core 1, one torch thread each (``benchmarks/timing.py``'s
``pinned_u_server``); the reference is the unsplit model on the client's core with one thread.
Each round runs every system once, paired, so a slow phase of the machine hits them all; medians
over the rounds after a warm-up round. Rows, each a ratio to the unsplit model of the same family:

- **training**: one U-shape step (forward, loss, backward, AdamW on the client; the server's apply)
  of the split model (``AutoSplitModelForCausalLM``: ``SplitGPT2LMHeadModel`` for GPT-2, the
  family's own class for Llama) with ``micro_batches`` 1 and 2 (pipelined), split time ÷ unsplit;
- **greedy b1 / b8**: ``generate()`` of 32 new tokens from a 16-token prompt, tokens/s split ÷
  unsplit, measured before the training rounds move the server's weights; the rows whose
  tokens equal the unsplit model's are counted (a random model's near-tied logits can flip a token
  where the server's prepacked decode weights differ in the last bits).

The Llama (``benchmarks/configs/llama-small.json``, a config file: a random model): hidden 768, 12 layers, 12 heads / 4 KV heads, a gated MLP
of 2,048 (GPT-2 small's MLP parameters), vocabulary 32,000.
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

from benchmarks.timing import pinned_u_server, write_result  # noqa: E402
from splitlearn import AutoSplitModelForCausalLM, load_model  # noqa: E402

CONFIGS = Path(__file__).resolve().parent / "configs"
OUT = Path(__file__).resolve().parent / "results" / "cpu" / "families_speed.json"


def measure(model_src: str, cuts, batch, rounds: int, new_tokens: int, prompt_len: int, micro) -> dict:
    srv = pinned_u_server(model_src, cuts)
    try:
        unsplit = load_model(model_src).train()
        opt = torch.optim.AdamW(unsplit.parameters(), lr=1e-4, weight_decay=0.0)
        split = {}
        for m in micro:
            try:
                split[m] = AutoSplitModelForCausalLM.from_pretrained(
                    model_src, server=srv.url, token=srv.token, micro_batches=m, client_id=f"m{m}").train()
            except Exception as e:  # noqa: BLE001 - a family without pipelining yet: said in the row
                print(f"  {model_src}: micro_batches={m} not available: {e}", file=sys.stderr)
        opts = {m: torch.optim.AdamW(mod.parameters(), lr=1e-4, weight_decay=0.0) for m, mod in split.items()}
        gen = AutoSplitModelForCausalLM.from_pretrained(model_src, server=srv.url, token=srv.token,
                                                        client_id="gen").eval()
        ref = load_model(model_src).eval()  # generation reference: the same weights, never trained
        g = torch.Generator().manual_seed(0)
        vocab = unsplit.config.vocab_size
        B, T = batch
        times: dict[str, list[float]] = {}

        def timed(name, fn):
            t0 = time.perf_counter()
            out = fn()
            times.setdefault(name, []).append(time.perf_counter() - t0)
            return out

        def unsplit_step(ids):
            opt.zero_grad()
            unsplit(input_ids=ids, labels=ids).loss.backward()
            opt.step()

        def split_step(m, ids):
            split[m](input_ids=ids, labels=ids).loss.backward()
            opts[m].step()
            opts[m].zero_grad()

        # generation first, while the server's weights are the reference's (the training rounds
        # below apply steps to them), then training; the first round of each warms up
        rows_equal = rows = 0
        for r in range(rounds + 1):
            for b in (1, 8):
                prompt = torch.randint(0, vocab, (b, prompt_len), generator=g)
                kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                          attention_mask=torch.ones_like(prompt), pad_token_id=0)
                with torch.no_grad():
                    a = timed(f"greedy b{b} unsplit", lambda: ref.generate(prompt, **kw))
                    s = timed(f"greedy b{b} split", lambda: gen.generate(prompt, **kw))
                rows += b
                rows_equal += int((a == s).all(dim=1).sum())
            if r == 0:
                times = {k: [] for k in times}
            print(f"  {model_src} generation round {r} done", file=sys.stderr)
        for r in range(rounds + 1):
            ids = torch.randint(0, vocab, (B, T), generator=g)
            timed("train unsplit", lambda: unsplit_step(ids))
            for m in split:
                timed(f"train split m={m}", lambda m=m: split_step(m, ids))
            if r == 0:
                times = {k: v for k, v in times.items() if not k.startswith("train")}
            print(f"  {model_src} training round {r} done", file=sys.stderr)
        med = {k: statistics.median(v) for k, v in times.items()}
        ratio = {f"train m={m}": med[f"train split m={m}"] / med["train unsplit"] for m in split}
        for b in (1, 8):  # tokens/s split ÷ unsplit = unsplit time ÷ split time
            ratio[f"greedy b{b} tokens/s"] = med[f"greedy b{b} unsplit"] / med[f"greedy b{b} split"]
        return {"model": Path(model_src).stem if model_src.endswith(".json") else model_src, "cuts": list(cuts), "train_batch": [B, T], "rounds": rounds,
                "new_tokens": new_tokens, "prompt_len": prompt_len, "median_s": med, "ratio": ratio,
                "greedy_rows_equal": [rows_equal, rows]}
    finally:
        srv.stop()


def table(results: list[dict]) -> str:
    keys = sorted({k for r in results for k in r["ratio"]})
    lines = ["| model | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]
    for r in results:
        lines.append(f"| {r['model']} | " + " | ".join(f"{r['ratio'][k]:.3f}" if k in r["ratio"] else "—"
                                                     for k in keys) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/families_speed.py", allow_abbrev=False,
                                description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny models, one round: a smoke test")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=None, help=f"write the results here (default {OUT}; --quick: nowhere)")
    a = p.parse_args(argv)
    if (os.cpu_count() or 1) < 2:
        print("needs two cores", file=sys.stderr)
        return 2
    if a.quick:
        models, cuts, batch, rounds, n, plen = ("random:tiny-varied", CONFIGS / "tiny-llama.json"), (1, 3), (2, 16), 1, 4, 4
    else:
        models, cuts, batch, rounds, n, plen = ("random:gpt2", CONFIGS / "llama-small.json"), (2, 10), (8, 128), a.rounds, 32, 16
    results = [measure(str(m), cuts, batch, rounds, n, plen, (1, 2)) for m in models]
    out = {"date": time.strftime("%Y-%m-%d"), "machine": f"{os.cpu_count()} cores, pinned client core 0, server core 1",
           "results": results, "table": table(results)}
    print(out["table"])
    if a.json or not a.quick:
        path = write_result(out, a.json or OUT)
        path.with_suffix(".md").write_text("# GPT-2 small beside a Llama of its size (two emulated devices)\n\n"
                                           "`python benchmarks/families_speed.py`, ratios split ÷ unsplit "
                                           "(training: time; greedy: tokens/s)\n\n" + out["table"] + "\n")
    for r in results:
        print(f"{r['model']}: greedy rows equal to the unsplit model's: {r['greedy_rows_equal'][0]} of "
              f"{r['greedy_rows_equal'][1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
