"""Every cut point at once, and which one to use, for any family the adapter knows.

The whole model is counted and timed once (a hook per layer); each 2-way cut's sides are sums
of the parts they hold: the client the embeddings and layers ``[0, c)``, the server the rest,
the final norm and the head; each side with a layer recomputes rotary (a family that has it).
On the meta device (shapes, no weights) the sweep counts and nothing is timed: no ``*_ms``, no
recommendation. Given a link::

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
from .core import AnalysisConfig, check_shapes, keys_of, make_run, segment_inputs
from .counting import count_segment, named_submodules
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
    n = seg.arch.n_layers
    args = segment_inputs(_Single(seg), config, device)[0]
    S = args[0].shape[1]
    counts = count_segment(seg, args, config.batch_size, S, keys_of(args), train=config.mode == "train")
    mods = {name: m for name, (m, parent) in named_submodules(seg).items() if parent == ""}
    timed = device.type != "meta"
    t = ms = None
    if timed:
        prepare, run = make_run(seg, args, config.mode, config.seed)
        t = timing.time_runs(run, mods, device, config.repeats, config.warmup,
                             backward=config.mode == "train", prepare=prepare,
                             max_seconds=config.max_seconds)
        prepare()
        ms = {k: v.median for k, v in t.modules.items()}
    mac = counts.fvcore
    groups = side_groups(seg)
    tokens = 1 if config.mode == "decode" else config.seq_len
    per_dir = wire_bytes(config.batch_size, tokens, model.config.hidden_size)
    points = []
    for c in range(n + 1):
        client, server = groups.two_way(c)
        bytes_ = {k: v * (2 if config.mode == "train" else 1) for k, v in per_dir.items()}
        if config.mode == "train":  # labels go to the server, which holds the loss
            bytes_ = {k: v + 8 * config.batch_size * tokens for k, v in bytes_.items()}
        p = {"cut": c,
             "client_macs": sum(mac.get(m, 0) for m in client),
             "server_macs": sum(mac.get(m, 0) for m in server),
             **({"client_ms": sum(ms[m] for m in client), "server_ms": sum(ms[m] for m in server)} if timed else {}),
             "bytes": bytes_}
        if link.link_mbps is not None and timed:
            p["transfer_ms"] = link.rtt_ms + 8 * bytes_[link.wire_dtype] / (link.link_mbps * 1e3)
            p["step_ms"] = p["client_ms"] + p["server_ms"] / link.server_speedup + p["transfer_ms"]
        points.append(p)
    u_points = u_shape_points(n, mac, ms, per_dir, config.mode, link, groups)
    out = {"mode": config.mode, "link": vars(link), "whole_model_ms": t.total.to_dict() if timed else None,
           "latency_sum_check": timing.sum_check("", t.total.median, ms,
                                                 max([t.total.spread] + [v.spread for v in t.modules.values()])).to_dict()
           if timed else None,
           "mac_mismatches": [vars(m) for m in counts.mismatches], "points": points,
           "u_points": u_points}
    if link.link_mbps is not None and timed:
        out["recommendation"] = recommend(points, link, n)
    return out


class SideGroups:
    """The rows (:func:`~.counting.named_submodules` names, top level) each side of a cut holds:
    ``embed`` (the embeddings), ``layers[i]``, ``head`` (final norm(s) and the head) and
    ``shared`` (rotary: every side with a layer computes it)."""

    def __init__(self, embed: list, layers: list, head: list, shared: list):
        self.embed, self.layers, self.head, self.shared = embed, layers, head, shared

    def _side(self, before: list, layers, after: list) -> list:
        layers = list(layers)
        return before + [self.layers[i] for i in layers] + after + (self.shared if layers else [])

    def two_way(self, c: int) -> tuple[list, list]:
        """(client, server) of cut ``c``: embeddings + layers [0, c) | layers [c, n) + head."""
        n = len(self.layers)
        return self._side(self.embed, range(c), []), self._side([], range(c, n), self.head)

    def u_shape(self, c1: int, c2: int) -> tuple[list, list]:
        """(client, server) of cuts ``c1 < c2``: embeddings, layers [0, c1) and [c2, n), head |
        layers [c1, c2)."""
        n = len(self.layers)
        return (self._side(self.embed, [*range(c1), *range(c2, n)], self.head),
                self._side([], range(c1, c2), []))


def side_groups(seg) -> SideGroups:
    """:class:`SideGroups` of a whole-model segment."""
    layer_names = [f"{seg.arch.layers_name}.{i}" for i in range(len(seg.layers_list))]
    top = [name for name, (_, parent) in named_submodules(seg).items() if not parent]
    embed = [m for m in top if m in seg.arch.embed_names]
    head = [m for m in top if m in seg.arch.norm_names or m == seg.arch.head_name]
    shared = [m for m in top if m not in embed + head + layer_names]
    return SideGroups(embed, layer_names, head, shared)


def u_shape_points(n: int, mac: dict, ms: Optional[dict], per_dir: dict, mode: str, link: LinkConfig,
                   groups: SideGroups) -> list[dict]:
    """Every U-shape pair c1 < c2 (client: embeddings, layers [0, c1) and [c2, n), the final
    norm and the head; server: layers [c1, c2)): activations cross twice; in train mode gradients
    cross back twice in a second round trip, and no labels travel. ``ms`` None: not timed."""
    trips = 2 if mode == "train" else 1
    out = []
    for c1 in range(n + 1):
        for c2 in range(c1 + 1, n + 1):
            client, server = groups.u_shape(c1, c2)
            p = {"cuts": [c1, c2],
                 "client_macs": sum(mac.get(m, 0) for m in client),
                 "server_macs": sum(mac.get(m, 0) for m in server),
                 **({"client_ms": sum(ms[m] for m in client), "server_ms": sum(ms[m] for m in server)}
                    if ms is not None else {}),
                 "bytes": {k: v * 2 * trips for k, v in per_dir.items()}}
            if link.link_mbps is not None and ms is not None:
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


def recommend(points: list[dict], link: LinkConfig, n_layers: int) -> dict:
    """The allowed cut with the least step time, and a sentence saying why. Where the allowed
    cuts tie (their steps span less than :data:`TIE`), time cannot choose: the sentence says so
    and why, and the fewest client blocks allowed are recommended (the least memory and compute
    on the client; the privacy floor is ``min_client_blocks``, or the sweep's ``--privacy``)."""
    allowed = [p for p in points if link.min_client_blocks <= p["cut"] <= n_layers] or points
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
