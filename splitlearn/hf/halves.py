"""The two halves of a split model's forward, for the features that run a batch in pieces
(micro-batch pipelining, :mod:`.pipeline`; row groups in generation, :mod:`.generation`):
``bottom_half`` (everything before the cut: what crosses it) and ``top_half`` (U-shape: the
client's last layers and the final norm on the server's output), and a way to run the head
class's own forward on a top half computed already (:func:`precomputed`).

Every split model's trunk has them, one implementation for GPT-2's
(:class:`~splitlearn.hf.trunk.SplitGPT2Model`) and any family's
(:class:`~splitlearn.hf.familytrunk.SplitDecoder`): :class:`~splitlearn.hf.splittrunk.SplitTrunk`,
computed as its forward computes them (the adapter's positions, embeddings, layers and final norm,
:mod:`splitlearn.model.arch`, and the defenses), so a forward in pieces equals the forward of the
whole batch.
"""
from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def precomputed(halves, hidden: torch.Tensor, cache=None):
    """Within the block, the trunk's forward answers ``hidden`` (a ``top_half``'s output): the head
    class's own forward then runs its head (the family's softcap) and loss on it."""
    halves._precomputed = halves.output_class(last_hidden_state=hidden, cache=cache)
    try:
        yield
    finally:
        halves._precomputed = None


def halves_of(model):
    """The halves of a split head model: its trunk (GPT-2's ``model.transformer``, a family's
    :class:`~splitlearn.hf.familytrunk.SplitDecoder`)."""
    trunk = getattr(model, "split_decoder", None)
    return trunk if trunk is not None else model.transformer
