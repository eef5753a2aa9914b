"""``SplitDecoder``: a family's base model (``LlamaModel``, ``Gemma2Model``, ...) with the
server's layers behind one :class:`~splitlearn.hf.remote.RemoteSegment` (``self.remote``), for
:class:`splitlearn.hf.auto.AutoSplitModelForCausalLM`.

It holds the base model's own modules under their own names (``embed_tokens``, ``layers``,
``norm``, ``rotary_emb``: the adapter's, :mod:`splitlearn.model.arch`), the server's layers as
parameterless :class:`~splitlearn.hf.trunk.ServerBlock` placeholders, so the split model's
state-dict names are the family's (``model.layers.3.self_attn.q_proj.weight``) and the family's
own ``*ForCausalLM`` (its head, softcap, ``logits_to_keep``, loss) runs on top::

    U-shape (cuts c1 < c2): embed -> layers[0:c1] -> remote (server layers[c1:c2]) -> layers[c2:n] -> norm
    2-way (cut c):          embed -> layers[0:c] -> (the split class sends it: server layers[c:n] + norm + head)

Positions: the given ``position_ids`` (generate() passes them), else derived from the 2-D mask
(``cumsum - 1``) as the server derives them for its layers: both sides rotate with the same
positions (docs/MODELS.md). Given ones (packed sequences, positions of the caller's own) go with
the training and evaluation requests (the wire's optional ``position_ids``), so the server's
layers use them too. Generation: a :class:`~splitlearn.hf.cache.RemoteCache` whose
``local`` cache holds the client's layers' keys and values (a slot per model layer) and whose
session holds the server's.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from transformers.modeling_outputs import BaseModelOutputWithPast

from ..errors import ConfigError
from ..model.arch import arch_of
from .limits import check_positions
from .remote import RemoteSegment
from .trunk import ServerBlock


class SplitDecoder(nn.Module):
    """The family's base model, the server's layers behind ``self.remote``. In 2-way its output is
    the bottom's (what crosses the cut), for :class:`splitlearn.hf.auto.SplitFamilyMixin`'s forward."""

    def __init__(self, base: nn.Module, cuts: tuple[int, ...], remote: Optional[RemoteSegment]):
        super().__init__()
        self.config = base.config
        self.arch = arch = arch_of(base.config)
        self.cuts = cuts
        self.u_shape = len(cuts) == 2
        c1, c2 = cuts if self.u_shape else (cuts[0], arch.n_layers)
        for name in arch.embed_names:
            setattr(self, name, getattr(base, name))
        layers = getattr(base, arch.layers_name)
        setattr(self, arch.layers_name, nn.ModuleList([ServerBlock(i) if c1 <= i < c2 else layers[i]
                                                       for i in range(arch.n_layers)]))
        for name in arch.norm_names:  # 2-way: the server holds the final norm
            setattr(self, name, getattr(base, name, None) if self.u_shape else None)
        rotary = getattr(base, "rotary_emb", None)
        if rotary is not None:
            self.rotary_emb = rotary
        self.remote = remote

    @property
    def layers_list(self) -> nn.ModuleList:
        return getattr(self, self.arch.layers_name)

    def get_input_embeddings(self):
        return getattr(self, self.arch.embed_names[0])

    def set_input_embeddings(self, value):
        setattr(self, self.arch.embed_names[0], value)

    def _run(self, start: int, end: int, hidden, mask, cache, positions, embeds):
        layers = [self.layers_list[i] for i in range(start, end)]
        return self.arch.run_layers(layers, start, hidden, mask, cache, positions,
                                    getattr(self, "rotary_emb", None), embeds)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                use_cache=None, past_key_values=None, **kwargs) -> BaseModelOutputWithPast:
        """As the family's base model's forward (what its ``*ForCausalLM`` calls)."""
        if self.remote is None:
            raise ConfigError("this split model is not connected to a server (from_pretrained(..., server=URL))")
        cache = cache if cache is not None else past_key_values
        remote_cache = cache if hasattr(cache, "remote") else None
        if cache is not None and remote_cache is None:
            raise ConfigError("a split model's cache must be its remote cache (model.new_cache()), not a plain "
                              "transformers Cache: the server keeps its layers' keys and values")
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        local = remote_cache.local if remote_cache is not None else None
        T = (input_ids if input_ids is not None else inputs_embeds).shape[1]
        past = remote_cache.get_seq_length() if remote_cache is not None else 0
        check_positions(self.remote.info, self.config, past + T, position_ids)  # before anything is sent
        given = position_ids  # the caller's own (packed sequences) travel with a training piece
        if attention_mask is not None and attention_mask.ndim != 2:
            raise ConfigError("a split model takes a 2-D attention_mask (the server builds its own masks)")
        if position_ids is None:
            position_ids = self.arch.positions(attention_mask, past, T,
                                               (input_ids if input_ids is not None else inputs_embeds).device)
        embeds_in = {n: getattr(self, n, None) for n in self.arch.embed_names}
        hidden = self.arch.embed(embeds_in, position_ids, input_ids=input_ids, inputs_embeds=inputs_embeds,
                                 attention_mask=attention_mask, past=past)  # (B, T, d)
        c1 = self.cuts[0]
        hidden = self._run(0, c1, hidden, attention_mask, local, position_ids, None)
        if not self.u_shape:
            return BaseModelOutputWithPast(last_hidden_state=hidden, cache=remote_cache)  # what crosses the cut
        c2 = self.cuts[1]
        if remote_cache is not None:
            hidden = remote_cache.remote(hidden, attention_mask)  # the server's session: its layers' KV
        else:
            hidden = self.remote.trunk(hidden, attention_mask, given)  # autograd over the wire
        hidden = self._run(c2, self.arch.n_layers, hidden, attention_mask, local, position_ids, None)
        hidden = self.arch.head_hidden({n: getattr(self, n, None) for n in self.arch.norm_names}, hidden)
        return BaseModelOutputWithPast(last_hidden_state=hidden, cache=remote_cache)
