"""Per-client LoRA on one server: memory per client and mixed-adapter decode throughput.

    python benchmarks/lora.py            # GPT-2 small shape (random:gpt2), trunk = blocks 2-9
    python benchmarks/lora.py --quick    # the tiny model, seconds: the smoke test

1. Memory. 16 clients each take one AdamW training step on the server's trunk through
   :class:`splitlearn.server.engine.adapters.AdapterBank` (r=8, alpha=16 on c_attn and c_proj, as
   Plato's GPT-2 split-learning LoRA example); the bytes each client holds (adapter + AdamW
   moments) are read from the tensors themselves and compared with what full-segment
   training holds per client (a copy of the segment + AdamW moments, measured on a real
   AdamW step of a copy).
2. Decode. 8 sessions (1 row each, 32-token prefill) decode ``--steps`` tokens, every step
   batched into one forward by :func:`splitlearn.server.engine.batching.batched_decode`: with no
   adapters (a server without LoRA), with one adapter shared by the 8, and with 8 different
   adapters (shared base matmul + per-adapter delta on its rows). In-process, no HTTP, so
   the numbers isolate the adapters' compute cost; also checks that the mixed batch equals
   the sessions run one by one.
"""
from __future__ import annotations

import argparse
import copy
import json
import time

import torch

import splitlearn as sl
from splitlearn.model.checkpoint import make_optimizer
from splitlearn.model.lora import LoraSpec, lora_scope
from splitlearn.server.engine.adapters import AdapterBank
from splitlearn.server.engine.batching import DecodeItem, batched_decode


def trunk_of(model_name: str, cuts):
    return sl.partition(sl.load_model(model_name), cuts).trunk


def memory(model_name: str, cuts, spec: LoraSpec, clients: int) -> dict:
    trunk = trunk_of(model_name, cuts)
    d = trunk.config.n_embd
    bank = AdapterBank(trunk, spec, 0, lambda ps: make_optimizer(ps, "adamw", 1e-3))
    x = torch.randn(1, 16, d)
    for i in range(clients):
        rep = bank.replica(f"client{i}")
        rep.segment.train()
        rep.optimizer.zero_grad()
        rep.segment(x).pow(2).mean().backward()
        rep.optimizer.step()
    per = [bank.bytes_of(f"client{i}") for i in range(clients)]
    lora_bytes = sum(p["adapter"] + p["optimizer"] for p in per) / clients
    full = copy.deepcopy(trunk_of(model_name, cuts))  # what a per-client full copy holds
    opt = make_optimizer(full.parameters(), "adamw", 1e-3)
    full.train()
    full(x).pow(2).mean().backward()
    opt.step()
    seg_bytes = sum(p.numel() * p.element_size() for p in full.parameters())
    state_bytes = sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values()
                      if isinstance(v, torch.Tensor))
    base_bytes = sum(p.numel() * p.element_size() for p in trunk.parameters())
    return {"clients": clients, "segment_params": sum(p.numel() for p in trunk.parameters()),
            "adapter_params_per_client": sum(p.numel() for p in bank.replica("client0").segment.parameters()),
            "lora_bytes_per_client": lora_bytes, "lora_adapter_bytes": per[0]["adapter"],
            "lora_optimizer_bytes": per[0]["optimizer"], "full_bytes_per_client": seg_bytes + state_bytes,
            "shared_base_bytes": base_bytes,
            "ratio": (seg_bytes + state_bytes) / lora_bytes,
            "server_total_16_lora": base_bytes + clients * lora_bytes,
            "server_total_16_full": clients * (seg_bytes + state_bytes)}


def decode(model_name: str, cuts, spec: LoraSpec, sessions: int, steps: int, prompt: int, repeats: int) -> dict:
    trunk = trunk_of(model_name, cuts).eval()
    plain = trunk_of(model_name, cuts).eval()  # a server without LoRA: no hooks at all
    d = trunk.config.n_embd
    bank = AdapterBank(trunk, spec, 0, lambda ps: make_optimizer(ps, "adamw", 1e-3))
    g = torch.Generator().manual_seed(0)
    adapters = [bank.replica(f"c{i}").segment.adapter for i in range(sessions)]
    with torch.no_grad():
        for ad in adapters:
            for b in ad.lora_B:
                b.copy_(torch.randn(b.shape, generator=g) * 0.02)
    prompts = [torch.randn(1, prompt, d, generator=g) for _ in range(sessions)]
    news = [[torch.randn(1, 1, d, generator=g) for _ in range(sessions)] for _ in range(steps)]
    plans = {"none": (plain, [None] * sessions), "one adapter": (trunk, [adapters[0]] * sessions),
             f"{sessions} adapters": (trunk, adapters)}
    out = {}
    for name, (seg, ads) in plans.items():
        times = []
        for _ in range(repeats + 1):  # the first run warms up and is dropped
            caches = [seg.new_cache() for _ in range(sessions)]
            with torch.no_grad():
                for c, p, ad in zip(caches, prompts, ads):
                    with lora_scope(seg, ad):
                        seg(p, None, c)
            t = time.perf_counter()
            for new in news:
                batched_decode(seg, [DecodeItem(c, x, adapter=ad) for c, x, ad in zip(caches, new, ads)])
            times.append(time.perf_counter() - t)
        times = times[1:]
        best = sorted(times)[len(times) // 2]  # median
        out[name] = {"tokens_per_s": sessions * steps / best, "ms_per_step": best / steps * 1e3}
    # exactness: the mixed batch equals the sessions one by one
    caches = [[trunk.new_cache() for _ in range(sessions)] for _ in range(2)]
    with torch.no_grad():
        for cs in caches:
            for c, p, ad in zip(cs, prompts, adapters):
                with lora_scope(trunk, ad):
                    trunk(p, None, c)
        got = batched_decode(trunk, [DecodeItem(c, x, adapter=ad) for c, x, ad in zip(caches[0], news[0], adapters)])
        diff = 0.0
        for c, x, ad, o in zip(caches[1], news[0], adapters, got):
            with lora_scope(trunk, ad):
                diff = max(diff, float((trunk(x, None, c) - o).abs().max()))
    out["max_abs_diff_batched_vs_alone"] = diff
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="the tiny model, a few steps")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", help="write the results here")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    model, cuts = ("tiny", (1, 3)) if a.quick else ("random:gpt2", (2, 10))
    spec = LoraSpec(r=8, alpha=16.0, targets=("c_attn", "c_proj"))
    steps, repeats = (8, 1) if a.quick else (32, 3)
    res = {"model": model, "cuts": list(cuts), "lora": spec.to_dict(), "threads": torch.get_num_threads(),
           "memory": memory(model, cuts, spec, 16), "decode": decode(model, cuts, spec, 8, steps, 32, repeats)}
    m = res["memory"]
    print(f"{model} trunk blocks [{cuts[0]}, {cuts[1]}): {m['segment_params'] / 1e6:.1f}M parameters; "
          f"LoRA {spec.to_dict()}")
    print(f"per client: LoRA {m['lora_bytes_per_client'] / 2**20:.2f} MiB (adapter {m['lora_adapter_bytes'] / 2**20:.2f} "
          f"+ AdamW {m['lora_optimizer_bytes'] / 2**20:.2f}) vs full segment {m['full_bytes_per_client'] / 2**20:.0f} MiB "
          f"({m['ratio']:.0f}x); 16 clients: {m['server_total_16_lora'] / 2**20:.0f} MiB vs "
          f"{m['server_total_16_full'] / 2**20:.0f} MiB")
    for k, v in res["decode"].items():
        print(f"decode, 8 sessions, {k}: {v}" if isinstance(v, float) else
              f"decode, 8 sessions, {k}: {v['tokens_per_s']:.1f} tokens/s ({v['ms_per_step']:.2f} ms/step)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
