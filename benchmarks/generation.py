"""Generation: greedy decoding of ``new_tokens`` tokens per prompt, tokens/s per system.

The same random prompts (batch B x ``prompt_len``) go to:

- ``unsplit``: Hugging Face ``model.generate(do_sample=False)`` in this process (the limit);
- ``splitlearn <shape> <wire dtype>``: :meth:`SplitClient.generate` against a server on
  loopback: transformers' ``generate`` on ``SplitClient.model`` over a ``RemoteCache`` (the
  client keeps its blocks' keys and values, the server its own in a session; one position per
  step). ``overlap`` says whether the rows ran as two row groups in flight
  (``RemoteCache.row_groups``: from two rows, in the U-shape, where the server does not share
  the client's cores; never on the shared cores of this workload unless pinned);
- ``naive JSON``: the whole sequence resent as JSON lists every step, no KV cache
  (:mod:`benchmarks.baselines.naive_json`); it decodes ``naive_new_tokens`` tokens only,
  which flatters it: its cost per token grows with the sequence;
- ``torch.distributed.rpc``: the same U-shape split over TensorPipe, the server keeping the
  trunk's KV cache (:mod:`benchmarks.baselines.torch_rpc`).

tokens/s = B x new tokens / median wall time; ``ratio`` = tokens/s over the unsplit model's.
For splitlearn, ``overhead_ms_per_call`` = (round trip - server compute) / calls, from the
client's own statistics, and ``same_tokens`` says whether the tokens equal ``generate``'s.
"""
from __future__ import annotations

import torch

from splitlearn.transport import WireStats

from .config import BenchConfig
from .timing import measure


def prompts(cfg: BenchConfig, batch: int, vocab: int, length: int = None) -> torch.Tensor:
    g = torch.Generator().manual_seed(cfg.seed + batch)
    return torch.randint(0, vocab, (batch, length or cfg.prompt_len), generator=g)  # (B, T)


def hf_generate(model, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)


def _row(cfg, batch, system, new_tokens, t, **extra) -> dict:
    return {"workload": "generation", "case": f"batch {batch}, {new_tokens} new tokens",
            "batch": batch, "system": system, "value": batch * new_tokens / t.median_s,
            "unit": "tokens/s", "better": "higher", "median_s": t.median_s, "p90_s": t.p90_s,
            "repeats": len(t.runs), **extra}


def run(cfg: BenchConfig, ctx) -> list[dict]:
    model = ctx.model()
    vocab, dev, N = model.config.vocab_size, cfg.device, cfg.new_tokens
    rows = []
    for B in cfg.gen_batches:
        ids = prompts(cfg, B, vocab).to(dev)
        ctx.log(f"  generation batch {B}: unsplit")
        with torch.no_grad():
            t = measure(lambda: hf_generate(model, ids, N), cfg.repeats, cfg.warmup, dev)
            reference = hf_generate(model, ids, N).cpu()
        base = _row(cfg, B, "unsplit", N, t)
        rows.append(base)
        for shape in ("u", "2-way"):
            for wire in cfg.wire_dtypes:
                ctx.log(f"  generation batch {B}: splitlearn {shape} {wire}")
                with ctx.client(shape, wire) as client:
                    out = client.generate(ids, max_new_tokens=N).cpu()
                    client.transport.stats = WireStats()
                    t = measure(lambda: client.generate(ids, max_new_tokens=N), cfg.repeats, cfg.warmup, dev)
                    s = client.stats
                rows.append(_row(cfg, B, f"splitlearn {shape} {wire}", N, t, shape=shape, wire_dtype=wire,
                                 same_tokens=bool(torch.equal(out, reference)),
                                 overlap=B >= 2 and client.model.overlaps(),
                                 overhead_ms_per_call=1e3 * s.overhead_s / s.calls,
                                 server_ms_per_call=1e3 * s.server_compute_s / s.calls,
                                 bytes_per_call=(s.bytes_sent + s.bytes_received) / s.calls))
        naive = ctx.naive()
        if naive is not None:
            n = min(cfg.naive_new_tokens, N)
            ctx.log(f"  generation batch {B}: naive JSON ({n} tokens)")
            t = measure(lambda: naive.generate(ids.cpu(), n), 1, 0)
            out = naive.generate(ids.cpu(), n)
            rows.append(_row(cfg, B, "naive JSON", n, t, shape="u", wire_dtype="json",
                             same_tokens=bool(torch.equal(out, reference[:, :ids.shape[1] + n])),
                             note=f"{n} of {N} tokens: its per-token cost grows with the sequence"))
        rpc = ctx.rpc()
        if rpc is not None:
            ctx.log(f"  generation batch {B}: torch.distributed.rpc")
            t, out = rpc.measure_generate(ids.cpu(), N)
            rows.append(_row(cfg, B, "torch.distributed.rpc", N, t, shape="u", wire_dtype="float32",
                             same_tokens=bool(torch.equal(out, reference))))
    for r in rows:
        base = next(b for b in rows if b["system"] == "unsplit" and b["batch"] == r["batch"])
        r["ratio"] = r["value"] / base["value"]
    return rows
