"""The model a :class:`splitlearn.client.SplitClient` works through, for any family (docs/MODELS.md).

GPT-2 sources and directories of exported segments keep :func:`~.modeling.split_segments` (a
``SplitGPT2LMHeadModel`` over the client's :class:`~splitlearn.model.segments.Segment`\\ s); a
source of any other family is loaded, checked against the server's model (config fields and the
weights at load: :func:`~.sources.check_same_model`) and split in place as
:class:`~.auto.AutoSplitModelForCausalLM` splits it (``Split<Name>``: the family's own class,
state-dict names, ``generate()``, micro-batches, row groups and federation).
"""
from __future__ import annotations

import copy
from typing import Optional

from torch import nn

from ..errors import ConfigError
from ..model.arch import arch_of
from ..model.loading import load_config, load_model
from .auto import split_family_model
from .modeling import _SPLIT_CLASSES, split_segments
from .remote import RemoteSegment
from .sources import _is_export, check_same_model, fingerprint_at_load


def is_gpt2_source(source) -> bool:
    """Whether ``source`` goes through the split GPT-2 classes: exported segments, GPT-2 sources,
    and any source whose config cannot be read here (its loader says why)."""
    if _is_export(source):
        return True
    try:
        return arch_of(load_config(source)).model_class() in _SPLIT_CLASSES
    except ConfigError:
        return True


def client_model(source, remote: RemoteSegment, device=None, seed: int = 0) -> tuple[nn.Module, Optional[list]]:
    """The client's split model of ``source`` at ``remote``'s cuts -> (model, segments): GPT-2,
    :func:`~.modeling.split_segments`' model and segments; any other family, its ``Split<Name>``
    (on ``device``; only the client's layers kept; a model given is copied) and None. ``ConfigError`` naming the fields
    (or weights) where ``source`` is not the server's model."""
    if is_gpt2_source(source):
        return split_segments(source, remote, device, seed)
    if isinstance(source, nn.Module):  # split in place below: the caller's model is left as it was
        source = copy.deepcopy(source)
    model = load_model(source, device=device, seed=seed)
    check_same_model(model.config, fingerprint_at_load(model, remote.info), remote.info)
    return split_family_model(model, remote), None


__all__ = ["client_model", "is_gpt2_source"]
