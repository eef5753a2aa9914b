"""Per-client LoRA on a split model class: peft's adapters on the client's blocks, the server's
adapter for this client id trained by the same optimizer steps.

    model = SplitGPT2LMHeadModel.from_pretrained("gpt2", server=URL, client_id="alice",
                                                 lora=peft.LoraConfig(r=8, lora_alpha=16,
                                                                      target_modules=["c_attn"],
                                                                      fan_in_fan_out=True))
    opt = torch.optim.AdamW(p for p in model.parameters() if p.requires_grad)

A server started with ``--lora-r`` keeps its segment frozen and trains one adapter per client
id (``splitlearn/server/adapters.py``): the forward and backward of the model's open-ended
steps (``splitlearn/hf/remote.py``) run with this client's adapter, and ``POST
/v1/train/apply`` steps it at the client's learning rate. Here, :func:`apply_lora` puts
peft's LoRA layers on the client's own blocks (``peft.inject_adapter_in_model``), freezes every
other client weight, and initialises every adapter as the server and ``SplitClient(lora=...)``
do (:func:`splitlearn.lora.init_adapter_pair`, seeded by the seed, the client id and the
module's Hugging Face name), so the split model trains exactly as single-process peft with
that initialisation (tests/test_hf_lora.py). The server must agree: same r, alpha and targets,
or ``lora="server"`` to take its options; a model without LoRA is refused by a LoRA server, and
the reverse.
"""
from __future__ import annotations

import logging

import torch

from .._extras import require

from ..errors import ConfigError
from ..lora import LoraSpec, as_spec, check_server, inject_adapters, target_modules

log = logging.getLogger(__name__)


def resolve_spec(info: dict, lora):
    """The :class:`LoraSpec` for ``lora`` (a ``peft.LoraConfig``, a ``LoraSpec``, ``"server"`` or
    None) checked against the server's ``/v1/info``; None for no LoRA."""
    if lora == "server":
        if info.get("lora") is None:
            raise ConfigError("lora=\"server\": the server trains its whole segment (started without --lora-r)")
        lora = LoraSpec.from_dict(info["lora"])
    spec = None if lora is None else as_spec(lora)
    check_server(info, spec)
    return spec


def apply_lora(model, lora, *, seed: int = 0) -> list[torch.nn.Parameter]:
    """Put LoRA adapters on ``model``'s client blocks in place (see the module docstring) and
    return them; every other client parameter is frozen but a classification head (``score``)
    and the remote segment's gradient-norm proxy (the global clip). ``model``: a split model
    class instance."""
    remote = model.transformer.remote
    spec = resolve_spec(remote.info, lora)
    if spec is None:
        return []
    if getattr(model, "lora_spec", None) is not None:
        raise ConfigError("this split model has LoRA adapters already")
    require("lora", "peft", what="LoRA")
    if remote.info.get("federation", "shared") != "shared":
        raise ConfigError(f"the model classes train in the shared federation mode; this server runs "
                          f"{remote.info.get('federation')!r}: use SplitClient(..., lora=...) there")
    head = getattr(model, "score", None)  # a classification head is new: it trains (peft's modules_to_save)
    keep = {id(remote.grad_proxy)} | {id(p) for p in (head.parameters() if head is not None else ())}
    for p in model.parameters():
        if id(p) not in keep:
            p.requires_grad_(False)
    params = []
    for a, b in model.transformer.client_blocks:
        for i in range(a, b):
            block = model.transformer.h[i]
            mods = target_modules(block, spec)
            if not mods:
                continue
            params += inject_adapters(block, spec, mods, seed, remote.client_id,
                                      lambda local, i=i: f"transformer.h.{i}.{local}")
    model.lora_spec = spec
    log.info("client %s: LoRA %s, %d adapter parameters", remote.client_id, spec.to_dict(),
             sum(p.numel() for p in params))
    return params
