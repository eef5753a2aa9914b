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
from ..model.loading import _LOAD_LOCK, is_spec_source, load_model, name_causal_lm_loss
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


CUTS_KEY = "splitlearn_cuts"  # the config attribute naming the server's cuts


def need_u_shape(trunk, what: str) -> None:
    if not trunk.u_shape:
        raise ConfigError(f"{what} needs a U-shape server (two cuts: it holds only the trunk); this one "
                          f"holds the top with the LM head (cut {trunk.cuts[0]}), which serves "
                          f"SplitGPT2LMHeadModel only")


def split_into(model: nn.Module, remote: RemoteSegment, cls: type, trunk_cls: type) -> nn.Module:
    """Make the Hugging Face GPT-2 ``model`` (checked by :func:`splitlearn.hf.modeling.split_model`)
    the split class ``cls`` over a ``trunk_cls`` (``SplitGPT2Model``) at ``remote``'s cuts, in
    place: its server-side blocks dropped, its own modules kept (no copy). A ``GPT2Model``
    becomes the trunk itself. Returns the model."""
    trunk_hf = model if isinstance(model, GPT2Model) else model.transformer
    _check_config(model.config, remote.info)
    config = copy.deepcopy(model.config)
    setattr(config, CUTS_KEY, list(remote.cuts))
    if config.pad_token_id is None and config.eos_token_id is not None and not isinstance(model, GPT2LMHeadModel):
        # a head that pools the last token (sequence classification) refuses a batch of more than
        # one row without a pad token: GPT-2 has none, and transformers advises its eos
        config.pad_token_id = config.eos_token_id
    with torch.device("meta"):
        trunk = trunk_cls(config)
    trunk.wte, trunk.wpe, trunk.drop = trunk_hf.wte, trunk_hf.wpe, trunk_hf.drop
    for a, b in trunk.client_blocks:
        for i in range(a, b):
            trunk.h[i] = trunk_hf.h[i]
    if trunk.u_shape:
        trunk.ln_f = trunk_hf.ln_f
    trunk.remote = remote
    if isinstance(model, GPT2Model):
        need_u_shape(trunk, trunk_cls.__name__)
        remote.link.bind(trunk)
        return trunk
    if not trunk.u_shape and not issubclass(cls, GPT2LMHeadModel):
        need_u_shape(trunk, cls.__name__)
    model.transformer = trunk
    model.config = config
    if not trunk.u_shape:  # the server holds ln_f and the LM head
        model.lm_head = None
        model._tied_weights_keys = {}
    model.__class__ = cls
    name_causal_lm_loss(model)  # a language model's loss, named: no transformers warning at every loss
    remote.link.bind(model)
    return model


def from_source(hf_cls: type, source, options, cls: type, trunk_cls: type, **kwargs) -> nn.Module:
    """``cls.from_pretrained``: ``source`` (a :func:`splitlearn.load_model` source or an export
    directory) as ``hf_cls``, split into ``cls`` over ``trunk_cls`` against a new
    :class:`RemoteSegment` of ``options`` (a :class:`~splitlearn.hf.config.SplitOptions`).
    ``kwargs``: the head's config (``num_labels=3``)."""
    seed = options.seed
    remote = RemoteSegment(options.remote_config)
    try:
        if _is_export(source):  # export_segments' directory: the client's segments, as SplitClient takes it
            hf = _hf_from_segments(hf_cls, _client_segments(source, remote), seed, **kwargs)
        else:
            hf = _load_hf(hf_cls, source, seed, **kwargs)
        return split_into(hf, remote, cls, trunk_cls).eval()
    except BaseException:
        remote.close()
        raise
