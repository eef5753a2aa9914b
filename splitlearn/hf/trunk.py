"""``SplitGPT2Model``: ``GPT2Model`` with the server's blocks behind one
:class:`~splitlearn.hf.remote.RemoteSegment` (``self.remote``) and :class:`ServerBlock`
placeholders in ``h``, the trunk of every split head model (:mod:`splitlearn.hf.modeling`'s
docstring has the layout, the shapes and the generation hook).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from torch.autograd.function import once_differentiable
from transformers import GPT2Config, GPT2Model
from transformers.modeling_outputs import BaseModelOutputWithPastAndCrossAttentions
from transformers.models.gpt2.modeling_gpt2 import GPT2Block, GPT2PreTrainedModel
from transformers.utils.deprecation import deprecate_kwarg

from ..errors import ConfigError
from ..model.partition import validate_cuts
from ..model.segments import embed, run_blocks
from .config import HEAD_OPTIONS, SplitOptions, with_options
from .limits import check_positions
from .remote import RemoteSegment
from .sources import CUTS_KEY, from_source



class ServerBlock(nn.Module):
    """Where block ``layer_idx`` would be: it is on the server (no parameters)."""

    def __init__(self, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx

    def extra_repr(self) -> str:
        return f"layer_idx={self.layer_idx}: on the server"

    def forward(self, *args, **kwargs):
        raise RuntimeError(f"block {self.layer_idx} is on the server: it runs through transformer.remote")


def _cuts(config: GPT2Config) -> tuple[int, ...]:
    cuts = getattr(config, CUTS_KEY, None)
    if cuts is None:
        raise ConfigError(f"a split model's config needs {CUTS_KEY!r} (the server's cuts): build it with "
                          f"from_pretrained(..., server=URL) or splitlearn.split_model(model, server=URL)")
    return validate_cuts(tuple(int(c) for c in cuts), config.n_layer)


class SplitGPT2Model(GPT2PreTrainedModel):
    """``GPT2Model`` with the server's blocks behind ``self.remote`` (see :mod:`splitlearn.hf.modeling`).

    In the U-shape its output is ``ln_f`` of the last block, as ``GPT2Model``'s; in 2-way it is
    the bottom's output (what crosses the cut), for :class:`SplitGPT2LMHeadModel`.
    """

    def __init__(self, config: GPT2Config, remote: Optional[RemoteSegment] = None):
        super().__init__(config)
        self.cuts = _cuts(config)
        self.u_shape = len(self.cuts) == 2
        n = config.n_layer
        server = range(self.cuts[0], self.cuts[1] if self.u_shape else n)
        self.embed_dim = config.hidden_size
        self.wte = nn.Embedding(config.vocab_size, self.embed_dim)
        self.wpe = nn.Embedding(config.max_position_embeddings, self.embed_dim)
        self.drop = nn.Dropout(config.embd_pdrop)
        self.h = nn.ModuleList([ServerBlock(i) if i in server else GPT2Block(config, layer_idx=i)
                                for i in range(n)])
        self.ln_f = nn.LayerNorm(self.embed_dim, eps=config.layer_norm_epsilon) if self.u_shape else None
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

    @property
    def client_blocks(self) -> list[tuple[int, int]]:
        """The client's block ranges: ``[(0, c1), (c2, n)]`` (U-shape) or ``[(0, c)]``."""
        n = self.config.n_layer
        return [(0, self.cuts[0]), (self.cuts[1], n)] if self.u_shape else [(0, self.cuts[0])]

    def get_input_embeddings(self):
        return self.wte

    def set_input_embeddings(self, new_embeddings):
        self.wte = new_embeddings

    def _run_blocks(self, start: int, end: int, hidden, attention_mask, cache, position_ids, embeds):
        """Blocks ``[start, end)``: :func:`splitlearn.model.segments.run_blocks`, as a segment runs them."""
        return run_blocks([self.h[i] for i in range(start, end)], self.config, start, hidden, attention_mask, cache,
                          position_ids, embeds)

    #: the NoPeek-style loss of the last forward with gradients (None: no defense, or one without
    #: a loss); the head models add it to the loss they compute
    defense_loss: Optional[torch.Tensor] = None

    def _defended(self, hidden: torch.Tensor, inputs_embeds: torch.Tensor) -> torch.Tensor:
        """The remote segment's defense (``remote.defense``, a :class:`splitlearn.privacy.Defense`)
        applied to the bottom's output ``hidden`` (B, T, d) — differentiable, so the client's
        gradients see it — and its extra loss kept in :attr:`defense_loss`."""
        self.defense_loss = None
        defense = getattr(self.remote, "defense", None)
        if defense is None:
            return hidden
        if torch.is_grad_enabled():
            self.defense_loss = defense.loss(inputs_embeds, hidden)  # token embeddings, as SplitClient
        return defense.apply(hidden)

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
        hidden, ctx = self.bottom_half(input_ids, cache, attention_mask, token_type_ids, position_ids,
                                       inputs_embeds)
        remote_cache = ctx["cache"]
        if self.u_shape:
            if remote_cache is not None:
                hidden = remote_cache.remote(hidden, ctx["mask"])  # generation: the server's KV cache
            else:
                hidden = self.remote.trunk(hidden, ctx["mask"])  # autograd over the wire
            hidden = self.top_half(hidden, ctx)
        return BaseModelOutputWithPastAndCrossAttentions(last_hidden_state=hidden,
                                                         cache=remote_cache if use_cache or
                                                         remote_cache is not None else None)

    #: set by :mod:`splitlearn.hf.pipeline` while a head runs on one micro-batch's output
    _precomputed: Optional[BaseModelOutputWithPastAndCrossAttentions] = None

    def bottom_half(self, input_ids=None, cache=None, attention_mask=None, token_type_ids=None,
                    position_ids=None, inputs_embeds=None) -> tuple[torch.Tensor, dict]:
        """Everything before the cut: embeddings, the client's first blocks, the defense ->
        (what crosses the cut (B, T, d), what :meth:`top_half` needs)."""
        if self.remote is None:
            raise ConfigError("this split model is not connected to a server (from_pretrained(..., server=URL))")
        if input_ids is not None and inputs_embeds is not None:
            raise ValueError("You cannot specify both input_ids and inputs_embeds at the same time")
        if input_ids is not None:
            self.warn_if_padding_and_no_attention_mask(input_ids, attention_mask)
            input_shape = input_ids.size()
            input_ids = input_ids.view(-1, input_shape[-1])
            batch_size = input_ids.shape[0]
        elif inputs_embeds is not None:
            input_shape = inputs_embeds.size()[:-1]
            batch_size = inputs_embeds.shape[0]
        else:
            raise ValueError("You have to specify either input_ids or inputs_embeds")
        remote_cache = cache if hasattr(cache, "remote") else None
        if cache is not None and remote_cache is None:
            raise ConfigError("a split model's cache must be its remote cache (with .remote and "
                              ".local), not a plain transformers Cache: the server keeps its blocks' KV")
        if getattr(remote_cache, "groups", None):
            raise ConfigError("a cache with row groups runs through SplitGPT2LMHeadModel's forward")
        local = remote_cache.local if remote_cache is not None else None
        past_seen = remote_cache.get_seq_length() if remote_cache is not None else 0
        check_positions(self.remote.info, self.config, past_seen + input_shape[-1], position_ids)  # before wpe
        if token_type_ids is not None:
            token_type_ids = token_type_ids.view(-1, input_shape[-1])
        if inputs_embeds is None:
            inputs_embeds = self.wte(input_ids)
        if position_ids is None:
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen
            position_ids = position_ids.unsqueeze(0)
        if attention_mask is not None:
            if attention_mask.ndim == 4:
                raise ConfigError("a split model takes a 2-D attention_mask (the server builds its own causal mask)")
            attention_mask = attention_mask.view(batch_size, -1)
        hidden = embed(self.wte, self.wpe, self.drop, position_ids, inputs_embeds=inputs_embeds,
                       token_type_ids=token_type_ids)
        output_shape = (-1,) + tuple(input_shape[1:]) + (hidden.size(-1),)
        (a, b) = self.client_blocks[0]
        hidden = self._run_blocks(a, b, hidden, attention_mask, local, position_ids, inputs_embeds)
        clean = hidden
        hidden = self._defended(hidden, inputs_embeds)  # what crosses the cut
        residual = self.u_shape and getattr(getattr(self.remote, "defense", None), "residual", False)
        return hidden, dict(mask=attention_mask, cache=remote_cache, local=local, position_ids=position_ids,
                            embeds=inputs_embeds, output_shape=output_shape,
                            residual=(clean, hidden) if residual else None)

    def top_half(self, hidden: torch.Tensor, ctx: dict) -> torch.Tensor:
        """U-shape: the trunk's output (B, T, d) through the client's last blocks and ``ln_f``. With
        a defense's residual design (``GaussianNoise(residual=True)``), the server's update (its
        output minus what was sent) is added to the client's clean activations first. With a
        gradient defense (``GaussianNoise(grad_clip=..., grad_sigma=...)``), the gradient the
        client sends back for ``hidden`` is clipped and noised (:class:`_DefendGradient`)."""
        defense = getattr(self.remote, "defense", None)
        if getattr(defense, "defends_gradient", False) and torch.is_grad_enabled() and hidden.requires_grad:
            hidden = _DefendGradient.apply(hidden, defense)
        if ctx.get("residual") is not None:
            clean, sent = ctx["residual"]
            hidden = clean + (hidden - sent)  # (B, T, d)
        (a, b) = self.client_blocks[1]
        hidden = self._run_blocks(a, b, hidden, ctx["mask"], ctx["local"], ctx["position_ids"], ctx["embeds"])
        return self.ln_f(hidden).view(ctx["output_shape"])


class _DefendGradient(torch.autograd.Function):
    """Identity forward on the trunk's output (B, T, d); backward: the defense's
    ``defend_gradient`` (clip per token + noise) on the gradient sent back to the server, so the
    server's blocks and the client's bottom train from what was sent. The client's own paths
    (the residual design's clean stream) keep the clean gradient."""

    @staticmethod
    def forward(ctx, hidden, defense):
        ctx.defense = defense
        return hidden.view_as(hidden)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        return ctx.defense.defend_gradient(grad), None
