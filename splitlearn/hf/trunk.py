"""``SplitGPT2Model``: ``GPT2Model`` with the server's blocks behind one
:class:`~splitlearn.hf.remote.RemoteSegment` (``self.remote``) and :class:`ServerBlock`
placeholders in its layer list, the trunk of every split GPT-2 head model (:mod:`splitlearn.hf.modeling`'s
docstring has the layout, the shapes and the generation hook). Its forward is every family's
(:class:`~splitlearn.hf.splittrunk.SplitTrunk`: embeddings, layers, defenses, the server, the final
norm), its parts under the names the adapter gives GPT-2 (:mod:`splitlearn.model.arch`).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from transformers import GPT2Config, GPT2Model
from transformers.modeling_outputs import BaseModelOutputWithPastAndCrossAttentions
from transformers.models.gpt2.modeling_gpt2 import GPT2Block, GPT2PreTrainedModel
from transformers.utils.deprecation import deprecate_kwarg

from ..errors import ConfigError
from ..model.arch import arch_of
from ..model.partition import validate_cuts
from .config import HEAD_OPTIONS, SplitOptions, with_options
from .remote import RemoteSegment
from .sources import CUTS_KEY, from_source
from .splittrunk import SplitTrunk, _DefendGradient  # noqa: F401 - _DefendGradient: its old home



class ServerBlock(nn.Module):
    """Where block ``layer_idx`` would be: it is on the server (no parameters)."""

    def __init__(self, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx

    def extra_repr(self) -> str:
        return f"layer_idx={self.layer_idx}: on the server"

    def forward(self, *args, **kwargs):
        raise RuntimeError(f"block {self.layer_idx} is on the server: it runs through the trunk's remote")


def _cuts(config: GPT2Config) -> tuple[int, ...]:
    cuts = getattr(config, CUTS_KEY, None)
    if cuts is None:
        raise ConfigError(f"a split model's config needs {CUTS_KEY!r} (the server's cuts): build it with "
                          f"from_pretrained(..., server=URL) or splitlearn.split_model(model, server=URL)")
    return validate_cuts(tuple(int(c) for c in cuts), config.num_hidden_layers)


class SplitGPT2Model(SplitTrunk, GPT2PreTrainedModel):
    """``GPT2Model`` with the server's blocks behind ``self.remote`` (see :mod:`splitlearn.hf.modeling`).

    In the U-shape its output is the final norm of the last block, as ``GPT2Model``'s; in 2-way it
    is the bottom's output (what crosses the cut), for :class:`SplitGPT2LMHeadModel`.
    """

    output_class = BaseModelOutputWithPastAndCrossAttentions
    sends_positions = False  # learned positions: the server's blocks take none
    positions_from_mask = False  # arange past the cache, as GPT2Model

    def __init__(self, config: GPT2Config, remote: Optional[RemoteSegment] = None):
        super().__init__(config)
        self.cuts = _cuts(config)
        self.u_shape = len(self.cuts) == 2
        arch = arch_of(config)
        n = arch.n_layers
        server = range(self.cuts[0], self.cuts[1] if self.u_shape else n)
        self.embed_dim = d = config.hidden_size
        tokens, positions, dropout = arch.embed_names  # learned positions: token, position, dropout
        setattr(self, tokens, nn.Embedding(config.vocab_size, d))
        setattr(self, positions, nn.Embedding(config.max_position_embeddings, d))
        setattr(self, dropout, nn.Dropout(config.embd_pdrop))
        setattr(self, arch.layers_name, nn.ModuleList([ServerBlock(i) if i in server else GPT2Block(config, layer_idx=i)
                                                       for i in range(n)]))
        for name in arch.norm_names:  # 2-way: the server holds the final norm
            setattr(self, name, nn.LayerNorm(d, eps=config.layer_norm_epsilon) if self.u_shape else None)
        self.gradient_checkpointing = False
        self.post_init()
        self.remote = remote

    @classmethod
    @with_options(*SplitOptions.names(skip=HEAD_OPTIONS))
    def from_pretrained(cls, source, *model_args, **kwargs):
        """The trunk alone (``GPT2Model``'s output, U-shape servers): see :meth:`SplitMixin.from_pretrained`
        (its options less a head's: ``defense``, ``lora``, ``micro_batches``)."""
        return from_source(GPT2Model, source, SplitOptions.take(kwargs, skip=HEAD_OPTIONS), cls, cls, **kwargs)

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        self.remote.link.attach(optimizer)
        return optimizer

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        if self.remote is not None:
            self.remote.steps.discard()

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")  # as GPT2Model.forward
    def forward(self, input_ids: Optional[torch.LongTensor] = None, cache=None,
                attention_mask: Optional[torch.Tensor] = None, token_type_ids: Optional[torch.LongTensor] = None,
                position_ids: Optional[torch.LongTensor] = None, inputs_embeds: Optional[torch.Tensor] = None,
                use_cache: Optional[bool] = None, return_dict: Optional[bool] = None,
                **kwargs) -> BaseModelOutputWithPastAndCrossAttentions:
        """As ``GPT2Model.forward``; the server's blocks run remotely (see :mod:`splitlearn.hf.modeling`).
        ``cache``: None, or a remote cache (``.remote``, ``.local``; the generation hook)."""
        if self._precomputed is not None:  # a micro-batch's output, computed by .pipeline
            return self._precomputed
        hidden, remote_cache = self.split_forward(input_ids, cache, attention_mask, token_type_ids, position_ids,
                                                  inputs_embeds)
        return BaseModelOutputWithPastAndCrossAttentions(last_hidden_state=hidden,
                                                         cache=remote_cache if use_cache or
                                                         remote_cache is not None else None)
