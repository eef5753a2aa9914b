"""Training-loss drift of lossy wire dtypes: the same run with float32 and with each other dtype.

``drift_steps`` U-shape training steps of ``drift_model`` on the corpus shipped with
splitlearn, from the same initial weights and the same batches, once per wire dtype, each
against a fresh server. Activations (forward) and gradients (backward) travel in that dtype
both ways; everything else is identical, so any difference in the loss curve is what the
wire dtype costs. Value: the largest |loss - float32 loss| over the run; also the mean and
the final losses.
"""
from __future__ import annotations

import statistics

from splitlearn import ByteTokenizer, load_corpus
from splitlearn.model.data import lm_batches

from .config import BenchConfig


def losses(cfg: BenchConfig, ctx, wire_dtype: str) -> list[float]:
    data = ByteTokenizer().encode(load_corpus())
    srv = ctx.fresh_server("u", model=cfg.drift_model, cuts=tuple(cfg.drift_cuts), lr=cfg.drift_lr)
    try:
        with ctx.client("u", wire_dtype, model=ctx.fresh_model(cfg.drift_model), server=srv,
                        lr=cfg.drift_lr) as client:
            batches = lm_batches(data, cfg.drift_batch, cfg.drift_seq, seed=cfg.seed, steps=cfg.drift_steps)
            return [client.train_step(b) for b in batches]
    finally:
        srv.stop()


def run(cfg: BenchConfig, ctx) -> list[dict]:
    ctx.log(f"  int8 drift: {cfg.drift_steps} steps of {cfg.drift_model}, float32 wire")
    ref = losses(cfg, ctx, "float32")
    rows = []
    for wire in cfg.wire_dtypes:
        if wire == "float32":
            continue
        ctx.log(f"  int8 drift: {cfg.drift_steps} steps, {wire} wire")
        got = losses(cfg, ctx, wire)
        diff = [abs(a - b) for a, b in zip(got, ref)]
        rows.append({"workload": "int8_drift",
                     "case": f"{cfg.drift_model}, {cfg.drift_steps} steps, batch {cfg.drift_batch} x {cfg.drift_seq}",
                     "system": f"splitlearn u {wire}", "wire_dtype": wire, "value": max(diff),
                     "unit": "max |loss - float32 loss|", "better": "lower",
                     "mean_abs_diff": statistics.fmean(diff), "final_loss": got[-1],
                     "final_loss_float32": ref[-1], "first_loss": got[0],
                     "relative_final_diff": abs(got[-1] - ref[-1]) / ref[-1],
                     "losses": got, "losses_float32": ref})
    return rows
