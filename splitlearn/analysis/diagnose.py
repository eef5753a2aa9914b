"""The transport doctor: what a call to this server costs, and what that means for a split.

``python -m splitlearn.client diagnose --server URL [--json]``: round trips of 1 KiB to 16 MiB
through ``POST /v1/echo`` fitted to ``round trip = overhead + 2 x bytes / bandwidth``
(:func:`fit_link`), each wire dtype's (de)serialisation cost, the bytes per cut of the server's
model priced on this link, a latency- or bandwidth-bound verdict with the wire dtype that the measured table makes
fastest (:func:`dtype_advice`), and on a slow link :func:`wan_advice`.

A smaller wire dtype is not always faster: float32 is written as it lies, while bfloat16,
float16 and int8 each cost torch operations (a cast; int8: abs, max, divide, round, clamp,
cast) over every activation, each an OpenMP parallel region across ``torch.get_num_threads()``
threads. Where the machine's other cores are busy (a server or another job on the same
2-core machine) each region waits for a descheduled thread: measured here, 8 x 128 x 768,
2 threads, a loaded 2-core machine: encode float32 0.6 ms, bfloat16 15.6 ms, int8 89.9 ms;
with 1 thread 0.3 / 0.7 / 8.8 ms. The table measures this machine as it is, and the advice
follows the table. The report's ``link`` entry (``rtt_ms``, ``link_mbps``) is what
``analyze_model_performance --link-from`` reads. Design: docs/WAN.md, 'Measure your own link'.
"""
from __future__ import annotations

import logging
import os
import statistics
import time
from dataclasses import dataclass
from typing import Optional

import torch

from ..api import protocol as P
from ..errors import ConfigError, TransportError
from ..api.wire import WIRE_DTYPE_NAMES, decode, encode, pack, unpack
from ..transport import Transport

log = logging.getLogger(__name__)

KIB, MIB = 1 << 10, 1 << 20
LATENCY_ADVICE = "latency-bound: fewer round trips or larger batches"
BANDWIDTH_ADVICE = "bandwidth-bound: the bytes cost more than the calls"
LOSSY_GAIN = 0.95  # a lossy wire dtype is advised where its step takes at most this share of float32's


@dataclass
class DiagnoseConfig:
    sizes: tuple[int, ...] = (KIB, 16 * KIB, 256 * KIB, MIB, 4 * MIB, 16 * MIB)  # echo payloads, bytes
    repeats: int = 5  # round trips per payload size (the median is reported)
    warmup: int = 2  # untimed round trips per size first
    train_batch: int = 8  # rows of the training step estimated
    train_seq: int = 128  # tokens per row of the training step estimated
    decode_batch: int = 1  # rows of the decode step estimated
    codec_repeats: int = 5  # encode + decode runs per wire dtype (median)

    def __post_init__(self):
        self.sizes = tuple(sorted(set(int(s) for s in self.sizes)))
        if len(self.sizes) < 2 or self.sizes[0] < 1:
            raise ConfigError("diagnose needs at least two payload sizes of >= 1 byte")
        for name in ("repeats", "train_batch", "train_seq", "decode_batch", "codec_repeats"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.warmup < 0:
            raise ConfigError(f"warmup must be >= 0, got {self.warmup}")


def echo_round_trips(transport: Transport, sizes: tuple[int, ...], repeats: int, warmup: int) -> list[dict]:
    """Median/min/p90 round trip (ms) of each payload size through ``POST /v1/echo``."""
    rows = []
    for size in sizes:
        body = os.urandom(size)
        times = []
        for i in range(warmup + repeats):
            t0 = time.perf_counter()
            answer = transport.post_bytes(P.ECHO, body)
            dt = time.perf_counter() - t0
            if answer != body:
                raise TransportError(f"{P.ECHO} answered {len(answer)} bytes for {size} that differ from "
                                     f"what was sent: something between client and server alters bodies")
            if i >= warmup:
                times.append(dt)
        med = statistics.median(times)
        rows.append({"bytes": size, "median_ms": 1e3 * med, "min_ms": 1e3 * min(times),
                     "p90_ms": 1e3 * sorted(times)[int(round(0.9 * (len(times) - 1)))],
                     "effective_MBps": 2 * size / med / 1e6})  # both directions
    return rows


def fit_link(rows: list[dict]) -> tuple[float, float]:
    """(per-call overhead ms, bandwidth MB/s) of ``round trip = overhead + 2 x bytes / bandwidth``.

    The overhead comes from the small payloads (<= 64 KiB, where the call dominates: the
    cheapest median), the bandwidth from the two largest (where the bytes do): a
    least-squares line through all sizes lets the large payloads' noise swamp the intercept.
    """
    small = [r for r in rows if r["bytes"] <= 64 * KIB] or rows[:1]
    base = min(small, key=lambda r: r["median_ms"])  # the cheapest small call: the least noise
    big = [r for r in (rows[-2:] if len(rows) > 2 else rows[-1:]) if r["bytes"] > base["bytes"]]
    slope = statistics.median(max(r["median_ms"] - base["median_ms"], 0.0) / (2 * (r["bytes"] - base["bytes"]))
                              for r in big) if big else 0.0  # ms per byte
    slope = max(slope, 1e-12)  # noise swamped the bytes: the link is faster than we can see
    overhead = max(base["median_ms"] - 2 * base["bytes"] * slope, 0.0)
    return overhead, 1e-3 / slope  # 1/slope bytes per ms = 1e-3/slope MB/s


def codec_costs(d: int, batch: int, seq: int, decode_batch: int, repeats: int) -> list[dict]:
    """Encode + decode ms per wire dtype for a decode step's and a training step's activation."""
    g = torch.Generator().manual_seed(0)
    shapes = {"decode_step": (decode_batch, 1, d), "training_step": (batch, seq, d)}
    rows = []
    for name in WIRE_DTYPE_NAMES:
        row = {"wire_dtype": name}
        for kind, shape in shapes.items():
            x = torch.randn(*shape, generator=g)  # (B, T, d)
            enc, dec = [], []
            for _ in range(repeats + 1):
                t0 = time.perf_counter()
                body = encode(pack(P.HIDDEN, x, name))
                t1 = time.perf_counter()
                unpack(decode(body)[0], P.HIDDEN).float()
                t2 = time.perf_counter()
                enc.append(t1 - t0)
                dec.append(t2 - t1)
            row[f"{kind}_bytes"] = len(body)
            row[f"{kind}_serialize_ms"] = 1e3 * statistics.median(enc[1:])
            row[f"{kind}_deserialize_ms"] = 1e3 * statistics.median(dec[1:])
        rows.append(row)
    return rows


def config_value(model_config: dict, name: str):
    """``name`` (transformers' generic name: ``hidden_size``) of a server's ``model_config`` (its
    ``config.to_dict()``), which a family may store under its own name (the config class's
    ``attribute_map``); no ``model_type``: GPT-2, as :func:`splitlearn.model.loading.config_from_dict`."""
    if name in model_config:
        return model_config[name]
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_config.get("model_type", "gpt2")]
    return model_config[cls.attribute_map.get(name, name)]


def step_traffic(info: dict, batch: int, tokens: int, mode: str) -> dict:
    """Calls and bytes per wire dtype of one step against this server (the analyzer's bytes per cut).

    U-shape training: two calls, activations and gradients across both cuts (4 tensors of
    (B, T, d)). 2-way training: one call, activations + labels out, gradients + loss back.
    Decode: one call; U-shape returns the trunk's (B, 1, d), 2-way the logits (B, V).
    """
    from .traffic import wire_bytes  # the analyzer's bytes per cut

    cfg = info["model_config"]
    d, vocab = config_value(cfg, "hidden_size"), config_value(cfg, "vocab_size")
    u_shape = len(info["cuts"]) == 2
    act = wire_bytes(batch, tokens, d)  # one (B, T, d) tensor per wire dtype
    out = {}
    for name in WIRE_DTYPE_NAMES:
        if mode == "train":
            sent = 2 * act[name] if u_shape else act[name] + 8 * batch * tokens  # + I64 labels
            received = 2 * act[name] if u_shape else act[name] + 4  # + F32 loss
        else:
            sent = act[name] + 8 * batch * tokens  # + the new positions' I64 mask
            received = act[name] if u_shape else wire_bytes(batch, 1, vocab)[name]
        out[name] = {"bytes_sent": sent, "bytes_received": received}
    return {"calls": 2 if (mode == "train" and u_shape) else 1, "bytes": out}


def estimate(step: dict, overhead_ms: float, mbps: float, codec: dict, kind: str) -> dict:
    """Link time of ``step`` per wire dtype, and whether calls or bytes dominate it."""
    per = {}
    for name, b in step["bytes"].items():
        total = b["bytes_sent"] + b["bytes_received"]
        transfer = total / (mbps * 1e6) * 1e3
        c = codec[name]
        tensors = 4 if (kind == "training_step" and step["calls"] == 2) else 2
        codec_ms = tensors * (c[f"{kind}_serialize_ms"] + c[f"{kind}_deserialize_ms"])  # each sent once
        per[name] = {**b, "transfer_ms": transfer, "calls_ms": step["calls"] * overhead_ms,
                     "codec_ms": codec_ms, "estimated_ms": step["calls"] * overhead_ms + transfer + codec_ms}
    f32 = per["float32"]
    bound = "bandwidth" if f32["transfer_ms"] > f32["calls_ms"] else "latency"
    best = fastest(per)
    return {**step, "per_wire_dtype": per, "bound": bound, "fastest_wire_dtype": best,
            "advice": f"{BANDWIDTH_ADVICE if bound == 'bandwidth' else LATENCY_ADVICE}; {dtype_advice(per, best)}"}


def fastest(per: dict) -> str:
    """The wire dtype whose estimated link time is the least; float32 (exact) unless a lossy one
    takes at most :data:`LOSSY_GAIN` of its time."""
    best = min(per, key=lambda name: (round(per[name]["estimated_ms"], 3), name != "float32"))
    return best if per[best]["estimated_ms"] <= LOSSY_GAIN * per["float32"]["estimated_ms"] else "float32"


def dtype_advice(per: dict, best: str) -> str:
    """Which ``--wire-dtype`` the measured table favours, and why: the bytes a smaller dtype
    saves against what its cast (int8: its quantisation) costs on this machine."""
    f32 = per["float32"]
    if best == "float32":
        others = {n: e for n, e in per.items() if n != "float32"}
        listed = ", ".join(f"{n} {e['estimated_ms']:.1f} ms" for n, e in others.items())
        text = f"keep --wire-dtype float32 (exact, {f32['estimated_ms']:.1f} ms; {listed})"
        if all(e["codec_ms"] - f32["codec_ms"] > f32["transfer_ms"] - e["transfer_ms"] for e in others.values()):
            return text + ": on this machine the cast to a smaller dtype costs more than the bytes it saves"
        return text + f": no smaller dtype saves {100 * (1 - LOSSY_GAIN):.0f}% of the step"
    b = per[best]
    return (f"--wire-dtype {best} is the fastest here ({b['estimated_ms']:.1f} ms against float32's "
            f"{f32['estimated_ms']:.1f} ms: {f32['transfer_ms'] - b['transfer_ms']:.1f} ms fewer on the link "
            f"for {b['codec_ms'] - f32['codec_ms']:.1f} ms more of (de)serialising)")


WAN_CALL_MS = 5.0  # calls dearer than this: a link worth drafting and pipelining over
DRAFT_AGREEMENT = 0.9  # the agreement assumed for a good draft (docs/WAN.md measures one)


def wan_advice(overhead_ms: float, train_link_ms: float) -> list[str]:
    """What a link whose calls cost ``overhead_ms`` means for generation and training (no
    advice below :data:`WAN_CALL_MS`: on a LAN the knobs are the ones above)."""
    from ..hf.draft import best_draft_length, expected_tokens

    if overhead_ms < WAN_CALL_MS:
        return []
    k = best_draft_length(DRAFT_AGREEMENT, overhead_ms / 1e3, 0.0, k_max=12)
    per_round = expected_tokens(DRAFT_AGREEMENT, k)
    return [f"generation: each plain token costs a call, so this link caps it near {1e3 / overhead_ms:.0f} "
            f"tokens/s; speculative decoding verifies k drafted tokens per call: a draft agreeing "
            f"{DRAFT_AGREEMENT:.0%} (an assistant model, or distill_draft of the U-shape's free draft) at "
            f"k={k} yields {per_round:.1f} tokens per call (splitlearn.hf.draft.link_aware picks k as "
            f"it measures; docs/WAN.md)",
            f"training: a step spends about {train_link_ms:.0f} ms on this link; micro_batches=4 keeps "
            f"pieces in flight so the link overlaps compute (docs/WAN.md)"]


def diagnose(transport: Transport, cfg: Optional[DiagnoseConfig] = None) -> dict:
    """Measure the link to ``transport``'s server; the report as a JSON-ready dict."""
    cfg = cfg or DiagnoseConfig()
    info = transport.get_json(P.INFO)
    limits = info.get("limits", {})
    limit = limits.get("max_echo_bytes", limits.get("max_body_bytes"))  # echo's own cap, where there is one
    sizes = tuple(s for s in cfg.sizes if limit is None or s <= limit)
    skipped = [s for s in cfg.sizes if s not in sizes]
    if len(sizes) < 2:
        raise ConfigError(f"the server echoes bodies up to {limit} bytes: too small to measure a link")
    log.info("echo round trips of %s bytes, %d each", sizes, cfg.repeats)
    trips = echo_round_trips(transport, sizes, cfg.repeats, cfg.warmup)
    overhead_ms, mbps = fit_link(trips)
    d = config_value(info["model_config"], "hidden_size")
    codec_rows = codec_costs(d, cfg.train_batch, cfg.train_seq, cfg.decode_batch, cfg.codec_repeats)
    codec = {r["wire_dtype"]: r for r in codec_rows}
    train = estimate(step_traffic(info, cfg.train_batch, cfg.train_seq, "train"), overhead_ms, mbps,
                     codec, "training_step")
    dec = estimate(step_traffic(info, cfg.decode_batch, 1, "decode"), overhead_ms, mbps, codec, "decode_step")
    train.update(batch=cfg.train_batch, seq_len=cfg.train_seq)
    dec.update(batch=cfg.decode_batch, seq_len=1)
    return {"server": transport.cfg.url, "lean_transport": transport.lean,
            "transport": transport.cfg.url.split("://", 1)[0],  # http, https, unix (shared memory), inproc
            "model": {"shape": info.get("shape"), "cuts": info["cuts"], "hidden_size": d,
                      "vocab_size": config_value(info["model_config"], "vocab_size")},
            "round_trips": trips, "skipped_sizes": skipped,
            "per_call_overhead_ms": overhead_ms, "bandwidth_MBps": mbps,
            "link": {"rtt_ms": overhead_ms, "link_mbps": 8 * mbps},  # analyze_model_performance --link-from
            "codec": codec_rows, "steps": {"training": train, "decode": dec},
            "advice": [f"training step: {train['advice']}", f"decode step: {dec['advice']}",
                       *wan_advice(overhead_ms, train["per_wire_dtype"]["float32"]["estimated_ms"])]}


def _size(n: int) -> str:
    return f"{n // MIB} MiB" if n >= MIB and n % MIB == 0 else f"{n // KIB} KiB" if n % KIB == 0 else f"{n} B"


def render(report: dict) -> str:
    """The report as text for a terminal."""
    m = report["model"]
    lines = [f"server {report['server']}: {m['shape']} split at {m['cuts']}, d={m['hidden_size']}, "
             f"vocab={m['vocab_size']}",
             "", "round trips through POST /v1/echo (the body out and back):",
             f"  {'payload':>9}  {'median ms':>10}  {'min ms':>8}  {'p90 ms':>8}  {'MB/s':>8}"]
    for r in report["round_trips"]:
        lines.append(f"  {_size(r['bytes']):>9}  {r['median_ms']:10.3f}  {r['min_ms']:8.3f}  "
                     f"{r['p90_ms']:8.3f}  {r['effective_MBps']:8.1f}")
    if report["skipped_sizes"]:
        lines.append(f"  (skipped, over the server's echo limit: {', '.join(map(_size, report['skipped_sizes']))})")
    lines += ["", f"per-call overhead {report['per_call_overhead_ms']:.3f} ms, "
                  f"bandwidth {report['bandwidth_MBps']:.0f} MB/s (fit: round trip = overhead + 2 x bytes / bandwidth)",
              "", "(de)serialise per wire dtype (encode + decode, ms):",
              f"  {'dtype':>9}  {'decode step':>12}  {'training step':>14}  {'training bytes':>15}"]
    for c in report["codec"]:
        lines.append(f"  {c['wire_dtype']:>9}  {c['decode_step_serialize_ms'] + c['decode_step_deserialize_ms']:12.3f}"
                     f"  {c['training_step_serialize_ms'] + c['training_step_deserialize_ms']:14.3f}"
                     f"  {c['training_step_bytes']:15d}")
    for name, s in report["steps"].items():
        lines += ["", f"{name} step, batch {s['batch']} x {s['seq_len']} tokens, {s['calls']} call(s) "
                      f"(bytes per cut from the analyzer):",
                  f"  {'dtype':>9}  {'bytes out+back':>15}  {'calls ms':>9}  {'bytes ms':>9}  {'codec ms':>9}"
                  f"  {'link ms':>9}"]
        for dt, e in s["per_wire_dtype"].items():
            lines.append(f"  {dt:>9}  {e['bytes_sent'] + e['bytes_received']:15d}  {e['calls_ms']:9.3f}  "
                         f"{e['transfer_ms']:9.3f}  {e['codec_ms']:9.3f}  {e['estimated_ms']:9.3f}")
        lines.append(f"  -> {s['advice']}")
    wan = report["advice"][2:]  # wan_advice: only on a link whose calls cost milliseconds
    if wan:
        lines += ["", f"across this link ({report['per_call_overhead_ms']:.0f} ms per call):"]
        lines += [f"  -> {a}" for a in wan]
    return "\n".join(lines) + "\n"
