"""``load_model(source)``: a decoder-only causal LM of any family the adapter knows
(:mod:`splitlearn.model.arch`, docs/MODELS.md) from, tried in this order:

========================================  =====================================================
a ``*ForCausalLM`` / its config            the model itself / a random init from the config
an existing directory                      ``from_pretrained`` (``save_pretrained`` layout), offline
an existing ``.json`` file                 a config (``model_type``, default gpt2): random init
``random:NAME`` or a spec-only ``NAME``    ``models/NAME.json``: random init (offline)
anything else                              a hub id, ``from_pretrained`` (needs the hub or its cache)
========================================  =====================================================

Random inits are seeded (``seed=0``), so two processes loading the same spec hold the same
weights. A spec with ``"hub_id"`` (``gpt2``, ...) means the hub checkpoint by its bare name,
``random:gpt2`` the same shape with random weights."""
from __future__ import annotations

import contextlib

import json
import logging
import threading
from pathlib import Path
from typing import Union

import torch
from torch import nn
from transformers import AutoConfig, PretrainedConfig, PreTrainedModel

from .arch import arch_of, check_causal_lm
from .devices import resolve_device, resolve_dtype
from ..errors import ConfigError
from .specs import is_spec_source, list_specs, read_spec, specs_dir  # noqa: F401 - this module's names too

log = logging.getLogger(__name__)

ModelSource = Union[str, Path, PretrainedConfig, PreTrainedModel]

# model construction is not thread-safe (docs/INTERNALS.md, "transformers 5 and segments"): loads take turns
_LOAD_LOCK = threading.RLock()


def config_from_dict(d: dict) -> PretrainedConfig:
    """The config of a ``config.json``/spec dict (``model_type`` default ``gpt2``), refused with
    the reason unless the adapter can cut its family."""
    d = {k: v for k, v in d.items() if k not in ("hub_id", "description", "tokenizer")}
    model_type = d.pop("model_type", "gpt2")
    try:
        cfg = AutoConfig.for_model(model_type, **d)
    except ValueError as e:
        raise ConfigError(f"model_type is {model_type!r}, which transformers does not know ({e})") from None
    try:
        arch_of(cfg)
    except ConfigError as e:
        raise ConfigError(f"model_type is {model_type!r}: {e}") from None
    return cfg


def load_config(source: ModelSource) -> PretrainedConfig:
    """The config that :func:`load_model` would build, without any weights."""
    if isinstance(source, PreTrainedModel):
        return source.config
    if isinstance(source, PretrainedConfig):
        return source
    s = str(source)
    p = Path(s)
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ConfigError(f"{p} has no config.json; is it a save_pretrained directory?")
        return config_from_dict(json.loads((p / "config.json").read_text()))
    if is_spec_source(s):
        return config_from_dict(json.loads(p.read_text()) if p.is_file()
                                else read_spec(s.removeprefix("random:")))
    _refuse_missing_file(s)
    try:
        cfg = AutoConfig.from_pretrained(s)
    except Exception as e:  # hub unreachable, unknown id
        raise ConfigError(f"cannot load a config for {s!r}: {e}") from None
    return config_from_dict(cfg.to_dict())


def random_model(config: PretrainedConfig, seed: int = 0) -> PreTrainedModel:
    """A randomly initialised model of ``config``'s family, the same for the same config and
    seed on any machine."""
    arch = arch_of(config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return arch.new_model(config)


def load_model(source: ModelSource, *, dtype: Union[str, torch.dtype, None] = None,
               device: Union[str, torch.device, None] = None, seed: int = 0) -> PreTrainedModel:
    """Load a causal language model in eval mode. ``source``: see the module docstring; ``dtype``:
    ``"float32"``, ``"bfloat16"``, ``"float16"`` or a torch dtype (None: float32); ``device``:
    ``"cpu"``, ``"cuda"``, ``"auto"`` (None: cpu); ``seed``: of random inits."""
    torch_dtype = resolve_dtype(dtype)
    dev = resolve_device(device or "cpu")
    # on meta (shapes only: the memory model, the analyzer) a random model is built there at
    # once: initialising GPT-2 XL's weights on the CPU first costs ~20 s and 6 GiB for nothing
    meta = dev.type == "meta" and (isinstance(source, PretrainedConfig) or
                                   (isinstance(source, (str, Path)) and is_spec_source(str(source))))
    with _LOAD_LOCK, (torch.device("meta") if meta else contextlib.nullcontext()):
        model = _build(source, seed)
    name_causal_lm_loss(check_causal_lm(model))
    model = model.to(device=dev, dtype=torch_dtype) if torch_dtype else model.to(dev)
    return model.eval()


def _build(source: ModelSource, seed: int) -> PreTrainedModel:
    if isinstance(source, nn.Module):
        model = check_causal_lm(source)
    else:
        s = str(source) if not isinstance(source, PretrainedConfig) else None
        if s is not None and Path(s).is_dir():
            cls = arch_of(load_config(s)).model_class()  # refuses a directory without a config we can cut
            try:
                model = cls.from_pretrained(s, local_files_only=True)
            except (OSError, ValueError) as e:
                raise ConfigError(f"cannot load a checkpoint from {s}: {e}") from None
        elif s is not None and not is_spec_source(s):
            _refuse_missing_file(s)
            try:
                cls = arch_of(load_config(s)).model_class()
                model = cls.from_pretrained(s)
            except Exception as e:
                hint = f"; for random weights of that shape use 'random:{s}'" if s in list_specs() else ""
                raise ConfigError(f"cannot load {s!r} from the Hugging Face hub: {e}{hint}") from None
        else:
            model = random_model(load_config(source), seed)
    return model


def name_causal_lm_loss(model: nn.Module) -> nn.Module:
    """Name the loss of a causal language model (``model.loss_type``), in place -> ``model``.

    transformers picks a model's loss by its class name; some (``*LMHeadModel``, and the split
    classes) name none, so every loss warned "`loss_type=None` ... unrecognized" and fell back to
    ``ForCausalLM``: the loss it is, named here so that the fallback (and its warning) is never needed."""
    if isinstance(model, PreTrainedModel) and getattr(model, "loss_type", "") is None:
        model.loss_type = "ForCausalLM"
    return model


def _refuse_missing_file(s: str) -> None:
    """A ``.json`` source that is not a file is a typo, not a hub id: say so, offline."""
    if s.endswith(".json"):
        raise ConfigError(f"config file {s} does not exist")
