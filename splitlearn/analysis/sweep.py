"""Every cut point at once, and which one to use.

The whole model is counted and timed once (a hook per block); each 2-way cut's sides are sums
of the parts they hold. Given a link::

    step = client_ms(c) + server_ms(c) / server_speedup + rtt_ms + 8 · bytes / link_bps

The recommendation and why bytes do not depend on the cut: docs/ANALYSIS.md, 'Sweep and advice'."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

from ..errors import ConfigError
from ..model.partition import whole
from ..api.wire import WIRE_DTYPE_NAMES
from . import timing
from .core import AnalysisConfig, check_shapes, make_run, named_submodules, segment_inputs
from .counting import count_segment
from .traffic import wire_bytes

log = logging.getLogger(__name__)


@dataclass
class LinkConfig:
    """The network between client and server, and the server's speed."""

    link_mbps: Optional[float] = None  # link bandwidth, 10^6 bit/s (None: no step estimate)
    rtt_ms: float = 0.0                # round-trip time, milliseconds
    server_speedup: float = 1.0        # server compute is this many times faster than here
    wire_dtype: str = "float32"        # float32 | bfloat16 | float16 | int8
    min_client_blocks: int = 1         # blocks the client keeps at least (privacy)
    measured_from: Optional[str] = None  # the server diagnose measured rtt_ms and link_mbps against

    @classmethod
    def from_diagnose(cls, report: dict, **kw) -> "LinkConfig":
        """The link ``python -m splitlearn.client diagnose --json`` measured: its per-call
        overhead as the round trip, its fitted bandwidth as the rate (``report["link"]``)."""
        link = report.get("link") if isinstance(report, dict) else None
        if not isinstance(link, dict) or not {"rtt_ms", "link_mbps"} <= set(link):
            raise ConfigError("not a diagnose report: no link entry with rtt_ms and link_mbps "
                              "(make one with: python -m splitlearn.client diagnose --server URL --json)")
        return cls(link_mbps=float(link["link_mbps"]), rtt_ms=float(link["rtt_ms"]),
                   measured_from=report.get("server"), **kw)

    def __post_init__(self):
        if self.link_mbps is not None and self.link_mbps <= 0:
            raise ConfigError(f"link_mbps must be > 0, got {self.link_mbps}")
        if self.rtt_ms < 0 or self.server_speedup <= 0:
            raise ConfigError("rtt_ms must be >= 0 and server_speedup > 0")
        if self.wire_dtype not in WIRE_DTYPE_NAMES:
            raise ConfigError(f"unknown wire dtype {self.wire_dtype!r}")
        if self.min_client_blocks < 0:
            raise ConfigError("min_client_blocks must be >= 0")


def sweep_cuts(model, config: AnalysisConfig, link: LinkConfig, device) -> dict:
    """Analyse every 2-way cut of ``model`` (already on ``device``): a dict with "points", "u_points"
    (:func:`u_shape_points`) and, given a link, "recommendation"."""
    check_shapes(model.config, config)
    seg = whole(model)
    n = model.config.n_layer
    args = segment_inputs(_Single(seg), config, device)[0]
    S = args[0].shape[1]
    keys = S + (args[1].shape[2] if len(args) > 1 else 0)
    counts = count_segment(seg, args, config.batch_size, S, keys, train=config.mode == "train")
    mods = {name: m for name, (m, parent) in named_submodules(seg).items() if parent == ""}
    prepare, run = make_run(seg, args, config.mode, config.seed)
    t = timing.time_runs(run, mods, device, config.repeats, config.warmup,
                         backward=config.mode == "train", prepare=prepare,
                         max_seconds=config.max_seconds)
    prepare()
    ms = {k: v.median for k, v in t.modules.items()}
    mac = counts.fvcore
    emb, head = ("wte", "wpe", "drop"), ("ln_f", "lm_head")
    tokens = 1 if config.mode == "decode" else config.seq_len
    per_dir = wire_bytes(config.batch_size, tokens, model.config.n_embd)
    points = []
    for c in range(n + 1):
        client = list(emb) + [f"h.{i}" for i in range(c)]
        server = [f"h.{i}" for i in range(c, n)] + list(head)
        bytes_ = {k: v * (2 if config.mode == "train" else 1) for k, v in per_dir.items()}
        if config.mode == "train":  # labels go to the server, which holds the loss
            bytes_ = {k: v + 8 * config.batch_size * tokens for k, v in bytes_.items()}
        p = {"cut": c,
             "client_macs": sum(mac.get(m, 0) for m in client),
             "server_macs": sum(mac.get(m, 0) for m in server),
             "client_ms": sum(ms[m] for m in client), "server_ms": sum(ms[m] for m in server),
             "bytes": bytes_}
        if link.link_mbps is not None:
            p["transfer_ms"] = link.rtt_ms + 8 * bytes_[link.wire_dtype] / (link.link_mbps * 1e3)
            p["step_ms"] = p["client_ms"] + p["server_ms"] / link.server_speedup + p["transfer_ms"]
        points.append(p)
    u_points = u_shape_points(n, mac, ms, per_dir, config.mode, link)
    out = {"mode": config.mode, "link": vars(link), "whole_model_ms": t.total.to_dict(),
           "latency_sum_check": timing.sum_check("", t.total.median, ms,
                                                 max([t.total.spread] + [v.spread for v in t.modules.values()])).to_dict(),
           "mac_mismatches": [vars(m) for m in counts.mismatches], "points": points,
           "u_points": u_points}
    if link.link_mbps is not None:
        out["recommendation"] = recommend(points, link, n)
    return out


def u_shape_points(n: int, mac: dict, ms: dict, per_dir: dict, mode: str, link: LinkConfig) -> list[dict]:
    """Every U-shape pair c1 < c2 (client: embeddings, blocks [0, c1) and [c2, n), ln_f, lm_head;
    server: blocks [c1, c2)): activations cross twice; in train mode gradients cross back twice
    in a second round trip, and no labels travel."""
    emb, head = ("wte", "wpe", "drop"), ("ln_f", "lm_head")
    trips = 2 if mode == "train" else 1
    out = []
    for c1 in range(n + 1):
        for c2 in range(c1 + 1, n + 1):
            client = list(emb) + [f"h.{i}" for i in range(c1)] + [f"h.{i}" for i in range(c2, n)] + list(head)
            server = [f"h.{i}" for i in range(c1, c2)]
            p = {"cuts": [c1, c2],
                 "client_macs": sum(mac.get(m, 0) for m in client),
                 "server_macs": sum(mac.get(m, 0) for m in server),
                 "client_ms": sum(ms[m] for m in client), "server_ms": sum(ms[m] for m in server),
                 "bytes": {k: v * 2 * trips for k, v in per_dir.items()}}
            if link.link_mbps is not None:
                p["transfer_ms"] = (trips * link.rtt_ms
                                    + 8 * p["bytes"][link.wire_dtype] / (link.link_mbps * 1e3))
                p["step_ms"] = p["client_ms"] + p["server_ms"] / link.server_speedup + p["transfer_ms"]
            out.append(p)
    return out


class _Single:
    """A one-segment stand-in for a Partition, for :func:`segment_inputs`."""

    def __init__(self, seg):
        self.segments, self.config = [seg], seg.config

    def __call__(self, ids, caches=None):
        return self.segments[0](ids, cache=caches[0] if caches else None)

    def new_caches(self):
        return [self.segments[0].new_cache()]


TIE = 0.01  # cuts whose step times span less than this fraction tie: timing noise is larger


def recommend(points: list[dict], link: LinkConfig, n_layer: int) -> dict:
    """The allowed cut with the least step time, and a sentence saying why. Where the allowed
    cuts tie (their steps span less than :data:`TIE`), time cannot choose: the sentence says so
    and why, and the fewest client blocks allowed are recommended (the least memory and compute
    on the client; the privacy floor is ``min_client_blocks``, or the sweep's ``--privacy``)."""
    allowed = [p for p in points if link.min_client_blocks <= p["cut"] <= n_layer] or points
    best = min(allowed, key=lambda p: (round(p["step_ms"], 6), p["cut"]))
    worst = max(allowed, key=lambda p: (round(p["step_ms"], 6), p["cut"]))
    spread = (worst["step_ms"] - best["step_ms"]) / best["step_ms"] if best["step_ms"] else 0.0
    share = best["transfer_ms"] / best["step_ms"] if best["step_ms"] else 0.0
    tie = len(allowed) > 1 and spread < TIE
    if tie:
        best = min(allowed, key=lambda p: p["cut"])
        if link.server_speedup == 1:
            why = ("client and server run at the same speed (--server-speedup 1) and every cut sends "
                   "the same bytes, so a cut only moves work from one side to the other")
        elif share > 0.5:
            why = (f"the link dominates ({100 * share:.0f}% of the step) and every cut sends the same "
                   f"bytes")
        else:
            why = ("every cut sends the same bytes and the blocks a cut moves cost about the same on "
                   "either side")
        reason = (f"cut {best['cut']}, by memory: the allowed cuts tie, each {best['step_ms']:.2f} ms per step "
                  f"(they span {100 * spread:.1f}%), because {why}. Time does not choose the cut; privacy and "
                  f"memory do: cut {best['cut']}, the fewest client blocks allowed (--min-client-blocks "
                  f"{link.min_client_blocks}), keeps the least memory and compute on the client; a deeper "
                  f"cut keeps the activations further from the tokens. To choose by measured leakage: "
                  f"--privacy --max-leakage L (the cheapest cut under L); else raise --min-client-blocks")
        decided_by = "client memory: the fewest client blocks the privacy floor allows"
    else:
        if share > 0.5:
            driver = (f"the link dominates ({100 * share:.0f}% of the step) and every cut sends the "
                      f"same bytes, so the cut only moves compute; consider a smaller wire dtype")
        elif link.server_speedup > 1:
            driver = (f"the server is {link.server_speedup:g}x faster, so the fewest blocks the "
                      f"client may keep ({link.min_client_blocks}) minimise the step")
        else:
            driver = ("the client is faster than the server, so the cut that keeps the most work on "
                      "the client minimises the step")
        reason = (f"cut {best['cut']}: {best['step_ms']:.2f} ms per step (client "
                  f"{best['client_ms']:.2f} ms, server {best['server_ms'] / link.server_speedup:.2f} ms, "
                  f"transfer {best['transfer_ms']:.2f} ms of {best['bytes'][link.wire_dtype]} bytes "
                  f"in {link.wire_dtype}); the allowed cuts span {100 * spread:.1f}% "
                  f"(worst: cut {worst['cut']}, {worst['step_ms']:.2f} ms); {driver}")
        decided_by = "step time"
    # every cut sends the same bytes, so the wire dtype is chosen apart from the cut: the best
    # cut's step in each dtype (bfloat16, float16 and int8 trade exactness for bytes)
    fixed = best["step_ms"] - 8 * best["bytes"][link.wire_dtype] / (link.link_mbps * 1e3)
    by_dtype = {dt: fixed + 8 * b / (link.link_mbps * 1e3) for dt, b in best["bytes"].items()}
    fastest = min(by_dtype, key=lambda dt: (round(by_dtype[dt], 6), dt != link.wire_dtype))
    if by_dtype[fastest] < 0.95 * best["step_ms"]:
        reason += (f"; in {fastest} the same cut would take {by_dtype[fastest]:.2f} ms "
                   f"({best['step_ms'] / by_dtype[fastest]:.2f}x faster, lossy: check the drift)")
    return {"cut": best["cut"], "step_ms": best["step_ms"], "reason": reason, "tie": tie,
            "decided_by": decided_by, "wire_dtype_step_ms": by_dtype, "fastest_wire_dtype": fastest}
