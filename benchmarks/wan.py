"""Split generation and training across an emulated WAN: plain, and with speculative decoding.

    python benchmarks/wan.py                    # RTT 1, 20, 50, 100 ms; tiny-demo trained on the corpus
    python benchmarks/wan.py --quick            # RTT 1 and 50 ms, fewer tokens: about a minute
    python benchmarks/wan.py --model random:gpt2 --cuts 2,10 --train-steps 0   # GPT-2 small shape

The link: the server (``python -m splitlearn.server``, U-shape, float32 wire) sits behind
:mod:`splitlearn.netem.relay` (a child process adding ``RTT / 2`` each way; this kernel has no
``netem``, see the relay's docstring) and the client connects to the relay. Optional
``--mbps`` rate-limits each direction with the relay's token bucket (``tc tbf`` on a veth
pair is the kernel alternative where root, docs/WAN.md).

The models. ``--model tiny-demo`` (default) is trained here, unsplit, on the shipped corpus
(``--train-steps``), and so is the **assistant**: a smaller GPT-2 with the same byte
vocabulary (``--draft-layers`` blocks of the same width). The server loads the trained target
from a directory. Systems, batch 1, greedy, ``--new-tokens`` after a ``--prompt-len`` prompt
taken from the corpus:

- ``unsplit``: the target in this process, Hugging Face ``generate`` (no link);
- ``split``: ``SplitGPT2LMHeadModel.generate`` through the relay, one round trip per token;
- ``split + lookup``: ``prompt_lookup_num_tokens`` (length from :class:`LinkAwarePolicy`);
- ``split + assistant``: the trained small draft (link-aware length), and ``... (hf length)``
  with transformers' own heuristic, to show what the link-aware length buys;
- ``split + free draft``: the client's own blocks with the trunk skipped
  (:func:`splitlearn.hf.draft.free_draft`);
- ``split + self draft``: the target's own weights as the draft (acceptance 1: the upper bound
  of what a draft can give at the cost of a whole local model per drafted token).

Per cell: median tokens/s over ``--repeats`` runs (after one warm-up), the acceptance
(accepted / drafted tokens), round trips, the mean draft length, positions the server saw,
the speedup over ``split`` at the same RTT, and whether the tokens equal the unsplit model's.
Training: one U-shape step (``SplitClient.train_step``, batch ``--train-batch``) per RTT with
``micro_batches`` 1 and 4 (pipelined), lr 0 so the served weights stay those the generation
checks against. Writes ``--out`` (default ``benchmarks/results/cpu/wan.json``).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from splitlearn import ByteTokenizer, load_corpus, load_model  # noqa: E402
from splitlearn.data import lm_batches  # noqa: E402
from splitlearn.localserver import LocalServer  # noqa: E402
from splitlearn.netem import relay_process  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "cpu" / "wan.json"


def train_lm(model, ids, steps: int, batch: int, seq: int, lr: float, log) -> float:
    """Plain AdamW on random windows of the corpus; returns the last loss."""
    if steps <= 0:
        return float("nan")
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    loss = None
    for i, x in enumerate(lm_batches(ids, batch, seq, seed=1, steps=steps)):
        loss = model(x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if i % 100 == 0 or i == steps - 1:
            log(f"  step {i}: loss {loss.item():.3f}")
    model.eval()
    return float(loss.item())


def draft_model(target, layers: int, seed: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(**{k: v for k, v in target.config.to_dict().items()
                        if k not in ("architectures", "transformers_version")})
    cfg.n_layer = layers
    torch.manual_seed(seed)
    return GPT2LMHeadModel(cfg).eval()


def timed(fn, repeats: int):
    fn()  # warm-up
    out, times = None, []
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return out, times


def run(a, log=print) -> dict:
    from splitlearn.client import SplitClient
    from splitlearn.hf.draft import CountingRemoteCache, LinkAwarePolicy, free_draft, link_aware
    from splitlearn.hf.modeling import SplitGPT2LMHeadModel

    torch.set_num_threads(a.threads)
    cuts = tuple(int(c) for c in a.cuts.split(","))
    text = load_corpus()
    tok = ByteTokenizer()
    ids = tok.encode(text)
    work = Path(a.cache or tempfile.mkdtemp(prefix="splitlearn-wan-")) / \
        f"{a.model.replace(':', '_')}-{a.train_steps}-d{a.draft_layers}"
    t0 = time.perf_counter()
    if (work / "draft" / "config.json").exists():  # trained by an earlier run with the same settings
        log(f"reusing the trained models in {work}")
        target = load_model(str(work / "target"))
        assistant = load_model(str(work / "draft"))
        losses = json.loads((work / "losses.json").read_text())
    else:
        target = load_model(a.model, seed=0)
        log(f"target {a.model}: {target.config.n_layer} blocks, d={target.config.n_embd}; "
            f"training {a.train_steps} steps")
        losses = {"target": train_lm(target, ids, a.train_steps, 16, 64, 3e-3, log)}
        assistant = draft_model(target, a.draft_layers, seed=1)
        log(f"assistant: {a.draft_layers} blocks; training {a.train_steps} steps")
        losses["draft"] = train_lm(assistant, ids, a.train_steps, 16, 64, 3e-3, log)
        target.save_pretrained(work / "target")
        assistant.save_pretrained(work / "draft")
        (work / "losses.json").write_text(json.dumps(losses))
    target_loss, draft_loss = losses["target"], losses["draft"]
    self_draft = load_model(str(work / "target"))
    train_s = time.perf_counter() - t0

    P, N = a.prompt_len, a.new_tokens
    start = len(ids) - 600  # a window near the end of the corpus
    prompt = torch.tensor([ids[start:start + P]])
    gen_kw = dict(do_sample=False, max_new_tokens=N, pad_token_id=target.config.eos_token_id,
                  eos_token_id=None)
    _, t_unsplit = timed(lambda: target.generate(prompt, attention_mask=torch.ones_like(prompt), **gen_kw),
                         a.repeats)
    want = target.generate(prompt, attention_mask=torch.ones_like(prompt), **gen_kw)
    unsplit_tps = N / statistics.median(t_unsplit)
    log(f"unsplit: {unsplit_tps:.1f} tokens/s")

    # one torch thread: client, server and relay share the cores (OpenMP threads spinning on a
    # shared 2-core box cost the server 5-10x per decode step)
    args = ["--model", str(work / "target"), "--device", "cpu", "--threads", "8", "--torch-threads", "1"]
    for c in cuts:
        args += ["--cut", str(c)]
    rows, training = [], []
    with LocalServer(args) as srv:
        for rtt in a.rtt:
            with relay_process(srv.url, rtt_ms=rtt, rate_mbps=a.mbps or None) as relay:
                model = SplitGPT2LMHeadModel.from_pretrained(str(work / "target"), server=relay.url,
                                                             token=srv.token)
                remote = model.transformer.remote
                fd = free_draft(model)
                systems = [("split", {}, None),
                           ("split + lookup", dict(prompt_lookup_num_tokens=4), True),
                           ("split + assistant", dict(assistant_model=assistant), True),
                           ("split + assistant (hf length)", dict(assistant_model=assistant), False),
                           ("split + free draft", dict(assistant_model=fd), True),
                           ("split + self draft", dict(assistant_model=self_draft), True)]
                cell = {}
                for name, kw, control in systems:
                    stats = {}

                    def once():
                        with CountingRemoteCache.from_info(model.config, remote.transport, remote.info) as cache:
                            if control is None:
                                out = model.generate(prompt, attention_mask=torch.ones_like(prompt),
                                                     past_key_values=cache, **gen_kw)
                                stats.update(rounds=cache.steps_sent, positions=cache.positions_sent)
                                return out
                            pol = LinkAwarePolicy(k_max=a.k_max, rtt_ms=rtt)
                            with link_aware(model, pol, control=control):
                                out = model.generate(prompt, attention_mask=torch.ones_like(prompt),
                                                     past_key_values=cache, **gen_kw, **kw)
                            stats.update(rounds=pol.rounds, drafted=pol.drafted, accepted=pol.accepted,
                                         positions=cache.positions_sent,
                                         mean_k=pol.drafted / max(pol.rounds, 1))
                            return out

                    out, times = timed(once, a.repeats)
                    tps = N / statistics.median(times)
                    row = {"rtt_ms": rtt, "mbps": a.mbps or None, "system": name, "tokens_per_s": tps,
                           "median_s": statistics.median(times), "times_s": times,
                           "exact": bool(torch.equal(out, want)), **stats}
                    if "drafted" in stats:
                        row["acceptance"] = stats["accepted"] / stats["drafted"] if stats["drafted"] else None
                    cell[name] = row
                    rows.append(row)
                base = cell["split"]["tokens_per_s"]
                for row in cell.values():
                    row["speedup_vs_split"] = row["tokens_per_s"] / base
                    row["ratio_vs_unsplit"] = row["tokens_per_s"] / unsplit_tps
                    acc = row.get("acceptance")
                    log(f"rtt {rtt:>5} ms  {row['system']:<30} {row['tokens_per_s']:7.1f} tok/s  "
                        f"x{row['speedup_vs_split']:.2f}  acc {'-' if acc is None else f'{acc:.2f}'}  "
                        f"rounds {row['rounds']}  exact {row['exact']}")
                remote.close()
        for rtt in a.rtt if a.train_batch else ():  # after every generation cell: training moves the weights
            with relay_process(srv.url, rtt_ms=rtt, rate_mbps=a.mbps or None) as relay:
                tr = {"rtt_ms": rtt, "batch": [a.train_batch, 64]}
                x = next(lm_batches(ids, a.train_batch, 64, seed=2, steps=1))
                for m in (1, 4):
                    c = SplitClient(relay.url, str(work / "target"), token=srv.token, lr=1e-4, device="cpu",
                                    micro_batches=m, client_id=f"wan-train-r{int(rtt)}-m{m}")
                    _, ts = timed(lambda: c.train_step(x), a.repeats)
                    tr[f"step_s_micro{m}"] = statistics.median(ts)
                    c.close()
                training.append(tr)
                log(f"rtt {rtt:>5} ms  train step b{a.train_batch}x64: micro 1 {tr['step_s_micro1']:.3f} s, "
                    f"micro 4 {tr['step_s_micro4']:.3f} s")
    from benchmarks.timing import command_line, machine_info

    return {"command": command_line(), "machine": machine_info(a.threads), "model": a.model, "cuts": list(cuts),
            "draft_layers": a.draft_layers, "train_steps": a.train_steps, "target_loss": target_loss,
            "draft_loss": draft_loss, "train_s": train_s, "prompt_len": P, "new_tokens": N, "repeats": a.repeats,
            "unsplit_tokens_per_s": unsplit_tps, "rows": rows, "training": training}


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python benchmarks/wan.py", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="RTT 1 and 50 ms, 32 tokens, 2 repeats")
    p.add_argument("--model", default="tiny-demo")
    p.add_argument("--cuts", default="1,5", help="U-shape cuts c1,c2 (the server holds blocks [c1, c2))")
    p.add_argument("--rtt", help="round trips in ms, comma-separated (default 1,20,50,100; --quick 1,50)")
    p.add_argument("--mbps", type=float, default=0.0, help="rate per direction through the relay (0: none)")
    p.add_argument("--train-steps", type=int, default=400, help="unsplit training of target and draft (0: none)")
    p.add_argument("--draft-layers", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int)
    p.add_argument("--k-max", type=int, default=12)
    p.add_argument("--repeats", type=int)
    p.add_argument("--train-batch", type=int, default=8, help="training step batch (0: no training figures)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the client (the server: its default)")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--cache", default=str(Path(tempfile.gettempdir()) / "splitlearn-wan"),
                   help="where the trained models are kept between runs")
    a = p.parse_args(argv)
    a.rtt = [float(x) for x in (a.rtt or ("1,50" if a.quick else "1,20,50,100")).split(",")]
    a.new_tokens = a.new_tokens or (32 if a.quick else 64)
    a.repeats = a.repeats or (2 if a.quick else 3)
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    result = run(a, log=lambda s: print(s, file=sys.stderr, flush=True))
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
