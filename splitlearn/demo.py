"""``make demo``: split-train a small GPT-2 in the U-shape over HTTP, then generate with it.

Checks split == unsplit, starts a loopback server holding the trunk, trains on the shipped
corpus, generates a sample, stops the server; then three data owners train one model with
SplitFed (docs/FEDERATION.md)."""
from __future__ import annotations

import argparse
import sys
import threading
import time

import torch

from . import ByteTokenizer, load_corpus, load_model, partition
from .client import SplitClient
from .data import lm_batches
from .localserver import LocalServer

MODEL, CUTS = "tiny-demo", (2, 4)


def check_partition() -> None:
    model = load_model(MODEL)
    parts = partition(model, CUTS)
    total = sum(p.numel() for p in model.parameters())
    print(f"model {MODEL}: {model.config.n_layer} blocks, d={model.config.n_embd}, {total / 1e6:.2f}M parameters")
    for seg in parts:
        n = sum(p.numel() for p in seg.parameters())
        tied = " (lm_head tied to the bottom's wte: same tensor)" if seg.kind == "top" else ""
        print(f"  {seg.kind:<6} blocks [{seg.start}, {seg.end})  {n / 1e6:.3f}M params{tied}")
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (parts(ids) - model(ids).logits).abs().max().item()
    print(f"  split == unsplit: max |logits difference| = {diff:.2e}")
    if diff > 1e-5:
        raise SystemExit("the split does not equal the unsplit model")


def federated(a, data: list[int], held_out) -> bool:
    """Part 6: three owners, one shard each, SplitFed rounds; True if the shared model learned."""
    shards = [data[i * len(data) // 3:(i + 1) * len(data) // 3] for i in range(3)]
    print(f"== 6. three data owners, shards of {', '.join(str(len(s)) for s in shards)} tokens, "
          f"SplitFed: {a.fed_rounds} rounds of {a.fed_steps} steps each, then FedAvg")
    with LocalServer(["--model", MODEL, "--cut", str(CUTS[0]), "--cut", str(CUTS[1]), "--lr", str(a.lr),
                      "--device", "cpu", "--federation", "splitfed", "--clients-per-round", "3"]) as srv:
        owners = [SplitClient(srv.url, MODEL, token=srv.token, lr=a.lr, device="cpu", client_id=f"owner-{i}")
                  for i in range(3)]
        before = owners[0].evaluate(held_out)
        losses: dict[str, list[float]] = {c.client_id: [] for c in owners}

        def train(c: SplitClient, shard: list[int]) -> None:
            batches = lm_batches(shard, 8, a.seq_len, seed=int(c.client_id[-1]))
            for _ in range(a.fed_rounds):
                losses[c.client_id] += [c.train_step(next(batches)) for _ in range(a.fed_steps)]
                c.sync()  # waits for the other owners, continues from the average

        threads = [threading.Thread(target=train, args=(c, s)) for c, s in zip(owners, shards)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        after = owners[0].evaluate(held_out)
        for cid, ls in losses.items():
            k = max(len(ls) // 5, 1)
            print(f"   {cid}: train loss {sum(ls[:k]) / k:.3f} -> {sum(ls[-k:]) / k:.3f}")
        print(f"   shared model, held-out loss: {before:.3f} -> {after:.3f} "
              f"(round {owners[0].federation.version + 1})")
        for c in owners:
            c.close()
    return after < before


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m splitlearn.demo", allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=800, help="training steps")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--prompt", default="Once upon a time")
    p.add_argument("--max-new-tokens", type=int, default=100)
    p.add_argument("--fed-rounds", type=int, default=20, help="SplitFed rounds of part 6 (0: skip it)")
    p.add_argument("--fed-steps", type=int, default=3, help="steps per owner per round")
    a = p.parse_args(argv)
    from tqdm import tqdm

    torch.manual_seed(0)
    print("== 1. partition")
    check_partition()
    print(f"== 2. server: trunk of {MODEL} on 127.0.0.1 (cuts {CUTS})")
    tok = ByteTokenizer()
    data = tok.encode(load_corpus())
    with LocalServer(["--model", MODEL, "--cut", str(CUTS[0]), "--cut", str(CUTS[1]), "--lr", str(a.lr),
                      "--device", "cpu"]) as srv:
        print(f"   serving at {srv.url}")
        with SplitClient(srv.url, MODEL, token=srv.token, lr=a.lr, device="cpu") as client:
            print(f"== 3. train {a.steps} steps, U-shape: the text never leaves the client")
            batches = lm_batches(data, a.batch_size, a.seq_len, seed=0)
            held_out = next(lm_batches(data, 32, a.seq_len, seed=123))
            before = client.evaluate(held_out)
            t0 = time.perf_counter()
            bar = tqdm(range(a.steps), desc="train", unit="step")
            for i in bar:
                loss = client.train_step(next(batches))
                bar.set_postfix(loss=f"{loss:.3f}")
                if (i + 1) % max(a.steps // 6, 1) == 0:
                    tqdm.write(f"   step {i + 1:>4}: loss {loss:.3f}")
            after = client.evaluate(held_out)
            s = client.stats
            print(f"   eval loss {before:.3f} -> {after:.3f} in {time.perf_counter() - t0:.0f}s; "
                  f"{s.calls} calls, {s.bytes_sent / 1e6:.1f} MB sent, {s.bytes_received / 1e6:.1f} MB received, "
                  f"HTTP overhead {s.overhead_s / s.calls * 1e3:.2f} ms/call")
            print(f"== 4. generate {a.max_new_tokens} tokens (sampling: temperature 0.8, top-k 20, seed 0) "
                  f"through bottom -> server trunk -> top")
            ids = torch.tensor([tok.encode(a.prompt)])
            sys.stdout.write("   " + a.prompt)
            for t in client.generate_stream(ids, max_new_tokens=a.max_new_tokens, do_sample=True,
                                            temperature=0.8, top_k=20, seed=0):
                sys.stdout.write(tok.decode([int(t[0])]))
                sys.stdout.flush()
            print()
        print("== 5. stopping the server")
    learned = federated(a, data, held_out) if a.fed_rounds else True
    print("done")
    return 0 if after < before and learned else 1


if __name__ == "__main__":
    sys.exit(main())
