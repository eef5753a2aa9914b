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
  once, as ``wte``: what the server's schema takes, :mod:`splitlearn.server.federation.clientside`) and
  the rows trained since the last sync; sequential gives the turn back; splitfed waits until
  the round's other members have synced and loads the average.

The waiting and the version bookkeeping are :class:`splitlearn.hf.fedsync.FederationState`
(``SplitClient`` trains through these classes). With LoRA (``from_pretrained(..., lora=...)``)
only the client's adapters are shared (SplitLoRA: every member starts from the same adapters,
and a sync carries peft's names, :func:`splitlearn.hf.lora.adapter_tensors`). With a separate
fed server (``from_pretrained(..., fed_url=..., fed_token=...)``, a segment server started with
``--client-weights external``) the weights go to the fed server instead, with the segment
server's signed ticket, and come back from it.
"""
from __future__ import annotations

import torch
from torch import nn


REMOTE = "transformer.remote."  # the remote segment's own parameter (the gradient proxy) is not a weight


def _named(model: nn.Module) -> dict[str, nn.Parameter]:
    """The client's parameters by Hugging Face name (``transformer.`` first for a bare trunk)."""
    prefix = "" if hasattr(model, "transformer") else "transformer."
    return {prefix + name: p for name, p in model.named_parameters() if not (prefix + name).startswith(REMOTE)}


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
