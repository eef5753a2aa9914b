"""A split GPT-2 that is a ``transformers`` model: ``SplitGPT2LMHeadModel``,
``SplitGPT2ForSequenceClassification``, ``SplitGPT2Model`` and :func:`split_model`.

The client keeps Hugging Face's own modules for what it holds (the token and position
embeddings, its ``GPT2Block``\\ s with their global ``layer_idx``, the final norm, the heads),
under the names the architecture adapter gives GPT-2 (:mod:`splitlearn.model.arch`); the blocks the
server holds are replaced by one :class:`~splitlearn.hf.remote.RemoteSegment` (``transformer.remote``)
and parameterless :class:`ServerBlock` placeholders in the trunk's layer list (so every client
parameter keeps its Hugging Face name, the stock class's state-dict names; peft's
``target_modules`` and ``state_dict`` loading work unchanged)::

    U-shape (cuts c1 < c2):  embed -> layers[0:c1] -> remote.trunk (server layers[c1:c2]) -> layers[c2:n] -> norm -> head
    2-way (cut c):           embed -> layers[0:c]  -> remote.loss (server layers[c:n] + norm + lm_head + loss)

A U-shape server holds only the trunk, so any head works (the labels never leave the
client); a 2-way server holds the final norm and the LM head, so only :class:`SplitGPT2LMHeadModel`
works there: training needs ``labels`` (the server computes the loss and answers only it:
``logits`` is None), evaluation under ``torch.no_grad()`` answers every position's logits. In
2-way the server's LM head is its own copy of the token embedding (untied), as with ``SplitClient``.

Positions, masks and losses are computed by the same code as ``GPT2Model`` (``position_ids``
default to ``arange`` past the cache, ``create_causal_mask``, ``self.loss_function``), so a
split forward equals the unsplit one (float32 wire).

**Generation hook** (``splitlearn/hf/cache.py``): when ``cache`` has a
``remote(hidden, attention_mask_2d)`` method and a ``local`` attribute (a ``DynamicCache`` with
a slot for every model layer), the client blocks read and extend ``local`` under their global
``layer_idx`` and the server's part is ``cache.remote(hidden, mask)`` instead of the
training ``Function``: U-shape, ``hidden`` (B, T_new, d) -> trunk output (B, T_new, d); 2-way,
the bottom's output -> the logits the server answers (B, k, V). ``mask`` is the 2-D mask of
the whole sequence so far (B, past + T_new), or None. ``cache.get_seq_length()``
gives the positions already seen. A cache with row groups (``cache.row_groups(B)``: two
rows or more where the server has cores of its own, :attr:`SplitGenerationMixin.overlap`) is
run by ``SplitGPT2LMHeadModel``'s forward one group at a time, both in flight
(``_grouped_forward``).
"""
from __future__ import annotations

from typing import Optional, Union

import torch
from torch import nn
from transformers import GenerationMixin, GPT2Config, GPT2ForSequenceClassification, GPT2LMHeadModel, GPT2Model
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
from transformers.modeling_outputs import CausalLMOutputWithCrossAttentions
from transformers.models.gpt2.modeling_gpt2 import GPT2PreTrainedModel
from transformers.utils.deprecation import deprecate_kwarg

from ..errors import ConfigError
from ..model.loading import load_model
from ..model.partition import partition
from . import pipeline
from .config import ModelOptions, RemoteConfig, SplitOptions, with_options
from .generation import SplitGenerationMixin, grouped_logits
from .mixin import SplitMixin
from .remote import RemoteSegment
from .sources import (KEPT_ATTR, _client_segments, _hf_from_segments, _is_export, check_same_model,
                      fingerprint_at_load, need_u_shape, split_into)
from .trunk import SplitGPT2Model


class SplitGPT2LMHeadModel(SplitMixin, SplitGenerationMixin, GPT2LMHeadModel):
    """``GPT2LMHeadModel`` split across this process and a splitlearn server (either shape)."""

    HF_CLASS = GPT2LMHeadModel
    causal_lm = True

    def __init__(self, config: GPT2Config):
        GPT2PreTrainedModel.__init__(self, config)
        self.transformer = SplitGPT2Model(config)
        if self.transformer.u_shape:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        else:  # the server holds the final norm and the LM head (its own copy of the token embedding: untied)
            self.lm_head = None
            self._tied_weights_keys = {}
        self.post_init()

    def get_output_embeddings(self):
        return self.lm_head

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")  # as GPT2LMHeadModel.forward
    def forward(self, input_ids=None, cache=None, attention_mask=None, token_type_ids=None,
                position_ids=None, inputs_embeds=None, encoder_hidden_states=None, encoder_attention_mask=None,
                labels=None, use_cache=None, logits_to_keep: Union[int, torch.Tensor] = 0, **kwargs):
        if pipeline.applies(self, labels, cache, inputs_embeds):
            out = pipeline.forward(self, super().forward, input_ids, attention_mask, labels, token_type_ids,
                                   position_ids, **kwargs)
            if out is not None:
                return out
        groups = cache.row_groups((input_ids if input_ids is not None else inputs_embeds).shape[0]) \
            if hasattr(cache, "row_groups") else None
        if groups:
            return self._grouped_forward(groups, cache, input_ids, attention_mask, token_type_ids, position_ids,
                                         inputs_embeds, labels, logits_to_keep)
        if self.transformer.u_shape:
            return self._add_defense_loss(super().forward(
                input_ids=input_ids, cache=cache, attention_mask=attention_mask,
                token_type_ids=token_type_ids, position_ids=position_ids, inputs_embeds=inputs_embeds,
                labels=labels, use_cache=use_cache, logits_to_keep=logits_to_keep, **kwargs))
        out = self.transformer(input_ids, cache=cache, attention_mask=attention_mask,
                               token_type_ids=token_type_ids, position_ids=position_ids,
                               inputs_embeds=inputs_embeds, use_cache=use_cache)
        h = out.last_hidden_state  # (B, T, d): the bottom's output, what crosses the cut
        mask = attention_mask.view(h.shape[0], -1) if attention_mask is not None else None
        remote = self.transformer.remote
        loss = logits = None
        if out.cache is not None and hasattr(out.cache, "remote"):
            # generation hook: the server's logits of the last k positions (generate: 1; assisted
            # decoding: the drafted ones + 1; a forward of its own: 0, all); indices: all, then select
            keep = logits_to_keep if isinstance(logits_to_keep, int) else 0
            logits = out.cache.remote(h, mask, logits_to_keep=keep)
            if not isinstance(logits_to_keep, int):
                logits = logits[:, logits_to_keep]
        elif torch.is_grad_enabled():
            if labels is None:
                raise ConfigError("a 2-way server holds the LM head and computes the loss: training (gradients "
                                  "enabled) needs labels; its logits never reach the client (under "
                                  "torch.no_grad() the forward answers them)")
            loss = remote.loss(h, labels.to(h.device), mask)
        else:
            logits, loss = remote.evaluate(h, mask, labels)
            if isinstance(logits_to_keep, int) and logits_to_keep:
                logits = logits[:, -logits_to_keep:]
        if loss is not None and kwargs.get("num_items_in_batch") is not None:
            # the server's loss is the mean over this batch's targets; HF's is the sum over the
            # accumulated batches' targets (Trainer's num_items_in_batch): rescale
            n = (labels[..., 1:] != -100).sum()
            loss = loss * (n.to(loss.dtype) / torch.as_tensor(kwargs["num_items_in_batch"]).to(loss))
        return self._add_defense_loss(CausalLMOutputWithCrossAttentions(loss=loss, logits=logits,
                                                                        cache=out.cache))


    def _grouped_forward(self, groups, cache, input_ids, attention_mask, token_type_ids, position_ids,
                         inputs_embeds, labels, logits_to_keep) -> CausalLMOutputWithCrossAttentions:
        """A generation step over a cache with row groups: :func:`~.generation.grouped_logits`
        (its docstring has the timeline) on this model's trunk and LM head."""
        if labels is not None:
            raise ConfigError("a cache with row groups is for generation (no labels)")
        logits = grouped_logits(self.transformer, self.lm_head, groups, cache, input_ids, attention_mask,
                                token_type_ids, position_ids, inputs_embeds, logits_to_keep)
        return CausalLMOutputWithCrossAttentions(logits=logits, cache=cache)


class SplitGPT2ForSequenceClassification(SplitMixin, GPT2ForSequenceClassification):
    """``GPT2ForSequenceClassification`` split across this process and a U-shape server."""

    HF_CLASS = GPT2ForSequenceClassification

    def __init__(self, config: GPT2Config):
        GPT2PreTrainedModel.__init__(self, config)
        self.num_labels = config.num_labels
        self.transformer = SplitGPT2Model(config)
        need_u_shape(self.transformer, type(self).__name__)
        self.score = nn.Linear(config.hidden_size, self.num_labels, bias=False)
        self.post_init()

    def forward(self, *args, **kwargs):
        return self._add_defense_loss(super().forward(*args, **kwargs))


_SPLIT_CLASSES = {GPT2LMHeadModel: SplitGPT2LMHeadModel,
                  GPT2ForSequenceClassification: SplitGPT2ForSequenceClassification}

# transformers recognises a causal LM by its class *name* in this table (the text-generation
# pipeline logs "is not supported for text-generation" otherwise; Trainer's label smoothing
# shifts the labels only of the names listed): list ours under a model type of its own, which no
# config has, so no Auto class ever resolves to it
MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.setdefault("splitlearn-gpt2", SplitGPT2LMHeadModel.__name__)


def _split_class(hf_cls: type) -> type:
    """The split class of a GPT-2 head class: ours, or ``Split<Name>`` made on the fly (any head
    whose forward calls ``self.transformer(...)``: token classification, QA, double heads...)."""
    if hf_cls in _SPLIT_CLASSES:
        return _SPLIT_CLASSES[hf_cls]
    if issubclass(hf_cls, SplitMixin):
        return hf_cls
    bases = (SplitMixin, SplitGenerationMixin, hf_cls) if issubclass(hf_cls, GenerationMixin) else (SplitMixin, hf_cls)
    made = type(f"Split{hf_cls.__name__}", bases, {"HF_CLASS": hf_cls, "__module__": __name__})
    _SPLIT_CLASSES[hf_cls] = made
    return made


@with_options(*SplitOptions.names(skip=("server", *ModelOptions.names())))
def split_model(model: nn.Module, server: Optional[str] = None, *, remote: Optional[RemoteSegment] = None,
                **options):
    """Split a Hugging Face GPT-2 (``GPT2Model``, ``GPT2LMHeadModel``, ``GPT2ForSequenceClassification``
    or any GPT-2 head class) against the splitlearn server at ``server``: **in place**, like
    peft's ``get_peft_model``. Its server-side blocks (and, 2-way, the final norm and the LM head)
    are dropped, its own modules are kept as they are (no copy), and it becomes the split
    class (``SplitGPT2LMHeadModel``, ...). Returns the model.

    ``options``: :class:`~splitlearn.hf.config.RemoteConfig`'s fields (the connection), e.g.
    ``min_client_blocks`` (default 1), ``expected_cuts``, ``shape`` (``"u"``: the labels stay
    here): the splits this client accepts (:class:`splitlearn.api.trust.Pins`); a server outside
    them is a ConfigError before anything is sent to it.
    """
    if remote is None:
        if server is None:
            raise ConfigError("split_model needs server=URL (or remote=RemoteSegment)")
        remote = RemoteSegment(RemoteConfig.given(server, options, "split_model"))
    elif options:
        raise ConfigError(f"split_model takes remote=RemoteSegment or the connection's options, not both "
                          f"({', '.join(sorted(options))})")
    if isinstance(model, SplitGPT2Model) or isinstance(model, SplitMixin):
        raise ConfigError("this model is split already")
    trunk_hf = model if isinstance(model, GPT2Model) else getattr(model, "transformer", None)
    if not isinstance(trunk_hf, GPT2Model) or getattr(model.config, "add_cross_attention", False):
        raise ConfigError(f"split_model splits Hugging Face GPT-2 models (a GPT2Model under .transformer, "
                          f"no cross-attention); got {type(model).__name__}")
    cls = SplitGPT2Model if isinstance(model, GPT2Model) else _split_class(type(model))
    return split_into(model, remote, cls, SplitGPT2Model)


def split_segments(source, remote: RemoteSegment, device=None, seed: int = 0) -> tuple:
    """The client's :class:`~splitlearn.model.segments.Segment`\\ s of ``source`` (a
    :func:`splitlearn.load_model` source, or a directory of exported segments) at ``remote``'s cuts
    (bottom; U-shape also top), and a :class:`SplitGPT2LMHeadModel` over ``remote`` whose modules
    are theirs (no copy) -> (model, segments)."""
    if _is_export(source):
        segments = [s.to(device) for s in _client_segments(source, remote)]
    else:
        m = load_model(source, device=device, seed=seed)
        fingerprint = fingerprint_at_load(m, remote.info)  # the whole model's: the server's parts too
        check_same_model(m.config, fingerprint, remote.info)
        parts = partition(m, remote.cuts)  # the server's segment dies with `m` and `parts`
        segments = [parts.bottom, parts.top] if remote.u_shape else [parts.bottom]
    hf = _hf_from_segments(GPT2LMHeadModel, segments)
    if not _is_export(source):
        setattr(hf, KEPT_ATTR, fingerprint)  # the server's parts were m's: the split model compares those
    return split_model(hf, remote=remote), segments
