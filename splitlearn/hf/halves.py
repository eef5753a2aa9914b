"""The two halves of a split model's forward, for the features that run a batch in pieces
(micro-batch pipelining, :mod:`.pipeline`; row groups in generation, :mod:`.generation`):
``bottom_half`` (everything before the cut: what crosses it) and ``top_half`` (U-shape: the
client's last layers and the final norm on the server's output), and a way to run the head
class's own forward on a top half computed already (:meth:`Halves.precomputed`).

The split GPT-2 classes' trunk (:class:`~splitlearn.hf.trunk.SplitGPT2Model`) has these
itself; :class:`FamilyHalves` gives them to any family's
:class:`~splitlearn.hf.familytrunk.SplitDecoder`, computed as its forward computes them (the
adapter's positions, embeddings, layers and final norm: :mod:`splitlearn.model.arch`), so a
forward in pieces equals the forward of the whole batch.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
from transformers.modeling_outputs import BaseModelOutputWithPast

from ..errors import ConfigError
from .limits import check_positions


class FamilyHalves:
    """``bottom_half`` / ``top_half`` of a :class:`~splitlearn.hf.familytrunk.SplitDecoder`
    (``dec``), with the interface of :class:`~splitlearn.hf.trunk.SplitGPT2Model`'s."""

    defense_loss: Optional[torch.Tensor] = None  # no defenses on the other families' client yet

    def __init__(self, dec):
        self.dec = dec

    @property
    def u_shape(self) -> bool:
        return self.dec.u_shape

    @property
    def remote(self):
        return self.dec.remote

    @property
    def cuts(self) -> tuple:
        return self.dec.cuts

    def bottom_half(self, input_ids=None, cache=None, attention_mask=None, token_type_ids=None,
                    position_ids=None, inputs_embeds=None) -> tuple[torch.Tensor, dict]:
        """Embeddings and the client's first layers -> (what crosses the cut (B, T, d), what
        :meth:`top_half` needs). ``cache``: a remote cache (its ``local`` holds the client's
        layers' keys and values), or None."""
        dec = self.dec
        if dec.remote is None:
            raise ConfigError("this split model is not connected to a server (from_pretrained(..., server=URL))")
        if token_type_ids is not None:
            raise ConfigError("token_type_ids: GPT-2 only (docs/MODELS.md, 'Not yet')")
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        x = input_ids if input_ids is not None else inputs_embeds
        local = cache.local if cache is not None else None
        past = cache.get_seq_length() if cache is not None else 0
        T = x.shape[1]
        check_positions(dec.remote.info, dec.config, past + T, position_ids)  # before anything is sent
        if attention_mask is not None and attention_mask.ndim != 2:
            raise ConfigError("a split model takes a 2-D attention_mask (the server builds its own masks)")
        if position_ids is None:
            position_ids = dec.arch.positions(attention_mask, past, T, x.device)
        modules = {n: getattr(dec, n, None) for n in dec.arch.embed_names}
        hidden = dec.arch.embed(modules, position_ids, input_ids=input_ids, inputs_embeds=inputs_embeds,
                                attention_mask=attention_mask, past=past)  # (B, T, d)
        hidden = dec._run(0, dec.cuts[0], hidden, attention_mask, local, position_ids, None)
        return hidden, dict(mask=attention_mask, cache=cache, local=local, position_ids=position_ids)

    def top_half(self, hidden: torch.Tensor, ctx: dict) -> torch.Tensor:
        """U-shape: the server's output (B, T, d) through the client's last layers and the final
        norm (what the head multiplies)."""
        dec = self.dec
        hidden = dec._run(dec.cuts[1], dec.arch.n_layers, hidden, ctx["mask"], ctx["local"], ctx["position_ids"],
                          None)
        return dec.arch.head_hidden({n: getattr(dec, n, None) for n in dec.arch.norm_names}, hidden)

    @contextlib.contextmanager
    def precomputed(self, hidden: torch.Tensor, cache=None):
        """Within the block, the decoder's forward answers ``hidden`` (a :meth:`top_half`'s output)
        instead of computing: the family's own ``*ForCausalLM.forward`` then runs its head, softcap
        and loss on it."""
        dec = self.dec
        out = BaseModelOutputWithPast(last_hidden_state=hidden, cache=cache)
        dec.forward = lambda *args, **kwargs: out  # an instance attribute: nn.Module.__call__ finds it first
        try:
            yield
        finally:
            del dec.forward


@contextlib.contextmanager
def precomputed(halves, hidden: torch.Tensor, cache=None):
    """Within the block, the trunk's forward answers ``hidden`` (a ``top_half``'s output): the head
    class's own forward then runs its head and loss on it (GPT-2's trunk: its ``_precomputed``)."""
    if isinstance(halves, FamilyHalves):
        with halves.precomputed(hidden, cache):
            yield
        return
    from transformers.modeling_outputs import BaseModelOutputWithPastAndCrossAttentions

    halves._precomputed = BaseModelOutputWithPastAndCrossAttentions(last_hidden_state=hidden, cache=cache)
    try:
        yield
    finally:
        halves._precomputed = None


def halves_of(model):
    """The halves of a split head model: GPT-2's trunk (``model.transformer``) itself, or a
    :class:`FamilyHalves` over any family's decoder."""
    trunk = getattr(model, "transformer", None)
    if trunk is not None and hasattr(trunk, "bottom_half"):
        return trunk
    return FamilyHalves(model.split_decoder)
