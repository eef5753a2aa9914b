"""The client's half of every split model, one implementation for GPT-2's trunk
(:class:`~.trunk.SplitGPT2Model`) and any family's (:class:`~.familytrunk.SplitDecoder`), over the
architecture adapter (:mod:`splitlearn.model.arch`: the parts under the family's own names)::

    U-shape (cuts c1 < c2): embed -> layers[0:c1] -> defense -> remote (server layers[c1:c2])
                            -> [gradient defense, residual design] -> layers[c2:n] -> final norm
    2-way (cut c):          embed -> layers[0:c] -> defense -> (the head model sends it: the server's
                            layers[c:n], final norm, head and loss)

**Defenses** (``remote.defense``, a :class:`splitlearn.privacy.Defense`; the head model's
``defense``), the same for every family: what crosses the first cut is ``defense.apply(h)`` of the
client's layers' output ``h`` (B, T, d), differentiable, in training, evaluation and generation; with
gradients enabled ``defense.loss(token embeddings, h)`` (NoPeek) is kept in :attr:`SplitTrunk.defense_loss`
and the head model adds it to the loss it computes from ``labels`` (:func:`add_defense_loss`); the
residual design (``GaussianNoise(residual=True)``, U-shape) adds the server's update (its output minus
what was sent) to the client's clean activations; the gradient defense (``grad_clip``/``grad_sigma``,
U-shape training) clips and noises the gradient sent back at the second cut (:class:`_DefendGradient`).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.autograd.function import once_differentiable
from transformers.modeling_outputs import BaseModelOutputWithPast

from ..errors import ConfigError
from ..model.arch import Arch, arch_of
from .limits import check_positions


class SplitTrunk:
    """The client's half of a split model, mixed into an ``nn.Module`` that holds ``config``,
    ``cuts``, ``u_shape``, ``remote`` (a :class:`~.remote.RemoteSegment`) and the client's parts
    under the adapter's names: the embedding modules, the layer list (the server's layers as
    parameterless :class:`~.trunk.ServerBlock` placeholders), the final norm(s) (U-shape) and
    ``rotary_emb`` where the family has one."""

    #: the defense's extra loss (NoPeek) of the last forward with gradients (None: no defense, or
    #: one without a loss); the head models add it to the loss they compute
    defense_loss: Optional[torch.Tensor] = None
    #: a forward's output computed already (a micro-batch's top half, :mod:`.pipeline`;
    #: :func:`.halves.precomputed`): the forward answers it
    _precomputed = None
    #: the forward's output class (the base model's)
    output_class = BaseModelOutputWithPast
    #: the positions the client used travel with a training piece where they differ from the mask's
    #: (the server's layers rotate with them); False where positions enter at the embeddings only and
    #: the server takes none
    sends_positions = True
    #: default positions with a generation cache from the 2-D mask (``cumsum - 1``, as generate()
    #: and the server's session derive them); without one (training, evaluation) the stock class's
    #: own (``arange``; OPT: from the mask). False: ``arange`` always, as GPT2Model computes them
    positions_from_mask = True

    @property
    def arch(self) -> Arch:
        return arch_of(self.config)

    @property
    def layers_list(self):
        return getattr(self, self.arch.layers_name)

    def get_input_embeddings(self):
        return getattr(self, self.arch.embed_names[0])

    def set_input_embeddings(self, value):
        setattr(self, self.arch.embed_names[0], value)

    @property
    def client_blocks(self) -> list[tuple[int, int]]:
        """The client's layer ranges: ``[(0, c1), (c2, n)]`` (U-shape) or ``[(0, c)]``."""
        n = self.arch.n_layers
        return [(0, self.cuts[0]), (self.cuts[1], n)] if self.u_shape else [(0, self.cuts[0])]

    @property
    def defense(self):
        return getattr(self.remote, "defense", None)

    def _run(self, start: int, end: int, hidden, mask, cache, positions, embeds=None):
        """Layers ``[start, end)`` on ``hidden`` (B, T, d): :meth:`splitlearn.model.arch.Arch.run_layers`."""
        layers = [self.layers_list[i] for i in range(start, end)]
        return self.arch.run_layers(layers, start, hidden, mask, cache, positions, getattr(self, "rotary_emb", None),
                                    embeds)

    def default_positions(self, attention_mask: Optional[torch.Tensor], past: int, new: int, device=None,
                          cached: bool = False) -> torch.Tensor:
        """The positions of ``new`` tokens after ``past`` when the caller gives none: (B|1, new).
        Without a generation cache, the stock class's (``arange`` past the cache; OPT derives its
        own from the mask); with one, from the mask (generate()'s rule, the server's session's)."""
        arch = self.arch
        from_mask = self.positions_from_mask and (cached or arch.family.positions == "opt")
        return arch.positions(attention_mask if from_mask else None, past, new, device)

    def wire_positions(self, attention_mask: Optional[torch.Tensor], position_ids: Optional[torch.Tensor],
                       new: int, device=None) -> Optional[torch.Tensor]:
        """The ``position_ids`` a training or evaluation request carries (no cache): the positions
        the client's layers use (the caller's, else :meth:`default_positions`), only where they
        differ from what the server derives from the mask without any (``arch.positions``: a
        padded batch's ``arange``, packed sequences); None where they are the same (an unpadded
        batch sends no extra bytes) or where the server's layers take none (GPT-2)."""
        if not self.sends_positions:
            return None
        if position_ids is None:
            position_ids = self.default_positions(attention_mask, 0, new, device)
        if position_ids.ndim != 2:
            return position_ids  # as given (the server checks its shape)
        derived = self.arch.positions(attention_mask, 0, new, position_ids.device).to(position_ids.device)
        rows = (position_ids.shape[0], derived.shape[0])  # (B|1, T) each: compared as they broadcast
        same = position_ids.shape[-1] == derived.shape[-1] and (1 in rows or rows[0] == rows[1]) \
            and bool((position_ids == derived).all())
        return None if same else position_ids

    def _defended(self, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """The defense applied to the client's layers' output ``hidden`` (B, T, d) — differentiable,
        so the client's gradients see it — and its extra loss (from the token embeddings ``tokens``
        (B, T, d), as SplitClient) kept in :attr:`defense_loss`."""
        self.defense_loss = None
        defense = self.defense
        if defense is None:
            return hidden
        if torch.is_grad_enabled():
            self.defense_loss = defense.loss(tokens, hidden)
        return defense.apply(hidden)

    def bottom_half(self, input_ids=None, cache=None, attention_mask=None, token_type_ids=None,
                    position_ids=None, inputs_embeds=None) -> tuple[torch.Tensor, dict]:
        """Everything before the cut: embeddings, the client's first layers, the defense -> (what
        crosses the cut (B, T, d), what :meth:`top_half` needs). ``cache``: None, or a remote cache
        (``.remote``, ``.local``: its ``local`` holds the client's layers' keys and values)."""
        arch = self.arch
        if self.remote is None:
            raise ConfigError("this split model is not connected to a server (from_pretrained(..., server=URL))")
        if input_ids is not None and inputs_embeds is not None:
            raise ValueError("You cannot specify both input_ids and inputs_embeds at the same time")
        if token_type_ids is not None and arch.family.embedding != "learned_positions":
            raise ConfigError(f"token_type_ids: only for learned-position embeddings (GPT-2), not "
                              f"{arch.model_type} (docs/MODELS.md, 'Not yet')")
        if input_ids is not None:
            warn = getattr(self, "warn_if_padding_and_no_attention_mask", None)  # a PreTrainedModel's
            if warn is not None:
                warn(input_ids, attention_mask)
            input_shape = input_ids.size()
            input_ids = input_ids.view(-1, input_shape[-1])  # (B, T)
        elif inputs_embeds is not None:
            input_shape = inputs_embeds.size()[:-1]
        else:
            raise ValueError("You have to specify either input_ids or inputs_embeds")
        remote_cache = cache if hasattr(cache, "remote") else None
        if cache is not None and remote_cache is None:
            raise ConfigError("a split model's cache must be its remote cache (with .remote and .local), not a "
                              "plain transformers Cache: the server keeps its layers' keys and values")
        if getattr(remote_cache, "groups", None):
            raise ConfigError("a cache with row groups runs through the split head model's forward")
        local = remote_cache.local if remote_cache is not None else None
        past = remote_cache.get_seq_length() if remote_cache is not None else 0
        T = input_shape[-1]
        check_positions(self.remote.info, self.config, past + T, position_ids)  # before anything is sent
        if token_type_ids is not None:
            token_type_ids = token_type_ids.view(-1, T)
        if attention_mask is not None:
            if attention_mask.ndim > 2:
                raise ConfigError("a split model takes a 2-D attention_mask (the server builds its own masks)")
            attention_mask = attention_mask.view(input_ids.shape[0] if input_ids is not None
                                                 else inputs_embeds.shape[0], -1)
        tokens = inputs_embeds if inputs_embeds is not None else self.get_input_embeddings()(input_ids)  # (B, T, d)
        if position_ids is None:
            position_ids = self.default_positions(attention_mask, past, T, tokens.device, remote_cache is not None)
        modules = {n: getattr(self, n, None) for n in arch.embed_names}
        hidden = arch.embed(modules, position_ids, inputs_embeds=tokens, attention_mask=attention_mask, past=past,
                            token_type_ids=token_type_ids)  # (B, T, d)
        output_shape = (-1,) + tuple(input_shape[1:]) + (hidden.size(-1),)
        hidden = self._run(0, self.cuts[0], hidden, attention_mask, local, position_ids)
        clean = hidden
        hidden = self._defended(hidden, tokens)  # what crosses the cut
        residual = self.u_shape and getattr(self.defense, "residual", False)
        # a training or evaluation piece carries the positions the client used where the server's own
        # differ (compared after the layers: on a GPU its read waits only for what the send waits for)
        given = None if remote_cache is not None else self.wire_positions(attention_mask, position_ids, T)
        return hidden, dict(mask=attention_mask, cache=remote_cache, local=local, position_ids=position_ids,
                            given=given, output_shape=output_shape, residual=(clean, hidden) if residual else None)

    def top_half(self, hidden: torch.Tensor, ctx: dict) -> torch.Tensor:
        """U-shape: the server's output (B, T, d) through the client's last layers and the final
        norm (what the head multiplies). With a defense's residual design, the server's update (its
        output minus what was sent) is added to the client's clean activations first; with a
        gradient defense, the gradient sent back for ``hidden`` is clipped and noised."""
        defense = self.defense
        if getattr(defense, "defends_gradient", False) and torch.is_grad_enabled() and hidden.requires_grad:
            hidden = _DefendGradient.apply(hidden, defense)
        if ctx.get("residual") is not None:
            clean, sent = ctx["residual"]
            hidden = clean + (hidden - sent)  # (B, T, d)
        hidden = self._run(self.cuts[1], self.arch.n_layers, hidden, ctx["mask"], ctx["local"], ctx["position_ids"])
        norms = {n: getattr(self, n, None) for n in self.arch.norm_names}
        return self.arch.head_hidden(norms, hidden).view(ctx["output_shape"])

    def split_forward(self, input_ids=None, cache=None, attention_mask=None, token_type_ids=None,
                      position_ids=None, inputs_embeds=None) -> tuple[torch.Tensor, Optional[object]]:
        """The whole client's half -> (U-shape: the final norm's output; 2-way: what crosses the cut
        (B, T, d), the remote cache or None). The server's part: the remote cache's session
        (generation) or autograd over the wire (training, evaluation)."""
        hidden, ctx = self.bottom_half(input_ids, cache, attention_mask, token_type_ids, position_ids, inputs_embeds)
        remote_cache = ctx["cache"]
        if self.u_shape:
            if remote_cache is not None:
                hidden = remote_cache.remote(hidden, ctx["mask"])  # generation: the server's KV cache
            else:
                hidden = self.remote.trunk(hidden, ctx["mask"], ctx["given"])
            hidden = self.top_half(hidden, ctx)
        return hidden, remote_cache


class _DefendGradient(torch.autograd.Function):
    """Identity forward on the server's output (B, T, d); backward: the defense's
    ``defend_gradient`` (clip per token + noise) on the gradient sent back to the server, so the
    server's layers and the client's bottom train from what was sent. The client's own paths
    (the residual design's clean stream) keep the clean gradient."""

    @staticmethod
    def forward(ctx, hidden, defense):
        ctx.defense = defense
        return hidden.view_as(hidden)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        return ctx.defense.defend_gradient(grad), None


def check_defense(defense, u_shape: bool, micro_batches: int) -> None:
    """Refuse a defense the split model cannot run: not a :class:`splitlearn.privacy.Defense`, the
    residual design or the gradient defense on a 2-way server or with micro-batches."""
    from ..defense.defenses import Defense

    if defense is not None and not isinstance(defense, Defense):
        raise ConfigError(f"defense must be a splitlearn.privacy Defense (GaussianNoise, NoPeek), "
                          f"got {type(defense).__name__}")
    if getattr(defense, "residual", False):
        if not u_shape:
            raise ConfigError("a defense's residual design needs a U-shape server (the client "
                              "keeps the residual stream between the two cuts)")
        if micro_batches > 1:
            raise ConfigError("a defense's residual design trains whole batches (micro_batches=1)")
    if getattr(defense, "defends_gradient", False):
        if not u_shape:
            raise ConfigError("a defense of the gradient channel (grad_clip, grad_sigma) clips the "
                              "gradient a U-shape client sends back at the second cut; a 2-way "
                              "client sends none (the server computes the loss from the labels)")
        if micro_batches > 1:
            raise ConfigError("a defense of the gradient channel trains whole batches (micro_batches=1: "
                              "its clip is per token of the whole batch's loss)")


class DefendedModel:
    """What a split head model (GPT-2's or a family's) has of the defenses: :attr:`defense` and
    :attr:`defense_loss`. Its trunk is :attr:`split_trunk` (a :class:`SplitTrunk`)."""

    @property
    def split_trunk(self) -> SplitTrunk:
        raise NotImplementedError

    @property
    def defense(self):
        """A :class:`splitlearn.privacy.Defense` (``GaussianNoise``, ``NoPeek``) on every
        activation this model sends, in training, evaluation and generation; its extra loss is
        added to the loss the model computes from ``labels`` (and is :attr:`defense_loss` for a
        loss of your own). None: none."""
        return getattr(self.remote, "defense", None)

    @defense.setter
    def defense(self, defense) -> None:
        check_defense(defense, self.split_trunk.u_shape, getattr(self, "micro_batches", 1))
        self.remote.defense = defense

    @property
    def defense_loss(self) -> Optional[torch.Tensor]:
        """The defense's extra loss (NoPeek) of the last forward with gradients; None without one."""
        return self.split_trunk.defense_loss

    def _add_defense_loss(self, out):
        """``out`` with :attr:`defense_loss` added to its loss (where both are)."""
        extra = self.split_trunk.defense_loss
        if extra is not None and getattr(out, "loss", None) is not None:
            out.loss = out.loss + extra
        return out
