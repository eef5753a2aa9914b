"""Priority classes on one server: interactive generation while another owner trains.

    python benchmarks/priority.py              # GPT-2 small shape, U-shape (2, 10), b4 x 128 trainer
    python benchmarks/priority.py --quick      # tiny model, seconds

The server has one core (core 1) and one torch thread; the clients run on core 0. For each
policy (``--priority decode-first``, then ``fifo``: one server each, started in turn):

1. *generation alone*: a ``SplitClient`` generates ``--tokens`` greedy tokens, batch 1;
   the gaps between consecutive tokens give its p50/p99 per-token time;
2. *training alone*: an owner sends U-shape training steps (forward + backward of a
   b x T batch, random activations and gradients: the server's work, no client compute) back
   to back for ``--train-s`` seconds; steps per second;
3. *both*: the owner trains back to back while the generator generates; the worst gap
   between two tokens, and the trainer's steps per second.

Targets (issue: priority classes): with ``decode-first``, worst gap while training <=
4 x the p99 alone, and training keeps >= 70% of its throughput alone.

``--realistic`` (issue 29, item 6) measures the unpinned real-client setting instead: no core
pinning, one server (``decode-first``, one torch thread), a model-class ``generate()``
(``SplitGPT2LMHeadModel``) streaming ``--tokens`` greedy tokens while a ``SplitClient`` trains
b4 x 128 (client compute included), GPT-2 small shape, U (2, 10); per run the worst gap while
training over the p99 alone, over ``--runs`` runs (default 5; each run: a generation alone,
then one while training)::

    python benchmarks/priority.py --realistic --runs 5 --tokens 200
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import threading
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")

import requests  # noqa: E402
import torch  # noqa: E402

from splitlearn.api import protocol as P  # noqa: E402
from splitlearn.client import SplitClient  # noqa: E402
from splitlearn.procs.localserver import LocalServer  # noqa: E402
from splitlearn.api.wire import encode  # noqa: E402


def gaps_of(client: SplitClient, tokens: int, seed: int) -> list[float]:
    """Seconds between consecutive tokens of one greedy generation, batch 1."""
    ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(seed))
    stamps = [time.perf_counter()]
    for _ in client.generate_stream(ids, max_new_tokens=tokens):
        stamps.append(time.perf_counter())
    return [b - a for a, b in zip(stamps[1:], stamps[2:])]  # from the first token on (no prefill)


class Trainer(threading.Thread):
    """U-shape training steps back to back, as raw requests (no client compute)."""

    def __init__(self, url: str, token: str, d: int, shape: tuple[int, int]):
        super().__init__(daemon=True)
        self.url, self.d, (self.B, self.T) = url, d, shape
        self.session = requests.Session()
        self.session.headers.update({"Authorization": f"Bearer {token}", "Content-Type": P.CONTENT_TYPE})
        self.stop = threading.Event()
        self.done: list[float] = []  # time.perf_counter() of each applied step
        self.step = 0

    def _post(self, path: str, name: str, meta: P.StepMeta) -> None:
        x = torch.randn(self.B, self.T, self.d) * (1e-3 if name == P.GRAD else 1.0)
        r = self.session.post(self.url + path, data=encode({name: x}, meta.to_meta()), timeout=600)
        r.raise_for_status()

    def run(self) -> None:
        while not self.stop.is_set():
            self.step += 1
            meta = P.StepMeta("trainer", self.step)
            self._post(P.TRAIN_FORWARD, P.HIDDEN, meta)
            self._post(P.TRAIN_BACKWARD, P.GRAD, meta)
            self.session.post(self.url + P.TRAIN_APPLY, json={"client_id": "trainer", "step": self.step, "pieces": 1,
                                                            "lr": 1e-4},
                              headers={"Content-Type": "application/json"}, timeout=600).raise_for_status()
            self.done.append(time.perf_counter())


def rate(stamps: list[float], since: float, until: float) -> float:
    inside = [s for s in stamps if since <= s <= until]
    return (len(inside) - 1) / (inside[-1] - inside[0]) if len(inside) > 1 else 0.0


def measure(policy: str, model: str, cuts, shape, tokens: int, train_s: float, seed: int) -> dict:
    os.sched_setaffinity(0, {1})  # the server inherits core 1
    srv = LocalServer(["--model", model, "--cut", str(cuts[0]), "--cut", str(cuts[1]), "--torch-threads", "1",
                       "--device", "cpu", "--lr", "1e-5", "--priority", policy, "--threads", "8"],
                      env={"OMP_NUM_THREADS": "1"}).start()
    os.sched_setaffinity(0, {0})
    try:
        gen = SplitClient(srv.url, model, token=srv.token, device="cpu", client_id="generator")
        d = gen.info["model_config"]["n_embd"]
        gaps_of(gen, 4, seed)  # warm-up
        alone = gaps_of(gen, tokens, seed)
        tr = Trainer(srv.url, srv.token, d, shape)
        tr.start()
        t0 = time.perf_counter()
        time.sleep(train_s)
        train_alone = rate(tr.done, t0, time.perf_counter())
        t1 = time.perf_counter()
        both = gaps_of(gen, tokens, seed + 1)
        t2 = time.perf_counter()
        train_both = rate(tr.done, t1, t2)
        tr.stop.set()
        tr.join(600)
        info = requests.get(srv.url + P.INFO, headers={"Authorization": f"Bearer {srv.token}"}, timeout=30).json()
    finally:
        srv.stop()
    p99 = sorted(alone)[min(len(alone) - 1, int(0.99 * len(alone)))]
    worst = max(both)
    return {"policy": policy, "p50_alone_ms": 1e3 * statistics.median(alone), "p99_alone_ms": 1e3 * p99,
            "worst_alone_ms": 1e3 * max(alone), "p50_while_training_ms": 1e3 * statistics.median(both),
            "worst_while_training_ms": 1e3 * worst, "worst_over_p99": worst / p99,
            "train_steps_per_s_alone": train_alone, "train_steps_per_s_with_generation": train_both,
            "train_kept": train_both / train_alone if train_alone else None,
            "steps_during_generation": sum(1 for s in tr.done if t1 <= s <= t2),
            "server_priority": info.get("priority")}


class Stamps:
    """A ``generate(streamer=...)`` streamer that keeps when each token arrived."""

    def __init__(self):
        self.at: list[float] = []

    def put(self, value) -> None:
        self.at.append(time.perf_counter())

    def end(self) -> None:
        pass

    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.at[2:], self.at[3:])]  # after the prompt and the first token


def _trainer_process(url: str, token: str, model: str, shape, seed: int, stop, steps, client_id: str) -> None:
    """A data owner of its own (another process, as another tenant's client would be): train
    ``shape`` batches back to back until ``stop``; ``steps`` counts them."""
    torch.set_num_threads(1)
    trainer = SplitClient(url, model, token=token, device="cpu", client_id=client_id, lr=1e-5)
    vocab = trainer.info["model_config"]["vocab_size"]
    batch = torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed + 1))
    while not stop.is_set():
        trainer.train_step(batch)
        with steps.get_lock():
            steps.value += 1


def realistic(model: str, cuts, shape, tokens: int, runs: int, seed: int, same_process: bool = False) -> dict:
    """Unpinned: hf ``generate()`` streaming while a ``SplitClient`` trains; ``runs`` runs. The
    trainer is a process of its own (as another tenant's client is), or, ``same_process``, a
    thread of the generator's process (sharing its interpreter lock: the earlier setting)."""
    import splitlearn

    srv = LocalServer(["--model", model, "--cut", str(cuts[0]), "--cut", str(cuts[1]), "--torch-threads", "1",
                       "--device", "cpu", "--lr", "1e-5", "--priority", "decode-first", "--threads", "8"],
                      env={"OMP_NUM_THREADS": "1"}).start()
    try:
        gen = splitlearn.SplitGPT2LMHeadModel.from_pretrained(model, server=srv.url, token=srv.token, seed=seed)
        trainer = SplitClient(srv.url, model, token=srv.token, device="cpu", client_id="trainer", lr=1e-5)
        vocab = trainer.info["model_config"]["vocab_size"]
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, vocab, (1, 8), generator=g)
        batch = torch.randint(0, vocab, shape, generator=g)

        def generate() -> list[float]:
            st = Stamps()
            gen.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, min_new_tokens=tokens,
                         do_sample=False, eos_token_id=None, pad_token_id=0, streamer=st)
            return st.gaps()

        generate()  # warm-up
        out = []
        for r in range(runs):
            alone = generate()
            if same_process:
                stop, count = threading.Event(), []

                def train():
                    while not stop.is_set():
                        trainer.train_step(batch)
                        count.append(time.perf_counter())

                t = threading.Thread(target=train, daemon=True)
                n_steps = lambda: len(count)  # noqa: E731
            else:
                ctx = multiprocessing.get_context("spawn")
                stop, shared = ctx.Event(), ctx.Value("i", 0)
                t = ctx.Process(target=_trainer_process, daemon=True,  # a new client each run: steps from 1
                                args=(srv.url, srv.token, model, shape, seed, stop, shared, f"trainer-{r}"))
                n_steps = lambda: shared.value  # noqa: E731
            t.start()
            while not n_steps():  # training under way (its first step done)
                if not t.is_alive():
                    raise RuntimeError("the trainer stopped before its first step (its error is above)")
                time.sleep(0.05)
            first = n_steps()
            both = generate()
            steps = range(n_steps() - first + 1)
            stop.set()
            t.join(600)
            p99 = sorted(alone)[min(len(alone) - 1, int(0.99 * len(alone)))]
            out.append({"run": r, "p50_alone_ms": 1e3 * statistics.median(alone), "p99_alone_ms": 1e3 * p99,
                        "worst_while_training_ms": 1e3 * max(both), "worst_over_p99": max(both) / p99,
                        "train_steps_during": len(steps)})
            print(f"run {r}: p99 alone {1e3 * p99:.1f} ms, worst while training {1e3 * max(both):.1f} ms "
                  f"({max(both) / p99:.1f}x; target <= 4x), {len(steps)} training steps", flush=True)
        info = requests.get(srv.url + P.INFO, headers={"Authorization": f"Bearer {srv.token}"}, timeout=30).json()
    finally:
        srv.stop()
    setting = "trainer a thread of the generator's process" if same_process else "trainer a process of its own"
    return {"setting": f"unpinned, hf generate() streaming + SplitClient training ({setting})", "runs": out,
            "worst_over_p99_max": max(r["worst_over_p99"] for r in out), "server_priority": info.get("priority")}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/priority.py", allow_abbrev=False,
                                description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--tokens", type=int, default=None, help="tokens per generation (default 200; quick 40)")
    p.add_argument("--train-s", type=float, default=None, help="seconds of training alone (default 20; quick 3)")
    p.add_argument("--policies", default="decode-first,fifo")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--realistic", action="store_true",
                   help="the unpinned real-client setting (hf generate() streaming while a SplitClient trains)")
    p.add_argument("--runs", type=int, default=5, help="--realistic: runs (default 5)")
    p.add_argument("--same-process", action="store_true",
                   help="--realistic: the trainer as a thread of the generator's process (default: its own process)")
    a = p.parse_args(argv)
    if (os.cpu_count() or 1) < 2:
        print("needs two cores", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    model, cuts, shape = ("tiny", (1, 3), (4, 32)) if a.quick else ("random:gpt2", (2, 10), (4, 128))
    tokens = a.tokens or (40 if a.quick else 200)
    train_s = a.train_s or (3.0 if a.quick else 20.0)
    if a.realistic:
        out = {"model": model, "cuts": list(cuts), "trainer_batch": list(shape), "tokens": tokens,
               **realistic(model, cuts, shape, tokens, a.runs, 0, a.same_process)}
        print(f"worst gap over p99 alone, over {a.runs} runs: {out['worst_over_p99_max']:.1f}x (target <= 4x)")
        if a.json:
            Path(a.json).write_text(json.dumps(out, indent=2))
        return 0
    results = [measure(pol, model, cuts, shape, tokens, train_s, 0) for pol in a.policies.split(",")]
    out = {"model": model, "cuts": list(cuts), "trainer_batch": list(shape), "tokens": tokens, "results": results}
    for r in results:
        print(f"{r['policy']:>12}: token p99 alone {r['p99_alone_ms']:.1f} ms, worst while training "
              f"{r['worst_while_training_ms']:.1f} ms ({r['worst_over_p99']:.1f}x; target <= 4x); training "
              f"{r['train_steps_per_s_alone']:.3f} -> {r['train_steps_per_s_with_generation']:.3f} steps/s "
              f"({(r['train_kept'] or 0):.0%} kept; target >= 70%)")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
