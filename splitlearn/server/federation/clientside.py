"""The client side of the split as the servers see it: the schema a sync must match, and
the weights every client starts from.

The schema is computed from the server's own flags on the meta device, never from an upload::

    full model   every client-side parameter under the family's Hugging Face name, float32
                 (2-way: the bottom; U-shape: bottom + top, a tied lm_head once, under the
                 token embedding's name; any family the adapter cuts: model/arch.py)
    LoRA         the client-side adapters only, under peft's names
                 (base_model.model.<the layer's name>.<module>.lora_{A,B}.weight)

Anything else is refused (400). :attr:`ClientSide.initial` rebuilds the initial weights (the
first round's bound reference) once, or answers None (then the caller uses the first round's
median). Design: docs/FEDERATION.md, 'One member cannot break the federation'.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

import torch
from transformers import PretrainedConfig

from ...errors import BadRequest
from ...model.arch import arch_of
from ...model.lora import LoraSpec, hf_module_name, in_out, init_adapter_pair, target_modules
from ...model.partition import partition

log = logging.getLogger(__name__)

Schema = dict[str, tuple[int, ...]]
DTYPE = torch.float32  # of every client-side tensor a server takes


def _client_segments(model: torch.nn.Module, cuts: tuple[int, ...]) -> list:
    parts = partition(model, cuts)
    return [parts.bottom, parts.top] if parts.u_shape else [parts.bottom]


def _untied(segments) -> dict[str, torch.Tensor]:
    """The segments' tensors by Hugging Face name, a tied one once (by its first name)."""
    out, seen = {}, set()
    for seg in segments:
        for (_, p), name in zip(seg.state_dict(keep_vars=True).items(), seg.hf_state_dict()):
            if id(p) not in seen:
                seen.add(id(p))
                out[name] = p
    return out


def client_adapter_shapes(config: PretrainedConfig, cuts: tuple[int, ...], spec: LoraSpec) -> Schema:
    """peft names and shapes of the client-side adapters (what a LoRA client's sync carries)."""
    with torch.device("meta"):  # shapes only, no memory
        segs = _client_segments(arch_of(config).new_model(config), cuts)
    out = {}
    for seg in segs:
        for local, m in target_modules(seg, spec).items():
            name = f"base_model.model.{hf_module_name(seg, local)}"
            fan_in, fan_out = in_out(m)  # Conv1D or nn.Linear
            out[f"{name}.lora_A.weight"] = (spec.r, fan_in)
            out[f"{name}.lora_B.weight"] = (fan_out, spec.r)
    return out


def client_schema(config: PretrainedConfig, cuts: tuple[int, ...], lora: Optional[LoraSpec] = None) -> Schema:
    """Names and shapes of the client-side weights a sync carries (all float32)."""
    if lora is not None:
        return client_adapter_shapes(config, cuts, lora)
    with torch.device("meta"):  # shapes only, no memory
        segs = _client_segments(arch_of(config).new_model(config), cuts)
    return {k: tuple(p.shape) for k, p in _untied(segs).items()}


def check_upload(tensors: dict[str, torch.Tensor], schema: Schema) -> None:
    """400 unless ``tensors`` are exactly the schema's names and shapes, float32 and finite."""
    missing, extra = sorted(set(schema) - set(tensors)), sorted(set(tensors) - set(schema))
    if missing or extra:
        raise BadRequest(f"the weights must be exactly the client-side parameters: missing "
                         f"{missing[:5]}{'...' if len(missing) > 5 else ''}, unexpected "
                         f"{extra[:5]}{'...' if len(extra) > 5 else ''}")
    for name, t in tensors.items():
        if tuple(t.shape) != schema[name]:
            raise BadRequest(f"weight {name!r} has shape {list(t.shape)}, expected {list(schema[name])}")
        if t.dtype != DTYPE:
            raise BadRequest(f"weight {name!r} has dtype {t.dtype}; client-side weights travel as float32")
        if not bool(torch.isfinite(t).all()):
            raise BadRequest(f"weight {name!r} contains NaN or inf")


class ClientSide:
    """What a server knows of the client side: its schema and (lazily) its initial weights."""

    def __init__(self, config: PretrainedConfig, cuts: tuple[int, ...], *, model: Optional[str] = None,
                 segment: Optional[str] = None, seed: int = 0, lora: Optional[LoraSpec] = None):
        lora = lora.for_config(config) if lora is not None else None  # no targets: the family's default
        self.config, self.cuts, self.lora = config, tuple(cuts), lora
        self.model, self.segment, self.seed = model, segment, seed  # where the initial weights come from
        self.schema: Schema = client_schema(config, self.cuts, lora)
        self._initial: Optional[dict[str, torch.Tensor]] = None
        self._tried = False

    def check(self, tensors: dict[str, torch.Tensor]) -> None:
        check_upload(tensors, self.schema)

    def initial(self) -> Optional[dict[str, torch.Tensor]]:
        """The client-side weights every client starts from (float32), built on first use;
        None if this server cannot know them."""
        if not self._tried:
            self._tried = True
            self._initial = self._build()
        return self._initial

    def forget_initial(self) -> None:
        """Free them: the shared weights are the reference from now on."""
        self._initial, self._tried = None, True

    def _build(self) -> Optional[dict[str, torch.Tensor]]:
        from ...model.export import load_segments
        from ...model.loading import load_model

        if self.model is not None:
            segs = _client_segments(load_model(self.model, seed=self.seed, device="cpu"), self.cuts)
        else:
            kinds = ["bottom", "top"] if len(self.cuts) == 2 else ["bottom"]
            folder = Path(self.segment).parent if self.segment else None
            if folder is None or not all((folder / f"{k}.json").is_file() for k in kinds):
                log.warning("no initial client-side weights (no %s next to --segment): the first "
                            "round's updates are bounded around the median of its uploads", "/".join(kinds))
                return None
            segs = load_segments(folder, kinds, device="cpu")
        if self.lora is None:
            return {k: p.detach().to(DTYPE).clone() for k, p in _untied(segs).items()}
        out = {}
        for seg in segs:  # a fed client's adapters all start from the common id ""
            for local, m in target_modules(seg, self.lora).items():
                name = hf_module_name(seg, local)
                a, b = init_adapter_pair(self.seed, "", name, *in_out(m), self.lora.r)
                out[f"base_model.model.{name}.lora_A.weight"] = a
                out[f"base_model.model.{name}.lora_B.weight"] = b
        return out
