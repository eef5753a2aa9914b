"""Multiply-accumulates of a segment and of each of its submodules, counted three ways: fvcore
(the number reported), ``torch.utils.flop_counter`` and the analytic formulas (cross-checks),
for any family the adapter (:mod:`splitlearn.model.arch`) knows.

Matrix products only; 1 MAC = 2 FLOPs; training = 3 x forward. On the meta device (shapes, no
weights: a 7B model's table in seconds) fvcore and the formulas count; ``flop_counter`` runs
transformers' data-dependent mask checks, which meta tensors cannot answer, so it is skipped. The formulas, the handlers
added to each counter and their sources: docs/ANALYSIS.md, 'What is measured, and how', and
docs/INTERNALS.md, 'fvcore'."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn
from torch.utils import flop_counter as fc

from ..model.segments import Segment

log = logging.getLogger(__name__)

TOLERANCE = 0.01  # relative mismatch above which a cross-check is reported


class SegmentArgs(tuple):
    """A segment's call arguments ``(x, *kv)`` (see :class:`SegmentRunner`) and ``past``: the
    tokens the KV tensors stand for (a sliding layer's cache holds fewer: its window)."""

    past: int = 0

    def __new__(cls, items, past: int = 0):
        self = super().__new__(cls, items)
        self.past = past
        return self


class SegmentRunner(nn.Module):
    """Calls a segment with a KV cache built *inside* the call and returns the output tensor only,
    so tracers and timers see tensors in and out.

    forward(x, *kv): x is input ids (B, S) or hidden (B, S, d); kv is (k0, v0, k1, v1, ...) of
    shape (B, H_kv, T_l, head_dim), one pair per layer of the segment (T_l: what that layer's
    cache holds), or nothing (no cache). ``past``: the tokens already seen (default: the longest
    T_l)."""

    def __init__(self, seg: Segment, past: Optional[int] = None):
        super().__init__()
        self.seg = seg
        self.past = past

    def forward(self, x: torch.Tensor, *kv: torch.Tensor) -> torch.Tensor:
        if not kv:
            # meta tensors cannot answer transformers' packed-sequence check (a .item() it runs
            # when there is neither a cache nor a mask): an empty cache, the same products
            return self.seg(x, cache=self.seg.new_cache() if x.is_meta else None)
        past = self.past or past_length(self.seg, kv)
        cache = self.seg.new_cache()
        for i, layer in enumerate(range(self.seg.start, self.seg.end)):
            cache.kv.update(kv[2 * i], kv[2 * i + 1], layer)
        cache.length = past  # the positions (rotary) count from here
        return self.seg(x, cache=cache)


def runner(seg: Segment, args: tuple) -> SegmentRunner:
    """The runner of ``seg`` for ``args`` (a :class:`SegmentArgs` carries its past length)."""
    return SegmentRunner(seg, getattr(args, "past", None) or None)


def past_length(seg: Segment, kv: tuple) -> int:
    return max(int(k.shape[2]) for k in kv[::2]) if kv else 0


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
    """MACs per submodule name ("" is the whole segment, "layers.0.self_attn" ...), traced by fvcore."""
    from .._extras import require

    require("analysis", "fvcore", what="counting FLOPs (the analyzer)")
    from fvcore.nn import FlopCountAnalysis

    fa = FlopCountAnalysis(runner(seg, args).eval(), tuple(args))
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
        runner(seg, args)(*args)
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
        out = runner(seg, args)(*args)
        out.backward(torch.ones_like(out))
    seg.zero_grad(set_to_none=True)
    return mode.get_total_flops() // 2


def named_submodules(seg: Segment) -> dict[str, tuple[nn.Module, str]]:
    """name -> (module, parent name), in the segment's own names (the family's, from the
    adapter): the embeddings, rotary, each layer and its parts (its direct children), the final
    norm(s) and the head. Llama: ``embed_tokens, rotary_emb, layers.i, layers.i.{self_attn, mlp,
    input_layernorm, post_attention_layernorm}, norm, lm_head``; GPT-2 keeps the names of its
    ``GPT2LMHeadModel`` (docs/ANALYSIS.md)."""
    arch = seg.arch
    out = {}
    if seg.has_embeddings:
        for n in arch.embed_names:
            if getattr(seg, n, None) is not None:  # OPT's project_in is None at equal widths
                out[n] = (getattr(seg, n), "")
    if getattr(seg, "rotary_emb", None) is not None:
        out["rotary_emb"] = (seg.rotary_emb, "")
    for i, layer in enumerate(seg.layers_list):
        name = f"{arch.layers_name}.{i}"
        out[name] = (layer, "")
        for part, mod in layer.named_children():
            out[f"{name}.{part}"] = (mod, name)
    if seg.has_head:
        for n in arch.norm_names:
            if getattr(seg, n, None) is not None:
                out[n] = (getattr(seg, n), "")
        out[arch.head_name] = (seg.head_module, "")
    return out


def linear_macs_per_token(module: nn.Module) -> int:
    """Multiply-adds per token of every linear layer in ``module`` (``nn.Linear`` and GPT-2's
    ``Conv1D``: in x out each, the weight's size)."""
    from transformers.pytorch_utils import Conv1D

    return sum(m.weight.numel() for m in module.modules() if isinstance(m, (nn.Linear, Conv1D)))


def is_attention(module: nn.Module) -> bool:
    """The layer's attention module (every family's class is named ``...Attention``)."""
    return "Attention" in type(module).__name__


def attended_keys(seg: Segment, layer: int, new_tokens: int, keys: int) -> int:
    """Keys each new token's scores are computed against in ``layer``: every key (past + new) in
    prefill and in a full layer; a sliding layer's cache returns at most ``window - 1`` past ones."""
    past = keys - new_tokens
    window = getattr(seg.config, "sliding_window", None)
    if seg.arch.layer_types[layer] == "sliding_attention" and window and past:
        past = min(past, window - 1)
    return past + new_tokens


def analytic_macs(seg: Segment, batch: int, new_tokens: int, keys: int) -> dict[str, int]:
    """The module docstring's formulas for every submodule of ``seg`` (forward only), from its
    shapes: each linear layer in x out per token; attention ``B·H·S·T_l·(head_dim + head_dim)``
    (QKᵀ and AV) with ``T_l`` the keys the layer attends to (:func:`attended_keys`)."""
    b, s = batch, new_tokens
    heads = seg.config.num_attention_heads
    head_dim = seg.arch.kv_heads_and_dim()[1]
    subs = named_submodules(seg)
    layers = {f"{seg.arch.layers_name}.{i}": seg.start + i for i in range(len(seg.layers_list))}
    out = {}
    for name, (mod, parent) in subs.items():
        if parent:  # a part of a layer
            out[name] = b * s * linear_macs_per_token(mod)
            if is_attention(mod):
                out[name] += b * heads * s * attended_keys(seg, layers[parent], s, keys) * 2 * head_dim
    for name, (mod, parent) in subs.items():
        if not parent:
            out[name] = (sum(out[k] for k, (_, p) in subs.items() if p == name) if name in layers
                         else b * s * linear_macs_per_token(mod))
    out[""] = sum(out[k] for k, (_, p) in subs.items() if not p)
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
    ref: dict[str, int] = {}
    if args[0].device.type != "meta":  # see the module docstring
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
