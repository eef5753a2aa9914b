"""Micro-batch pipelining for the model classes (GPipe, Huang et al. 2019), under autograd.

``SplitGPT2LMHeadModel.from_pretrained(..., micro_batches=M)`` (or ``model.micro_batches = M``)
splits a training forward with ``labels`` into M micro-batches along the rows and keeps their
requests in flight on up to ``MAX_LANES`` connections, so the client and the server compute at
once. ``model(**batch).loss`` and ``loss.backward()`` keep their meaning; the pieces are pieces
of the current open-ended step (docs/PROTOCOL.md), applied when the optimizer steps.
U-shape, M = 3 (f: the trunk's forward, b: its backward, ⁻¹: a backward on the client)::

    forward   client: bottom(0) bottom(1) bottom(2) top(0) ..... top(1) top(2)
              server:           f(0) .... f(1) ..... f(2)
    backward  client: top⁻¹(0) top⁻¹(1) . bottom⁻¹(0) top⁻¹(2) . bottom⁻¹(1) .. bottom⁻¹(2)
              server:          b(0) ....... b(1) ............... b(2)

Every forward is sent as soon as its bottom is done, and top(i) runs as soon as f(i) is back.
``loss`` is one autograd node (:class:`_Pipelined`) over the micro-batches' graphs: its
backward runs top⁻¹(i), sends b(i) as soon as b(i-1) is answered (one backward at a time on
the server, so it sums the pieces' gradients in one order, as a replay after a crash does),
and runs bottom⁻¹(i-1) while the server runs b(i). 2-way: the server computes each
micro-batch's loss in the forward; in the backward b(i) overlaps bottom⁻¹(i-1).

**1F1B when the loss's gradient is known** (:attr:`RemoteSegment.loss_gradient
<splitlearn.hf.remote.RemoteSegment.loss_gradient>`, ``g``: ``SplitClient.train_step``'s
``loss.backward()`` promises 1): the backward runs *during* the forward, GPipe's 1F1B order:
top⁻¹(i) right after top(i), b(i) sent at once (several in flight), each bottom⁻¹(j) as soon as
b(j) is back, between two tops; ``loss.backward()`` then only checks the gradient is ``g``. The
pieces are still those of the open-ended step (applied when the optimizer steps, the apply
carried by the next step's first forwards); 2-way, each piece is one fused ``POST
/v1/train/step`` (forward, loss and backward on the server, its loss's gradient ``g x share``
sent as ``loss_scale``) and bottom⁻¹(i) runs as its answer comes.

The loss is the batch's: each micro-batch's mean loss weighted by its share of the batch's
target tokens (``labels`` not -100 after the shift), or of ``num_items_in_batch`` when
``Trainer`` passes it; the backward scales every piece by the gradient the loss receives
(``loss / accumulation_steps`` is exact). So a pipelined step equals an unpipelined one up to
float32 summation order. A batch with a micro-batch of no targets is sent whole. A
defense's extra loss (NoPeek) is computed per micro-batch and weighted by its rows.
``logits`` is None: the micro-batches' (B, T, V) logits are not kept (for GPT-2 small at b8 x
128 they are 206 MB, twice over once concatenated); evaluate without gradients for them.
"""
from __future__ import annotations

import logging
import statistics
import time
from typing import Optional

import torch
from torch.autograd.function import once_differentiable
from transformers.modeling_outputs import CausalLMOutputWithCrossAttentions

from ..api import protocol as P
from ..errors import ConfigError
from .halves import halves_of, precomputed
from .splittrunk import check_defense

log = logging.getLogger(__name__)

MAX_LANES = 8  # requests in flight at once (one keep-alive connection each)


def check_micro_batches(m) -> int:
    if isinstance(m, bool) or not isinstance(m, int) or not 1 <= m <= P.MAX_MICROS:
        raise ConfigError(f"micro_batches must be an integer in [1, {P.MAX_MICROS}], got {m!r}")
    return m


def _rows(x: Optional[torch.Tensor], m: int) -> list[Optional[torch.Tensor]]:
    return [None] * m if x is None else list(torch.tensor_split(x, m, dim=0))


def token_shares(labels: torch.Tensor, m: int) -> list[int]:
    """Each of ``m`` micro-batches' count of (shifted, non-ignored) target tokens."""
    return [int((y[..., 1:] != -100).sum()) for y in _rows(labels, m)]


class _Lanes:
    """Pieces in flight, one per lane; answers kept until asked for."""

    def __init__(self, remote, n: int):
        self.remote, self.n = remote, n
        self.calls: dict[int, tuple] = {}  # lane -> (key, call)
        self.answers: dict[tuple, tuple] = {}  # key -> steps.finish's (kind, piece, tensors)

    def start(self, key: tuple, kind: str, tensors: dict, piece=None, scale=None):
        lane = key[1] % self.n
        if lane in self.calls:  # one request per lane: read the one before
            self._read(lane)
        call = self.remote.steps.start(kind, tensors, lane, piece, **({} if scale is None else {"scale": scale}))
        self.calls[lane] = (key, call)
        return call[1]  # the piece

    def _read(self, lane: int) -> None:
        key, call = self.calls.pop(lane)
        self.answers[key] = self.remote.steps.finish(call)

    def ready(self, key: tuple) -> bool:
        """Can ``key``'s answer be had without waiting for the server?"""
        if key in self.answers:
            return True
        entry = self.calls.get(key[1] % self.n)
        return entry is None or entry[0] != key or entry[1][3] is None or entry[1][3].ready()

    def get(self, key: tuple) -> dict:
        """The answer's tensors, unpacked (``hidden``, ``loss``, ``grad``)."""
        if key not in self.answers:
            self._read(key[1] % self.n)
        return self.answers.pop(key)[2]

    def drain(self) -> None:
        """Read every request still out (after an error: the step is the caller's to discard)."""
        for lane in list(self.calls):
            try:
                self._read(lane)
            except Exception:  # noqa: BLE001 - the error being raised already says what went wrong
                self.calls.pop(lane, None)


class _Run:
    """One pipelined forward's state, kept for its backward."""

    def __init__(self, model, n: int):
        self.model, self.halves = model, halves_of(model)
        self.remote = self.halves.remote
        self.lanes = _Lanes(self.remote, min(n, MAX_LANES))
        self.sent: list[torch.Tensor] = []  # per micro-batch: what crossed the cut (b, T, d)
        self.defense: list[Optional[torch.Tensor]] = []  # per micro-batch: the defense's extra loss
        self.pieces: list[tuple[int, int]] = []  # per micro-batch: its (step, piece)
        self.leaves: list[torch.Tensor] = []  # U-shape: the trunk's outputs as leaves (b, T, d)
        self.losses: list[torch.Tensor] = []  # U-shape: mean losses with their graphs; 2-way: values
        self.weights: list[float] = []  # each micro-batch's share of the batch's loss
        self.row_weights: list[float] = []  # each micro-batch's share of the rows (the defense's loss)
        self.eager: Optional[float] = None  # the loss's known gradient: backward during the forward (1F1B)
        self.done = 0  # bottoms backpropagated, in order

    def backward(self, g: torch.Tensor) -> None:
        if self.eager is not None:
            if abs(float(g) - self.eager) > 1e-6 * abs(self.eager):
                raise ConfigError(f"the loss received the gradient {float(g):g} where {self.eager:g} was "
                                  f"promised (loss_gradient): its backward ran with the forward")
            return
        self._backward(g)

    def _backward(self, g: torch.Tensor) -> None:
        """top⁻¹(i) (U-shape), then b(i) sent once b(i-1) is answered, then bottom⁻¹(i-1) while
        the server runs b(i): one backward on the server at a time, so it sums the pieces'
        gradients in one order (a replay after a crash sums them alike)."""
        u = self.halves.u_shape
        try:
            for i in range(len(self.sent)):
                if u:
                    torch.autograd.backward(self.losses[i], g * self.weights[i])  # top⁻¹(i): the leaf's grad
                    tensors = self.remote.steps.backward_tensors(self.leaves[i].grad)
                else:  # the scalar gradient of the server's loss
                    tensors = self.remote.steps.backward_tensors((g.detach() * self.weights[i]).reshape(()))
                before = self.lanes.get(("b", i - 1)) if i else None
                self.lanes.start(("b", i), "b", tensors, self.pieces[i])
                if before is not None:
                    self.bottom(i - 1, before, g)
            last = len(self.sent) - 1
            self.bottom(last, self.lanes.get(("b", last)), g)
        finally:
            self.lanes.drain()

    def bottom(self, j: int, answer: dict, g: torch.Tensor) -> None:
        """bottom⁻¹(j) with the server's gradient of what micro-batch j sent (the next in order)."""
        assert j == self.done, (j, self.done)
        self.done += 1
        sent = self.sent[j]
        grad = answer[P.GRAD].to(device=sent.device, dtype=sent.dtype)
        if self.defense[j] is None:
            sent.backward(grad)
        else:
            torch.autograd.backward([sent, self.defense[j]], [grad, g * self.row_weights[j]])


class _Pipelined(torch.autograd.Function):
    """The batch's loss over the micro-batches' graphs; its backward is the pipelined one."""

    @staticmethod
    def forward(ctx, proxy, value: torch.Tensor, run: _Run):
        ctx.run = run
        return value.detach().clone()

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        run, ctx.run = ctx.run, None
        if run is None:
            raise RuntimeError("a pipelined loss can be backpropagated once")
        run.backward(g)
        return None, None, None


class Chooser:
    """Whole batches or ``M`` micro-batches, whichever measured faster (on a GPU by default).

    Pipelining pays where the client and the server compute at once on two devices (two CPUs,
    two GPUs, a link with latency); on one GPU both sides share it, and M smaller pieces cost M
    times the per-crossing and launch overheads (issue 42: GPT-2 XL U (2, 46) on one H100, 4 x
    1024, was 1.4x the unsplit step whole and 3.0x with ``micro_batches=4``). So the first
    training steps measure both: ``WARMUP`` + ``TRIALS`` steps with M, the same whole; a step's
    time is the time from its training forward to the next (forward, backward, the optimizer's
    step and whatever the loop does between: the same for both). The faster count's median
    wins and is kept (logged once at INFO). ``model.choose_micro_batches``: ``"auto"`` (the
    default: measure on a CUDA device only, where the GPU issue measured the loss), ``True``
    (measure on any device), ``False`` (always M). (Off for a while after its one H100 run met a
    forward answered with a backward's tensors: a piece sent again went on lane 0, where another
    piece's request was still out; :meth:`.pieces.StepPieces.finish` now resends on the piece's
    own lane.)"""

    WARMUP, TRIALS = 1, 3

    def __init__(self, m: int, clock=None):
        self.m, self.clock = m, clock or time.perf_counter
        self.plan = [m] * (self.WARMUP + self.TRIALS) + [1] * (self.WARMUP + self.TRIALS)
        self.times: dict[int, list[float]] = {m: [], 1: []}
        self.index, self.last, self.choice = 0, None, None

    def count(self) -> int:
        """The count for the training forward starting now (each call is one step's forward)."""
        now = self.clock()
        if self.choice is not None:
            return self.choice
        if self.last is not None:  # the step before this one has ended: its time
            prev = self.index - 1
            if prev % (self.WARMUP + self.TRIALS) >= self.WARMUP:
                self.times[self.plan[prev]].append(now - self.last)
        self.last = now
        if self.index == len(self.plan):
            med = {k: statistics.median(v) for k, v in self.times.items()}
            self.choice = self.m if med[self.m] <= med[1] else 1
            log.info(
                "micro_batches=%d: %.1f ms a step, whole batches: %.1f ms: training with %s (measured over %d "
                "steps each; model.choose_micro_batches = False keeps %d)", self.m, 1e3 * med[self.m],
                1e3 * med[1], f"{self.m} micro-batches" if self.choice == self.m else "whole batches",
                self.TRIALS, self.m)
            return self.choice
        self.index += 1
        return self.plan[self.index - 1]


def server_on_this_machine(model) -> bool:
    """Does ``model``'s server run on this machine (loopback, ``unix://``, ``inproc://``)?"""
    from urllib.parse import urlsplit

    url = getattr(getattr(getattr(getattr(model, "remote", None), "transport", None), "cfg", None), "url", "") or ""
    host = urlsplit(url).hostname or ""
    return url.startswith(("unix://", "inproc://")) or host == "localhost" or host.startswith("127.") or host == "::1"


def warn_same_machine(model, m: int) -> None:
    """Once per model: M > 1 micro-batches with a server on this machine's own CPU cores. The
    pipeline pays by overlapping the client's compute with the server's; sharing the cores they
    cannot overlap, and each of the M pieces pays a call's overhead (issue 54: ``--micro-batches 4``
    ~3x slower than whole batches on loopback, 2 cores)."""
    if m < 2 or model.__dict__.get("_micro_warned") or not server_on_this_machine(model):
        return
    param = next(model.parameters(), None)
    if param is not None and param.device.type == "cuda":
        return  # the client computes on its GPU: the Chooser measures there
    model.__dict__["_micro_warned"] = True
    log.warning("micro_batches=%d with the server on this machine's CPU cores: the %d pieces overlap with the "
                "server's compute only where spare cores are left, and each pays a call's overhead, so a step "
                "may be slower than whole batches (a small model on 2 busy cores: ~3x at 4); they pay where the "
                "server computes elsewhere (another host, a GPU) or the steps are large. "
                "model.choose_micro_batches = True measures both and keeps the faster", m, m)


def micro_count(model) -> int:
    """The micro-batches of this training forward: ``model.micro_batches``, or 1 while/after
    the :class:`Chooser` measured whole batches faster."""
    m = check_micro_batches(getattr(model, "micro_batches", 1))
    if getattr(model, "choose_micro_batches", False) is not True:
        warn_same_machine(model, m)
    choose = getattr(model, "choose_micro_batches", False)
    if m < 2 or choose is False:
        return m
    if choose == "auto":
        param = next(model.parameters(), None)
        if param is None or param.device.type != "cuda":
            return m
    chooser = model.__dict__.get("_micro_chooser")
    if chooser is None or chooser.m != m:
        chooser = model.__dict__["_micro_chooser"] = Chooser(m)
    return chooser.count()


def applies(model, labels, cache, inputs_embeds) -> bool:
    """Pipeline this forward? Training (gradients on), ``labels``, no cache, M > 1 (for this
    step: :func:`micro_count`), rows > 1."""
    if not (torch.is_grad_enabled() and labels is not None and cache is None and inputs_embeds is None):
        check_micro_batches(getattr(model, "micro_batches", 1))
        return False
    m = micro_count(model)
    model.__dict__["_micro_now"] = m
    return m > 1


def forward(model, hf_forward, input_ids, attention_mask, labels, token_type_ids=None, position_ids=None,
            num_items_in_batch=None, **kwargs):
    """The pipelined training forward of a causal LM -> ``CausalLMOutputWithCrossAttentions``;
    ``hf_forward(**kw)``: the Hugging Face head's own forward (U-shape), run on each micro-batch's
    output. None when the batch cannot be split (fewer rows than 2, a micro-batch of no targets)."""
    t = halves_of(model)
    m = min(model.__dict__.get("_micro_now", model.micro_batches), input_ids.shape[0])
    labels = labels.to(input_ids.device)
    counts = token_shares(labels, m)
    if m < 2 or min(counts) == 0:
        return None
    total = float(num_items_in_batch) if num_items_in_batch is not None else float(sum(counts))
    run = _Run(model, m)
    run.weights = [n / total for n in counts]
    known = run.remote.loss_gradient
    scales = [run.remote.steps.fused_scale(w) for w in run.weights]
    if known is not None and (t.u_shape or None not in scales):  # backpropagate while forwarding (1F1B)
        run.eager = float(known)
    rows = [x.shape[0] for x in _rows(input_ids, m)]
    run.row_weights = [r / sum(rows) for r in rows]
    parts = list(zip(_rows(input_ids, m), _rows(attention_mask, m), _rows(labels, m), _rows(token_type_ids, m),
                     _rows(position_ids if position_ids is not None and position_ids.shape[0] > 1 else None, m)))
    ctxs = []
    try:
        for i, (x, mask, y, tt, pos) in enumerate(parts):  # bottom(i + 1) while the server works on i
            pos = pos if pos is not None else position_ids
            sent, ctx = t.bottom_half(x, None, mask, tt, pos, None)
            run.sent.append(sent)
            run.defense.append(t.defense_loss)
            ctxs.append(ctx)
            tensors = run.remote.steps.forward_tensors(sent, ctx["mask"], None if t.u_shape else y, ctx["given"])
            fused = scales[i] if run.eager is not None and not t.u_shape else None
            run.pieces.append(run.lanes.start(("f", i), "f", tensors, scale=fused))
        one = torch.full((), run.eager if run.eager is not None else 1.0, device=input_ids.device)
        for i, (x, mask, y, tt, pos) in enumerate(parts):
            while run.eager is not None and run.done < i and run.lanes.ready(("b", run.done)):  # work that is here
                run.bottom(run.done, run.lanes.get(("b", run.done)), one)
            out = run.lanes.get(("f", i))
            if not t.u_shape:
                run.losses.append(out[P.LOSS].reshape(()))
                if run.eager is not None:  # a fused piece: the server's backward came with the loss
                    run.bottom(i, out, one)
                continue
            sent = run.sent[i]
            leaf = out[P.HIDDEN].to(device=sent.device, dtype=sent.dtype).requires_grad_()
            run.leaves.append(leaf)
            with precomputed(t, t.top_half(leaf, ctxs[i])):
                head = hf_forward(input_ids=x, attention_mask=mask, labels=y, token_type_ids=tt, **kwargs)
            run.losses.append(head.loss)
            del head  # its logits (b, T, V) are not kept: the loss's graph holds what the backward needs
            if run.eager is not None:  # top⁻¹(i) now, b(i) on its way while the client goes on
                torch.autograd.backward(run.losses[i], one * run.weights[i])
                run.lanes.start(("b", i), "b", run.remote.steps.backward_tensors(leaf.grad), run.pieces[i])
        while run.eager is not None and run.done < m:
            run.bottom(run.done, run.lanes.get(("b", run.done)), one)
    except BaseException:
        run.lanes.drain()
        raise
    value = sum(w * float(loss.detach()) for w, loss in zip(run.weights, run.losses))
    extra = [d for d in run.defense if d is not None]
    t.defense_loss = None
    if extra:
        t.defense_loss = sum(r * d.detach() for r, d in zip(run.row_weights, run.defense))
        value += float(t.defense_loss)
    ref = run.sent[0]
    proxy = run.remote.grad_proxy  # an input that needs a gradient, so autograd calls the backward
    anchor = proxy if proxy.requires_grad else torch.zeros(1, requires_grad=True)
    loss = _Pipelined.apply(anchor, torch.tensor(value, dtype=torch.float32, device=ref.device), run)
    return CausalLMOutputWithCrossAttentions(loss=loss, logits=None)


class FamilyPipeline:
    """``micro_batches`` on any family's split class (:class:`splitlearn.hf.auto.AutoSplitModelForCausalLM`):
    a training forward with ``labels`` runs in micro-batches, pipelined with the server, as on
    ``SplitGPT2LMHeadModel`` (this module's docstring); the family's own forward runs its head,
    softcap and loss on each micro-batch's top half (:mod:`.halves`)."""

    #: see :attr:`splitlearn.hf.mixin.SplitMixin.choose_micro_batches`
    choose_micro_batches = "auto"

    @property
    def micro_batches(self) -> int:
        """Training forwards with ``labels`` split into this many micro-batches (1: whole)."""
        return self.__dict__.get("_micro_batches", 1)

    @micro_batches.setter
    def micro_batches(self, m: int) -> None:
        check_defense(getattr(self, "defense", None), True, check_micro_batches(m))  # residual/gradient: whole batches
        self.__dict__["_micro_batches"] = m

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                labels=None, **kwargs):
        given = cache if cache is not None else kwargs.get("past_key_values")
        if applies(self, labels, given, inputs_embeds):
            def head(token_type_ids=None, **kw):  # the family's forward on a micro-batch's top half
                return super(FamilyPipeline, self).forward(**kw)

            out = forward(self, head, input_ids, attention_mask, labels, None, position_ids, **kwargs)
            if out is not None:
                return out
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               cache=cache, inputs_embeds=inputs_embeds, labels=labels, **kwargs)
