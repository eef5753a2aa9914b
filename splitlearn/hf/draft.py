"""Speculative decoding across the split: the U-shape's free draft and its distillation, a draft
length that follows the link, and the count of positions the server sees.

Every plain decoding step of a split model costs one round trip to the server, so over a WAN
the link, not the hardware, bounds tokens/s (50 ms RTT: at most 20 tokens/s). ``transformers``'
assisted generation (``generate(assistant_model=...)``, ``prompt_lookup_num_tokens=``) drafts k
tokens locally and verifies them in **one** forward of the target, i.e. one round trip; the
:class:`~splitlearn.hf.cache.RemoteCache` drops the rejected positions on the server with the
next step (its ``crop``), so greedy output is exactly the plain greedy output.

**The free draft** (:func:`free_draft`). A U-shape client already holds the bottom layers, the
top layers, the final norm and the head. Skipping the server's trunk (LayerSkip-style: the
bottom's output feeds the top directly) gives a language model that costs no round trip and no
extra weights: a plain model of the split model's family (its own ``*ForCausalLM`` class) of
``c1 + (n - c2)`` layers whose parameters *are* the split model's (shared tensors, so training
the split model trains the draft), built through the architecture adapter
(splitlearn/model/arch.py: the family's layer names, ``layer_types`` sliced). Usable as
``split_lm.generate(ids, assistant_model=free_draft(split_lm))``. How often it agrees with the
whole model depends on how much the trunk changes the next-token argmax: measure it
(``benchmarks/wan.py`` reports it; docs/WAN.md has the figures). Untrained as an early exit,
it agrees rarely; :func:`distill_draft` trains a copy of it against the split model's own
logits (the teacher's forward crosses the wire without gradients, so the data owner needs no
server weights), which lifts its agreement to about 0.9 on the benchmark's model.

**The draft length** (:class:`LinkAwarePolicy`, installed by :func:`link_aware`).
``transformers``' heuristic (+2 after a fully accepted draft, -1 otherwise) ignores what a
round costs. With per-token acceptance ``a`` (the probability that the target agrees with the
next drafted token), a draft of ``k`` tokens yields on average

    E(k) = 1 + a + a^2 + ... + a^k = (1 - a^(k+1)) / (1 - a)        (k + 1 when a = 1)

tokens per round (the accepted prefix plus the target's own next token), and a round costs

    T(k) = L + k * c

where ``L`` is the verification round (round trip + server compute + the client's own
forward: measured, the time the target's forward takes) and ``c`` the cost of drafting one
token locally (measured; about 0 for prompt lookup). The policy picks
``k = argmax_{0 <= k <= k_max} E(k) / T(k)``: with a long link (``L >> c``) long drafts pay
even at modest acceptance; on loopback (``L ~ c``) it drafts little, or not at all (k = 0: a
plain step, with a one-token probe every ``probe_every`` rounds to keep measuring). ``a`` is estimated from
the rounds so far (accepted drafted tokens / (accepted + rejections), the maximum-likelihood
estimate for a geometric prefix, started from a prior of ``prior_acceptance`` worth
``prior_weight`` tokens); ``L`` and ``c`` are exponential moving averages (the first round's
``L`` comes from ``rtt_ms`` if given). Greedy output does not depend on ``k``: the policy
changes speed only.

**By default** (:func:`default_policy`) a split model's plain ``generate(assistant_model=...)``
or ``generate(prompt_lookup_num_tokens=...)`` drafts at this length, a fresh policy per call
(``model.last_draft_policy`` keeps its counters), whose first round assumes the round trip the
client has measured so far; a caller who sets a schedule of their own (``num_assistant_tokens``,
``num_assistant_tokens_schedule``, ``assistant_confidence_threshold``, in ``generate``'s keywords
or a ``GenerationConfig``), a :func:`link_aware` block, or ``model.link_aware_drafts = False``
gets what they asked for.

**Positions the server sees** (:class:`CountingRemoteCache`). Docs/PRIVACY.md counts one
release per position sent (prompt + one per decoding step). Speculative decoding sends every
drafted position, accepted or not: a round of ``k`` drafted tokens sends ``k + 1`` positions
(the last accepted token and the drafts), and a rejected position is later sent again with
another token. ``positions_sent`` counts rows x positions of every step sent (the releases to
account: ``P + sum over rounds (k_r + 1) - 1`` for one row), never fewer than the tokens kept.
"""
from __future__ import annotations

import contextlib
import copy
import math
import time
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn
from transformers.generation.candidate_generator import CandidateGenerator

from ..errors import ConfigError
from ..model.arch import arch_of
from .cache import RemoteCache
from .sources import CUTS_KEY


# -- the free draft -----------------------------------------------------------------------

def free_draft(model) -> nn.Module:
    """The U-shape split model's own layers with the server's trunk skipped, as a plain model of
    its family (``LlamaForCausalLM``, ``Gemma2ForCausalLM``, ...: see the module docstring).
    ``model``: a U-shape split model of any family (what ``AutoSplitModelForCausalLM`` returns).
    The kept layers ``[0, c1) + [c2, n)`` are renumbered ``0..k-1`` under the family's layer list
    (splitlearn/model/arch.py), the config says ``k`` layers with ``layer_types``
    sliced (a kept sliding layer stays sliding), the embeddings, final norm, head and the family's
    own forward (embedding scale, softcaps, alibi, OPT's positions) are the family's class's. The
    draft's parameters and buffers are the model's own tensors (no copy); a tied head stays tied;
    it is in eval mode; a split model's ``generate(assistant_model=draft)`` drafts at the
    link-aware length by default (:func:`default_policy`)."""
    arch = arch_of(model.config)
    try:
        base = arch.base_of(model)
    except AttributeError:
        base = None
    cuts = tuple(getattr(base, "cuts", ()) or ())
    if len(cuts) != 2 or not getattr(base, "u_shape", False) or getattr(model, arch.head_name, None) is None:
        raise ConfigError("the free draft needs a U-shape split LM (the client holds the bottom, the top "
                          "and the head); a 2-way client has no head: use prompt lookup or an assistant model")
    c1, c2 = cuts
    keep = list(range(c1)) + list(range(c2, arch.n_layers))
    cfg = arch.kept_layers_config(keep)
    if hasattr(cfg, CUTS_KEY):  # a plain model: no server
        delattr(cfg, CUTS_KEY)
    with torch.device("meta"):
        draft = arch.model_class()(cfg)
    cfg.architectures = [type(draft).__name__]
    prefix = arch.layer_prefix() + "."
    new_index = {i: j for j, i in enumerate(keep)}

    def renamed(name: str) -> Optional[str]:
        """The draft's name of the split model's ``name`` (None: a server layer's)."""
        if not name.startswith(prefix):
            return name
        i, _, rest = name[len(prefix):].partition(".")
        return f"{prefix}{new_index[int(i)]}.{rest}" if int(i) in new_index else None

    want = draft.state_dict()
    state = {}
    for name, t in model.state_dict().items():
        new = renamed(name)
        if new in want:
            state[new] = t
    head = arch.head_name + ".weight"
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    missing, unexpected = draft.load_state_dict(state, strict=False, assign=True)
    if tied:  # one parameter, as the family's class ties it (distillation trains it once)
        draft.get_output_embeddings().weight = draft.get_input_embeddings().weight
        missing = [m for m in missing if m != head]
    if missing or unexpected:
        raise ConfigError(f"free draft: missing {missing}, unexpected {unexpected}")
    buffers = {renamed(n): b for n, b in model.named_buffers()}
    for name, buf in list(draft.named_buffers()):  # non-persistent ones (rotary, embedding scale)
        if buf.is_meta:
            if buffers.get(name) is None:
                raise ConfigError(f"free draft: buffer {name} was not set")
            owner, _, leaf = name.rpartition(".")
            draft.get_submodule(owner).register_buffer(leaf, buffers[name], persistent=False)
    draft.generation_config = copy.deepcopy(model.generation_config)
    draft.free_draft_of = cuts
    return draft.eval()


def distill_draft(teacher, batches, *, draft: Optional[nn.Module] = None, steps: Optional[int] = None,
                  lr: float = 1e-3, temperature: float = 1.0, progress: bool = True) -> nn.Module:
    """Train a draft to agree with ``teacher`` (knowledge distillation, Hinton et al. 2015):
    minimise the per-token KL divergence from the teacher's next-token distribution to the
    draft's, at ``temperature``, with AdamW (no weight decay) on a one-cycle schedule
    (10% warm-up). Returns the trained draft in eval mode, ready for
    ``teacher.generate(ids, assistant_model=draft)``.

    teacher: any causal LM whose output has ``.logits``, e.g. the split model itself: its
        forward runs under ``torch.no_grad()`` (the server evaluates; nothing changes there),
        so the data owner distils a draft without holding the server's weights.
    batches: an iterable of token id tensors (B, T) (or dicts with ``input_ids`` and an
        optional ``attention_mask``), e.g. :func:`splitlearn.model.data.lm_batches` of private text.
    draft: the model to train (updated in place); default: a **copy** of the U-shape
        teacher's :func:`free_draft` (the client's own layers, trunk skipped), so the split
        model itself is not changed. A 2-way teacher has no free draft: pass one.
    steps: batches to use (default: ``len(batches)``); the schedule spans them.

    What agreement buys is measured in docs/WAN.md: on the tiny-demo U-shape (1, 5) the free
    draft agrees with the whole model on about 0.3 of greedy tokens before, about 0.9 after.
    """
    if draft is None:
        draft = copy.deepcopy(free_draft(teacher))  # own tensors: training it leaves the split model alone
    if steps is None:
        try:
            steps = len(batches)
        except TypeError:
            raise ConfigError("distill_draft: give steps= for an iterable without a length") from None
    if steps < 1 or not lr > 0 or not temperature > 0:
        raise ConfigError(f"distill_draft needs steps >= 1, lr > 0 and temperature > 0, "
                          f"got {steps}, {lr}, {temperature}")
    if draft.config.vocab_size != teacher.config.vocab_size:
        raise ConfigError(f"the draft's vocabulary ({draft.config.vocab_size}) is not the teacher's "
                          f"({teacher.config.vocab_size})")
    from tqdm.auto import tqdm

    was_training = teacher.training
    teacher.eval()
    draft.train()
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    bar = tqdm(total=steps, desc="distilling the draft", unit="batch", disable=not progress)
    T, done = float(temperature), 0
    try:
        for batch in batches:
            if done == steps:
                break
            ids, mask = (batch["input_ids"], batch.get("attention_mask")) if isinstance(batch, dict) else (batch, None)
            with torch.no_grad():
                want = torch.log_softmax(teacher(input_ids=ids, attention_mask=mask).logits.float() / T, -1)
            got = torch.log_softmax(draft(input_ids=ids, attention_mask=mask).logits.float() / T, -1)
            kl = torch.nn.functional.kl_div(got, want, log_target=True, reduction="none").sum(-1)  # (B, T)
            loss = (kl * mask).sum() / mask.sum() if mask is not None else kl.mean()
            opt.zero_grad()
            (loss * T * T).backward()
            opt.step()
            sched.step()
            done += 1
            bar.update(1)
            bar.set_postfix(kl=f"{loss.item():.4f}")
    finally:
        bar.close()
        teacher.train(was_training)
    if done < steps:
        raise ConfigError(f"distill_draft: the batches ran out after {done} of {steps} steps")
    draft.eval()
    return draft


# -- the draft length -------------------------------------------------------------------

def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens a round of ``k`` drafted tokens yields on average at per-token ``acceptance``."""
    a = min(max(float(acceptance), 0.0), 1.0)
    return float(k + 1) if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)


def best_draft_length(acceptance: float, round_s: float, token_s: float, k_max: int = 16, k_min: int = 0) -> int:
    """``argmax_{k_min<=k<=k_max} expected_tokens(acceptance, k) / (round_s + k * token_s)``
    (k = 0: no draft, a plain step; the shortest k wins ties)."""
    if not 0 <= k_min <= k_max:
        raise ValueError("need 0 <= k_min <= k_max")
    round_s, token_s = max(float(round_s), 1e-6), max(float(token_s), 0.0)
    best, best_rate = k_min, -1.0
    for k in range(k_min, k_max + 1):
        rate = expected_tokens(acceptance, k) / (round_s + k * token_s)
        if rate > best_rate * (1 + 1e-9):
            best, best_rate = k, rate
    return best


@dataclass
class LinkAwarePolicy:
    """Chooses the draft length from the measured round, draft cost and acceptance (see the
    module docstring). ``rtt_ms``: the link's round trip if known (the first round's estimate
    of ``L``); later rounds measure it. Counters over its lifetime: ``rounds``, ``drafted``,
    ``accepted``, ``lengths`` (the k chosen per round)."""

    k_max: int = 16
    rtt_ms: Optional[float] = None
    probe_every: int = 8  # when drafting does not pay (k = 0), draft one token every this many rounds
    prior_acceptance: float = 0.6
    prior_weight: float = 4.0
    smoothing: float = 0.3  # EMA weight of the newest measurement of L and c
    round_s: Optional[float] = None  # L
    token_s: Optional[float] = None  # c
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    rejections: int = 0
    lengths: list = field(default_factory=list)

    @property
    def acceptance(self) -> float:
        """Estimated per-token acceptance (the prior blended with the rounds so far)."""
        hits = self.accepted + self.prior_acceptance * self.prior_weight
        return hits / (self.accepted + self.rejections + self.prior_weight)

    @property
    def measured_acceptance(self) -> float:
        """Accepted / drafted over the rounds so far (nan before any draft)."""
        return self.accepted / self.drafted if self.drafted else math.nan

    def next_length(self, k_min: int = 0) -> int:
        """The next round's draft length, at least ``k_min`` (1 for a generation's first round:
        :class:`LinkAwareDraft`)."""
        L = self.round_s if self.round_s is not None else (self.rtt_ms or 1.0) / 1000.0
        c = self.token_s if self.token_s is not None else 0.0
        k = best_draft_length(self.acceptance, L, c, self.k_max, min(k_min, self.k_max))
        if k == 0 and (self.rounds % self.probe_every == 0 or self.token_s is None):
            k = 1  # keep measuring the draft's cost and acceptance
        self.lengths.append(k)
        return k

    def _ema(self, old: Optional[float], new: float) -> float:
        return new if old is None else (1 - self.smoothing) * old + self.smoothing * new

    def update(self, drafted: int, accepted: int, draft_s: float, verify_s: float) -> None:
        """One round: ``drafted`` tokens proposed in ``draft_s``, ``accepted`` of them kept, the
        target's forward took ``verify_s``."""
        self.rounds += 1
        self.drafted += drafted
        self.accepted += accepted
        self.rejections += int(accepted < drafted)
        if drafted:
            self.token_s = self._ema(self.token_s, draft_s / drafted)
        self.round_s = self._ema(self.round_s, verify_s)


class LinkAwareDraft(CandidateGenerator):
    """Wraps transformers' candidate generator (assistant model or prompt lookup): with
    ``control``, sets its draft length from ``policy`` before every round (otherwise leaves
    transformers' schedule alone); always records draft time, verification time and
    acceptance in ``policy``."""

    def __init__(self, inner: CandidateGenerator, policy: LinkAwarePolicy, control: bool = True):
        self.inner, self.policy, self.control = inner, policy, control
        self.requires_model_outputs = getattr(inner, "requires_model_outputs", False)
        if control and hasattr(inner, "num_assistant_tokens"):
            # stop only at k: the assistant's confidence stop ignores the link
            inner.generation_config.assistant_confidence_threshold = 0.0
            inner.assistant_confidence_threshold = 0.0
        if callable(getattr(inner, "_prepare_generation_args", None)) and isinstance(getattr(inner, "assistant_kwargs", None), dict):
            inner._prepare_generation_args = self._one_config(inner)
        self._t0 = self._drafted = self._draft_s = None

    @staticmethod
    def _one_config(inner):
        """transformers 5.24's assistant calls its ``generate`` with a ``generation_config`` and
        ``min_new_tokens``/``max_new_tokens`` (and the main model's ``use_cache``) as keywords, which
        that ``generate`` warns is deprecated: the same values, set in a copy of the config."""
        prepare = inner._prepare_generation_args

        def prepare_in_config(input_ids, min_new_tokens, max_new_tokens):
            args = prepare(input_ids, min_new_tokens, max_new_tokens)
            config = copy.deepcopy(args["generation_config"])
            config.min_new_tokens, config.max_new_tokens = args.pop("min_new_tokens"), args.pop("max_new_tokens")
            if "use_cache" in inner.assistant_kwargs:  # the first round: into the config for every round
                inner.generation_config.use_cache = config.use_cache = inner.assistant_kwargs.pop("use_cache")
            args["generation_config"] = config
            return args

        return prepare_in_config

    def __getattr__(self, name):  # model_kwargs_overrides and the like
        return getattr(self.__dict__["inner"], name)

    def _set_length(self, k: int) -> None:
        if hasattr(self.inner, "num_assistant_tokens"):
            self.inner.num_assistant_tokens = k
        elif hasattr(self.inner, "num_output_tokens"):
            self.inner.num_output_tokens = k

    def get_candidates(self, input_ids, **kwargs):
        if self.control:
            # a generation's first round drafts: transformers' assistant starts its cache, attention
            # mask and positions there, and a first round of k = 0 (a policy carried over from
            # earlier calls, drafting judged not to pay) left them at the prompt's length, so the
            # next round's draft failed ('size of tensor a (20) must match ... b (16)')
            self._set_length(self.policy.next_length(k_min=1 if self._t0 is None else 0))
        t = time.perf_counter()
        ids, logits = self.inner.get_candidates(input_ids, **kwargs)
        now = time.perf_counter()
        self._draft_s, self._t0 = now - t, now
        self._drafted = ids.shape[1] - input_ids.shape[1]
        return ids, logits

    def update_candidate_strategy(self, input_ids, scores, num_matches):
        verify_s = time.perf_counter() - self._t0
        self.policy.update(self._drafted, int(num_matches), self._draft_s, verify_s)
        if not self.control:
            self.inner.update_candidate_strategy(input_ids, scores, num_matches)


@contextlib.contextmanager
def link_aware(model, policy: Optional[LinkAwarePolicy] = None, *, control: bool = True):
    """Within the block, ``model.generate(assistant_model=... | prompt_lookup_num_tokens=...)``
    drafts through :class:`LinkAwareDraft`: ``policy`` (default: a new
    :class:`LinkAwarePolicy`) chooses each round's length, or with ``control=False`` only
    records the rounds (transformers' own schedule). Yields the policy, whose counters say
    what happened (``rounds``, ``drafted``, ``accepted``, ``lengths``, ``measured_acceptance``).
    The model's ``_get_candidate_generator`` is wrapped on the instance for the block only."""
    policy = policy if policy is not None else LinkAwarePolicy()
    original = model._get_candidate_generator

    def wrapped(*args, **kwargs):
        return LinkAwareDraft(original(*args, **kwargs), policy, control)

    model._get_candidate_generator = wrapped
    try:
        yield policy
    finally:
        del model._get_candidate_generator


# -- the default: link-aware unless the caller chose ------------------------------------------

#: the round trip a split model's first drafting round assumes before its client has measured
#: one (ms): a WAN's; every later round uses the verification time measured (``LinkAwarePolicy``)
DEFAULT_RTT_MS = 50.0
#: what sets a draft schedule of the caller's own, in ``generate()``'s keywords or in a
#: ``GenerationConfig`` (the one passed, the model's, or the assistant's: transformers 5.24 reads
#: the schedule from the assistant's)
SCHEDULE_FIELDS = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")


def measured_rtt_ms(model) -> Optional[float]:
    """The mean round trip of the calls ``model``'s client has made so far (its transport's
    ``WireStats``: request sent to answer decoded, server compute included), in ms; None
    before its first call."""
    stats = model.remote.stats  # every split class's remote segment
    return 1000.0 * stats.round_trip_s / stats.calls if stats.calls else None


def default_policy(model, args: tuple = (), kwargs: Optional[dict] = None) -> Optional[LinkAwarePolicy]:
    """The :class:`LinkAwarePolicy` a split model's ``generate(*args, **kwargs)`` drafts with
    by default, or None where transformers' own schedule applies: no drafting (neither
    ``assistant_model`` nor ``prompt_lookup_num_tokens``), ``model.link_aware_drafts`` False,
    inside a :func:`link_aware` block (it chose already), or a schedule set by the caller
    (:data:`SCHEDULE_FIELDS` as keywords, or set in the ``generation_config`` passed, the
    model's or the assistant model's). The policy's first round assumes the client's measured
    round trip (:func:`measured_rtt_ms`), else :data:`DEFAULT_RTT_MS`."""
    kwargs = kwargs or {}
    if not getattr(model, "link_aware_drafts", True) or "_get_candidate_generator" in vars(model):
        return None
    if kwargs.get("assistant_model") is None and kwargs.get("prompt_lookup_num_tokens") is None:
        return None
    if any(kwargs.get(f) is not None for f in SCHEDULE_FIELDS):
        return None
    passed = kwargs.get("generation_config", args[1] if len(args) > 1 else None)
    configs = [passed, model.generation_config, getattr(kwargs.get("assistant_model"), "generation_config", None)]
    if any(getattr(c, f, None) is not None for c in configs for f in SCHEDULE_FIELDS):
        return None
    rtt = measured_rtt_ms(model)
    return LinkAwarePolicy(rtt_ms=rtt if rtt is not None else DEFAULT_RTT_MS)


# -- positions the server sees ----------------------------------------------------------

class CountingRemoteCache(RemoteCache):
    """A :class:`RemoteCache` that counts what it sends: ``positions_sent`` (rows x positions
    of every step, accepted or later cropped: the releases docs/PRIVACY.md accounts) and
    ``steps_sent`` (round trips; with row groups, each group's cache counts its own)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.positions_sent = 0
        self.steps_sent = 0

    def start(self, hidden, attention_mask=None, logits_to_keep: int = 1):
        step = super().start(hidden, attention_mask, logits_to_keep)
        self.positions_sent += int(hidden.shape[0]) * int(hidden.shape[1])
        self.steps_sent += 1
        return step
