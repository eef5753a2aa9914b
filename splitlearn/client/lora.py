"""LoRA on the client's own segments (peft), and exporting both sides' adapters as one peft adapter.

``SplitClient(url, model, lora=peft.LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn"],
fan_in_fan_out=True))`` puts peft's LoRA layers on the client's bottom (and top), freezes
everything else, and gives the client's optimizer the adapters alone; the server (started
with the same ``--lora-*`` options) trains its own adapter for this client id. Adapters start
from :func:`splitlearn.lora.init_adapter_pair` (seeded by the seed, the client id and the
module's Hugging Face name; in ``sequential`` and ``splitfed`` every client starts from the same
one), so a single-process peft model given the same init trains to the same weights.

:func:`export_adapter` writes a standard peft adapter directory for the whole model::

    adapter_config.json          peft.LoraConfig (fan_in_fan_out, targets, r, alpha, dropout)
    adapter_model.safetensors    base_model.model.transformer.h.<i>.<module>.lora_{A,B}.weight

holding the client's adapters and the server's (``GET /v1/clients/<id>/adapter``), so
``PeftModel.from_pretrained(GPT2LMHeadModel.from_pretrained(base), dir)`` is the split model.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional, Sequence, Union

import torch
from safetensors.torch import save_file

from .. import protocol as P
from ..checkpoint import make_optimizer
from ..errors import ConfigError
from ..lora import ADAPTER, PREFIX, LoraSpec, as_spec, check_server, hf_module_name, inject_adapters, target_modules
from ..segments import Segment
from ..wire import decode

log = logging.getLogger(__name__)







def apply_lora(segments: Sequence[Segment], spec: LoraSpec, seed: int, init_id: str) -> list[torch.nn.Parameter]:
    """Put peft's LoRA layers on ``segments`` in place; return the adapter parameters.

    Every other parameter is frozen. A segment without a target module (a bottom of the
    embeddings alone) is left as it is.
    """
    from .._extras import require

    require("lora", "peft", what="LoRA")
    params = []
    for seg in segments:
        mods = target_modules(seg, spec)
        for p in seg.parameters():
            p.requires_grad_(False)
        if not mods:
            continue
        params += inject_adapters(seg, spec, mods, seed, init_id, lambda local: hf_module_name(seg, local))
    return params




def _pairs(segments: Sequence[Segment]):
    for seg in segments:
        for name, m in seg.named_modules():
            if hasattr(m, "lora_A") and ADAPTER in getattr(m, "lora_A", {}):
                yield PREFIX + hf_module_name(seg, name), m


def client_adapter_tensors(segments: Sequence[Segment]) -> dict[str, torch.Tensor]:
    """The client's adapters under peft's saved names (what a sync and an export carry)."""
    out = {}
    for name, m in _pairs(segments):
        out[f"{name}.lora_A.weight"] = m.lora_A[ADAPTER].weight.detach().cpu().contiguous()
        out[f"{name}.lora_B.weight"] = m.lora_B[ADAPTER].weight.detach().cpu().contiguous()
    return out


def load_client_adapters(segments: Sequence[Segment], tensors: dict[str, torch.Tensor]) -> None:
    """Copy adapters named as :func:`client_adapter_tensors` names them into the segments."""
    with torch.no_grad():
        for name, m in _pairs(segments):
            for part in ("lora_A", "lora_B"):
                w = getattr(m, part)[ADAPTER].weight
                w.copy_(tensors[f"{name}.{part}.weight"].to(w.dtype))


def fetch_server_adapter(transport, client_id: str) -> dict[str, torch.Tensor]:
    """``GET /v1/clients/<id>/adapter``: the server side's adapter (peft names)."""
    tensors, _ = decode(transport.get_bytes(P.CLIENT_ADAPTER.format(client_id=client_id)))
    return tensors


def export_adapter(directory: Union[str, Path], spec: LoraSpec, client: dict[str, torch.Tensor],
                   server: dict[str, torch.Tensor], base_model: Optional[str] = None) -> Path:
    """Write ``client`` + ``server`` adapters as one peft adapter directory for the whole model."""
    overlap = set(client) & set(server)
    if overlap:
        raise ConfigError(f"client and server both hold adapters for {sorted(overlap)[:3]}")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    save_file({**client, **server}, str(d / "adapter_model.safetensors"), metadata={"format": "pt"})
    spec.to_peft(base_model).save_pretrained(str(d))
    log.info("exported %d adapter tensors (%d client, %d server) to %s", len(client) + len(server),
             len(client), len(server), d)
    return d


def setup(client, lora, seed: int) -> Optional[LoraSpec]:
    """Called once by ``SplitClient.__init__``: check the server agrees, put the adapters on,
    and give the client's optimizer (same rule and settings) the adapters alone."""
    if lora == "server":  # the server's own options (the CLI's --lora)
        if client.info.get("lora") is None:
            raise ConfigError("--lora: the server trains its whole segment (started without --lora-r)")
        lora = LoraSpec.from_dict(client.info["lora"])
    spec = None if lora is None else as_spec(lora)
    check_server(client.info, spec)
    if spec is None:
        return None
    init_id = client.client_id if client.federation.mode == "shared" else ""  # fed: one common start
    params = apply_lora(client.segments, spec, seed, init_id)
    old = client.optimizer
    name = "adamw" if isinstance(old, torch.optim.AdamW) else "sgd"
    client.optimizer = make_optimizer(params, name, old.defaults["lr"], old.defaults["weight_decay"])
    client.federation.load_weights = lambda tensors: load_client_adapters(client.segments, tensors)
    log.info("client %s: LoRA %s, %d adapter parameters", client.client_id, spec.to_dict(),
             sum(p.numel() for p in params))
    return spec
