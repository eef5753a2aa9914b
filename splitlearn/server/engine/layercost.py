"""The memory model's per-layer counts for families other than GPT-2 (docs/MODELS.md): what one
layer keeps for the backward and needs while it runs, in elements per position, read from the
layer's own shape (:class:`LayerShape`), for :mod:`.budget`'s formulas.

Counted, like GPT-2's (:mod:`.budget`), with ``saved_tensors_hooks`` on one layer of a tiny
random model of transformers 5.24 on the CPU (float32, no dropout, B = 2), every shape tried
fitting exactly (Llama) or within 1% (Gemma 2); q = heads x head_dim, kv = KV heads x head_dim,
I = intermediate_size, n = the layer's norms of width d, K = keys::

    Llama (sdpa, 2 norms, gated MLP)  5d + 4I + 2q + 2kv + a + hd + 2
        padded (a mask reaches sdpa)  + K + hd + 2(q - kv)     (the float mask; repeat_kv's copies)
    Gemma 2 (eager, 4 norms)          9.1d + 4I + 4q + hd + 4 + 2·a·K   (two scores a key: the
                                      softcap's tanh and the softmax)

So a layer keeps (2n + 1)·d for its norms and residuals, 4I for a gated MLP (gate, its
activation, up, their product) and 5I for GPT-2's ungated one, its projections' q, k, v and the
attention's output, the rotary cos and sin (hd at B = 2: they are (1, T, hd), shared by the rows;
priced 2·hd, as at B = 1), and, with eager attention, the scores. The prices below round each
count up (10d for Gemma 2's 9.1d, 2hd for hd) and take the padded case's copies whenever GQA meets
a mask; ``tests/test_server_budget_families.py`` checks them against what autograd keeps and
against the measured peak of a forward and backward.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from torch import nn


@dataclass(frozen=True)
class LayerShape:
    """One layer's sizes as the memory model needs them (a family's config and layer)."""

    q: int  # heads x head_dim: the width of the queries and of the attention's output
    kv: int  # num_key_value_heads x head_dim: the width of the keys (and of the values)
    head_dim: int
    norms: int  # norms of width d in the layer (Llama 2, Gemma 2 4)
    gated: bool  # a gated MLP (gate and up, then down): 4I kept; else GPT-2's 5I

    @classmethod
    def of(cls, segment: nn.Module) -> Optional["LayerShape"]:
        """The shape of ``segment``'s layers, or None for GPT-2 (its own formulas) or no layers."""
        arch = getattr(segment, "arch", None)
        layers = getattr(segment, "layers_list", None)
        if arch is None or arch.family.decode_batching or not layers:  # GPT-2: budget.py's own count
            return None
        kv_heads, hd = arch.kv_heads_and_dim()
        c, layer = segment.config, layers[0]
        d = c.hidden_size
        norms = sum(1 for name, m in layer.named_children()
                    if "norm" in name.lower() and getattr(m, "weight", None) is not None and m.weight.shape[-1] == d)
        names = {n.rsplit(".", 1)[-1] for n, _ in layer.named_modules()}
        gated = bool(names & {"gate_proj", "gate_up_proj"})
        return cls(q=c.num_attention_heads * hd, kv=kv_heads * hd, head_dim=hd, norms=max(norms, 2), gated=gated)


def kept(shape: LayerShape, d: int, inner: int, heads: int, K: int, masked: bool, eager: bool) -> int:
    """Elements one layer keeps per position for the backward (no dropout: these families'
    configs have none by default); ``masked``: a mask tensor reaches the attention."""
    q, kv, hd = shape.q, shape.kv, shape.head_dim
    n = (2 * shape.norms + 2) * d + (4 if shape.gated else 5) * inner + 2 * hd + 4
    if eager:  # repeat_kv's copies, q, the output; the scores twice (the softcap's tanh, the softmax)
        return n + 4 * q + 2 * kv + 2 * heads * K
    n += 2 * q + 2 * kv + heads  # q, k, v, the output; sdpa's log-sum-exp
    if masked:
        n += K + hd + 2 * max(0, q - kv)  # the float mask; GQA's repeated keys and values
    return n


def workspace(shape: LayerShape, d: int, inner: int, heads: int, K: int, masked: bool, eager: bool) -> int:
    """Elements per position one layer needs beyond what it keeps while it runs: a forward's MLP
    temporaries (the gate's or the first projection's output, its activation, up, their product:
    3I alive at once), two of width d, q and the keys and values; the scores and their softmax
    (eager); the mask and its float copy (sdpa with a mask). A backward's temporaries are fewer:
    it frees what the layer kept as it goes (measured at the peak of a forward and backward:
    ~0.8I + 1.1d on Llama, under this)."""
    n = 3 * inner + 2 * d + shape.q + 2 * shape.kv
    if eager:
        n += 2 * heads * K
    elif masked:
        n += 2 * K
    return n
