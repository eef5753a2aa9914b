"""``AutoSplitModelForCausalLM``: one entry for every family (docs/MODELS.md).

``AutoSplitModelForCausalLM.from_pretrained(source, server=URL, token=...)`` loads ``source`` (a
:func:`splitlearn.load_model` source: a ``save_pretrained`` directory, a config, a model, a hub
id, a spec) as the family's own transformers class (``LlamaForCausalLM``, ``Gemma2ForCausalLM``,
...), checks it is the server's model (config fields and the weights at load), and splits it in
place against the server's cuts: the base model becomes a :class:`~.familytrunk.SplitDecoder`
(the server's layers behind one :class:`~.remote.RemoteSegment`), the class a ``Split<Name>``
subclass of the family's, so ``forward``/``loss``/``backward``, ``generate()`` and the
state-dict names are the family's. GPT-2 sources go to :class:`~.modeling.SplitGPT2LMHeadModel`
(every feature of the split GPT-2 classes).

2-way: the server holds the final norm and the head; training needs ``labels`` (the server
answers the loss), ``torch.no_grad()`` forwards answer the logits, generation the last positions'
logits. Micro-batch pipelining (:class:`~.pipeline.FamilyPipeline`), row groups in generation
(:class:`~.generation.FamilyRowGroups`) and the federation modes (:class:`~.federation.FamilyFederation`)
are mixed into every ``Split<Name>``, and the privacy defenses (``defense=``: the same
:class:`~.splittrunk.SplitTrunk` as GPT-2's trunk applies them). What the other families do not have
yet (docs/MODELS.md, "Not yet"): exported-segment and split-folder sources.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from transformers import GenerationMixin
from transformers.modeling_outputs import CausalLMOutputWithPast

from ..errors import ConfigError
from ..model.arch import arch_of
from ..model.loading import load_config, load_model
from .config import RemoteConfig
from .familytrunk import SplitDecoder
from .federation import FamilyFederation
from .generation import FamilyRowGroups, SplitGenerationMixin
from .lora import apply_lora
from .modeling import _SPLIT_CLASSES, SplitGPT2LMHeadModel
from .pipeline import FamilyPipeline
from .remote import RemoteSegment
from .sources import check_same_model, fingerprint_at_load
from .splittrunk import DefendedModel


class SplitFamilyMixin(DefendedModel):
    """What a split model of any family adds to the family's ``*ForCausalLM`` (``defense`` and
    ``defense_loss``: :class:`~.splittrunk.DefendedModel`, as the split GPT-2 classes)."""

    causal_lm = False  # generate() runs no row groups here (SplitGPT2LMHeadModel's forward does)

    @property
    def split_decoder(self) -> SplitDecoder:
        return arch_of(self.config).base_of(self)

    @property
    def split_trunk(self) -> SplitDecoder:
        return self.split_decoder

    @property
    def remote(self) -> RemoteSegment:
        return self.split_decoder.remote

    def overlaps(self) -> bool:
        return False

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                labels=None, use_cache=None, logits_to_keep=0, **kwargs):
        """The family's forward (U-shape); 2-way: the bottom here, the rest and the loss on the server."""
        dec = self.split_decoder
        if attention_mask is None and position_ids is not None and not hasattr(cache, "remote") and \
                (use_cache if use_cache is not None else getattr(self.config, "use_cache", False)):
            # the family's base model makes a cache here (use_cache), and with one transformers builds a
            # plain causal mask, not the packed sequences' mask it reads from restarting positions
            # without one: an all-ones mask builds the plain one on both sides of the cut
            ids = input_ids if input_ids is not None else inputs_embeds
            attention_mask = torch.ones(ids.shape[:2], dtype=torch.long, device=ids.device)
        if dec.u_shape:
            out = super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                  cache=cache, inputs_embeds=inputs_embeds, labels=labels, use_cache=use_cache,
                                  logits_to_keep=logits_to_keep, **kwargs)
            # a micro-batch's head (dec._precomputed: .pipeline adds the defense's loss itself)
            return out if dec._precomputed is not None else self._add_defense_loss(out)
        out = dec(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                  inputs_embeds=inputs_embeds)
        h = out.last_hidden_state  # (B, T, d): the bottom's output
        loss = logits = None
        # the positions the bottom used, where they differ from the server's own (a padded batch)
        sent = None if out.cache is not None else dec.wire_positions(attention_mask, position_ids, h.shape[1], h.device)
        if out.cache is not None:  # generation: the server's logits of the last k positions
            keep = logits_to_keep if isinstance(logits_to_keep, int) else 0
            logits = out.cache.remote(h, attention_mask, logits_to_keep=keep)
            if not isinstance(logits_to_keep, int):
                logits = logits[:, logits_to_keep]
        elif torch.is_grad_enabled():
            if labels is None:
                raise ConfigError("a 2-way server holds the head and computes the loss: training (gradients "
                                  "enabled) needs labels (under torch.no_grad() the forward answers the logits)")
            loss = dec.remote.loss(h, labels.to(h.device), attention_mask, sent)
            if kwargs.get("num_items_in_batch") is not None:
                # the server's loss is the mean over this batch's targets; the family's is the sum over
                # the accumulated batches' targets (Trainer's num_items_in_batch): rescale (a new tensor)
                n = (labels[..., 1:] != -100).sum()
                loss = loss * (n.to(loss.dtype) / torch.as_tensor(kwargs["num_items_in_batch"]).to(loss))
        else:
            logits, loss = dec.remote.evaluate(h, attention_mask, labels, sent)
            if isinstance(logits_to_keep, int) and logits_to_keep:
                logits = logits[:, -logits_to_keep:]
        return self._add_defense_loss(CausalLMOutputWithPast(loss=loss, logits=logits, cache=out.cache))

    def new_cache(self, **kwargs):
        """A :class:`~splitlearn.hf.cache.RemoteCache` for this model's server (its session holds
        the server's layers' keys and values; ``local`` the client's)."""
        from .cache import RemoteCache

        remote = self.remote
        remote.flush()  # a deferred apply first: generation reads the server's weights
        kwargs.setdefault("wire_dtype", remote.cfg.wire_dtype)
        kwargs.setdefault("client_id", remote.client_id)
        kwargs.pop("overlap", None)
        return RemoteCache.from_info(self.config, remote.transport, remote.info, **kwargs)

    def attach_optimizer(self, optimizer):
        """Let only ``optimizer`` apply the server's steps; with a ``journal_dir``, also writes the
        starting checkpoint :meth:`resume` needs. Returns it."""
        self.remote.link.attach(optimizer)
        return optimizer

    def resume(self, optimizer) -> int:
        """After this process was killed: a model made as before (same ``client_id`` and
        ``journal_dir``) and a fresh ``optimizer`` are put back at the journal's client checkpoint
        (:meth:`splitlearn.hf.recovery.Recovery.resume`). Returns the optimizer step to run again
        first: feed it that step's data."""
        return self.remote.journal.resume(optimizer)

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        self.remote.steps.discard()


_MADE: dict[type, type] = {}


def split_class(hf_cls: type) -> type:
    """``Split<Name>``: the family's class with :class:`SplitFamilyMixin` and the split generation."""
    if hf_cls not in _MADE:
        bases = (FamilyFederation, FamilyPipeline, FamilyRowGroups, SplitFamilyMixin, SplitGenerationMixin, hf_cls) \
            if issubclass(hf_cls, GenerationMixin) else (FamilyFederation, FamilyPipeline, SplitFamilyMixin, hf_cls)
        _MADE[hf_cls] = type(f"Split{hf_cls.__name__}", bases, {"__module__": __name__})
    return _MADE[hf_cls]


def split_family_model(model: nn.Module, remote: RemoteSegment) -> nn.Module:
    """Split ``model`` (a family's ``*ForCausalLM``, the server's model) in place against
    ``remote``'s cuts -> the model, now a ``Split<Name>``."""
    arch = arch_of(model.config)
    parent_path, _, attr = arch.base_path.rpartition(".")
    parent = model
    for part in filter(None, parent_path.split(".")):
        parent = getattr(parent, part)
    setattr(parent, attr, SplitDecoder(getattr(parent, attr), tuple(remote.cuts), remote))
    if not remote.u_shape:  # the server holds the head
        setattr(model, arch.head_name, None)
    model.__class__ = split_class(type(model))
    remote.link.bind(model)  # its optimizers are found, and its journal checkpoints hold, this model's weights
    return model


class AutoSplitModelForCausalLM:
    """The split causal LM of any family the adapter cuts: see the module docstring."""

    def __init__(self, *args, **kwargs):
        raise TypeError("use AutoSplitModelForCausalLM.from_pretrained(source, server=URL, token=...)")

    @classmethod
    def from_pretrained(cls, source, server: Optional[str] = None, token: Optional[str] = None,
                        seed: int = 0, **options) -> nn.Module:
        """``source`` split against the server at ``server`` (``token``: its bearer token; ``lora``: a
        ``peft.LoraConfig`` or ``"server"`` for a server started with ``--lora-r``, adapters on both
        sides for this ``client_id``, :mod:`splitlearn.hf.lora`; ``defense``: a
        :class:`splitlearn.privacy.Defense` on what crosses the cut, :attr:`SplitFamilyMixin.defense`;
        other ``options``:
        :class:`~splitlearn.hf.config.RemoteConfig`'s fields). Eval mode."""
        hf_cls = arch_of(load_config(source)).model_class()
        if hf_cls in _SPLIT_CLASSES:  # the split GPT-2 classes: every feature
            kw = dict(options, **({"token": token} if token is not None else {}))
            return SplitGPT2LMHeadModel.from_pretrained(source, server=server, seed=seed, **kw)
        if server is None:
            raise ConfigError("AutoSplitModelForCausalLM.from_pretrained needs server=URL")
        if token is not None:
            options["token"] = token
        micro_batches = options.pop("micro_batches", 1)  # hf/pipeline.py
        lora = options.pop("lora", None)  # hf/lora.py
        defense = options.pop("defense", None)  # hf/splittrunk.py
        remote = RemoteSegment(RemoteConfig.given(server, options, "AutoSplitModelForCausalLM"))
        try:
            model = load_model(source, seed=seed)
            check_same_model(model.config, fingerprint_at_load(model, remote.info), remote.info)
            model = split_family_model(model, remote).eval()
            model.defense = defense
            model.micro_batches = micro_batches
            apply_lora(model, lora, seed=seed)  # also refuses a model without LoRA on a LoRA server
            return model
        except BaseException:
            remote.close()
            raise


__all__ = ["AutoSplitModelForCausalLM", "split_family_model", "SplitFamilyMixin"]
