"""Multiply-accumulates of a segment and of each of its submodules, counted three ways: fvcore
(the number reported), ``torch.utils.flop_counter`` and the analytic formulas (cross-checks).

Matrix products only; 1 MAC = 2 FLOPs; training = 3 x forward. The formulas, the handlers
added to each counter and their sources: docs/ANALYSIS.md, 'What is measured, and how', and
docs/INTERNALS.md, 'fvcore'."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
import torch
from torch import nn
from torch.utils import flop_counter as fc

from ..model.segments import Segment

log = logging.getLogger(__name__)

TOLERANCE = 0.01  # relative mismatch above which a cross-check is reported


class SegmentRunner(nn.Module):
    """Calls a segment with a KV cache built *inside* the call and returns the output tensor only,
    so tracers and timers see tensors in and out.

    forward(x, *kv): x is input ids (B, S) or hidden (B, S, d); kv is (k0, v0, k1, v1, ...) of
    shape (B, H, T, d/H), one pair per block of the segment, or nothing (no cache)."""

    def __init__(self, seg: Segment):
        super().__init__()
        self.seg = seg

    def forward(self, x: torch.Tensor, *kv: torch.Tensor) -> torch.Tensor:
        if not kv:
            return self.seg(x)
        cache = self.seg.new_cache()
        for i, layer in enumerate(range(self.seg.start, self.seg.end)):
            cache.kv.update(kv[2 * i], kv[2 * i + 1], layer)
        cache.length = past_length(self.seg, kv)
        return self.seg(x, cache=cache)


def past_length(seg: Segment, kv: tuple) -> int:
    return int(kv[0].shape[2]) if kv else 0


def _sdpa_macs_jit(inputs, outputs) -> int:
    """fvcore handler: q (B, H, S, e), k (B, H, T, e), v (B, H, T, ev) -> B·H·S·T·(e + ev)."""
    q, k, v = (i.type().sizes() for i in inputs[:3])
    b, h, s, e = q
    t, ev = k[-2], v[-1]
    return b * h * s * t * (e + ev)  # QKᵀ + AV


NORM_OPS = ("aten::layer_norm", "aten::group_norm", "aten::batch_norm", "aten::instance_norm")


def _zero(inputs, outputs) -> int:
    return 0


def fvcore_macs(seg: Segment, args: tuple) -> dict[str, int]:
    """MACs per submodule name ("" is the whole segment, "h.0.attn" ...), traced by fvcore."""
    from .._extras import require

    require("analysis", "fvcore", what="counting FLOPs (the analyzer)")
    from fvcore.nn import FlopCountAnalysis

    runner = SegmentRunner(seg).eval()
    fa = FlopCountAnalysis(runner, args)
    fa.set_op_handle("aten::scaled_dot_product_attention", _sdpa_macs_jit)
    for op in NORM_OPS:  # elementwise, see the module docstring (a None handle would not do it)
        fa.set_op_handle(op, _zero)
    fa.unsupported_ops_warnings(False)
    fa.uncalled_modules_warnings(False)
    fa.tracer_warnings("none")
    with torch.no_grad():
        by_module = fa.by_module()
    return {_strip(name, "seg"): int(v) for name, v in by_module.items() if name.startswith("seg")}


def _strip(name: str, root: str) -> str:
    return "" if name == root else name.removeprefix(root + ".")


def _cpu_sdpa(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return fc.sdpa_flop_count(query_shape, key_shape, value_shape)


def _cpu_sdpa_backward(grad_out_shape, query_shape, key_shape, value_shape, *args,
                       out_shape=None, **kwargs) -> int:
    return fc.sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


def _custom_mapping() -> dict:
    aten = torch.ops.aten
    mapping = {}
    if hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu"):
        mapping[aten._scaled_dot_product_flash_attention_for_cpu] = _cpu_sdpa
    if hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward"):
        mapping[aten._scaled_dot_product_flash_attention_for_cpu_backward] = _cpu_sdpa_backward
    return mapping


def flop_counter_macs(seg: Segment, args: tuple) -> dict[str, int]:
    """Forward MACs per submodule name from ``FlopCounterMode`` (its FLOPs / 2)."""
    mode = fc.FlopCounterMode(display=False, depth=None, custom_mapping=_custom_mapping())
    with mode, torch.no_grad():
        SegmentRunner(seg)(*args)
    counts = {}
    for name, ops in mode.get_flop_counts().items():
        if name == "SegmentRunner.seg" or name.startswith("SegmentRunner.seg."):
            counts[_strip(name.removeprefix("SegmentRunner."), "seg")] = sum(ops.values()) // 2
    counts.setdefault("", mode.get_total_flops() // 2)
    return counts


def flop_counter_train_macs(seg: Segment, args: tuple) -> int:
    """MACs of a real forward + backward of ``seg`` (all parameters trainable, the output's gradient
    all ones), from ``FlopCounterMode``: the total only."""
    mode = fc.FlopCounterMode(display=False, custom_mapping=_custom_mapping())
    with mode, torch.enable_grad():
        out = SegmentRunner(seg)(*args)
        out.backward(torch.ones_like(out))
    seg.zero_grad(set_to_none=True)
    return mode.get_total_flops() // 2


def analytic_macs(seg: Segment, batch: int, new_tokens: int, keys: int) -> dict[str, int]:
    """The module docstring's formulas for every submodule of ``seg`` (forward only)."""
    cfg = seg.config
    b, s, t, d = batch, new_tokens, keys, cfg.n_embd
    f = cfg.n_inner or 4 * d
    attn = 4 * b * s * d * d + 2 * b * s * t * d
    mlp = 2 * b * s * d * f
    out = {}
    for i in range(len(seg.h)):
        out[f"h.{i}.attn"], out[f"h.{i}.mlp"] = attn, mlp
        out[f"h.{i}"] = attn + mlp
    if seg.has_embeddings:
        out["wte"] = out["wpe"] = 0
    if seg.has_head:
        out["ln_f"] = 0
        out["lm_head"] = b * s * d * cfg.vocab_size
    out[""] = sum(v for k, v in out.items() if k.count(".") <= 1 and not k.endswith(("attn", "mlp")))
    return out


@dataclass
class Mismatch:
    """A submodule whose counters disagree by more than :data:`TOLERANCE`."""

    module: str        # submodule name within the segment ("" = the segment)
    reference: str     # "flop_counter" or "analytic"
    fvcore: int        # MACs
    other: int         # MACs
    relative: float    # |fvcore - other| / max(other, 1)


@dataclass
class Counts:
    """MACs of one segment: fvcore's (reported), the two cross-checks, and any mismatch."""

    fvcore: dict[str, int]
    flop_counter: dict[str, int]
    analytic: dict[str, int]
    mismatches: list[Mismatch] = field(default_factory=list)


def count_segment(seg: Segment, args: tuple, batch: int, new_tokens: int, keys: int,
                  train: bool = False) -> Counts:
    """Count ``seg`` run on ``args`` (see :class:`SegmentRunner`) all three ways; with ``train``
    forward + backward. Mismatches above 1% are logged and returned."""
    mult = 3 if train else 1
    fv = {k: v * mult for k, v in fvcore_macs(seg, args).items()}
    ref = {k: v * mult for k, v in flop_counter_macs(seg, args).items()}
    if train:
        ref[""] = flop_counter_train_macs(seg, args)
    ana = {k: v * mult for k, v in analytic_macs(seg, batch, new_tokens, keys).items()}
    mismatches = []
    for ref_name, other in (("flop_counter", ref), ("analytic", ana)):
        for name, expected in other.items():
            got = fv.get(name, 0)
            rel = abs(got - expected) / max(expected, 1)
            if rel > TOLERANCE:
                mismatches.append(Mismatch(name, ref_name, got, expected, rel))
                log.warning("MAC mismatch in %s %r: fvcore %d vs %s %d (%.1f%%)", seg.kind,
                            name or "(segment)", got, ref_name, expected, 100 * rel)
    return Counts(fv, ref, ana, mismatches)
