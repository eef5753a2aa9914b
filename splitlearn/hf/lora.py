"""Per-client LoRA on a split model class: peft's adapters on the client's blocks, the server's
adapter for this client id trained by the same optimizer steps.

    model = AutoSplitModelForCausalLM.from_pretrained(llama_dir, server=URL, client_id="alice",
                                                      lora=peft.LoraConfig(r=8, lora_alpha=16,
                                                                           target_modules=["q_proj", "v_proj"]))
    opt = torch.optim.AdamW(p for p in model.parameters() if p.requires_grad)

(the split GPT-2 classes take the same ``lora=``, on GPT-2's ``Conv1D`` names with
``fan_in_fan_out=True``: docs/LORA.md).

A server started with ``--lora-r`` keeps its segment frozen and trains one adapter per client
id (``splitlearn/server/engine/adapters.py``): the forward and backward of the model's open-ended
steps (``splitlearn/hf/remote.py``) run with this client's adapter, and ``POST
/v1/train/apply`` steps it at the client's learning rate. Here, :func:`apply_lora` puts
peft's LoRA layers on the client's own blocks (``peft.inject_adapter_in_model``), freezes every
other client weight, and initialises every adapter as the server and ``SplitClient(lora=...)``
do (:func:`splitlearn.model.lora.init_adapter_pair`, seeded by the seed, the client id and the
module's Hugging Face name), so the split model trains exactly as single-process peft with
that initialisation (tests/test_hf_lora.py). The server must agree: same r, alpha and targets,
or ``lora="server"`` to take its options; a model without LoRA is refused by a LoRA server, and
the reverse. Under ``sequential`` and ``splitfed`` every member starts from the same adapters
(the client id is left out of the seed) and a sync shares the adapters alone
(:func:`adapter_tensors`, SplitLoRA).
"""
from __future__ import annotations

import logging

import torch

from .._extras import require

from ..errors import ConfigError
from ..model.arch import arch_of
from ..model.lora import ADAPTER, PREFIX, LoraSpec, as_spec, check_server, inject_adapters, target_modules

log = logging.getLogger(__name__)


def resolve_spec(info: dict, lora, config=None):
    """The :class:`LoraSpec` for ``lora`` (a ``peft.LoraConfig``, a ``LoraSpec``, ``"server"`` or
    None) checked against the server's ``/v1/info``; None for no LoRA. With the model's ``config``,
    no targets (``target_modules=None``, as peft) means the family's default."""
    if lora == "server":
        if info.get("lora") is None:
            raise ConfigError("lora=\"server\": the server trains its whole segment (started without --lora-r)")
        lora = LoraSpec.from_dict(info["lora"])
    spec = None if lora is None else as_spec(lora, config)
    check_server(info, spec)
    return spec


def _remote(model):
    """The split model's :class:`~.remote.RemoteSegment` (its base model's), through a peft wrapper."""
    base = getattr(model, "base_model", None)
    inner = base.model if base is not None and hasattr(base, "model") else model
    return arch_of(inner.config).base_of(inner).remote


def client_layers(model) -> list[tuple[int, torch.nn.Module]]:
    """(global index, layer) of the layers the client holds: all but the server's, ``[c1, c2)``
    (U-shape) or ``[c, n)`` (2-way), whose places hold parameterless placeholders."""
    arch = arch_of(model.config)
    base = arch.base_of(model)
    cuts = tuple(base.remote.cuts)
    c1, c2 = cuts if len(cuts) == 2 else (cuts[0], arch.n_layers)
    layers = getattr(base, arch.layers_name)
    return [(i, layers[i]) for i in range(arch.n_layers) if not c1 <= i < c2]


def apply_lora(model, lora, *, seed: int = 0) -> list[torch.nn.Parameter]:
    """Put LoRA adapters on ``model``'s client blocks in place (see the module docstring) and
    return them; every other client parameter is frozen but a classification head (``score``)
    and the remote segment's gradient-norm proxy (the global clip). ``model``: a split model
    class instance (the split GPT-2 classes, :class:`~splitlearn.hf.auto.AutoSplitModelForCausalLM`'s)."""
    remote = _remote(model)
    spec = resolve_spec(remote.info, lora, model.config)
    if spec is None:
        return []
    if getattr(model, "lora_spec", None) is not None:
        raise ConfigError("this split model has LoRA adapters already")
    require("lora", "peft", what="LoRA")
    # sequential and splitfed members share the adapters: all start from the same ones
    init_id = remote.client_id if remote.info.get("federation", "shared") == "shared" else ""
    head = getattr(model, "score", None)  # a classification head is new: it trains (peft's modules_to_save)
    keep = {id(remote.grad_proxy)} | {id(p) for p in (head.parameters() if head is not None else ())}
    for p in model.parameters():
        if id(p) not in keep:
            p.requires_grad_(False)
    params = []
    prefix = arch_of(model.config).layer_prefix()  # the *ForCausalLM's name of the layer list
    for i, block in client_layers(model):
        mods = target_modules(block, spec)
        if not mods:
            continue
        params += inject_adapters(block, spec, mods, seed, init_id, lambda local, i=i: f"{prefix}.{i}.{local}")
    model.lora_spec = spec
    log.info("client %s: LoRA %s, %d adapter parameters", remote.client_id, spec.to_dict(),
             sum(p.numel() for p in params))
    return params


def _pairs(model):
    base = getattr(model, "base_model", None)
    inner = base.model if base is not None and hasattr(base, "model") else model  # (a peft wrapper)
    top = arch_of(inner.config).base_path + "."  # a base model alone (SplitGPT2Model): its *ForCausalLM's names
    for name, m in inner.named_modules():
        if hasattr(m, "lora_A") and ADAPTER in getattr(m, "lora_A", {}):
            yield PREFIX + (name if name.startswith(top) else top + name), m


def adapter_tensors(model) -> dict[str, torch.Tensor]:
    """The client's adapters under peft's saved names (``base_model.model.<layer list>.<i>.<module>
    .lora_{A,B}.weight``, the layer list ``model.layers``, GPT-2's ...): what a sync uploads and an
    export writes."""
    out = {}
    for name, m in _pairs(model):
        out[f"{name}.lora_A.weight"] = m.lora_A[ADAPTER].weight.detach().cpu().contiguous()
        out[f"{name}.lora_B.weight"] = m.lora_B[ADAPTER].weight.detach().cpu().contiguous()
    return out


def load_adapters(model, tensors: dict[str, torch.Tensor]) -> None:
    """Copy adapters named as :func:`adapter_tensors` names them into the model."""
    with torch.no_grad():
        for name, m in _pairs(model):
            for part in ("lora_A", "lora_B"):
                w = getattr(m, part)[ADAPTER].weight
                key = f"{name}.{part}.weight"
                if key in tensors:
                    w.copy_(tensors[key].to(device=w.device, dtype=w.dtype))


def fetch_server_adapter(transport, client_id: str) -> dict[str, torch.Tensor]:
    """``GET /v1/clients/<id>/adapter``: the server side's adapter (peft names)."""
    from ..api import protocol as P
    from ..api.wire import decode

    tensors, _ = decode(transport.get_bytes(P.CLIENT_ADAPTER.format(client_id=client_id)))
    return tensors


def export_adapter(model, directory, base_model=None):
    """Both sides' adapters of a LoRA split model as one peft adapter directory for the whole model
    (``PeftModel.from_pretrained(<the family's *ForCausalLM>.from_pretrained(base), directory)``)::

        adapter_config.json          peft.LoraConfig (fan_in_fan_out, targets, r, alpha, dropout)
        adapter_model.safetensors    base_model.model.<layer list>.<i>.<module>.lora_{A,B}.weight
    """
    from pathlib import Path

    from safetensors.torch import save_file

    spec = getattr(model, "lora_spec", None)
    if spec is None:
        raise ConfigError("export_adapter needs a LoRA model (lora=peft.LoraConfig(...))")
    remote = _remote(model)
    remote.flush()  # the last step's apply: the server's adapter holds it
    client, server = adapter_tensors(model), fetch_server_adapter(remote.transport, remote.client_id)
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
