"""A split GPT-2 that is a ``transformers`` model: ``SplitGPT2LMHeadModel``,
``SplitGPT2ForSequenceClassification``, ``SplitGPT2Model`` and :func:`split_model`.

The client keeps Hugging Face's own modules for what it holds (``wte``, ``wpe``, its
``GPT2Block``\\ s with their global ``layer_idx``, ``ln_f``, the heads); the blocks the server
holds are replaced by one :class:`~splitlearn.hf.remote.RemoteSegment` (``transformer.remote``)
and parameterless :class:`ServerBlock` placeholders in ``transformer.h`` (so every client
parameter keeps its Hugging Face name: ``transformer.h.3.attn.c_attn.weight``; peft's
``target_modules`` and ``state_dict`` loading work unchanged)::

    U-shape (cuts c1 < c2):  wte + wpe -> h[0:c1] -> remote.trunk (server h[c1:c2]) -> h[c2:n] -> ln_f -> head
    2-way (cut c):           wte + wpe -> h[0:c]  -> remote.loss (server h[c:n] + ln_f + lm_head + loss)

A U-shape server holds only the trunk, so any head works (the labels never leave the
client); a 2-way server holds ``ln_f`` and the LM head, so only :class:`SplitGPT2LMHeadModel`
works there: training needs ``labels`` (the server computes the loss and answers only it:
``logits`` is None), evaluation under ``torch.no_grad()`` answers every position's logits. In
2-way the server's LM head is its own copy of ``wte`` (untied), as with ``SplitClient``.

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

import contextlib
import copy
import logging
import threading
from pathlib import Path
from typing import Optional, Union

import torch
from torch import nn
from torch.autograd.function import once_differentiable
from transformers import GenerationMixin, GPT2Config, GPT2ForSequenceClassification, GPT2LMHeadModel, GPT2Model
from transformers.generation.configuration_utils import GenerationMode
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
from transformers.modeling_outputs import BaseModelOutputWithPastAndCrossAttentions, CausalLMOutputWithCrossAttentions
from transformers.models.gpt2.modeling_gpt2 import GPT2Block, GPT2PreTrainedModel
from transformers.utils.deprecation import deprecate_kwarg

from ..errors import ConfigError, NotYourTurn, StaleWeights
from ..model.loading import _LOAD_LOCK, is_spec_source, load_model, name_causal_lm_loss
from ..model.packed import PackedLinears
from ..model.export import load_segments
from ..model.partition import partition, validate_cuts
from ..model.segments import embed, run_blocks
from ..transport import shares_cores_with_server
from ..api.trust import Pins
from . import pipeline
from .cache import _rows
from .config import RemoteConfig
from .remote import RemoteSegment

log = logging.getLogger(__name__)

CUTS_KEY = "splitlearn_cuts"  # the config attribute naming the server's cuts


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
    """``GPT2Model`` with the server's blocks behind ``self.remote`` (see the module docstring).

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
    def from_pretrained(cls, source, *model_args, server: Optional[str] = None, token: Optional[str] = None,
                        client_id: Optional[str] = None, wire_dtype: str = "float32", seed: int = 0,
                        timeout_s: float = 300.0, retries: int = 6, **kwargs):
        """The trunk alone (``GPT2Model``'s output, U-shape servers): see :meth:`SplitMixin.from_pretrained`."""
        return _from_pretrained(GPT2Model, source, server, token, client_id, wire_dtype, seed,
                                timeout_s, retries, **kwargs)

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        self.remote.attach_optimizer(optimizer)
        return optimizer

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        if self.remote is not None:
            self.remote.discard_pending()

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
        """Blocks ``[start, end)``: :func:`splitlearn.segments.run_blocks`, as a segment runs them."""
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
        """As ``GPT2Model.forward``; the server's blocks run remotely (see the module docstring).
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
        if token_type_ids is not None:
            token_type_ids = token_type_ids.view(-1, input_shape[-1])
        if inputs_embeds is None:
            inputs_embeds = self.wte(input_ids)
        if position_ids is None:
            past_seen = remote_cache.get_seq_length() if remote_cache is not None else 0
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


class SplitMixin:
    """What every split head model has: the remote segment, the optimizer hook, ``zero_grad``."""

    @property
    def remote(self) -> RemoteSegment:
        return self.transformer.remote

    @property
    def client_id(self) -> str:
        return self.remote.client_id

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Let only ``optimizer`` apply the server's steps (by default the optimizer holding this
        model's parameters, found at the first backward, does); with a ``journal_dir``, also
        writes the starting checkpoint :meth:`resume` needs. Returns it."""
        self.remote.attach_optimizer(optimizer)
        return optimizer

    def resume(self, optimizer: torch.optim.Optimizer) -> int:
        """After this process was killed: a model made as before (same ``client_id``, same
        ``journal_dir``) and a fresh ``optimizer`` are put back at the journal's client checkpoint,
        the server is brought to it, and the logged steps after it are answered from the journal
        when your loop runs them again. Returns the optimizer step to run again first (1, 2...):
        feed it that step's data. The first run must have attached its optimizer
        (:meth:`attach_optimizer`) before training: that writes the starting checkpoint (with
        the RNG state, so dropout draws the same masks). See :mod:`splitlearn.hf.journal`."""
        return self.remote.resume(optimizer)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Both sides: this model's gradients, and the server's pending ones (discarded there)."""
        super().zero_grad(set_to_none=set_to_none)
        if self.transformer.remote is not None:
            self.transformer.remote.discard_pending()

    def __call__(self, *args, **kwargs):
        """``nn.Module.__call__``; a step refused at its first forward by a federation mode (the
        shared client-side weights moved on, or the turn lapsed) loads them, takes the turn and
        runs again (:mod:`splitlearn.hf.federation`)."""
        remote = self.transformer.remote
        if remote is not None and self.training:
            remote.prepare_step(self)
        try:
            return super().__call__(*args, **kwargs)
        except (StaleWeights, NotYourTurn) as e:
            if remote is None or not remote.refused_for_federation():
                raise
            log.info("the forward of step %d runs again: %s", remote.step, e.message)
            remote.prepare_step(self)
            return super().__call__(*args, **kwargs)

    def sync(self) -> dict:
        """The end of this owner's turn (sequential) or of its part of a round (splitfed): upload
        the client-side weights; splitfed waits for the round's other members and loads the
        average. A no-op in shared mode. Call it between optimizer steps. Returns the server's
        federation status. With a ``journal_dir`` and an attached optimizer, the client
        checkpoint is written again after it. See :mod:`splitlearn.hf.federation`."""
        from .federation import federation_of, shared_weights

        remote = self.transformer.remote
        remote.notice_zero_grad()
        if remote.pieces or remote.answered:
            raise ConfigError("sync() between optimizer steps: this step has pieces on the server "
                              "(optimizer.step() or zero_grad() first)")
        remote.flush()  # the last step's deferred apply, before the turn or the round closes
        fed = federation_of(self)
        status = fed.sync(shared_weights(self))
        optimizer = remote._optimizer_ref() if remote._optimizer_ref is not None else None
        if not fed.shared and optimizer is not None and remote.log.directory is not None and remote.log.enabled:
            remote.persist(optimizer)  # journal_dir: the server checkpoints at a sync; the average is loaded
        return status

    #: measure ``micro_batches`` against whole batches over the first training steps and keep the
    #: faster (:class:`splitlearn.hf.pipeline.Chooser`): "auto" on a CUDA device, True anywhere, False
    #: never (the default until a GPU run passes: on an H100, SplitClient with micro_batches=4 and
    #: "auto" got a backward's answer to a forward, refused as IntegrityError; cause not found)
    choose_micro_batches = False

    @property
    def micro_batches(self) -> int:
        """Training forwards with ``labels`` split into this many micro-batches, pipelined with
        the server (:mod:`splitlearn.hf.pipeline`); 1: whole. ``SplitGPT2LMHeadModel`` only."""
        return self.__dict__.get("_micro_batches", 1)

    @micro_batches.setter
    def micro_batches(self, m: int) -> None:
        from .pipeline import check_micro_batches

        check_micro_batches(m)
        if m > 1 and getattr(self.defense, "residual", False):
            raise ConfigError("a defense's residual design trains whole batches (micro_batches=1)")
        if m > 1 and getattr(self.defense, "defends_gradient", False):
            raise ConfigError("a defense of the gradient channel trains whole batches (micro_batches=1: "
                              "its clip is per token of the whole batch's loss)")
        if m > 1 and not isinstance(self, SplitGPT2LMHeadModel):
            raise ConfigError(f"micro_batches works with SplitGPT2LMHeadModel (a causal-LM loss); "
                              f"{type(self).__name__} trains whole batches")
        self.__dict__["_micro_batches"] = m

    def flush(self):
        """Send the last optimizer step's apply now (it is carried by the next step's first
        request): before reading the server's weights by other means. ``sync``, evaluation,
        ``generate``, a client checkpoint and ``close`` do it by themselves. Returns the server's
        answer (``remote.last_apply``), or None if nothing was deferred."""
        remote = self.transformer.remote
        return None if remote is None else remote.flush()

    def save_pretrained(self, *args, **kwargs):
        """``PreTrainedModel.save_pretrained`` of the client's side, the last optimizer step's
        apply sent first (:meth:`flush`): what is saved and what the server holds are one step."""
        self.flush()
        return super().save_pretrained(*args, **kwargs)

    @property
    def loss_gradient(self):
        """The gradient ``loss.backward()`` will send into this model's loss, when known in
        advance (``1.0`` for a plain loop; ``1 / k`` for ``(loss / k).backward()``): 2-way pieces
        are then fused (one request each: the server's forward, loss and backward at once) and
        micro-batches run 1F1B (:mod:`splitlearn.hf.pipeline`). A backward with another gradient is
        a ``ConfigError``. None (the default): not known; each piece's backward waits for it."""
        remote = self.transformer.remote
        return None if remote is None else remote.loss_gradient

    @loss_gradient.setter
    def loss_gradient(self, g) -> None:
        if g is not None and (isinstance(g, bool) or not isinstance(g, (int, float)) or not 0.0 < g <= 1.0):
            raise ConfigError(f"loss_gradient must be None or a number in (0, 1], got {g!r}")
        self.transformer.remote.loss_gradient = None if g is None else float(g)

    @property
    def defense(self):
        """A :class:`splitlearn.privacy.Defense` (``GaussianNoise``, ``NoPeek``) on every
        activation this model sends, in training, evaluation and generation; its extra loss is
        added to the loss the model computes from ``labels`` (and is ``transformer.defense_loss``
        for a loss of your own). None: none."""
        return getattr(self.remote, "defense", None)

    @defense.setter
    def defense(self, defense) -> None:
        from ..defense.defenses import Defense

        if defense is not None and not isinstance(defense, Defense):
            raise ConfigError(f"defense must be a splitlearn.privacy Defense (GaussianNoise, NoPeek), "
                              f"got {type(defense).__name__}")
        if getattr(defense, "residual", False):
            if not self.transformer.u_shape:
                raise ConfigError("a defense's residual design needs a U-shape server (the client "
                                  "keeps the residual stream between the two cuts)")
            if self.micro_batches > 1:
                raise ConfigError("a defense's residual design trains whole batches (micro_batches=1)")
        if getattr(defense, "defends_gradient", False):
            if not self.transformer.u_shape:
                raise ConfigError("a defense of the gradient channel (grad_clip, grad_sigma) clips the "
                                  "gradient a U-shape client sends back at the second cut; a 2-way "
                                  "client sends none (the server computes the loss from the labels)")
            if self.micro_batches > 1:
                raise ConfigError("a defense of the gradient channel trains whole batches (micro_batches=1)")
        self.remote.defense = defense

    def _add_defense_loss(self, out):
        extra = self.transformer.defense_loss
        if extra is not None and getattr(out, "loss", None) is not None:
            out.loss = out.loss + extra
        return out

    # -- construction --------------------------------------------------------------------

    HF_CLASS: type = GPT2Model

    @classmethod
    def from_pretrained(cls, source, *model_args, server: Optional[str] = None, token: Optional[str] = None,
                        client_id: Optional[str] = None, wire_dtype: str = "float32", seed: int = 0,
                        timeout_s: float = 300.0, retries: int = 6, defense=None, lora=None, micro_batches: int = 1,
                        **kwargs):
        """Build the split model for ``source`` (the sources of :func:`splitlearn.load_model`: a
        spec name, a directory, a config JSON, a hub id, a model) against the server at ``server``,
        whose cuts are read from its ``/v1/info``. ``defense``: see :attr:`defense`. ``lora``: a
        ``peft.LoraConfig`` (or ``"server"``) for a server started with ``--lora-r``: adapters on
        both sides for this ``client_id`` (:mod:`splitlearn.hf.lora`). ``micro_batches``: see
        :attr:`micro_batches`. ``fed_url``, ``fed_token``: a separate fed server for the federation
        modes (:mod:`splitlearn.hf.federation`); ``journal_dir``: the crash journal on disk too
        (:meth:`resume`); ``wait_timeout_s``, ``reconnect_timeout_s``, ``apply_wait_s``: as
        :class:`~splitlearn.hf.config.RemoteConfig`. ``min_client_blocks`` (default 1: a server cut at 0 is refused),
        ``expected_cuts``, ``shape`` (``"u"``: a 2-way server is refused, the labels stay here):
        the splits accepted (:class:`splitlearn.trust.Pins`), checked before anything is sent.
        Other keyword arguments go
        to the head's config (``num_labels=3``, ``pad_token_id=...``). Only the client's weights
        are kept; eval mode, as ``from_pretrained`` leaves any model."""
        from .lora import apply_lora

        model = _from_pretrained(cls.HF_CLASS, source, server, token, client_id, wire_dtype, seed,
                                 timeout_s, retries, **kwargs)
        try:
            if defense is not None:
                model.defense = defense
            model.micro_batches = micro_batches
            apply_lora(model, lora, seed=seed)  # also refuses a model without LoRA on a LoRA server
        except BaseException:
            model.remote.close()
            raise
        return model


class _GenerationScope(threading.local):
    """The caches ``generate()`` made in this thread, closed when the outermost call returns."""

    depth = 0
    caches: list = []


_SCOPE = _GenerationScope()


class SplitGenerationMixin:
    """``transformers``' own ``generate()`` for a split model: every strategy and option of
    ``GenerationMixin`` (greedy, sampling, beam search, ``num_return_sequences``, logits
    processors, stopping criteria and stop strings, streamers, assisted and prompt-lookup
    decoding) runs on a :class:`~splitlearn.hf.cache.RemoteCache`, whose server half is one
    generation session on the server.

    When the caller passes no ``cache``, ``generate`` makes the cache
    (:meth:`new_cache`: this model's connection, wire dtype and ``client_id``) and **closes its
    session when it returns** (normally or by an exception), so a ``generate`` call leaves
    nothing open on the server; the cache in a ``return_dict_in_generate`` output is then
    closed (empty). To keep a session across calls (a conversation), pass your own
    ``cache=model.new_cache()`` and close it (``with`` or ``.close()``) yourself. An
    assistant model's cache, made inside an outer split model's ``generate``, closes with it;
    a split *assistant* of an unsplit model keeps its cache across the drafting calls, and the
    cache's finalizer closes its session when transformers drops it.

    Assisted and prompt-lookup decoding draft at the link-aware length (one round trip per
    round, so the length follows the measured round trip, draft cost and acceptance:
    :mod:`splitlearn.hf.draft`) unless the caller sets a schedule of their own; the tokens are
    the same either way.

    A batch of two rows or more runs as two row groups in flight where that pays
    (:attr:`overlap`; :meth:`RemoteCache.row_groups <splitlearn.hf.cache.RemoteCache.row_groups>`):
    two sessions, the server computing one group while this process computes the other; in
    greedy decoding the first group's next step is sent before the second group's top runs.
    The tokens are those of one batch.
    """

    #: run a step of two rows or more as two row groups in flight, each on its own session and
    #: transport lane, so the server computes one while this process computes the other
    #: (:meth:`RemoteCache.row_groups <splitlearn.hf.cache.RemoteCache.row_groups>`; beam
    #: search, sampling and the rest alike; the tokens are the same). None: where it pays, in
    #: the U-shape (this process holds the top and the LM head: work worth overlapping) when
    #: the server does not share this process's cores (a server on another host, or this
    #: process pinned to a subset of the machine's cores); True/False: always/never. A 2-way
    #: client holds only the bottom: two groups there only double the server's weight reads
    #: (pinned batch 8: 68 tokens/s in two groups against 87 in one; benchmarks/README.md).
    overlap: Optional[bool] = None

    def overlaps(self) -> bool:
        """Whether ``generate`` runs two row groups in flight (see :attr:`overlap`)."""
        if not isinstance(self, SplitGPT2LMHeadModel):  # its forward is the one that runs groups
            return False
        if self.overlap is not None:
            return bool(self.overlap)
        remote = self.transformer.remote
        return self.transformer.u_shape and not shares_cores_with_server(remote.transport.cfg.url)

    def new_cache(self, **kwargs):
        """A :class:`~splitlearn.hf.cache.RemoteCache` for this model's server (``kwargs`` as
        for its constructor: ``lane``, ``replay``, ``overlap``, ``row_block``)."""
        from .cache import RemoteCache

        remote = self.transformer.remote
        if remote is None:
            raise ConfigError("this split model is not connected to a server (from_pretrained(..., server=URL))")
        remote.flush()  # a deferred apply first: generation reads the server's weights
        kwargs.setdefault("wire_dtype", remote.cfg.wire_dtype)
        kwargs.setdefault("client_id", remote.client_id)
        return RemoteCache.from_info(self.config, remote.transport, remote.info, **kwargs)

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, generation_mode, batch_size,
                                      max_cache_length):
        blocks = max(generation_config.num_beams or 1, generation_config.num_return_sequences or 1)
        given = model_kwargs.get("cache")
        if getattr(given, "groups", ()) is None:  # a RemoteCache passed in, not split yet
            given.row_block = blocks  # its groups split between prompts: beam search reorders within
        if given is not None or generation_config.use_cache is False:
            return super()._prepare_cache_for_generation(generation_config, model_kwargs, generation_mode,
                                                         batch_size, max_cache_length)
        if generation_config.cache_implementation not in (None, "dynamic"):
            raise ConfigError(f"a split model's cache is a RemoteCache (the server keeps its blocks' keys and "
                              f"values); cache_implementation={generation_config.cache_implementation!r} "
                              f"is not available")
        cache = self.new_cache(overlap=not generation_config.is_assistant and self.overlaps(), row_block=blocks)
        if cache.overlap and generation_mode == GenerationMode.GREEDY_SEARCH:  # see RemoteCache.next_inputs
            cache.greedy = True  # until a logits processor shows up (_get_logits_processor)
            cache.eos, cache.pad = generation_config._eos_token_tensor, generation_config._pad_token_tensor
            cache.max_length = generation_config.max_length or 0
        model_kwargs["cache"] = cache
        if _SCOPE.depth and not (generation_config.is_assistant and _SCOPE.depth == 1):
            _SCOPE.caches.append(cache)  # closed when the outermost generate returns
        if generation_config.is_assistant:
            cache.activate_past_recording()

    def _get_logits_processor(self, *args, **kwargs):
        processors = super()._get_logits_processor(*args, **kwargs)
        cache = (kwargs.get("model_kwargs") or {}).get("cache")
        if processors and getattr(cache, "greedy", False):
            cache.greedy = False  # the choice is not the logits' argmax: send nothing ahead
        return processors

    #: generate on oneDNN prepacked copies of the client's linear weights (CPU, float32, no
    #: grad; :mod:`splitlearn.packed`), as ``SplitClient(packed_weights=True)`` does: 1.2-2.5x
    #: faster few-row products (the LM head above all); set False on the model to turn it off
    packed_weights: bool = True

    #: ``generate(assistant_model=... | prompt_lookup_num_tokens=...)`` drafts at the link-aware
    #: length unless the caller sets a schedule (:func:`splitlearn.hf.draft.default_policy`);
    #: False: transformers' own schedule
    link_aware_drafts: bool = True
    #: the :class:`~splitlearn.hf.draft.LinkAwarePolicy` of the last ``generate`` that drafted by
    #: default (its ``rounds``, ``lengths``, ``measured_acceptance``), or None
    last_draft_policy = None

    def generate_stream(self, **kwargs):
        """Yield the next token of every row, (B,), as ``generate(**kwargs)`` makes it (in a
        thread; closing the iterator stops it at its next token): :mod:`splitlearn.hf.streaming`."""
        from .streaming import stream_tokens

        return stream_tokens(self.generate, **kwargs)

    def generate(self, *args, **kwargs):
        """``GenerationMixin.generate``; a cache it makes is closed on return, and drafting
        follows the link by default (see the class and :attr:`link_aware_drafts`)."""
        from .draft import default_policy, link_aware

        if _SCOPE.depth == 0:
            _SCOPE.caches = []
        _SCOPE.depth += 1
        try:
            with contextlib.ExitStack() as stack:
                policy = default_policy(self, args, kwargs)
                if policy is not None:
                    self.last_draft_policy = stack.enter_context(link_aware(self, policy))
                if self.packed_weights:
                    stack.enter_context(PackedLinears(self).active())  # a no-op off the CPU or float32
                return super().generate(*args, **kwargs)
        finally:
            _SCOPE.depth -= 1
            if _SCOPE.depth == 0:
                caches, _SCOPE.caches = _SCOPE.caches, []
                for cache in caches:
                    try:
                        cache.close()
                    except Exception:  # noqa: BLE001 - never mask generate's own outcome
                        log.warning("closing a generation session failed", exc_info=True)


class SplitGPT2LMHeadModel(SplitMixin, SplitGenerationMixin, GPT2LMHeadModel):
    """``GPT2LMHeadModel`` split across this process and a splitlearn server (either shape)."""

    HF_CLASS = GPT2LMHeadModel

    def __init__(self, config: GPT2Config):
        GPT2PreTrainedModel.__init__(self, config)
        self.transformer = SplitGPT2Model(config)
        if self.transformer.u_shape:
            self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        else:  # the server holds ln_f and the LM head (its own copy of wte: untied)
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
        """A generation step over a cache with row groups (:meth:`RemoteCache.row_groups
        <splitlearn.hf.cache.RemoteCache.row_groups>`): each group's bottom runs and is sent at
        once (its own session and lane), then each answer is read and that group's top and LM
        head run (U-shape), so the server computes one group while this process computes the
        other. In greedy decoding the first group's next step is sent ahead as soon as its
        logits are known (:meth:`RemoteCache.next_inputs
        <splitlearn.hf.cache.RemoteCache.next_inputs>`), so the overlap crosses steps::

            client: top A, bottom A' | top B, (generate) bottom B' | top A', bottom A'' | ...
            server: trunk B          | trunk A'                    | trunk B'           | ...

        The rows' logits are those of one batch (each row's computation is its own)."""
        if labels is not None:
            raise ConfigError("a cache with row groups is for generation (no labels)")
        t = self.transformer
        keep = logits_to_keep if isinstance(logits_to_keep, int) else 0
        sent = []
        for g, (rows, child) in enumerate(groups):
            ids, mask, pos = _rows(input_ids, rows), _rows(attention_mask, rows), _rows(position_ids, rows)
            ahead = None
            if g == 0 and inputs_embeds is None and token_type_ids is None:
                ahead = cache.take_ahead(ids, mask, pos, keep)  # sent by the last forward
            elif g == 0:
                cache._settle()  # inputs no step is sent ahead for
            if ahead is None:
                h, ctx = t.bottom_half(ids, child, mask, _rows(token_type_ids, rows), pos, _rows(inputs_embeds, rows))
                ahead = (child.start(h, ctx["mask"], keep), ctx)  # in flight while the next group runs
            sent.append((ids, mask, pos, child, *ahead))
        outs = []
        for g, (ids, mask, pos, child, step, ctx) in enumerate(sent):
            out = child.finish(step)  # U-shape: the trunk's output (b, T, d); 2-way: logits (b, k, V)
            if t.u_shape:
                hidden = t.top_half(out, ctx)
                out = self.lm_head(hidden[:, -keep:] if keep else hidden)  # (b, k or T, V)
            outs.append(out)
            if g == 0 and inputs_embeds is None and token_type_ids is None:
                nxt = cache.next_inputs(out[:, -1], ids, mask, pos)
                if nxt is not None:
                    h, nctx = t.bottom_half(nxt[0], child, nxt[1], None, nxt[2], None)
                    cache.sent_ahead(child.start(h, nctx["mask"], keep), nctx, *nxt, keep)
        logits = torch.cat(outs, dim=0)
        if not isinstance(logits_to_keep, int):
            logits = logits[:, logits_to_keep]
        return CausalLMOutputWithCrossAttentions(logits=logits, cache=cache)


class SplitGPT2ForSequenceClassification(SplitMixin, GPT2ForSequenceClassification):
    """``GPT2ForSequenceClassification`` split across this process and a U-shape server."""

    HF_CLASS = GPT2ForSequenceClassification

    def __init__(self, config: GPT2Config):
        GPT2PreTrainedModel.__init__(self, config)
        self.num_labels = config.num_labels
        self.transformer = SplitGPT2Model(config)
        _need_u_shape(self.transformer, type(self).__name__)
        self.score = nn.Linear(config.n_embd, self.num_labels, bias=False)
        self.post_init()

    def forward(self, *args, **kwargs):
        return self._add_defense_loss(super().forward(*args, **kwargs))


def _need_u_shape(trunk: SplitGPT2Model, what: str) -> None:
    if not trunk.u_shape:
        raise ConfigError(f"{what} needs a U-shape server (two cuts: it holds only the trunk); this one "
                          f"holds the top with the LM head (cut {trunk.cuts[0]}), which serves "
                          f"SplitGPT2LMHeadModel only")


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


def _check_config(cfg: GPT2Config, info: dict) -> None:
    server = info["model_config"]
    for key in ("n_embd", "n_layer", "n_head", "vocab_size", "n_positions"):
        if server.get(key) != getattr(cfg, key):
            raise ConfigError(f"the local model's {key}={getattr(cfg, key)} differs from the server's "
                              f"{server.get(key)}: load the same model on both sides")


def split_model(model: nn.Module, server: Optional[str] = None, *, remote: Optional[RemoteSegment] = None,
                token: Optional[str] = None, client_id: Optional[str] = None, wire_dtype: str = "float32",
                timeout_s: float = 300.0, retries: int = 6, min_client_blocks: int = 1,
                expected_cuts: Optional[tuple] = None, shape: Optional[str] = None):
    """Split a Hugging Face GPT-2 (``GPT2Model``, ``GPT2LMHeadModel``, ``GPT2ForSequenceClassification``
    or any GPT-2 head class) against the splitlearn server at ``server``: **in place**, like
    peft's ``get_peft_model``. Its server-side blocks (and, 2-way, ``ln_f`` and the LM head)
    are dropped, its own modules are kept as they are (no copy), and it becomes the split
    class (``SplitGPT2LMHeadModel``, ...). Returns the model.

    ``min_client_blocks`` (default 1), ``expected_cuts``, ``shape`` (``"u"``: the labels stay
    here): the splits this client accepts (:class:`splitlearn.trust.Pins`); a server outside
    them is a ConfigError before anything is sent to it.
    """
    if remote is None:
        if server is None:
            raise ConfigError("split_model needs server=URL (or remote=RemoteSegment)")
        remote = RemoteSegment(RemoteConfig(server, token, client_id, wire_dtype, timeout_s, retries,
                                            pins=Pins(min_client_blocks, expected_cuts, shape)))
    if isinstance(model, SplitGPT2Model) or isinstance(model, SplitMixin):
        raise ConfigError("this model is split already")
    trunk_hf = model if isinstance(model, GPT2Model) else getattr(model, "transformer", None)
    if not isinstance(trunk_hf, GPT2Model) or getattr(model.config, "add_cross_attention", False):
        raise ConfigError(f"split_model splits Hugging Face GPT-2 models (a GPT2Model under .transformer, "
                          f"no cross-attention); got {type(model).__name__}")
    _check_config(model.config, remote.info)
    config = copy.deepcopy(model.config)
    setattr(config, CUTS_KEY, list(remote.cuts))
    if config.pad_token_id is None and config.eos_token_id is not None and not isinstance(model, GPT2LMHeadModel):
        # a head that pools the last token (sequence classification) refuses a batch of more than
        # one row without a pad token: GPT-2 has none, and transformers advises its eos
        config.pad_token_id = config.eos_token_id
    with torch.device("meta"):
        trunk = SplitGPT2Model(config)
    trunk.wte, trunk.wpe, trunk.drop = trunk_hf.wte, trunk_hf.wpe, trunk_hf.drop
    for a, b in trunk.client_blocks:
        for i in range(a, b):
            trunk.h[i] = trunk_hf.h[i]
    if trunk.u_shape:
        trunk.ln_f = trunk_hf.ln_f
    trunk.remote = remote
    if isinstance(model, GPT2Model):
        _need_u_shape(trunk, "SplitGPT2Model")
        remote.bind(trunk)
        return trunk
    cls = _split_class(type(model))
    if not trunk.u_shape and not issubclass(cls, GPT2LMHeadModel):
        _need_u_shape(trunk, cls.__name__)
    model.transformer = trunk
    model.config = config
    if not trunk.u_shape:  # the server holds ln_f and the LM head
        model.lm_head = None
        model._tied_weights_keys = {}
    model.__class__ = cls
    name_causal_lm_loss(model)  # a language model's loss, named: no transformers warning at every loss
    remote.bind(model)
    return model


def split_segments(source, remote: RemoteSegment, device=None, seed: int = 0) -> tuple:
    """The client's :class:`~splitlearn.segments.Segment`\\ s of ``source`` (a
    :func:`splitlearn.load_model` source, or a directory of exported segments) at ``remote``'s cuts
    (bottom; U-shape also top), and a :class:`SplitGPT2LMHeadModel` over ``remote`` whose modules
    are theirs (no copy) -> (model, segments)."""
    if _is_export(source):
        segments = [s.to(device) for s in _client_segments(source, remote)]
    else:
        m = load_model(source, device=device, seed=seed)
        _check_config(m.config, remote.info)
        parts = partition(m, remote.cuts)  # the server's segment dies with `m` and `parts`
        segments = [parts.bottom, parts.top] if remote.u_shape else [parts.bottom]
    return split_model(_hf_from_segments(GPT2LMHeadModel, segments), remote=remote), segments


def _is_export(source) -> bool:
    """Whether ``source`` is a directory that :func:`splitlearn.export_segments` wrote."""
    return isinstance(source, (str, Path)) and (Path(source) / "bottom.json").is_file()


def _client_segments(source, remote: RemoteSegment) -> list:
    """The exported segments the client of ``remote`` holds (bottom; U-shape also top), checked
    against the server's cuts."""
    segments = load_segments(source, ["bottom", "top"][:1 + remote.u_shape])
    held = [segments[0].end] + ([segments[1].start] if remote.u_shape else [])
    if tuple(held) != tuple(remote.cuts):
        raise ConfigError(f"the segments exported in {source} are cut at {held}, the server at {list(remote.cuts)}")
    return segments


def _hf_from_segments(hf_cls: type, segments: list, seed: int = 0, **config_kwargs):
    """A ``hf_cls`` whose client-side modules are ``segments``' (no copy; the server's blocks are
    left on the meta device for :func:`split_model` to drop); a head the segments do not hold
    (a classifier's ``score``) is initialised from ``seed``, ``config_kwargs`` set on its config."""
    config = copy.deepcopy(segments[0].config)
    for k, v in config_kwargs.items():
        setattr(config, k, v)
    with torch.device("meta"):
        hf = hf_cls(config)
    t = hf if isinstance(hf, GPT2Model) else hf.transformer
    t.wte, t.wpe, t.drop = segments[0].wte, segments[0].wpe, segments[0].drop
    for seg in segments:
        for j, block in enumerate(seg.h):
            t.h[seg.start + j] = block
    if len(segments) == 2:  # U-shape: the top holds ln_f and the LM head
        t.ln_f = segments[1].ln_f
        if getattr(hf, "lm_head", None) is not None:
            hf.lm_head = segments[1].lm_head
    device = segments[0].wte.weight.device
    for name, child in hf.named_children():
        if child is not t and name != "lm_head" and any(p.is_meta for p in child.parameters()):
            child.to_empty(device=device)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                child.apply(hf._init_weights)
    return hf


def _load_hf(hf_cls: type, source, seed: int = 0, **config_kwargs):
    """A Hugging Face ``hf_cls`` for a :func:`splitlearn.load_model` source: checkpoints (a
    directory, a hub id) through ``hf_cls.from_pretrained``; spec names and configs as the seeded
    GPT-2 that ``load_model`` builds (the server's weights for the same spec and seed), with a
    seeded head."""
    if isinstance(source, nn.Module):
        if not isinstance(source, hf_cls):
            raise ConfigError(f"expected a {hf_cls.__name__}, got {type(source).__name__}")
        return source
    s = None if isinstance(source, GPT2Config) else str(source)
    if hf_cls is not GPT2LMHeadModel and s is not None and not is_spec_source(s):
        local = Path(s).is_dir()
        with _LOAD_LOCK:
            try:
                return hf_cls.from_pretrained(s, local_files_only=local, **config_kwargs)
            except (OSError, ValueError) as e:
                raise ConfigError(f"cannot load a {hf_cls.__name__} from {s}: {e}") from None
    lm = load_model(source, seed=seed)
    if hf_cls is GPT2LMHeadModel and not config_kwargs:
        return lm
    config = copy.deepcopy(lm.config)
    for k, v in config_kwargs.items():
        setattr(config, k, v)
    with _LOAD_LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = hf_cls(config)
    base = model if hf_cls is GPT2Model else model.transformer
    base.load_state_dict(lm.transformer.state_dict())
    if hasattr(model, "lm_head") and getattr(model, "lm_head", None) is not None:
        model.lm_head.weight.data.copy_(lm.lm_head.weight.data)
    return model


def _from_pretrained(hf_cls: type, source, server, token, client_id, wire_dtype, seed, timeout_s, retries,
                     **kwargs):
    if server is None:
        raise ConfigError("from_pretrained of a split model needs server=URL (the splitlearn server)")
    pins = Pins(*(kwargs.pop(k, d) for k, d in (("min_client_blocks", 1), ("expected_cuts", None), ("shape", None))))
    more = {k: kwargs.pop(k) for k in ("wait_timeout_s", "reconnect_timeout_s", "apply_wait_s", "fed_url", "fed_token", "journal_dir")
            if k in kwargs}  # RemoteConfig's other fields
    remote = RemoteSegment(RemoteConfig(server, token, client_id, wire_dtype, timeout_s, retries, pins=pins, **more))
    try:
        if _is_export(source):  # export_segments' directory: the client's segments, as SplitClient takes it
            hf = _hf_from_segments(hf_cls, _client_segments(source, remote), seed, **kwargs)
        else:
            hf = _load_hf(hf_cls, source, seed, **kwargs)
        return split_model(hf, remote=remote).eval()
    except BaseException:
        remote.close()
        raise
