"""The architecture adapter: the one place that knows where a decoder-only transformers model keeps
its parts and how a run of its layers is called (docs/MODELS.md).

transformers 5 names the parts of most families itself, and this module follows those conventions:

* ``config.base_model_pp_plan``: the base model's modules in pipeline order: the embedding
  modules, then the ``ModuleList`` of layers, then the final norm(s);
* ``model.base_model_prefix``: where the base model sits in the ``*ForCausalLM``;
* ``config.layer_types`` (``"full_attention"`` / ``"sliding_attention"`` per layer); a config
  without it but with a ``sliding_window`` masks every layer with the window (Mistral, Phi-3);
* ``base.rotary_emb(x, position_ids)`` (Gemma 3: ``(x, position_ids, layer_type)``);
* every layer is callable alone: ``layer(hidden, attention_mask=, position_ids=,
  position_embeddings=, cache=)`` (GPT-NeoX and Falcon name the cache ``layer_past=``).

A family that differs is a :class:`Family` entry in :data:`FAMILIES` (GPT-2, OPT, Falcon; Phi-3's LoRA default): data,
not ``if model_type ==`` across the code. Facts this relies on, measured on transformers 5.24
(docs/MODELS.md, "What each side of a cut needs"): rotary is recomputed on each side from the
first segment's ``position_ids``; one mask per layer type with ``layer_idx`` = the segment's first
layer of that type; Gemma 2's final logit softcap belongs to the head; Falcon's alibi is rebuilt
on each side from the 2-D mask; OPT's positions come from the mask (its embedding adds 2).
"""
from __future__ import annotations

import functools
import inspect
import math
import operator
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from ..errors import ConfigError

FULL, SLIDING = "full_attention", "sliding_attention"

#: the families whose exactness tests/test_arch.py checks (others that follow the conventions work
#: too: the adapter reads the parts from the config, docs/MODELS.md)
VERIFIED = ("llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "gemma3_text", "phi3",
            "gpt_neox", "opt", "falcon", "gpt2")


@dataclass(frozen=True)
class Family:
    """How one family differs from transformers' conventions (None: the convention's answer).

    ``base``: the dotted path of the module holding the parts inside the ``*ForCausalLM``;
    ``embed``/``layers``/``norm``: the parts' names in that module, in order (``norm`` may hold
    a projection after the norm, OPT's ``project_out``); ``head``: the LM head's name in the
    ``*ForCausalLM``; ``embedding``: how the embedding modules combine (``"sequential"``: each
    applied to the last one's output; ``"learned_positions"``: ``embed[0](ids) +
    embed[1](position_ids)``, then ``embed[2]`` (dropout); ``"opt"``: OPT's); ``positions``:
    ``"mask"`` (generate()'s rule, cumsum - 1 of the 2-D mask) or ``"opt"``
    (``cumsum * mask - 1``, as OPT computes them); ``alibi``: Falcon's alibi bias, folded into the
    mask; ``mask_positions``: pass ``position_ids`` to the mask functions (OPT does not);
    ``materialize_mask``: never let the mask be skipped for sdpa's ``is_causal`` (Falcon);
    ``max_positions``: the config field bounding learned position embeddings;
    ``decode_batching``: the server's hand-written cross-session decode knows this layer layout
    (GPT-2's; it is what the CUDA decode graphs capture); other families' decode steps are batched
    through the layers' own call, with per-session caches (splitlearn/server/engine/batching.py)."""

    base: Optional[str] = None
    embed: Optional[tuple[str, ...]] = None
    layers: Optional[str] = None
    norm: Optional[tuple[str, ...]] = None
    head: str = "lm_head"
    embedding: str = "sequential"
    positions: str = "mask"
    alibi: bool = False
    mask_positions: bool = True
    materialize_mask: bool = False
    max_positions: Optional[str] = None
    decode_batching: bool = False  # the server's hand-written cross-session decode (GPT-2's layer layout)
    # that decode's row-wise parts of a layer (module paths, applied in order): (norm, attention's
    # input projection), (attention's output projection,), (norm, MLP): server/engine/graphs.py
    decode_stages: tuple = ()
    conv1d: tuple[str, ...] = ()  # its layers' transformers Conv1D modules ((in, out) weights: peft's fan_in_fan_out)
    lora_targets: Optional[tuple[str, ...]] = None  # LoRA's default targets where peft's table has none
    notes: str = field(default="", compare=False)


FAMILIES: dict[str, Family] = {
    "gpt2": Family(base="transformer", embed=("wte", "wpe", "drop"), layers="h", norm=("ln_f",),
                   embedding="learned_positions", max_positions="n_positions", decode_batching=True,
                   decode_stages=(("ln_1", "attn.c_attn"), ("attn.c_proj",), ("ln_2", "mlp")),
                   conv1d=("c_attn", "c_proj", "c_fc"),
                   notes="learned positions (wpe); Conv1D linear layers; no base_model_pp_plan"),
    "opt": Family(base="model.decoder", embed=("embed_tokens", "embed_positions", "project_in"), layers="layers",
                  norm=("final_layer_norm", "project_out"), embedding="opt", positions="opt",
                  mask_positions=False, max_positions="max_position_embeddings",
                  notes="positions from the mask, offset 2 inside embed_positions; project_in/out"),
    "falcon": Family(base="transformer", embed=("word_embeddings",), layers="h", norm=("ln_f",),
                     alibi=True, materialize_mask=True,
                     notes="alibi (when config.alibi) rebuilt per side from the 2-D mask; fused QKV, "
                           "parallel residual; layers take layer_past="),
    "phi3": Family(lora_targets=("qkv_proj",), notes="fused qkv_proj (peft's LoRA table has no phi3)"),
}


def _model_class(config: PretrainedConfig) -> type:
    try:
        return AutoModelForCausalLM._model_mapping[type(config)]
    except KeyError:
        raise ConfigError(
            f"model_type {config.model_type!r} has no causal-LM class in transformers; splitlearn cuts "
            f"decoder-only language models ({supported_text()})") from None


def supported_text() -> str:
    return ("verified: " + ", ".join(VERIFIED) + "; and any decoder-only family following transformers' "
            "conventions (base_model_pp_plan, layer_types, layers callable alone)")


@functools.lru_cache(maxsize=None)
def _params(fn) -> frozenset:
    return frozenset(inspect.signature(fn).parameters)


class Arch:
    """The adapter of one config: names, layer types, positions, masks, the layer call, KV bytes.

    Holds no modules: the parts it names are passed in (a segment's, a split model's)."""

    def __init__(self, config: PretrainedConfig):
        if getattr(config, "is_encoder_decoder", False):
            raise ConfigError(f"{config.model_type!r} is an encoder-decoder model: splitlearn cuts decoder-only "
                              f"language models ({supported_text()})")
        self.config = config
        self.model_type = config.model_type
        self.family = FAMILIES.get(config.model_type, Family())
        cls = _model_class(config)
        f = self.family
        self.base_path = f.base or cls.base_model_prefix
        plan = list(getattr(config, "base_model_pp_plan", None) or [])
        if f.layers is None and "layers" not in plan:
            raise ConfigError(f"{config.model_type!r}: cannot find its layers (no base_model_pp_plan naming "
                              f"'layers' and no entry in splitlearn.model.arch.FAMILIES); {supported_text()}")
        self.layers_name = f.layers or "layers"
        at = plan.index(self.layers_name) if self.layers_name in plan else 0
        self.embed_names = f.embed if f.embed is not None else tuple(plan[:at])
        self.norm_names = f.norm if f.norm is not None else tuple(plan[at + 1:])
        self.head_name = f.head
        self.n_layers = int(config.num_hidden_layers)
        types = getattr(config, "layer_types", None)
        if types is None:
            sliding = getattr(config, "sliding_window", None) is not None
            types = [SLIDING if sliding else FULL] * self.n_layers
        self.layer_types = list(types)
        self.uses_alibi = f.alibi and bool(getattr(config, "alibi", False))
        self._stages = tuple(tuple(map(operator.attrgetter, s)) for s in f.decode_stages)
        self.softcap = getattr(config, "final_logit_softcapping", None)

    # -- names ----------------------------------------------------------------------------

    def base_of(self, model: nn.Module) -> nn.Module:
        """The module holding the parts (``model.model``, ``model.transformer``, OPT's decoder)."""
        m = model
        for part in self.base_path.split("."):
            m = getattr(m, part)
        return m

    def parts(self, model: nn.Module) -> dict:
        """``{"embed": {name: module}, "layers": ModuleList, "norm": {name: module}, "head": module,
        "rotary": module or None}`` of a whole ``*ForCausalLM``."""
        base = self.base_of(model)
        return {"embed": {n: getattr(base, n) for n in self.embed_names},
                "layers": getattr(base, self.layers_name),
                "norm": {n: getattr(base, n, None) for n in self.norm_names},
                "head": getattr(model, self.head_name),
                "rotary": getattr(base, "rotary_emb", None)}

    def hf_name(self, local: str, start: int) -> str:
        """A segment's parameter name (its parts under the family's names, layers numbered from
        0) -> the ``*ForCausalLM``'s (``layers.1.mlp...`` of a segment from layer 3 ->
        ``model.layers.4.mlp...``)."""
        first, _, rest = local.partition(".")
        if first == self.head_name:
            return local
        if first == self.layers_name:
            idx, _, rest = rest.partition(".")
            return f"{self.base_path}.{self.layers_name}.{start + int(idx)}.{rest}"
        return f"{self.base_path}.{local}"

    def layer_prefix(self) -> str:
        """The ``*ForCausalLM``'s name of the layer list (``model.layers``, ``transformer.h``)."""
        return f"{self.base_path}.{self.layers_name}"

    def kept_layers_config(self, keep: list) -> PretrainedConfig:
        """A copy of the config for a model of the layers ``keep`` alone (global indices, in order;
        the free draft, splitlearn/hf/draft.py): ``num_hidden_layers`` set (GPT-2's config maps it
        to its own field) and ``layer_types`` sliced, so each kept layer keeps its attention type."""
        import copy
        cfg = copy.deepcopy(self.config)
        cfg.num_hidden_layers = len(keep)
        if getattr(cfg, "layer_types", None) is not None:
            cfg.layer_types = [self.layer_types[i] for i in keep]
        return cfg

    def linear_paths(self, model: nn.Module) -> dict:
        """``{name: path in the *ForCausalLM}`` of every linear layer (``nn.Linear`` or transformers'
        ``Conv1D``) of every layer, in module order, then the LM head: ``layers.0.self_attn.q_proj
        -> model.layers.0.self_attn.q_proj`` (Llama: the 7 of ``config.base_model_tp_plan``),
        ``h.0.attn.c_attn -> transformer.h.0.attn.c_attn``, ``lm_head -> lm_head`` (masked offload)."""
        from transformers.pytorch_utils import Conv1D
        out = {}
        for i, layer in enumerate(self.parts(model)["layers"]):
            for sub, m in layer.named_modules():
                if isinstance(m, (nn.Linear, Conv1D)):
                    out[f"{self.layers_name}.{i}.{sub}"] = f"{self.layer_prefix()}.{i}.{sub}"
        out[self.head_name] = self.head_name
        return out

    def new_model(self, config: Optional[PretrainedConfig] = None) -> nn.Module:
        """A new (random) ``*ForCausalLM`` of this family."""
        return _model_class(config or self.config)(config or self.config)

    def model_class(self) -> type:
        return _model_class(self.config)

    # -- positions and embeddings ---------------------------------------------------------

    def positions(self, attention_mask: Optional[torch.Tensor], past: int, new: int,
                  device=None) -> torch.Tensor:
        """Position ids of the ``new`` positions after ``past``: (B, new) from the 2-D mask
        (B, past + new), or (1, new) without one."""
        if attention_mask is None:
            return torch.arange(past, past + new, device=device)[None]
        m = attention_mask.long()
        if self.family.positions == "opt":
            return (torch.cumsum(m, dim=1) * m - 1)[:, -new:]
        return (m.cumsum(-1) - 1).masked_fill(m == 0, 0)[:, -new:]

    def check_positions(self, position_ids: torch.Tensor) -> None:
        """Refuse positions a learned position embedding does not have."""
        if not self.family.max_positions:
            return  # rotary: no table to run past
        if position_ids.is_meta:
            return  # shapes only (the analyzer's --device meta): no values to check
        limit = getattr(self.config, self.family.max_positions, None)
        if int(position_ids.min()) < (-1 if self.family.positions == "opt" else 0):
            raise ConfigError(f"position {int(position_ids.min())} is negative")
        if limit and int(position_ids.max()) >= limit:
            raise ConfigError(f"position {int(position_ids.max())} is past {self.family.max_positions}={limit}")

    def embed(self, modules: dict, position_ids: torch.Tensor, input_ids=None, inputs_embeds=None,
              attention_mask: Optional[torch.Tensor] = None, past: int = 0,
              token_type_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The embeddings of the new positions, as the unsplit base model computes them: (B, T, d).
        ``modules``: the embedding modules by name."""
        names = self.embed_names
        kind = self.family.embedding
        tok = modules[names[0]]
        x = tok(input_ids) if inputs_embeds is None else inputs_embeds
        if kind == "learned_positions":
            h = x + modules[names[1]](position_ids).to(x.device)
            if token_type_ids is not None:
                h = h + tok(token_type_ids)
            return modules[names[2]](h)
        if kind == "opt":
            if attention_mask is None:
                attention_mask = torch.ones(x.shape[0], past + x.shape[1], device=x.device, dtype=torch.long)
            pos = modules[names[1]](attention_mask, past, position_ids=position_ids)
            if modules.get(names[2]) is not None:
                x = modules[names[2]](x)
            return x + pos.to(x.device)
        for n in names[1:]:
            x = modules[n](x)
        return x

    # -- layers ----------------------------------------------------------------------------

    def masks(self, start: int, end: int, hidden: torch.Tensor, attention_mask, cache, position_ids,
              inputs_embeds=None, materialize: bool = False) -> dict:
        """One mask per layer type among layers ``[start, end)``, sized against that type's
        first layer in the range (its cache slot). ``materialize``: never None (no skip for sdpa's
        ``is_causal``): the server's cross-session decode stacks the sessions' masks."""
        out = {}
        emb = hidden if inputs_embeds is None else inputs_embeds
        for i in range(start, end):
            t = self.layer_types[i]
            if t in out:
                continue
            fn = create_sliding_window_causal_mask if t == SLIDING else create_causal_mask
            kw = {"position_ids": position_ids} if self.family.mask_positions else {}
            if self.family.materialize_mask or materialize:
                kw["allow_is_causal_skip"] = False
            out[t] = fn(config=self.config, inputs_embeds=emb, attention_mask=attention_mask, cache=cache,
                        layer_idx=i, **kw)
        return out

    def _alibi(self, hidden, attention_mask, cache, start, masks):
        """Falcon's alibi from the whole 2-D mask, folded into the full-attention mask."""
        from transformers.models.falcon.modeling_falcon import build_alibi_tensor
        B, T = hidden.shape[:2]
        past = cache.get_seq_length(start) if cache is not None else 0
        m2 = attention_mask if attention_mask is not None else torch.ones(B, past + T, dtype=torch.long,
                                                                          device=hidden.device)
        heads = self.config.num_attention_heads
        alibi = build_alibi_tensor(m2, heads, dtype=hidden.dtype)
        cm = masks.get(FULL)
        if cm is not None and cm.ndim == 4:
            mn = torch.finfo(hidden.dtype).min
            if cm.dtype == torch.bool:
                cm = torch.where(cm, torch.full((), 0.0, device=cm.device, dtype=hidden.dtype), mn)
            a = alibi.reshape(B, -1, *alibi.shape[1:])
            masks[FULL] = torch.masked_fill(a / math.sqrt(self.config.hidden_size // heads), cm < -1, mn)
        return alibi

    def run_layers(self, layers, start: int, hidden: torch.Tensor, attention_mask=None, cache=None,
                   position_ids: Optional[torch.Tensor] = None, rotary: Optional[nn.Module] = None,
                   inputs_embeds: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Run ``layers`` (consecutive, the first with global index ``start``) on the new positions
        ``hidden`` (B, T, d): masks per layer type from the 2-D ``attention_mask`` (B, past + T)
        or None, against ``cache`` (a transformers ``Cache`` with a slot per model layer, or None);
        rotary from ``position_ids`` (B|1, T) when the family has it; then the layers."""
        if not len(layers):
            return hidden
        end = start + len(layers)
        if position_ids is None and rotary is not None:  # only rotary needs them past the embeddings
            past = cache.get_seq_length(start) if cache is not None else 0
            position_ids = self.positions(attention_mask, past, hidden.shape[1], hidden.device)
        masks = self.masks(start, end, hidden, attention_mask, cache, position_ids, inputs_embeds)
        alibi = self._alibi(hidden, attention_mask, cache, start, masks) if self.uses_alibi else None
        pes = {}
        if rotary is not None:
            per_type = "layer_type" in _params(type(rotary).forward)
            for t in masks:
                pes[t] = rotary(hidden, position_ids, t) if per_type else rotary(hidden, position_ids)
        for j, layer in enumerate(layers):
            t = self.layer_types[start + j]
            params = _params(type(layer).forward)
            kw = {"attention_mask": masks[t], "position_ids": position_ids, "use_cache": cache is not None}
            kw["layer_past" if "layer_past" in params else "cache"] = cache
            if t in pes:
                kw["position_embeddings"] = pes[t]
            if "alibi" in params:
                kw["alibi"] = alibi
            out = layer(hidden, **kw)
            hidden = out[0] if isinstance(out, tuple) else out  # (B, T, d)
        return hidden

    def call_layer(self, layer: nn.Module, hidden: torch.Tensor, mask, position_ids, cache,
                   position_embeddings=None) -> torch.Tensor:
        """One layer on ``hidden`` (B, T, d), called as :meth:`run_layers` calls it (the cache
        under the name the layer takes); the server's cross-session decode passes its own
        per-session cache view (splitlearn/server/engine/batching.py)."""
        params = _params(type(layer).forward)
        kw = {"attention_mask": mask, "position_ids": position_ids, "use_cache": cache is not None}
        kw["layer_past" if "layer_past" in params else "cache"] = cache
        if position_embeddings is not None:
            kw["position_embeddings"] = position_embeddings
        if "alibi" in params:
            kw["alibi"] = None  # Falcon with rotary; alibi's sessions are not stacked
        out = layer(hidden, **kw)
        return out[0] if isinstance(out, tuple) else out  # (B, T, d)

    def decode_attn_input(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The hand-written decode's (``decode_batching``) first row-wise part of ``layer``: its
        norm and attention input projection, (N, 1, d) -> (N, 1, 3d) (``Family.decode_stages``)."""
        for get in self._stages[0]:
            x = get(layer)(x)
        return x

    def decode_rest(self, layer: nn.Module, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """The rest of ``layer`` after its attention's output ``o`` (N, 1, d): the output
        projection and its residual, the norm, the MLP and its residual: (N, 1, d)."""
        x = x + self._stages[1][0](layer)(o)
        norm, mlp = self._stages[2]
        return x + mlp(layer)(norm(layer)(x))

    # -- the head --------------------------------------------------------------------------

    def head_hidden(self, norms: dict, hidden: torch.Tensor) -> torch.Tensor:
        """The final norm (and OPT's ``project_out``): what the LM head multiplies."""
        for n in self.norm_names:
            m = norms.get(n)
            if m is not None:
                hidden = m(hidden)
        return hidden

    def logits(self, head: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head on ``head_hidden``'s output, with Gemma 2's final softcap."""
        logits = head(hidden)
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    # -- memory ----------------------------------------------------------------------------

    def kv_heads_and_dim(self) -> tuple[int, int]:
        c = self.config
        heads = c.num_attention_heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
        kv = getattr(c, "num_key_value_heads", None)
        if self.model_type == "falcon":
            kv = c.num_kv_heads if (c.new_decoder_architecture or not c.multi_query) else 1
        return int(kv or heads), int(head_dim)

    def kv_bytes_per_token(self, dtype_bytes: int, start: int = 0, end: Optional[int] = None) -> dict:
        """Bytes one token's keys and values take in layers ``[start, end)``, per layer type:
        per layer 2 x num_key_value_heads x head_dim x dtype bytes. A sliding layer holds at most
        ``config.sliding_window`` tokens (:meth:`kv_bytes`)."""
        kv, hd = self.kv_heads_and_dim()
        out: dict = {}
        for i in range(start, self.n_layers if end is None else end):
            out[self.layer_types[i]] = out.get(self.layer_types[i], 0) + 2 * kv * hd * dtype_bytes
        return out

    def kv_bytes(self, tokens: int, dtype_bytes: int, start: int = 0, end: Optional[int] = None) -> int:
        """KV-cache bytes of ``tokens`` positions of one sequence in layers ``[start, end)``."""
        window = getattr(self.config, "sliding_window", None)
        total = 0
        for t, per in self.kv_bytes_per_token(dtype_bytes, start, end).items():
            total += per * (min(tokens, window) if t == SLIDING and window else tokens)
        return total


def mlp_width(config: PretrainedConfig) -> int:
    """The MLP's hidden width: ``intermediate_size`` (most families), OPT's ``ffn_dim``, GPT-2's
    own field (None there: 4 x ``hidden_size``)."""
    width = (getattr(config, "intermediate_size", None) or getattr(config, "ffn_dim", None)
             or getattr(config, "n_inner", None))
    return int(width or 4 * config.hidden_size)


def lora_default_targets(config: PretrainedConfig) -> tuple[str, ...]:
    """LoRA's default target modules for ``config``'s family, its attention's: peft's own table
    (``TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING``: GPT-2 ``c_attn``, Llama ``q_proj``,
    ``v_proj``), else the family's :class:`Family` entry; ConfigError where neither has one."""
    try:
        from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as table
    except ImportError:  # peft is the server's and the "lora" extra's
        table = {}
    targets = table.get(config.model_type) or FAMILIES.get(config.model_type, Family()).lora_targets
    if not targets:
        raise ConfigError(f"no default LoRA targets for {config.model_type!r} (neither peft's table nor "
                          f"splitlearn.model.arch.FAMILIES has one): name them (--lora-targets)")
    return tuple(sorted(targets))


def conv1d_names() -> frozenset:
    """The families' ``Conv1D`` module names (GPT-2's): LoRA on them is peft's ``fan_in_fan_out``."""
    return frozenset(n for f in FAMILIES.values() for n in f.conv1d)


_ARCHS: "dict[int, tuple[PretrainedConfig, Arch]]" = {}  # id(config) -> (config, its adapter), the last 64


def arch_of(config: PretrainedConfig) -> Arch:
    """The adapter of ``config``, made once per config object (a config's attribute reads cost
    ~10 us each: a split model's every forward asks)."""
    hit = _ARCHS.get(id(config))
    if hit is not None and hit[0] is config:
        return hit[1]
    arch = Arch(config)
    if len(_ARCHS) >= 64:
        _ARCHS.pop(next(iter(_ARCHS)), None)
    _ARCHS[id(config)] = (config, arch)
    return arch


def check_causal_lm(model: nn.Module) -> nn.Module:
    """Refuse anything that is not a decoder-only transformers ``*ForCausalLM`` the adapter can cut."""
    config = getattr(model, "config", None)
    if not isinstance(config, PretrainedConfig):
        raise ConfigError(f"splitlearn cuts transformers causal language models; got {type(model).__name__} "
                          f"({supported_text()})")
    if getattr(config, "add_cross_attention", False):
        raise ConfigError(f"{config.model_type} with cross-attention is not supported")
    arch = arch_of(config)
    try:
        parts = arch.parts(model)
    except AttributeError as e:
        raise ConfigError(f"{type(model).__name__} is not a causal LM whose parts splitlearn can find ({e}); "
                          f"{supported_text()}") from None
    layers = parts["layers"]
    if not isinstance(layers, nn.ModuleList) or not len(layers):
        raise ConfigError(f"{type(model).__name__}: its {arch.layer_prefix()} is not a list of layers; "
                          f"{supported_text()}")
    for layer in layers:  # a layer must take the mask (and so be callable alone, as run_layers calls it)
        if "attention_mask" not in _params(type(layer).forward):
            raise ConfigError(f"{type(model).__name__}: its layer {type(layer).__name__} cannot be called alone "
                              f"(no attention_mask parameter); {supported_text()}")
    return model
