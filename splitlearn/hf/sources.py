"""Where a split model's client-side modules come from: a :func:`splitlearn.load_model` source
or a directory of exported segments, checked against the server's ``/v1/info``."""
from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel, GPT2Model

from ..errors import ConfigError
from ..model.export import load_segments
from ..model.loading import _LOAD_LOCK, is_spec_source, load_model
from .remote import RemoteSegment


def _check_config(cfg: GPT2Config, info: dict) -> None:
    server = info["model_config"]
    for key in ("n_embd", "n_layer", "n_head", "vocab_size", "n_positions"):
        if server.get(key) != getattr(cfg, key):
            raise ConfigError(f"the local model's {key}={getattr(cfg, key)} differs from the server's "
                              f"{server.get(key)}: load the same model on both sides")



def _is_export(source) -> bool:
    """Whether ``source`` is a directory that :func:`splitlearn.export_segments` wrote."""
    return isinstance(source, (str, Path)) and (Path(source) / "bottom.json").is_file()


def _client_segments(source, remote: RemoteSegment) -> list:
    """The exported segments the client of ``remote`` holds (bottom; U-shape also top), checked
    against the server's cuts."""
    segments = load_segments(source, ["bottom", "top"][:1 + remote.u_shape])
    held = [segments[0].end] + ([segments[1].start] if remote.u_shape else [])
    if tuple(held) != tuple(remote.cuts):
        raise ConfigError(f"the segments exported in {source} are cut at {held}, the server at {list(remote.cuts)}")
    return segments


def _hf_from_segments(hf_cls: type, segments: list, seed: int = 0, **config_kwargs):
    """A ``hf_cls`` whose client-side modules are ``segments``' (no copy; the server's blocks are
    left on the meta device for :func:`split_model` to drop); a head the segments do not hold
    (a classifier's ``score``) is initialised from ``seed``, ``config_kwargs`` set on its config."""
    config = copy.deepcopy(segments[0].config)
    for k, v in config_kwargs.items():
        setattr(config, k, v)
    with torch.device("meta"):
        hf = hf_cls(config)
    t = hf if isinstance(hf, GPT2Model) else hf.transformer
    t.wte, t.wpe, t.drop = segments[0].wte, segments[0].wpe, segments[0].drop
    for seg in segments:
        for j, block in enumerate(seg.h):
            t.h[seg.start + j] = block
    if len(segments) == 2:  # U-shape: the top holds ln_f and the LM head
        t.ln_f = segments[1].ln_f
        if getattr(hf, "lm_head", None) is not None:
            hf.lm_head = segments[1].lm_head
    device = segments[0].wte.weight.device
    for name, child in hf.named_children():
        if child is not t and name != "lm_head" and any(p.is_meta for p in child.parameters()):
            child.to_empty(device=device)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                child.apply(hf._init_weights)
    return hf


def _load_hf(hf_cls: type, source, seed: int = 0, **config_kwargs):
    """A Hugging Face ``hf_cls`` for a :func:`splitlearn.load_model` source: checkpoints (a
    directory, a hub id) through ``hf_cls.from_pretrained``; spec names and configs as the seeded
    GPT-2 that ``load_model`` builds (the server's weights for the same spec and seed), with a
    seeded head."""
    if isinstance(source, nn.Module):
        if not isinstance(source, hf_cls):
            raise ConfigError(f"expected a {hf_cls.__name__}, got {type(source).__name__}")
        return source
    s = None if isinstance(source, GPT2Config) else str(source)
    if hf_cls is not GPT2LMHeadModel and s is not None and not is_spec_source(s):
        local = Path(s).is_dir()
        with _LOAD_LOCK:
            try:
                return hf_cls.from_pretrained(s, local_files_only=local, **config_kwargs)
            except (OSError, ValueError) as e:
                raise ConfigError(f"cannot load a {hf_cls.__name__} from {s}: {e}") from None
    lm = load_model(source, seed=seed)
    if hf_cls is GPT2LMHeadModel and not config_kwargs:
        return lm
    config = copy.deepcopy(lm.config)
    for k, v in config_kwargs.items():
        setattr(config, k, v)
    with _LOAD_LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = hf_cls(config)
    base = model if hf_cls is GPT2Model else model.transformer
    base.load_state_dict(lm.transformer.state_dict())
    if hasattr(model, "lm_head") and getattr(model, "lm_head", None) is not None:
        model.lm_head.weight.data.copy_(lm.lm_head.weight.data)
    return model
