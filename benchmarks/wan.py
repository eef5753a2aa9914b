"""Split generation and training across an emulated WAN: plain, and with speculative decoding.

    python benchmarks/wan.py                    # loopback + RTT 1, 20, 50, 100 ms; rates 1000/100/10 Mbit/s
    python benchmarks/wan.py --quick            # loopback and 50 ms, fewer tokens: a few minutes
    python benchmarks/wan.py --grid             # every RTT x every rate, generation and training
    python benchmarks/wan.py --model random:gpt2 --cuts 2,10 --train-steps 0 --no-generate \
        --train-seq 128 --rtt 50 --mbps 100 --train-wire float32 --train-repeats 2   # GPT-2 small training
    python benchmarks/wan.py --width 256 --perturb 0.5 --rtt 50 --mbps 100 --train-batch 0 --distill-steps 0 \
        --systems "split,split + perturbed head"   # the plain generate(assistant_model=) call, issue 33

The link: the server (``python -m splitlearn.server``, U-shape) sits behind
:mod:`splitlearn.netem.relay` (a child process adding ``RTT / 2`` each way, and with a rate a
token bucket per direction; this kernel has no ``netem``, see the relay's docstring) and the
client connects to the relay. "loopback" is the client talking to the server directly.

Cells (``rtt_ms``, ``mbps``): generation at loopback and every ``--rtt`` with no rate limit,
plus 50 ms at the lowest ``--mbps`` (a decode step is a few KB, so the rate hardly matters);
training at loopback and at 1 and 50 ms for every ``--mbps``, per ``--train-wire`` dtype.
``--grid`` runs every RTT x rate for both.

The models. ``--model tiny-demo`` (default) is trained here, unsplit, on the shipped corpus
(``--train-steps``), and so is the **assistant**: a smaller GPT-2 with the same byte
vocabulary (``--draft-layers`` blocks of the same width). The server loads the trained target
from a directory. The **distilled free draft** is a copy of the U-shape client's own blocks
(trunk skipped) trained with :func:`splitlearn.hf.draft.distill_draft` against the split model
on loopback (``--distill-steps`` batches of 16 x 64 from the corpus): what a data owner can
build without the server's weights. Systems, batch 1, greedy, ``--new-tokens`` after a
``--prompt-len`` prompt taken from the corpus:

- ``unsplit``: the target in this process, Hugging Face ``generate`` (no link);
- ``split``: ``SplitGPT2LMHeadModel.generate`` through the link, one round trip per token;
- ``split + lookup``: ``prompt_lookup_num_tokens`` (length from :class:`LinkAwarePolicy`);
- ``split + assistant``: the trained small draft (link-aware length), ``... (plain call)``: the
  same with no ``link_aware`` block and no schedule, ``model.generate(ids, assistant_model=draft)``
  as any transformers code writes it (the split model's default: the link-aware length, the
  first round assuming the client's measured round trip), and ``... (hf length)`` with
  transformers' own schedule, to show what the link-aware length buys;
- ``split + perturbed head`` (with ``--perturb SIGMA``): the target's own weights with Gaussian
  noise of ``SIGMA`` x the head's standard deviation added to its (untied) LM head, a draft that
  agrees often but not always (the issue's cell), as a plain call, with ``link_aware``, and at
  transformers' length;
- ``split + free draft``: the client's own blocks with the trunk skipped
  (:func:`splitlearn.hf.draft.free_draft`), untrained as an early exit;
- ``split + distilled free draft``: the same blocks after distillation (link-aware length);
- ``split + self draft``: the target's own weights as the draft (acceptance 1: the upper bound
  of what a draft can give at the cost of a whole local model per drafted token).

Per cell: median tokens/s over ``--repeats`` runs (after one warm-up), the draft's
**agreement** with the target (the share of the unsplit greedy tokens that are the draft's own
greedy choice given the same prefix: what "a draft that agrees on 90% of tokens" means), the
acceptance (accepted / drafted tokens: lower than the agreement when long drafts are cut at
their first miss), round trips, the mean draft length, positions the server saw,
the speedup over ``split`` at the same link, and whether the tokens equal the unsplit model's.
Training: one U-shape step (``SplitClient.train_step``, batch ``--train-batch`` x
``--train-seq``) per cell and wire dtype with each ``--micro`` (1: one round trip per
crossing; 4: pipelined, pieces in flight), lr 1e-4, after the generation cells; each step
time also as a ratio to the same step on loopback. Writes ``--out`` (default
``benchmarks/results/cpu/wan.json``) and prints the markdown tables of docs/WAN.md.
"""
from __future__ import annotations

import argparse
import contextlib
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
from splitlearn.model.data import lm_batches  # noqa: E402
from splitlearn.procs.localserver import LocalServer  # noqa: E402
from splitlearn.netem import relay_process  # noqa: E402
from benchmarks.timing import write_result  # noqa: E402

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


def perturbed_head(model, sigma: float, seed: int):
    """``model`` (changed in place) with its LM head untied from ``wte`` and Gaussian noise of
    ``sigma`` x the head's standard deviation added: a draft close to the target."""
    w = model.lm_head.weight.detach().clone()
    g = torch.Generator().manual_seed(seed)
    model.lm_head.weight = torch.nn.Parameter(w + sigma * w.std() * torch.randn(w.shape, generator=g))
    model.config.tie_word_embeddings = False
    return model.eval()


def draft_model(target, layers: int, seed: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(**{k: v for k, v in target.config.to_dict().items()
                        if k not in ("architectures", "transformers_version")})
    cfg.n_layer = layers
    torch.manual_seed(seed)
    return GPT2LMHeadModel(cfg).eval()


@torch.no_grad()
def agreement(draft, want: torch.Tensor, prompt_len: int) -> float:
    """How often ``draft`` agrees with the target: the share of the target's greedy tokens
    ``want`` (1, P + N) that are the draft's own greedy choice given the same prefix."""
    guess = draft(want).logits[0, prompt_len - 1:-1].argmax(-1)  # (N,)
    return float((guess == want[0, prompt_len:]).float().mean())


def timed(fn, repeats: int):
    fn()  # warm-up
    out, times = None, []
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return out, times


@contextlib.contextmanager
def link_to(srv, rtt: float, mbps: float):
    """The URL to reach ``srv`` through: the server itself for loopback (``rtt`` 0, no rate),
    else a relay adding ``rtt`` ms (and a ``mbps`` token bucket each way)."""
    if not rtt and not mbps:
        yield srv.url
        return
    with relay_process(srv.url, rtt_ms=rtt, rate_mbps=mbps or None) as relay:
        yield relay.url


def label(rtt: float, mbps: float) -> str:
    if not rtt and not mbps:
        return "loopback"
    return f"{rtt:g} ms" + (f" / {mbps:g} Mbit/s" if mbps else "")


def cells(a) -> tuple[list, list]:
    """(generation cells, training cells), each a list of (rtt_ms, mbps) with mbps 0 = no limit."""
    if a.grid:
        grid = [(0.0, 0.0)] + [(r, m) for r in a.rtt for m in a.mbps]
        return grid, grid
    gen = [(0.0, 0.0)] + [(r, 0.0) for r in a.rtt if r]
    if 50.0 in a.rtt and a.mbps:
        gen.append((50.0, min(a.mbps)))  # decode steps are a few KB: the rate hardly matters
    train_rtts = [r for r in a.rtt if r in (1.0, 50.0)] or a.rtt[:1]
    train = [(0.0, 0.0)] + [(r, m) for r in train_rtts for m in a.mbps]
    return gen, train


def run(a, log=print) -> dict:
    from splitlearn.client import SplitClient
    from splitlearn.hf.draft import CountingRemoteCache, LinkAwarePolicy, distill_draft, free_draft, link_aware
    from splitlearn.hf.modeling import SplitGPT2LMHeadModel

    torch.set_num_threads(a.threads)
    cuts = tuple(int(c) for c in a.cuts.split(","))
    text = load_corpus()
    tok = ByteTokenizer()
    ids = tok.encode(text)
    work = Path(a.cache or tempfile.mkdtemp(prefix="splitlearn-wan-")) / \
        f"{a.model.replace(':', '_')}{f'-w{a.width}' if a.width else ''}-{a.train_steps}-d{a.draft_layers}"
    t0 = time.perf_counter()
    if (work / "draft" / "config.json").exists():  # trained by an earlier run with the same settings
        log(f"reusing the trained models in {work}")
        losses = json.loads((work / "losses.json").read_text())
    else:
        source = a.model
        if a.width:  # the spec's shape at another width (the cell: 6 blocks, d=256)
            from splitlearn.model.loading import load_config

            source = load_config(a.model)
            source.n_embd = a.width
        target = load_model(source, seed=0)
        log(f"target {a.model}: {target.config.n_layer} blocks, d={target.config.n_embd}; "
            f"training {a.train_steps} steps")
        losses = {"target": train_lm(target, ids, a.train_steps, 16, 64, 3e-3, log)}
        assistant = draft_model(target, a.draft_layers, seed=1)
        if a.generate:
            log(f"assistant: {a.draft_layers} blocks; training {a.train_steps} steps")
            losses["draft"] = train_lm(assistant, ids, a.train_steps, 16, 64, 3e-3, log)
        target.save_pretrained(work / "target")
        assistant.save_pretrained(work / "draft")
        (work / "losses.json").write_text(json.dumps(losses))
    target = load_model(str(work / "target"))
    assistant = load_model(str(work / "draft"))
    self_draft = load_model(str(work / "target"))
    perturbed = perturbed_head(load_model(str(work / "target")), a.perturb, seed=4) if a.perturb else None
    train_s = time.perf_counter() - t0
    gen_cells, train_cells = cells(a)

    P, N = a.prompt_len, a.new_tokens
    start = len(ids) - 600  # a window near the end of the corpus
    prompt = torch.tensor([ids[start:start + P]])
    gen_kw = dict(do_sample=False, max_new_tokens=N, pad_token_id=target.config.eos_token_id,
                  eos_token_id=None)
    unsplit_tps, want = None, None
    if a.generate:
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
    rows, training, distill = [], [], {}
    agreement_of = {}  # draft model -> agreement with the target's greedy tokens
    with LocalServer(args) as srv:
        distilled = None
        if a.generate and a.distill_steps:
            dpath = work / f"distilled-{a.distill_steps}"
            if (dpath / "config.json").exists():
                distilled = load_model(str(dpath)).eval()
                distill = json.loads((dpath / "distill.json").read_text())
                log(f"reusing the distilled free draft in {dpath}")
            else:  # through the split model on loopback: the data owner needs no server weights
                teacher = SplitGPT2LMHeadModel.from_pretrained(str(work / "target"), server=srv.url, token=srv.token)
                d0 = time.perf_counter()
                distilled = distill_draft(teacher, lm_batches(ids, 16, 64, seed=3, steps=a.distill_steps),
                                          steps=a.distill_steps, lr=1e-3, progress=False)
                distill = {"steps": a.distill_steps, "seconds": time.perf_counter() - d0,
                           "layers": distilled.config.n_layer}
                teacher.transformer.remote.close()
                distilled.save_pretrained(dpath)
                (dpath / "distill.json").write_text(json.dumps(distill))
                log(f"distilled the free draft: {a.distill_steps} batches in {distill['seconds']:.0f} s")
        for rtt, mbps in gen_cells if a.generate else ():
            with link_to(srv, rtt, mbps) as url:
                model = SplitGPT2LMHeadModel.from_pretrained(str(work / "target"), server=url, token=srv.token)
                remote = model.transformer.remote
                fd = free_draft(model)
                systems = [("split", {}, None),
                           ("split + lookup", dict(prompt_lookup_num_tokens=4), True),
                           ("split + assistant", dict(assistant_model=assistant), True),
                           ("split + assistant (plain call)", dict(assistant_model=assistant), "plain"),
                           ("split + assistant (hf length)", dict(assistant_model=assistant), False),
                           ("split + free draft", dict(assistant_model=fd), True)]
                if distilled is not None:
                    systems.append(("split + distilled free draft", dict(assistant_model=distilled), True))
                if perturbed is not None:
                    systems += [("split + perturbed head", dict(assistant_model=perturbed), True),
                                ("split + perturbed head (plain call)", dict(assistant_model=perturbed), "plain"),
                                ("split + perturbed head (hf length)", dict(assistant_model=perturbed), False)]
                systems.append(("split + self draft", dict(assistant_model=self_draft), True))
                if a.systems:  # "split + x" keeps that system and its (plain call) / (hf length) rows
                    systems = [s for s in systems if s[0] == "split" or
                               any(s[0].split(" (")[0] == want for want in a.systems)]
                cell = {}
                for name, kw, control in systems:
                    if "assistant_model" in kw and kw["assistant_model"] not in agreement_of:
                        agreement_of[kw["assistant_model"]] = agreement(kw["assistant_model"], want, P)
                    stats = {}

                    def once():
                        with CountingRemoteCache.from_info(model.config, remote.transport, remote.info) as cache:
                            if control is None:
                                out = model.generate(prompt, attention_mask=torch.ones_like(prompt),
                                                     cache=cache, **gen_kw)
                                stats.update(rounds=cache.steps_sent, positions=cache.positions_sent)
                                return out
                            if control == "plain":  # transformers code as written: the split model's default
                                model.last_draft_policy = None
                                out = model.generate(prompt, attention_mask=torch.ones_like(prompt),
                                                     cache=cache, **gen_kw, **kw)
                                pol = model.last_draft_policy
                                assert pol is not None, "the plain call did not draft at the link-aware length"
                            else:
                                pol = LinkAwarePolicy(k_max=a.k_max, rtt_ms=rtt or None)
                                with link_aware(model, pol, control=control):
                                    out = model.generate(prompt, attention_mask=torch.ones_like(prompt),
                                                         cache=cache, **gen_kw, **kw)
                            stats.update(rounds=pol.rounds, drafted=pol.drafted, accepted=pol.accepted,
                                         positions=cache.positions_sent,
                                         mean_k=pol.drafted / max(pol.rounds, 1))
                            return out

                    out, times = timed(once, a.repeats)
                    tps = N / statistics.median(times)
                    row = {"rtt_ms": rtt, "mbps": mbps or None, "link": label(rtt, mbps), "system": name,
                           "tokens_per_s": tps, "median_s": statistics.median(times), "times_s": times,
                           "exact": bool(torch.equal(out, want)), **stats}
                    if "drafted" in stats:
                        row["acceptance"] = stats["accepted"] / stats["drafted"] if stats["drafted"] else None
                    if "assistant_model" in kw:
                        row["agreement"] = agreement_of[kw["assistant_model"]]
                    cell[name] = row
                    rows.append(row)
                base = cell["split"]["tokens_per_s"]
                for row in cell.values():
                    row["speedup_vs_split"] = row["tokens_per_s"] / base
                    row["ratio_vs_unsplit"] = row["tokens_per_s"] / unsplit_tps
                    acc = row.get("acceptance")
                    log(f"{label(rtt, mbps):>22}  {row['system']:<30} {row['tokens_per_s']:7.1f} tok/s  "
                        f"x{row['speedup_vs_split']:.2f}  acc {'-' if acc is None else f'{acc:.2f}'}  "
                        f"rounds {row['rounds']}  exact {row['exact']}")
                remote.close()
        # training after every generation cell (it moves the weights the generation checks against)
        x = next(lm_batches(ids, a.train_batch, a.train_seq, seed=2, steps=1)) if a.train_batch else None
        unsplit_step_s = None
        if x is not None:  # the same step unsplit, in this process (no link): the limit
            ref = load_model(str(work / "target")).train()
            ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-4, weight_decay=0.0)

            def ref_step():
                loss = ref(x, labels=x).loss
                ref_opt.zero_grad()
                loss.backward()
                ref_opt.step()

            _, ts = timed(ref_step, a.train_repeats)
            unsplit_step_s = statistics.median(ts)
            log(f"{'unsplit':>22}  train b{a.train_batch}x{a.train_seq}: {unsplit_step_s:.3f} s")
            del ref, ref_opt
        for rtt, mbps in train_cells if a.train_batch else ():
            with link_to(srv, rtt, mbps) as url:
                for wire in a.train_wire:
                    tr = {"rtt_ms": rtt, "mbps": mbps or None, "link": label(rtt, mbps), "wire_dtype": wire,
                          "batch": [a.train_batch, a.train_seq]}
                    for m in a.micro:
                        c = SplitClient(url, str(work / "target"), token=srv.token, lr=1e-4, device="cpu",
                                        wire_dtype=wire, micro_batches=m,
                                        client_id=f"wan-{int(rtt)}-{int(mbps)}-{wire}-m{m}")
                        _, ts = timed(lambda: c.train_step(x), a.train_repeats)
                        tr[f"step_s_micro{m}"] = statistics.median(ts)
                        c.close()
                    training.append(tr)
                    log(f"{label(rtt, mbps):>22}  train b{a.train_batch}x{a.train_seq} {wire:<8} " + "  ".join(
                        f"micro {m}: {tr[f'step_s_micro{m}']:.3f} s" for m in a.micro))
    loop = {(t["wire_dtype"]): t for t in training if t["link"] == "loopback"}
    for t in training:
        base = loop.get(t["wire_dtype"])
        for m in a.micro:
            if base is not None:
                t[f"vs_loopback_micro{m}"] = t[f"step_s_micro{m}"] / base[f"step_s_micro{m}"]
    from benchmarks.timing import command_line, machine_info

    return {"command": command_line(), "machine": machine_info(a.threads), "model": a.model, "cuts": list(cuts),
            "draft_layers": a.draft_layers, "train_steps": a.train_steps, "losses": losses,
            "distill": distill, "train_s": train_s, "prompt_len": P, "new_tokens": N, "repeats": a.repeats,
            "unsplit_tokens_per_s": unsplit_tps, "rows": rows, "training": training,
            "unsplit_train_step_s": unsplit_step_s,
            "micro_batches": list(a.micro)}


def tables(result: dict) -> str:
    """The markdown tables of docs/WAN.md and benchmarks/README.md from one result."""
    out = []
    rows = result["rows"]
    if rows:
        links = list(dict.fromkeys(r["link"] for r in rows))
        systems = list(dict.fromkeys(r["system"] for r in rows))
        out.append("| system | " + " | ".join(links) + " | agreement | accepted / drafted |")
        out.append("|---|" + "---|" * (len(links) + 2))
        out.append("| unsplit (no link) | " + " | ".join(f"{result['unsplit_tokens_per_s']:.1f}" for _ in links)
                   + " | - | - |")
        for name in systems:
            cells, acc = [], []
            for link in links:
                r = next((r for r in rows if r["system"] == name and r["link"] == link), None)
                if r is None:
                    cells.append("-")
                    continue
                cell = f"{r['tokens_per_s']:.1f}" + ("" if name == "split" else f" (x{r['speedup_vs_split']:.2f})")
                cells.append(cell + ("" if r["exact"] else " NOT EXACT"))
                if r.get("acceptance") is not None:
                    acc.append(f"{r['acceptance']:.2f}")
            agree = next((r["agreement"] for r in rows if r["system"] == name and "agreement" in r), None)
            out.append(f"| {name} | " + " | ".join(cells) + f" | {'-' if agree is None else f'{agree:.2f}'} | "
                       f"{' / '.join(acc) or '-'} |")
        out.append("")
    tr = result["training"]
    if tr:
        micro = result.get("micro_batches", [1, 4])
        out.append("| link | wire | " + " | ".join(f"micro_batches={m} (s)" for m in micro)
                   + " | " + " | ".join(f"vs loopback, m={m}" for m in micro) + " |")
        out.append("|---|---|" + "---|" * (2 * len(micro)))
        if result.get("unsplit_train_step_s"):
            out.append(f"| unsplit (no link) | - | {result['unsplit_train_step_s']:.3f} |"
                       + " |" * (2 * len(micro) - 1))
        for t in tr:
            out.append(f"| {t['link']} | {t['wire_dtype']} | "
                       + " | ".join(f"{t[f'step_s_micro{m}']:.3f}" for m in micro) + " | "
                       + " | ".join(f"{t.get(f'vs_loopback_micro{m}', float('nan')):.2f}x" for m in micro) + " |")
    return "\n".join(out)


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python benchmarks/wan.py", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help="loopback and 50 ms, 32 tokens, 2 repeats, training at 50 ms / 100 Mbit/s in float32")
    p.add_argument("--grid", action="store_true", help="every RTT x every rate, for generation and training")
    p.add_argument("--model", default="tiny-demo")
    p.add_argument("--cuts", default="1,5", help="U-shape cuts c1,c2 (the server holds blocks [c1, c2))")
    p.add_argument("--rtt", help="round trips in ms through the relay, comma-separated (default 1,20,50,100; "
                                 "--quick 50); loopback (no relay) is always measured too")
    p.add_argument("--mbps", help="rates per direction in Mbit/s, comma-separated (default 1000,100,10; "
                                  "--quick 100): the training cells at 1 and 50 ms, and generation at 50 ms "
                                  "at the lowest rate")
    p.add_argument("--no-generate", dest="generate", action="store_false", help="training cells only")
    p.add_argument("--train-steps", type=int, default=400, help="unsplit training of target and draft (0: none)")
    p.add_argument("--draft-layers", type=int, default=2)
    p.add_argument("--width", type=int, help="the model's n_embd instead of the spec's (the issue 33 cell: 256)")
    p.add_argument("--perturb", type=float, default=0.0,
                   help="also draft with the target's weights, LM head + noise of this x its std (0: not)")
    p.add_argument("--systems", help='only these systems (comma-separated, e.g. "split,split + perturbed head"; '
                                     "a name keeps its (plain call) and (hf length) rows)")
    p.add_argument("--distill-steps", type=int, default=1200,
                   help="batches to distil the free draft against the split model (0: no distilled draft)")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int)
    p.add_argument("--k-max", type=int, default=12)
    p.add_argument("--repeats", type=int)
    p.add_argument("--train-batch", type=int, default=8, help="training step batch (0: no training figures)")
    p.add_argument("--train-seq", type=int, default=64, help="training step tokens per row")
    p.add_argument("--train-wire", help="wire dtypes of the training cells (default float32,bfloat16,int8; "
                                        "--quick float32)")
    p.add_argument("--micro", default="1,4", help="micro_batches of the training cells")
    p.add_argument("--train-repeats", type=int, help="timed training steps per cell (default: --repeats)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the client (the server: its default)")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--cache", default=str(Path(tempfile.gettempdir()) / "splitlearn-wan"),
                   help="where the trained models are kept between runs")
    a = p.parse_args(argv)
    a.rtt = _floats(a.rtt or ("50" if a.quick else "1,20,50,100"))
    a.mbps = _floats(a.mbps or ("100" if a.quick else "1000,100,10"))
    a.train_wire = [w for w in (a.train_wire or ("float32" if a.quick else "float32,bfloat16,int8")).split(",") if w]
    a.micro = [int(m) for m in a.micro.split(",") if m]
    a.systems = [x.strip() for x in a.systems.split(",") if x.strip()] if a.systems else None
    a.new_tokens = a.new_tokens or (32 if a.quick else 64)
    a.repeats = a.repeats or (2 if a.quick else 3)
    a.train_repeats = a.train_repeats or a.repeats
    if any(r < 0 for r in a.rtt) or any(m <= 0 for m in a.mbps):
        p.error("--rtt must be >= 0 and --mbps > 0")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    result = run(a, log=lambda s: print(s, file=sys.stderr, flush=True))
    print(tables(result))
    write_result(result, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
