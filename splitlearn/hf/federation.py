"""The federation modes (sequential, SplitFed) on the model classes.

Against a server started with ``--federation sequential`` or ``--federation splitfed``
(docs/FEDERATION.md), a model class trains in your own loop and shares its client-side weights
with :meth:`SplitMixin.sync <splitlearn.hf.mixin.SplitMixin.sync>`::

    model = SplitGPT2LMHeadModel.from_pretrained(src, server=url, client_id="owner-a")
    for batch in my_batches:               # this owner's turn (sequential) or round (splitfed)
        model(**batch).loss.backward(); opt.step(); opt.zero_grad()
    model.sync()                           # upload; splitfed: wait for the round, load the average

- The first forward of each step takes the turn (sequential: waits while another client holds
  it) and loads the shared client-side weights when this model is behind; every training
  request carries the version it holds (``fed_version``), which the server checks.
- A step the server refuses because those weights are stale (another member synced) or the
  turn lapsed is refused at its first forward, before anything of it exists on the server:
  the model loads the shared weights, takes the turn and runs that forward again, so your
  loop does not see it (:meth:`SplitMixin.__call__`).
- :meth:`sync` uploads the client's parameters under their Hugging Face names (a tied LM head
  once, under the embedding's name: what the server's schema takes, :mod:`splitlearn.server.federation.clientside`) and
  the rows trained since the last sync; sequential gives the turn back; splitfed waits until
  the round's other members have synced and loads the average.

The waiting and the version bookkeeping are :class:`splitlearn.hf.fedsync.FederationState`
(``SplitClient`` trains through these classes). With LoRA (``from_pretrained(..., lora=...)``)
only the client's adapters are shared (SplitLoRA: every member starts from the same adapters,
and a sync carries peft's names, :func:`splitlearn.hf.lora.adapter_tensors`). With a separate
fed server (``from_pretrained(..., fed_url=..., fed_token=...)``, a segment server started with
``--client-weights external``) the weights go to the fed server instead, with the segment
server's signed ticket, and come back from it.

Any family's split class (:class:`splitlearn.hf.auto.AutoSplitModelForCausalLM`: ``LlamaForCausalLM``,
``Gemma2ForCausalLM``, ...) takes part the same way (:class:`FamilyFederation`: ``sync()`` and the
step's first forward), its weights under the family's names (``model.layers.0.self_attn.q_proj.weight``).
"""
from __future__ import annotations

import torch
from torch import nn


def _named(model: nn.Module) -> dict[str, nn.Parameter]:
    """The client's parameters by Hugging Face name (``transformer.`` first for a bare GPT-2 trunk),
    less the remote segment's own parameter (the gradient proxy: not a weight)."""
    prefix = "transformer." if hasattr(model, "bottom_half") else ""  # SplitGPT2Model alone
    remote = getattr(model, "remote", None)
    skip = {id(p) for p in remote.parameters()} if isinstance(remote, nn.Module) else set()
    return {prefix + name: p for name, p in model.named_parameters() if id(p) not in skip}


def client_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The client's parameters by Hugging Face name, a tied one once (its first name), on the CPU."""
    return {name: p.detach().cpu().contiguous() for name, p in _named(model).items()}


def load_client_weights(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy shared client-side weights (Hugging Face names) into the model's parameters."""
    params = _named(model)
    with torch.no_grad():
        for name, t in tensors.items():
            if name in params:
                params[name].copy_(t.to(device=params[name].device, dtype=params[name].dtype))


def federation_of(model: nn.Module):
    """The model's :class:`~splitlearn.hf.fedsync.FederationState` (one ``GET
    /v1/federation`` the first time), loading shared weights into ``model``."""
    from .fedsync import FederationState

    remote = getattr(model, "transformer", model).remote
    if remote.federation is None:
        state = FederationState(remote.transport, remote.client_id, [], remote.cfg.wait_timeout_s, remote.fed)
        if getattr(model, "lora_spec", None) is not None:  # SplitLoRA: the adapters alone
            from .lora import load_adapters

            state.load_weights = lambda tensors: load_adapters(model, tensors)
        else:
            state.load_weights = lambda tensors: load_client_weights(model, tensors)
        remote.federation = state
    return remote.federation


def shared_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """What a sync uploads: the client's adapters (LoRA) or its parameters."""
    if getattr(model, "lora_spec", None) is not None:
        from .lora import adapter_tensors

        return adapter_tensors(model)
    return client_weights(model)


def sync_model(model, remote) -> dict:
    """A split model's ``sync()`` (any family; ``remote``: its segment): the end of its owner's
    turn or of its part of a round (:meth:`splitlearn.hf.mixin.SplitMixin.sync`)."""
    from ..errors import ConfigError

    remote.link.notice_zero_grad()
    if remote.pieces or remote.answered:
        raise ConfigError("sync() between optimizer steps: this step has pieces on the server "
                          "(optimizer.step() or zero_grad() first)")
    remote.flush()  # the last step's deferred apply, before the turn or the round closes
    fed = federation_of(model)
    status = fed.sync(shared_weights(model))
    optimizer = remote.link.attached
    if not fed.shared and optimizer is not None and remote.journal.on_disk:
        remote.journal.persist(optimizer)  # journal_dir: the server checkpoints at a sync; the average is loaded
    return status


class FamilyFederation:
    """The federation modes on any family's split class (see the module docstring): the step's
    first forward takes the turn and loads the shared weights (:meth:`__call__`), :meth:`sync`
    shares them. As :class:`splitlearn.hf.mixin.SplitMixin`'s, over ``self.remote``."""

    def __call__(self, *args, **kwargs):
        from ..errors import NotYourTurn, StaleWeights

        remote = self.remote
        if self.training:
            remote.steps.prepare(self)
        try:
            return super().__call__(*args, **kwargs)
        except (StaleWeights, NotYourTurn):
            if not remote.steps.refused_for_federation():
                raise
            remote.steps.prepare(self)  # the shared weights loaded, the turn taken: the forward again
            return super().__call__(*args, **kwargs)

    def sync(self) -> dict:
        """See :meth:`splitlearn.hf.mixin.SplitMixin.sync`."""
        return sync_model(self, self.remote)

    def flush(self):
        """Send the last optimizer step's apply now (see :meth:`splitlearn.hf.mixin.SplitMixin.flush`)."""
        return self.remote.flush()
