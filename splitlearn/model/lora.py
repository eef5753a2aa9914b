"""LoRA for segments of any family (GPT-2's ``Conv1D`` layers, the others' ``nn.Linear``): the
configuration, a deterministic adapter init, and many adapters
on one frozen segment with a per-row choice of adapter::

    y = base(x) + scale * dropout(x) @ A^T @ B^T        A: (r, in), B: (out, r), scale = alpha / r

``lora_A`` (r, in) and ``lora_B`` (out, r) are peft's layout for GPT-2's ``Conv1D``
(``fan_in_fan_out=True``) and for ``nn.Linear``, so an adapter here is a peft adapter. :class:`LoraRouter` adds
adapters by forward hooks, per forward or per row. See docs/LORA.md."""
from __future__ import annotations

import hashlib
import math
from contextlib import contextmanager, nullcontext
from typing import Iterator, Optional, Sequence, Union

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from ..errors import ConfigError
from .loraspec import LoraSpec  # noqa: F401 (re-exported: plain data, no torch)


def target_modules(module: nn.Module, spec: LoraSpec) -> dict[str, nn.Module]:
    """The ``Conv1D`` (GPT-2) or ``nn.Linear`` (the other families) submodules of ``module`` whose
    last name component is a target."""
    return {name: m for name, m in module.named_modules()
            if isinstance(m, (Conv1D, nn.Linear)) and name.rsplit(".", 1)[-1] in spec.targets}


def layer_linear_names(segment: nn.Module) -> list[str]:
    """The names (last component) of the ``Conv1D`` / ``nn.Linear`` modules of ``segment``'s layers
    (``layers_list``; any module without one): what a LoRA target may name."""
    layers = getattr(segment, "layers_list", segment)
    return sorted({name.rsplit(".", 1)[-1] for name, m in layers.named_modules()
                   if isinstance(m, (Conv1D, nn.Linear))})


def check_targets(segment: nn.Module, spec: LoraSpec) -> None:
    """Refuse targets ``segment``'s layers do not have, naming the ones they have."""
    have = layer_linear_names(segment)
    missing = [t for t in spec.targets if t not in have]
    if missing:
        kind = getattr(segment, "kind", "")
        raise ConfigError(f"the {kind + ' ' if kind else ''}segment has no LoRA target module "
                          f"{', '.join(map(repr, missing))}: its layers' linear modules are "
                          f"{', '.join(have) or 'none'} (--lora-targets, LoraConfig.target_modules)")


def in_out(m: nn.Module) -> tuple[int, int]:
    """(in, out) features of a target: a ``Conv1D``'s weight is (in, out), a ``Linear``'s (out, in)."""
    return (m.nx, m.nf) if isinstance(m, Conv1D) else (m.in_features, m.out_features)


def init_adapter_pair(seed: int, client_id: str, name: str, fan_in: int, fan_out: int,
                      r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A (r, fan_in) and B (fan_out, r) float32 for module ``name`` (Hugging Face name): A as peft's
    ``kaiming_uniform_(a=sqrt(5))`` from a generator seeded by (seed, client_id, name), B zero."""
    digest = hashlib.sha256(f"{seed}/{client_id}/{name}".encode()).digest()
    g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
    bound = 1.0 / math.sqrt(fan_in)
    a = (torch.rand(r, fan_in, generator=g) * 2 - 1) * bound  # (r, in)
    return a, torch.zeros(fan_out, r)  # (out, r)


def hf_module_name(segment, local: str) -> str:
    """A segment's module name -> the ``*ForCausalLM``'s (the adapter's :meth:`Arch.hf_name
    <splitlearn.model.arch.Arch.hf_name>`): ``layers.1.self_attn.q_proj`` of a segment starting at
    layer 2 -> ``model.layers.3.self_attn.q_proj``."""
    return segment.arch.hf_name(local, segment.start)


class Adapter(nn.Module):
    """One client's LoRA weights for one segment: (A, B) per target module (HF names)."""

    def __init__(self, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]], spec: LoraSpec):
        super().__init__()
        self.spec = spec
        self.names = list(pairs)  # Hugging Face module names, in segment order
        self.lora_A = nn.ParameterList([nn.Parameter(a) for a, _ in pairs.values()])  # (r, in) each
        self.lora_B = nn.ParameterList([nn.Parameter(b) for _, b in pairs.values()])  # (out, r) each
        self._index = {n: i for i, n in enumerate(self.names)}

    def delta(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """scale * dropout(x) @ A^T @ B^T for x (..., in) -> (..., out)."""
        i = self._index[name]
        a, b = self.lora_A[i], self.lora_B[i]
        if self.spec.dropout and self.training:
            x = nn.functional.dropout(x, self.spec.dropout, training=True)
        return (x.to(a.dtype) @ a.t()) @ b.t() * self.spec.scale  # (..., r) -> (..., out)

    def tensors(self, prefix: str = "base_model.model.") -> dict[str, torch.Tensor]:
        """peft's saved names: ``base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight``."""
        out = {}
        for n, a, b in zip(self.names, self.lora_A, self.lora_B):
            out[f"{prefix}{n}.lora_A.weight"] = a.detach().cpu().contiguous()
            out[f"{prefix}{n}.lora_B.weight"] = b.detach().cpu().contiguous()
        return out

    def load_tensors(self, tensors: dict[str, torch.Tensor], prefix: str = "base_model.model.") -> None:
        with torch.no_grad():
            for n, a, b in zip(self.names, self.lora_A, self.lora_B):
                a.copy_(tensors[f"{prefix}{n}.lora_A.weight"])
                b.copy_(tensors[f"{prefix}{n}.lora_B.weight"])

    def numel(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def __deepcopy__(self, memo):  # copies the tensors, shares the (frozen) spec
        pairs = {n: (a.detach().clone(), b.detach().clone())
                 for n, a, b in zip(self.names, self.lora_A, self.lora_B)}
        new = Adapter(pairs, self.spec)
        new.train(self.training)
        return new


Plan = Union[None, Adapter, list[tuple[int, Optional[Adapter]]]]


class LoraRouter:
    """Adds adapters to the target ``Conv1D`` / ``Linear`` layers of a frozen segment, chosen per forward.

    ``plan``: None (the base), one :class:`Adapter` (every row), or (rows, adapter or None) groups
    in row order; set it with :meth:`use` / :meth:`per_rows` around a forward."""

    def __init__(self, segment: nn.Module, spec: LoraSpec):
        spec = spec.for_config(segment.config)  # no targets: the family's default
        check_targets(segment, spec)
        self.spec = spec
        self.segment = segment
        mods = target_modules(segment, spec)
        self.shapes = {hf_module_name(segment, n): in_out(m) for n, m in mods.items()}  # (in, out)
        self.plan: Plan = None
        self._handles = [m.register_forward_hook(self._hook(hf_module_name(segment, n)))
                         for n, m in mods.items()]
        for p in segment.parameters():
            p.requires_grad_(False)  # the base never trains
        segment.lora_router = self  # what lora_scope / lora_rows look for

    def new_adapter(self, seed: int, client_id: str) -> Adapter:
        pairs = {n: init_adapter_pair(seed, client_id, n, i, o, self.spec.r) for n, (i, o) in self.shapes.items()}
        dev = next(self.segment.parameters()).device
        return Adapter(pairs, self.spec).to(dev)

    @contextmanager
    def use(self, plan: Plan) -> Iterator[None]:
        old, self.plan = self.plan, plan
        try:
            yield
        finally:
            self.plan = old

    def per_rows(self, groups: Sequence[tuple[int, Optional[Adapter]]]):
        """Rows in order: ``[(n_1, adapter_1), (n_2, adapter_2), ...]`` (one group per session)."""
        adapters = {id(a) for _, a in groups}
        if len(adapters) == 1:  # one adapter (or none) for all rows: no per-row work
            return self.use(groups[0][1] if groups else None)
        return self.use(list(groups))

    def _hook(self, name: str):
        def hook(module: nn.Module, inputs: tuple, output: torch.Tensor) -> Optional[torch.Tensor]:
            plan = self.plan
            if plan is None:
                return None
            x = inputs[0]  # (B, T, in)
            if isinstance(plan, Adapter):
                return output + plan.delta(name, x).to(output.dtype)  # (B, T, out)
            return output + self._grouped_delta(name, x, plan).to(output.dtype)
        return hook

    @staticmethod
    def _grouped_delta(name: str, x: torch.Tensor, groups: list[tuple[int, Optional[Adapter]]]) -> torch.Tensor:
        """Each adapter's delta on its own rows (gathered across groups), zero elsewhere."""
        rows_of: dict[int, tuple[Adapter, list[int]]] = {}
        start = 0
        for n, adapter in groups:
            if adapter is not None:
                rows_of.setdefault(id(adapter), (adapter, []))[1].extend(range(start, start + n))
            start += n
        a0 = next(iter(rows_of.values()))[0] if rows_of else None
        out_dim = a0.lora_B[a0._index[name]].shape[0] if a0 is not None else 0
        delta = x.new_zeros(*x.shape[:-1], out_dim)  # (N, T, out)
        for adapter, rows in rows_of.values():
            idx = torch.tensor(rows, device=x.device)
            delta.index_copy_(0, idx, adapter.delta(name, x.index_select(0, idx)).to(delta.dtype))
        return delta

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


class AdaptedSegment(nn.Module):
    """The shared frozen segment run with one adapter: its parameters and state dict are the
    adapter's only (the segment is referenced, not registered; a copy shares the base)."""

    def __init__(self, router: LoraRouter, adapter: Adapter):
        super().__init__()
        self.adapter = adapter
        object.__setattr__(self, "_router", router)  # not a submodule

    @property
    def base(self) -> nn.Module:
        return self._router.segment

    def forward(self, *args, **kwargs) -> torch.Tensor:
        with self._router.use(self.adapter):
            return self.base(*args, **kwargs)

    def train(self, mode: bool = True) -> "AdaptedSegment":
        self.base.train(mode)
        return super().train(mode)

    def __deepcopy__(self, memo) -> "AdaptedSegment":
        import copy

        return AdaptedSegment(self._router, copy.deepcopy(self.adapter, memo))


def lora_scope(segment: nn.Module, plan: Plan):
    """Run ``segment`` with ``plan`` (an adapter, or None) if it carries a router, else as is."""
    router = getattr(segment, "lora_router", None)
    return router.use(plan) if router is not None else nullcontext()


def lora_rows(segment: nn.Module, groups: Sequence[tuple[int, Optional[Adapter]]]):
    """Per-row adapters for a batch of decode rows (see :meth:`LoraRouter.per_rows`)."""
    router = getattr(segment, "lora_router", None)
    return router.per_rows(groups) if router is not None else nullcontext()


PREFIX = "base_model.model."  # peft's prefix of a saved adapter's tensor names
ADAPTER = "default"  # the adapter name peft uses inside the modules

def as_spec(lora, config=None) -> LoraSpec:
    """A :class:`LoraSpec` from a ``peft.LoraConfig`` or a :class:`LoraSpec` (``"server"``,
    the server's own options, is resolved by :func:`setup`); with the model's ``config``, no
    targets means the family's default (:meth:`LoraSpec.for_config`)."""
    if isinstance(lora, LoraSpec):
        return lora.for_config(config) if config is not None else lora
    if type(lora).__name__ == "LoraConfig":
        spec = LoraSpec.from_peft(lora)
        return spec.for_config(config) if config is not None else spec
    raise ConfigError(f"lora must be a peft.LoraConfig or a splitlearn.model.lora.LoraSpec, got {type(lora).__name__}")

def check_server(info: dict, spec: Optional[LoraSpec]) -> None:
    """Refuse a LoRA client on a server without LoRA, the reverse, and different LoRA options."""
    server = info.get("lora")
    if spec is None and server is not None:
        raise ConfigError(f"the server trains LoRA adapters ({server}) and keeps its segment frozen: "
                          f"connect with SplitClient(..., lora=peft.LoraConfig(...)) of the same r, "
                          f"alpha and targets, or lora=\"server\" (the command line's --lora)")
    if spec is not None and server is None:
        raise ConfigError("this client asks for LoRA but the server trains its whole segment "
                          "(started without --lora-r): drop lora=... or restart the server with --lora-r")
    if spec is not None and LoraSpec.from_dict(server) != spec:
        raise ConfigError(f"LoRA options differ: this client {spec.to_dict()}, the server {server}; "
                          f"one exported adapter needs the same r, alpha, targets and dropout on both sides")

def inject_adapters(module: torch.nn.Module, spec: LoraSpec, mods, seed: int, init_id: str,
                    hf_name) -> list[torch.nn.Parameter]:
    """peft's LoRA layers on ``module``'s target submodules ``mods`` (local names), initialised by
    :func:`init_adapter_pair` under ``hf_name(local)``; returns the adapter parameters."""
    from peft import inject_adapter_in_model

    inject_adapter_in_model(spec.to_peft(), module, adapter_name=ADAPTER)
    params = []
    for local in mods:
        layer = module.get_submodule(local)
        a, b = layer.lora_A[ADAPTER].weight, layer.lora_B[ADAPTER].weight  # (r, in), (out, r)
        init_a, init_b = init_adapter_pair(seed, init_id, hf_name(local), a.shape[1], b.shape[0], spec.r)
        with torch.no_grad():
            a.copy_(init_a)
            b.copy_(init_b)
        params += [a, b]
    return params
