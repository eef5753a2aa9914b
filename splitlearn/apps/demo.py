"""``make demo``: split-train a small GPT-2 in the U-shape over HTTP, beside the same model unsplit.

1. partition ``tiny-tales`` (6 blocks, d=128, a BPE learnt from the shipped tales: ~200,000 words
   of stories from splitlearn's own grammar, ``python -m splitlearn.model.corpus.generate``);
   the split's logits equal the unsplit model's;
2. a loopback server holds the trunk (blocks 2-3), this process the bottom and the top;
3. training: the split model over HTTP and, in this process, the unsplit model on the same batches
   with the same AdamW; both report the loss on held-out windows of the stories;
4. one seed, two samples: the lines ``split:`` and ``unsplit:`` are identical (the proof), their word
   pairs those of the corpus' sentences (the untrained model's: ~0%);
5. three data owners train one model with SplitFed (docs/FEDERATION.md)."""
from __future__ import annotations

import argparse
import re
import sys
import threading
import time
from pathlib import Path

import torch

from .. import get_tokenizer, load_corpus, load_model, partition
from ..client import SplitClient
from ..model.data import lm_batches
from ..procs.localserver import LocalServer

MODEL, CUTS = "tiny-tales", (2, 4)
CORPUS = Path(__file__).resolve().parents[1] / "model" / "corpus" / "tiny_tales.txt"  # the grammar's tales
# the server's options: one tenant, so no clip of its steps by the shared segment's running norm
# (server/engine/gradclip.py): the trunk steps as the unsplit model's blocks do
SERVER = ["--model", MODEL, "--cut", str(CUTS[0]), "--cut", str(CUTS[1]), "--device", "cpu", "--grad-clip-factor", "none"]
# one torch thread per process: client and server take turns, and two OpenMP threads per process
# on a busy 2-core machine made one step ~10x slower (1.7 s -> 20 s measured under load)
THREADS = 1
SAMPLING = dict(do_sample=True, temperature=0.8, top_k=20)  # the two samples' settings, seed 0


def check_partition() -> None:
    model = load_model(MODEL)
    parts = partition(model, CUTS)
    total = sum(p.numel() for p in model.parameters())
    print(f"model {MODEL}: {model.config.num_hidden_layers} blocks, d={model.config.hidden_size}, "
          f"vocab {model.config.vocab_size}, {total / 1e6:.2f}M parameters")
    for seg in parts:
        n = sum(p.numel() for p in seg.parameters())
        tied = " (lm_head tied to the bottom's embedding: same tensor)" if seg.kind == "top" else ""
        print(f"  {seg.kind:<6} blocks [{seg.start}, {seg.end})  {n / 1e6:.3f}M params{tied}")
    ids = torch.randint(0, model.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (parts(ids) - model(ids).logits).abs().max().item()
    print(f"  split == unsplit: max |logits difference| = {diff:.2e}")
    if diff > 1e-5:
        raise SystemExit("the split does not equal the unsplit model")


def held_out_split(ids: list[int], seq_len: int, every: int = 8, most: int = 64) -> tuple[list[int], torch.Tensor]:
    """(training tokens, held-out windows (N <= ``most``, seq_len)): every ``every``-th window of
    ``seq_len`` tokens is held out (the same stories' language, text the model never trains on)."""
    windows = [ids[i:i + seq_len] for i in range(0, len(ids) - seq_len + 1, seq_len)]
    held = [w for k, w in enumerate(windows) if k % every == every - 1]
    if not held:
        raise SystemExit(f"the corpus has {len(ids)} tokens: too few for held-out windows of {seq_len}")
    train = [t for k, w in enumerate(windows) if k % every != every - 1 for t in w]
    return train, torch.tensor(held[:most])  # (N, seq_len)


def word_share(sample: str, corpus: str) -> float:
    """The share of ``sample``'s words (letters and apostrophes) that occur in ``corpus``."""
    known = set(words(corpus))
    return sum(w in known for w in words(sample)) / max(len(words(sample)), 1)


def words(text: str) -> list[str]:
    return re.findall(r"[A-Za-z']+", text.lower())


def pair_share(sample: str, corpus: str) -> float:
    """The share of ``sample``'s word pairs (two words in a row, punctuation ignored) that occur in
    ``corpus``: ~1 for sentences of the corpus' grammar, ~0 for words in a random order."""
    w, c = words(sample), words(corpus)
    known = set(zip(c, c[1:]))
    pairs = list(zip(w, w[1:]))
    return sum(p in known for p in pairs) / max(len(pairs), 1)


class Ticker:
    """Progress: tqdm's bar on a terminal; elsewhere (a log, CI) a plain line every ``every`` steps."""

    def __init__(self, steps: int, every: int):
        from tqdm import tqdm

        self.every, self.t0 = max(every, 1), time.perf_counter()
        self.bar = tqdm(total=steps, desc="   train", unit="step", mininterval=0.5, disable=not sys.stderr.isatty())

    def update(self, step: int, **losses: float) -> None:
        self.bar.update(1)
        self.bar.set_postfix({k: f"{v:.3f}" for k, v in losses.items()}, refresh=False)
        if step % self.every == 0:
            shown = ", ".join(f"{k} {v:.3f}" for k, v in losses.items())
            self.bar.write(f"   step {step:>4}: train loss {shown} ({time.perf_counter() - self.t0:.0f}s)")

    def close(self) -> None:
        self.bar.close()


def train_both(a, client: SplitClient, data: list[int], held: torch.Tensor):
    """``a.steps`` steps of the split model (``client``) and of the unsplit one on the same batches
    -> (the unsplit model, held-out losses {split/unsplit: (before, after)})."""
    ref = load_model(MODEL)  # the same spec and seed as the client's and the server's weights
    opt = torch.optim.AdamW(ref.parameters(), lr=a.lr, weight_decay=0.0)  # the optimizer of both sides
    with torch.no_grad():
        before = float(ref(held, labels=held).loss)
    tick = Ticker(a.steps, a.steps // 6)
    for i, batch in enumerate(lm_batches(data, a.batch_size, a.seq_len, seed=0, steps=a.steps), 1):
        split_loss = client.train_step(batch)
        ref.train()
        opt.zero_grad(set_to_none=True)
        loss = ref(batch, labels=batch).loss
        loss.backward()
        opt.step()
        tick.update(i, split=split_loss, unsplit=loss.item())
    tick.close()
    ref.eval()
    with torch.no_grad():
        unsplit_after = float(ref(held, labels=held).loss)
    return ref, {"split": (before, client.evaluate(held)), "unsplit": (before, unsplit_after)}


def samples(a, client: SplitClient, ref, tok) -> tuple[str, str]:
    """The split and the unsplit model's sample for the prompt, both with seed 0."""
    prompt = torch.tensor([tok.encode(a.prompt)])
    kw = dict(max_new_tokens=a.max_new_tokens, eos_token_id=None, pad_token_id=tok.pad_token_id, **SAMPLING)
    split = client.generate(prompt, seed=0, **kw)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        unsplit = ref.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), top_p=1.0, **kw)
    return tok.decode(split[0], skip_special_tokens=True), tok.decode(unsplit[0], skip_special_tokens=True)


def federated(a, data: list[int], held_out) -> bool:
    """Three owners, one shard each, SplitFed rounds; True if the shared model learned."""
    shards = [data[i * len(data) // 3:(i + 1) * len(data) // 3] for i in range(3)]
    print(f"== 5. three data owners, shards of {', '.join(str(len(s)) for s in shards)} tokens, "
          f"SplitFed: {a.fed_rounds} rounds of {a.fed_steps} steps each, then FedAvg")
    with LocalServer([*SERVER, "--lr", str(a.lr), "--torch-threads", str(THREADS), "--federation", "splitfed",
                      "--clients-per-round", "3"]) as srv:
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
    p = argparse.ArgumentParser(prog="python -m splitlearn.apps.demo", allow_abbrev=False,
                                description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    # 320 steps of 8 x 32 at 2e-3, measured (2 shared cores, load 2.5-5): held-out 6.79 -> 0.88 (0.13x),
    # 97% of the sample's word pairs the corpus', training 64 s, the whole demo 2m09s (the train loss
    # leaves its unigram plateau ~4.5 near step 150; lr 5e-3 and 1e-2 stayed on it longer)
    p.add_argument("--steps", type=int, default=320, help="training steps")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=32, help="tokens per training window")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--prompt", default="Once upon a time")
    p.add_argument("--max-new-tokens", type=int, default=40)
    p.add_argument("--fed-rounds", type=int, default=6, help="SplitFed rounds of part 5 (0: skip it)")
    p.add_argument("--fed-steps", type=int, default=3, help="steps per owner per round")
    p.add_argument("--want-loss-ratio", type=float, default=0.6,
                   help="fail (exit 1) unless the held-out loss after training is at most this times the loss before")
    p.add_argument("--want-pairs", type=float, default=0.6,
                   help="fail (exit 1) unless this share of the sample's word pairs occur in the corpus")
    a = p.parse_args(argv)

    torch.manual_seed(0)
    torch.set_num_threads(THREADS)
    print("== 1. partition")
    check_partition()
    tok = get_tokenizer(MODEL)
    text = load_corpus(CORPUS)
    data, held = held_out_split(tok.encode(text), a.seq_len)
    print(f"== 2. server: trunk of {MODEL} on 127.0.0.1 (cuts {CUTS})")
    with LocalServer([*SERVER, "--lr", str(a.lr), "--torch-threads", str(THREADS)]) as srv:
        print(f"   serving at {srv.url}")
        with SplitClient(srv.url, MODEL, token=srv.token, lr=a.lr, device="cpu") as client:
            print(f"== 3. train {a.steps} steps of {a.batch_size} x {a.seq_len} tokens ({len(data)} tokens of "
                  f"stories), U-shape: the text never leaves the client; the unsplit model beside it")
            t0 = time.perf_counter()
            ref, losses = train_both(a, client, data, held)
            s = client.stats
            print(f"   {time.perf_counter() - t0:.0f}s; {s.calls} calls, {s.bytes_sent / 1e6:.1f} MB sent, "
                  f"{s.bytes_received / 1e6:.1f} MB received, HTTP overhead {s.overhead_s / s.calls * 1e3:.2f} ms/call")
            for name, (before, after) in losses.items():
                print(f"   held-out loss ({name}): {before:.3f} -> {after:.3f} ({after / before:.2f}x)")
            print(f"== 4. one sample each, seed 0 (temperature 0.8, top-k 20), {a.max_new_tokens} tokens")
            split, unsplit = samples(a, client, ref, tok)
        print(f"split:   {' '.join(split.split())}")  # one line each: the sample's line breaks as spaces
        print(f"unsplit: {' '.join(unsplit.split())}")
        pairs = pair_share(split, text)
        print(f"   identical: {'yes' if split == unsplit else 'NO'}; word pairs found in the corpus: {pairs:.0%}")
    learned = federated(a, data, held) if a.fed_rounds else True
    before, after = losses["split"]
    checks = {"split == unsplit": split == unsplit,
              f"held-out loss after <= {a.want_loss_ratio}x before": after <= a.want_loss_ratio * before,
              f"word pairs of the corpus >= {a.want_pairs:.0%}": pairs >= a.want_pairs,
              "the federated model learned": learned}
    failed = [name for name, good in checks.items() if not good]
    print("done" if not failed else f"FAILED: {'; '.join(failed)}")
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
