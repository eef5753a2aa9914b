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

Its forward is the one every split model runs (:class:`~splitlearn.hf.splittrunk.SplitTrunk`, also
GPT-2's trunk): the embeddings, the client's layers, the privacy defenses (the model's ``defense``:
what crosses the cut, the NoPeek loss in :attr:`defense_loss`, the residual design, the gradient
defense), the server, the client's last layers and the final norm.

Positions: the given ``position_ids`` (generate() passes them), else, as the stock class given
none, ``arange`` past the cache (OPT: from the mask, its own rule), and with a generation cache from
the 2-D mask (``cumsum - 1``) as the server's session derives them. A training or evaluation request
carries the positions the client's layers used (the wire's optional ``position_ids``) where they
differ from those the server derives from the mask (a padded batch, packed sequences), so both
sides rotate with the same positions (docs/MODELS.md); an unpadded batch sends none. Generation: a
:class:`~splitlearn.hf.cache.RemoteCache` whose
``local`` cache holds the client's layers' keys and values (a slot per model layer) and whose
session holds the server's.
"""
from __future__ import annotations

from typing import Optional

from torch import nn
from transformers.modeling_outputs import BaseModelOutputWithPast

from ..model.arch import arch_of
from .remote import RemoteSegment
from .splittrunk import SplitTrunk
from .trunk import ServerBlock


class SplitDecoder(SplitTrunk, nn.Module):
    """The family's base model, the server's layers behind ``self.remote``. In 2-way its output is
    the bottom's (what crosses the cut), for :class:`splitlearn.hf.auto.SplitFamilyMixin`'s forward."""

    def __init__(self, base: nn.Module, cuts: tuple[int, ...], remote: Optional[RemoteSegment]):
        super().__init__()
        self.config = base.config
        arch = arch_of(base.config)
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

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                use_cache=None, past_key_values=None, **kwargs) -> BaseModelOutputWithPast:
        """As the family's base model's forward (what its ``*ForCausalLM`` calls)."""
        if self._precomputed is not None:  # a micro-batch's top half, computed by .pipeline
            return self._precomputed
        cache = cache if cache is not None else past_key_values
        hidden, remote_cache = self.split_forward(input_ids, cache, attention_mask, None, position_ids, inputs_embeds)
        return BaseModelOutputWithPast(last_hidden_state=hidden, cache=remote_cache)
