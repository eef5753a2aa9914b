"""Training: one optimizer step (AdamW) on a batch of ``train_batch`` x ``train_seq`` tokens.

- ``unsplit``: forward, loss, backward and ``optimizer.step()`` of the whole model in this
  process (the limit);
- ``splitlearn <shape> <wire dtype>``: :meth:`SplitClient.train_step` against a server on
  loopback (2-way: one round trip per step; U-shape: forward and backward round trips),
  both sides stepping their optimizers;
- ``naive JSON`` and ``torch.distributed.rpc``: the same U-shape step in the baselines
  (the RPC one with distributed autograd and ``DistributedOptimizer``).

The unsplit model and the splitlearn variants run interleaved, one step of each per round
(``train_repeats`` rounds), so slow phases of a noisy machine hit all of them alike. Value:
the median seconds per step; ``ratio``: the median over rounds of the step time over the
unsplit step of the same round (lower is better; the target is <= 1.05 on CPU). The
baselines run after (the RPC one in a process of its own); their ratio is over the unsplit
median.
"""
from __future__ import annotations

import statistics

import torch

from splitlearn.model.checkpoint import make_optimizer
from splitlearn.transport import WireStats
from splitlearn.model.segments import labels_from_batch, loss_from_logits

from .config import BenchConfig
from .generation import prompts
from .timing import Timing, measure, p90


def unsplit_step(model, optimizer, ids: torch.Tensor) -> float:
    model.train()
    optimizer.zero_grad(set_to_none=True)
    loss = loss_from_logits(model(ids).logits, labels_from_batch(ids, None))
    loss.backward()
    optimizer.step()
    return float(loss.detach())


def _row(cfg, system, t, **extra) -> dict:
    return {"workload": "training", "case": f"batch {cfg.train_batch} x seq {cfg.train_seq}, AdamW",
            "system": system, "value": t.median_s, "unit": "s/step", "better": "lower",
            "median_s": t.median_s, "p90_s": t.p90_s, "repeats": len(t.runs), **extra}


def run(cfg: BenchConfig, ctx) -> list[dict]:
    """Unsplit and every splitlearn variant interleaved: each round times one step of each.

    Interleaving puts every system under the same machine conditions, round by round; a
    splitlearn system's ``ratio`` is the median over rounds of its step time over the
    unsplit step time of the same round.
    """
    model = ctx.model()
    ids = prompts(cfg, cfg.train_batch, model.config.vocab_size, cfg.train_seq).to(cfg.device)
    opt = make_optimizer(model.parameters(), "adamw", cfg.lr, 0.0)
    steps = {"unsplit": lambda opt=opt: unsplit_step(model, opt, ids)}
    clients = {}
    for shape in ("u", "2-way"):
        for wire in cfg.wire_dtypes:
            c = clients[f"splitlearn {shape} {wire}"] = ctx.client(shape, wire)
            steps[f"splitlearn {shape} {wire}"] = (lambda c=c: c.train_step(ids))
    ctx.log(f"  training: {len(steps)} systems interleaved, {cfg.warmup} + {cfg.train_repeats} rounds")
    for _ in range(cfg.warmup):
        for fn in steps.values():
            fn()
    for c in clients.values():
        c.transport.stats = WireStats()
    runs = {name: [] for name in steps}
    for _ in range(cfg.train_repeats):
        for name, fn in steps.items():
            runs[name].append(measure(fn, 1, 0, cfg.device).median_s)
    rows = []
    for name, times in runs.items():
        t = Timing(statistics.median(times), p90(times), times)
        paired = statistics.median(a / b for a, b in zip(times, runs["unsplit"]))
        extra = {"ratio": paired}
        if name in clients:
            s = clients[name].stats
            shape, wire = name.split()[1:]
            extra.update(shape=shape, wire_dtype=wire, overhead_ms_per_call=1e3 * s.overhead_s / max(1, s.calls),
                         bytes_per_step=(s.bytes_sent + s.bytes_received) / cfg.train_repeats)
            clients[name].close()
        rows.append(_row(cfg, name, t, **extra))
    del steps, opt, clients
    naive = ctx.naive()
    if naive is not None:
        ctx.log("  training: naive JSON")
        t = measure(lambda: naive.train_step(ids.cpu()), max(1, min(cfg.repeats, 2)), 1)
        rows.append(_row(cfg, "naive JSON", t, shape="u", wire_dtype="json"))
    rpc = ctx.rpc()
    if rpc is not None:
        ctx.log("  training: torch.distributed.rpc")
        t = rpc.measure_train(ids.cpu())
        rows.append(_row(cfg, "torch.distributed.rpc", t, shape="u", wire_dtype="float32"))
    base = rows[0]["value"]
    for r in rows:
        r.setdefault("ratio", r["value"] / base)  # baselines: over the unsplit median
    return rows
