"""Where a split model's client-side modules come from: a :func:`splitlearn.load_model` source
or a directory of exported segments, checked against the server's ``/v1/info``."""
from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Optional

import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel, GPT2Model

from ..api.fingerprint import config_differences, weight_differences, weight_parts
from ..errors import ConfigError
from ..model.arch import arch_of
from ..model.export import load_segments
from ..model.loading import _LOAD_LOCK, is_spec_source, load_model
from .remote import RemoteSegment
from .unsplit import is_split_folder, load_split_folder, stock_loss_type

log = logging.getLogger(__name__)


FINGERPRINT_KEY = "splitlearn_fingerprint"  # config: {"dtype", "parts"}, the weights at load (api/fingerprint.py)
# a model's own attribute: the fingerprint of the weights its first session loaded, kept where they
# changed since (a split model's folder, merge_and_unload's model, the segments SplitClient holds)
KEPT_ATTR = "_splitlearn_fingerprint"


def _check_config(cfg, info: dict) -> None:
    """ConfigError naming every config field (family, sizes, rope settings, vocabulary...) in which
    the local model differs from the server's (:func:`splitlearn.api.fingerprint.config_differences`)."""
    differ = config_differences(cfg.to_dict(), info["model_config"])
    if differ:
        family = [d for d in differ if d.startswith("model_type:")]  # another family first: the rest follows from it
        shown = (family + [d for d in differ if d not in family])[:8]
        more = f"; and {len(differ) - len(shown)} more" if len(differ) > len(shown) else ""
        raise ConfigError("this model is not the server's: its config differs in " + "; ".join(shown) + more +
                          ". Load the same checkpoint on both sides (the same spec and --seed, directory or hub id)")


def fingerprint_at_load(model: nn.Module, info: dict) -> Optional[dict]:
    """The digests of ``model``'s parts as loaded (:func:`splitlearn.api.fingerprint.weight_parts`, in
    the server's compute dtype): the one the model keeps where it has one (:data:`KEPT_ATTR`: a split
    model's own folder, ``merge_and_unload``'s model: the weights their first session loaded), else
    made now of the whole model (parts this side never held, on the meta device, left out). None
    where the server publishes none."""
    kept = getattr(model, KEPT_ATTR, None)
    if kept:
        return kept
    theirs = info.get("fingerprint")
    if not theirs:
        return None
    dtype = getattr(torch, theirs["dtype"], None)
    return {"dtype": theirs["dtype"], "parts": weight_parts(model.state_dict(), dtype)}


def check_same_model(cfg, fingerprint: Optional[dict], info: dict) -> None:
    """Refuse a model that is not the server's, naming what differs: the config's fields, or the
    weights at load (the parts whose digests differ). Where this side never held the server's parts
    (exported segments) only the config is compared, and a log line says so."""
    _check_config(cfg, info)
    theirs = info.get("fingerprint")
    if not theirs or not fingerprint:
        return
    if fingerprint.get("dtype") != theirs.get("dtype"):
        log.warning("the weights at load are not compared: this model's fingerprint was made in %s, the server "
                    "computes in %s", fingerprint.get("dtype"), theirs.get("dtype"))
        return
    differ, unknown = weight_differences(fingerprint["parts"], theirs["parts"])
    if differ:
        raise ConfigError(f"this model is not the server's: the weights at load differ in {len(differ)} of the "
                          f"server's {len(theirs['parts'])} parts ({', '.join(differ[:4])}"
                          f"{', ...' if len(differ) > 4 else ''}). Load the same checkpoint on both sides (the "
                          f"same spec and --seed, directory or hub id; compared are the weights each side loaded, "
                          f"before any training)")
    if unknown:
        log.info("the server's parts %s are not compared: this side never held them", ", ".join(unknown[:4]))


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
    arch = arch_of(config)
    t = hf if isinstance(hf, GPT2Model) else arch.base_of(hf)
    for name in arch.embed_names:
        setattr(t, name, getattr(segments[0], name))
    layers = getattr(t, arch.layers_name)
    for seg in segments:
        for j, block in enumerate(seg.layers_list):
            layers[seg.start + j] = block
    if len(segments) == 2:  # U-shape: the top holds the final norm and the LM head
        for name in arch.norm_names:
            setattr(t, name, getattr(segments[1], name))
        if getattr(hf, "lm_head", None) is not None:
            hf.lm_head = segments[1].head_module
    device = getattr(segments[0], arch.embed_names[0]).weight.device
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
    fingerprint = fingerprint_at_load(model, remote.info)  # before the server's parts are dropped
    check_same_model(model.config, fingerprint, remote.info)  # first: another family is named as such
    arch = arch_of(model.config)
    trunk_hf = model if isinstance(model, GPT2Model) else arch.base_of(model)
    loss_type = stock_loss_type(type(model), model.config)  # the unsplit class's, whatever transformers does
    config = copy.deepcopy(model.config)
    setattr(config, CUTS_KEY, list(remote.cuts))
    if fingerprint:
        setattr(config, FINGERPRINT_KEY, fingerprint)  # kept by save_pretrained: the next session compares it
    if config.pad_token_id is None and config.eos_token_id is not None and not isinstance(model, GPT2LMHeadModel):
        # a head that pools the last token (sequence classification) refuses a batch of more than
        # one row without a pad token: GPT-2 has none, and transformers advises its eos
        config.pad_token_id = config.eos_token_id
    with torch.device("meta"):
        trunk = trunk_cls(config)
    for name in arch.embed_names:  # the adapter's names of the parts (the stock model's)
        setattr(trunk, name, getattr(trunk_hf, name))
    theirs, ours = getattr(trunk_hf, arch.layers_name), getattr(trunk, arch.layers_name)
    for a, b in trunk.client_blocks:
        for i in range(a, b):
            ours[i] = theirs[i]
    if trunk.u_shape:
        for name in arch.norm_names:
            setattr(trunk, name, getattr(trunk_hf, name))
    trunk.remote = remote
    if isinstance(model, GPT2Model):
        need_u_shape(trunk, trunk_cls.__name__)
        remote.link.bind(trunk)
        return trunk
    if not trunk.u_shape and not issubclass(cls, GPT2LMHeadModel):
        need_u_shape(trunk, cls.__name__)
    model.transformer = trunk
    model.config = config
    if not trunk.u_shape:  # the server holds the final norm and the LM head
        model.lm_head = None
        model._tied_weights_keys = {}
    model.__class__ = cls
    # the unsplit class's loss_type (GPT2LMHeadModel: None), not a name of ours: Trainer counts a
    # step's targets by it (labels[..., 1:] only for a ForCausalLM loss), as for the unsplit model
    model.loss_type = loss_type
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
        elif is_split_folder(source):  # a split model's own save_pretrained: the client's weights
            hf = load_split_folder(hf_cls, source, seed, **kwargs)
            setattr(hf, KEPT_ATTR, getattr(hf.config, FINGERPRINT_KEY, None))  # of the weights first loaded
        else:
            hf = _load_hf(hf_cls, source, seed, **kwargs)
        return split_into(hf, remote, cls, trunk_cls).eval()
    except BaseException:
        remote.close()
        raise
