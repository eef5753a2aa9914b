"""The layers a masked-offload server computes, named the same on both sides, and their wire.

Every linear layer of every layer of the model and its LM head, as the architecture adapter names
them (``splitlearn.model.arch.Arch.linear_paths``: every ``nn.Linear`` or transformers ``Conv1D``
inside a layer, in module order). The server holds only ``Wq`` of ``W`` in (in, out) layout:
``Conv1D.weight`` as it is, ``nn.Linear.weight`` (out, in) transposed; the client adds the biases::

    Llama, Gemma 2 (7 per layer)
    layers.{i}.self_attn.q_proj  (d -> H hd)       layers.{i}.mlp.gate_proj  (d -> f)
    layers.{i}.self_attn.k_proj  (d -> KV hd)      layers.{i}.mlp.up_proj    (d -> f)
    layers.{i}.self_attn.v_proj  (d -> KV hd)      layers.{i}.mlp.down_proj  (f -> d)
    layers.{i}.self_attn.o_proj  (H hd -> d)       lm_head                   (d -> V)

GPT-2 (its names are the adapter's): 4 ``Conv1D`` per layer (the fused QKV, d -> 3d; the attention
output, d -> d; the MLP's d -> 4d and 4d -> d) and the LM head, ``W`` = the tied embedding^T.

Wire (``POST /v1/offload/linear``, one safetensors body, :mod:`splitlearn.api.wire`)::

    request   __metadata__ {"layers": "layers.0.mlp.gate_proj,layers.0.mlp.up_proj", "scheme": "masked"}
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
from transformers.pytorch_utils import Conv1D

from .field import Limits, limits_for, quantise_weight

HEAD = "lm_head"  # the LM head's name (every family's: splitlearn.model.arch.Family.head)
MAX_PRODUCTS = 8  # products in one request
SCHEMES = ("masked", "plain")


def in_out(module: nn.Module) -> tuple[torch.Tensor, "torch.Tensor | None"]:
    """``(W (in, out), bias (out,) or None)`` of an ``nn.Linear`` (its (out, in) weight, transposed:
    a view) or a ``Conv1D`` (already (in, out))."""
    if isinstance(module, Conv1D):
        return module.weight, module.bias
    if isinstance(module, nn.Linear):
        return module.weight.t(), module.bias
    raise TypeError(f"{type(module).__name__} is not a linear layer (nn.Linear or Conv1D)")


def linear_weights(modules: dict[str, nn.Module]) -> dict[str, tuple[torch.Tensor, "torch.Tensor | None"]]:
    """``name -> (W (in, out), bias (out,) or None)`` of every offloaded layer (views, no copies);
    ``modules``: ``name -> module``, as ``Arch.linear_paths`` names them."""
    return {name: in_out(m) for name, m in modules.items()}


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
    """``name -> QuantisedLayer`` for every offloaded layer (``modules``: ``name -> nn.Linear |
    Conv1D``, in the adapter's order), and their digest."""

    def __init__(self, modules: dict[str, nn.Module]):
        super().__init__()
        for name, (w, _) in linear_weights(modules).items():
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
