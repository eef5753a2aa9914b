"""The layers a masked-offload server computes, named the same on both sides, and their wire.

Every linear layer of a GPT-2 (``W`` of shape (in, out); the server holds only ``Wq``, the
client adds the biases)::

    h.{i}.attn.c_attn   (d -> 3d)      h.{i}.mlp.c_fc      (d -> 4d)
    h.{i}.attn.c_proj   (d -> d)       h.{i}.mlp.c_proj    (4d -> d)
    lm_head             (d -> V)       W = wte^T, no bias

Wire (``POST /v1/offload/linear``, one safetensors body, :mod:`splitlearn.api.wire`)::

    request   __metadata__ {"layers": "h.0.mlp.c_fc,h.1.mlp.c_fc", "scheme": "masked"}
              x.0  I32 [2, n0, in0]   masked input of the first layer, one slice per prime
              x.1  I32 [2, n1, in1]   ...                               (at most MAX_PRODUCTS)
    answer    y.0  I32 [2, n0, out0]  Zi = Xi~ Wq mod pi, per prime
              y.1  ...
    scheme "plain" (a server started with --offload-plain; the benchmark's unmasked baseline):
              x.k  F32 [n, in] -> y.k F32 [n, out] = x W (no bias)"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from torch import nn
from transformers import GPT2LMHeadModel

from .field import Limits, limits_for, quantise_weight

BLOCK_LINEARS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
HEAD = "lm_head"
MAX_PRODUCTS = 8  # products in one request
SCHEMES = ("masked", "plain")


def layer_names(n_layer: int) -> list[str]:
    return [f"h.{i}.{name}" for i in range(n_layer) for name in BLOCK_LINEARS] + [HEAD]


def linear_weights(model: GPT2LMHeadModel) -> dict[str, tuple[torch.Tensor, "torch.Tensor | None"]]:
    """``name -> (W (in, out), bias (out,) or None)`` of every offloaded layer (views, no copies)."""
    out = {}
    for i, block in enumerate(model.transformer.h):
        for name in BLOCK_LINEARS:
            conv = block.get_submodule(name)
            out[f"h.{i}.{name}"] = (conv.weight, conv.bias)
    head = model.lm_head
    out[HEAD] = (head.weight.t(), head.bias if isinstance(head, nn.Linear) else None)
    return out


@dataclass
class QuantisedLayer:
    name: str
    limits: Limits
    wq: torch.Tensor  # float64 (in, out), integers in [-wmax, wmax]
    sw: torch.Tensor  # float64 (out,), W ~ Wq * sw

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.wq.shape)


class QuantisedLayers(dict):
    """``name -> QuantisedLayer`` for every offloaded layer of ``model``, and their digest."""

    def __init__(self, model: GPT2LMHeadModel):
        super().__init__()
        for name, (w, _) in linear_weights(model).items():
            lim = limits_for(w.shape[0])
            wq, sw = quantise_weight(w, lim.wmax)
            self[name] = QuantisedLayer(name, lim, wq, sw)

    def digest(self) -> str:
        """sha256 over the layers' names, shapes and ``Wq`` (as int32), in layer order."""
        h = hashlib.sha256()
        for name, layer in self.items():
            h.update(f"{name}:{list(layer.shape)}:{layer.limits.wmax};".encode())
            h.update(layer.wq.to(torch.int32).numpy().tobytes())
        return h.hexdigest()
