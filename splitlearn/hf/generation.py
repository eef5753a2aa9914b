"""``SplitGenerationMixin``: ``transformers``' own ``generate()`` for a split model, on a
:class:`~splitlearn.hf.cache.RemoteCache` (the server keeps its blocks' keys and values)."""
from __future__ import annotations

import contextlib
import logging
import threading
from typing import Optional

import torch
from transformers.generation.configuration_utils import GenerationMode

from ..errors import ConfigError
from ..model.packed import PackedLinears
from ..procs.openmp import long_spin, quiet_workers
from ..transport import shares_cores_with_server

log = logging.getLogger(__name__)


class _GenerationScope(threading.local):
    """The caches ``generate()`` made in this thread, closed when the outermost call returns."""

    depth = 0
    caches: list = []


_SCOPE = _GenerationScope()


def _spins_against_server(model) -> bool:
    """This process's idle OpenMP workers spin long and the model's server shares its cores."""
    remote = getattr(getattr(model, "transformer", None), "remote", None) or getattr(model, "remote", None)
    return remote is not None and long_spin() and shares_cores_with_server(remote.transport.cfg.url)


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
        if not getattr(self, "causal_lm", False):  # SplitGPT2LMHeadModel's forward is the one that runs groups
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
    #: grad; :mod:`splitlearn.model.packed`), as ``SplitClient(packed_weights=True)`` does: 1.2-2.5x
    #: faster few-row products (the LM head above all); set False on the model to turn it off
    packed_weights: bool = True

    #: where this process's idle OpenMP workers spin long (libgomp's default: a script that
    #: imported torch before splitlearn and exported no ``GOMP_SPINCOUNT``;
    #: :func:`splitlearn.procs.openmp.long_spin`) and the server shares its cores, ``generate``
    #: shortens the spin for its duration (libgomp's own throttle:
    #: :func:`splitlearn.procs.openmp.quiet_workers`), so no worker of this process spins on the
    #: cores the server computes on while it waits (docs/PERFORMANCE.md, 'Import order'); False: never
    quiet_openmp: bool = True

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
        follows the link by default (see the class and :attr:`link_aware_drafts`). Checked
        before anything is sent: a prompt + ``max_new_tokens`` past the model's positions is a
        ConfigError; more rows than the server takes run as several calls on groups of prompts,
        padded alike (:mod:`splitlearn.hf.limits`)."""
        from .draft import default_policy, link_aware
        from .limits import generate_groups, generate_in_groups

        groups = generate_groups(self, args, kwargs)
        if groups is not None:
            return generate_in_groups(self, groups, args, kwargs)

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
                if self.quiet_openmp and _spins_against_server(self):
                    stack.enter_context(quiet_workers())  # no idle OpenMP worker spins on the server's cores
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


class FamilyRowGroups:
    """Row groups in generation on any family's split class (:class:`splitlearn.hf.auto.AutoSplitModelForCausalLM`),
    as ``SplitGPT2LMHeadModel``'s (:attr:`SplitGenerationMixin.overlap`): a step of two row groups
    runs each group's bottom and sends it, then reads each answer and runs that group's top, norm
    and head (the family's, softcap included), so the server computes one group while this
    process computes the other; greedy decoding sends the first group's next step ahead
    (:mod:`.ahead`). The rows' logits are those of one batch."""

    def overlaps(self) -> bool:
        """Whether ``generate`` runs two row groups in flight (see :attr:`SplitGenerationMixin.overlap`)."""
        if self.overlap is not None:
            return bool(self.overlap)
        return self.split_decoder.u_shape and not shares_cores_with_server(self.remote.transport.cfg.url)

    def new_cache(self, **kwargs):
        """The split model's :class:`~splitlearn.hf.cache.RemoteCache` (``overlap``: row groups, see
        :meth:`RemoteCache.row_groups <splitlearn.hf.cache.RemoteCache.row_groups>`)."""
        overlap = kwargs.pop("overlap", False)
        cache = super().new_cache(**kwargs)
        cache.overlap = bool(overlap)
        return cache

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                labels=None, logits_to_keep=0, **kwargs):
        x = input_ids if input_ids is not None else inputs_embeds
        groups = cache.row_groups(x.shape[0]) if hasattr(cache, "row_groups") and x is not None else None
        if groups:
            return grouped_forward(self, groups, cache, input_ids, attention_mask, position_ids, inputs_embeds,
                                   labels, logits_to_keep)
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               cache=cache, inputs_embeds=inputs_embeds, labels=labels, logits_to_keep=logits_to_keep,
                               **kwargs)


def grouped_forward(model, groups, cache, input_ids, attention_mask, position_ids, inputs_embeds, labels,
                    logits_to_keep):
    """A generation step over a cache with row groups of a family's split model: :func:`grouped_logits`
    on the family's halves (:mod:`.halves`) and head (with its softcap) -> ``CausalLMOutputWithPast``."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    from ..model.arch import arch_of
    from .halves import halves_of

    if labels is not None:
        raise ConfigError("a cache with row groups is for generation (no labels)")
    arch = arch_of(model.config)
    logits = grouped_logits(halves_of(model), lambda hidden: arch.logits(model.get_output_embeddings(), hidden),
                            groups, cache, input_ids, attention_mask, None, position_ids, inputs_embeds, logits_to_keep)
    return CausalLMOutputWithPast(logits=logits, cache=cache)


def grouped_logits(t, head, groups, cache, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
                   logits_to_keep) -> torch.Tensor:
    """The logits of a generation step over a cache with row groups (:meth:`RemoteCache.row_groups
    <splitlearn.hf.cache.RemoteCache.row_groups>`), of one batch's rows. ``t``: the model's halves
    (``bottom_half``/``top_half``, ``u_shape``: the split GPT-2's trunk or a family's :mod:`.halves`);
    ``head``: hidden states (b, k, d) -> logits. Each group's bottom runs and is sent at once (its
    own session and lane), then each answer is read and that group's top and head run (U-shape), so
    the server computes one group while this process computes the other. In greedy decoding the
    first group's next step is sent ahead as soon as its logits are known (:meth:`RemoteCache.next_inputs
    <splitlearn.hf.cache.RemoteCache.next_inputs>`), so the overlap crosses steps::

        client: top A, bottom A' | top B, (generate) bottom B' | top A', bottom A'' | ...
        server: trunk B          | trunk A'                    | trunk B'           | ...
    """
    from .cache import _rows

    keep = logits_to_keep if isinstance(logits_to_keep, int) else 0
    plain = inputs_embeds is None and token_type_ids is None  # inputs a next step can be sent ahead for
    sent = []
    for g, (rows, child) in enumerate(groups):
        ids, mask, pos = _rows(input_ids, rows), _rows(attention_mask, rows), _rows(position_ids, rows)
        ahead = None
        if g == 0 and plain:
            ahead = cache.take_ahead(ids, mask, pos, keep)  # sent by the last forward
        elif g == 0:
            cache._settle()  # inputs no step is sent ahead for
        if ahead is None:
            h, ctx = t.bottom_half(ids, child, mask, _rows(token_type_ids, rows), pos, _rows(inputs_embeds, rows))
            ahead = (child.start(h, ctx["mask"], keep), ctx)  # in flight while the next group runs
        sent.append((ids, mask, pos, child, *ahead))
    outs = []
    for g, (ids, mask, pos, child, step, ctx) in enumerate(sent):
        out = child.finish(step)  # U-shape: the server's output (b, T, d); 2-way: logits (b, k, V)
        if t.u_shape:
            hidden = t.top_half(out, ctx)
            out = head(hidden[:, -keep:] if keep else hidden)  # (b, k or T, V)
        outs.append(out)
        if g == 0 and plain:
            nxt = cache.next_inputs(out[:, -1], ids, mask, pos)
            if nxt is not None:
                h, nctx = t.bottom_half(nxt[0], child, nxt[1], None, nxt[2], None)
                cache.sent_ahead(child.start(h, nctx["mask"], keep), nctx, *nxt, keep)
    logits = torch.cat(outs, dim=0)
    if not isinstance(logits_to_keep, int):
        logits = logits[:, logits_to_keep]
    return logits
