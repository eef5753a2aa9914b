"""Training: one optimizer step (AdamW) on a batch of ``train_batch`` x ``train_seq`` tokens.

- ``unsplit``: forward, loss, backward and ``optimizer.step()`` of the whole model in this
  process (the limit);
- ``splitlearn <shape> <wire dtype>``: :meth:`SplitClient.train_step` against a server on
  loopback (2-way: one round trip per step; U-shape: forward and backward round trips),
  both sides stepping their optimizers;
- ``naive JSON`` and ``torch.distributed.rpc``: the same U-shape step in the baselines
  (the RPC one with distributed autograd and ``DistributedOptimizer``).

Value: the median seconds per step; ``ratio`` = step time over the unsplit model's (lower is
better; the target is <= 1.05 on CPU).
"""
from __future__ import annotations

import torch

from splitlearn.checkpoint import make_optimizer
from splitlearn.client.transport import WireStats
from splitlearn.segments import labels_from_batch, loss_from_logits

from .config import BenchConfig
from .generation import prompts
from .timing import measure


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
    model = ctx.model()
    ids = prompts(cfg, cfg.train_batch, model.config.vocab_size, cfg.train_seq).to(cfg.device)
    ctx.log("  training: unsplit")
    opt = make_optimizer(model.parameters(), "adamw", cfg.lr, 0.0)
    t = measure(lambda: unsplit_step(model, opt, ids), cfg.repeats, cfg.warmup, cfg.device)
    del opt
    rows = [_row(cfg, "unsplit", t)]
    for shape in ("u", "2-way"):
        for wire in cfg.wire_dtypes:
            ctx.log(f"  training: splitlearn {shape} {wire}")
            with ctx.client(shape, wire) as client:
                client.transport.stats = WireStats()
                t = measure(lambda: client.train_step(ids), cfg.repeats, cfg.warmup, cfg.device)
                s = client.stats
                calls = max(1, s.calls)
            rows.append(_row(cfg, f"splitlearn {shape} {wire}", t, shape=shape, wire_dtype=wire,
                             overhead_ms_per_call=1e3 * s.overhead_s / calls,
                             bytes_per_step=(s.bytes_sent + s.bytes_received) / (cfg.repeats + cfg.warmup)))
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
        r["ratio"] = r["value"] / base
    return rows
