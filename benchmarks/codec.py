"""Wire codec: encode + decode throughput and bytes on the wire, per wire dtype.

One activation tensor of ``codec_shape`` (4 x 128 x 768 float32 by default: a GPT-2 small
training step's activations) goes through what a splitlearn request does to it:
``wire.pack`` (cast or int8-quantise) + ``wire.encode`` (safetensors bytes) on one side,
``wire.decode`` + ``wire.unpack`` (back to a float tensor) on the other. Throughput is the
float32 tensor's bytes over the time of both halves. For comparison, the same tensor as JSON
lists of numbers (the naive baseline's wire format) and through ``torch.save``/``torch.load``
(pickle-based: what torch users reach for, and what splitlearn must never read from a network).
"""
from __future__ import annotations

import io
import json
import time

import torch

from splitlearn.api import wire

from .config import BenchConfig
from .timing import measure


def _splitlearn(x: torch.Tensor, dtype: str):
    def roundtrip():
        body = wire.encode(wire.pack("hidden", x, dtype), {"step": "1"})
        tensors, _ = wire.decode(body)
        return wire.unpack(tensors, "hidden").float(), body
    return roundtrip


def _json(x: torch.Tensor):
    def roundtrip():
        body = json.dumps({"hidden": x.tolist()}).encode()
        return torch.tensor(json.loads(body)["hidden"]), body
    return roundtrip


def _torch_save(x: torch.Tensor):
    def roundtrip():
        buf = io.BytesIO()
        torch.save({"hidden": x}, buf)
        body = buf.getvalue()
        return torch.load(io.BytesIO(body), weights_only=True)["hidden"], body
    return roundtrip


def run(cfg: BenchConfig, ctx=None) -> list[dict]:
    g = torch.Generator().manual_seed(cfg.seed)
    x = torch.randn(*cfg.codec_shape, generator=g)  # (B, T, d) float32
    raw = x.numel() * x.element_size()
    cases = [(f"splitlearn {d}", d, _splitlearn(x, d)) for d in cfg.wire_dtypes]
    cases += [("JSON lists (naive)", "float32", _json(x)), ("torch.save (pickle)", "float32", _torch_save(x))]
    rows = []
    for name, dtype, fn in cases:
        slow = name.startswith("JSON")
        t = measure(fn, 1 if slow else cfg.codec_repeats, 0 if slow else 1)
        out, body = fn()
        payload = (sum(t.numel() * t.element_size() for t in wire.pack("hidden", x, dtype).values())
                   if name.startswith("splitlearn") else raw)
        rows.append({
            "workload": "codec", "case": "x".join(map(str, cfg.codec_shape)), "system": name,
            "wire_dtype": dtype, "value": raw / t.median_s / 1e9, "unit": "GB/s", "better": "higher",
            "median_s": t.median_s, "p90_s": t.p90_s, "bytes": len(body), "raw_float32_bytes": raw,
            "payload_bytes": payload, "header_bytes": len(body) - payload,
            "max_abs_error": float((out - x).abs().max()),
        })
    return rows


if __name__ == "__main__":  # python -m benchmarks.codec: the codec table alone
    t0 = time.perf_counter()
    for r in run(BenchConfig()):
        print(f"{r['system']:<24} {r['value']:8.2f} GB/s  {r['bytes']:>10} bytes  "
              f"(header {r['header_bytes']})  max err {r['max_abs_error']:.2e}")
    print(f"{time.perf_counter() - t0:.1f} s")
