"""Training steps on the server: pieces accumulated, applied exactly once at the client's lr.

A step arrives in pieces (GPipe micro-batching, Huang et al. 2019, or gradient accumulation
under a client's own optimizer, :mod:`splitlearn.hf`), with no count fixed in advance. Every
piece carries the step's number, its ``micro`` index and ``micros = 0`` (closed steps, whose
server applied at its own lr after ``micros >= 1`` pieces, are gone: 400). Each backward
piece adds to the accumulated gradients and answers, in its metadata, ``grad_norm`` (the L2
norm of the server's accumulated parameter gradients so far) and ``accumulated`` (how many
pieces that covers); nothing is applied until ``POST /v1/train/apply`` (:meth:`Training.apply`)
names the step, how many backward pieces the client got answers for, the learning rate to
step with (the client's current one; on state shared between tenants, at most the server's
own ``--lr``) and an optional clip factor. On a 2-way server a forward carries the labels and
answers the loss (the graph waits); its backward carries the scalar gradient of that loss
(``grad`` F32 ``[1]``: what the client's autograd backpropagates into it) and answers
``dL/dhidden``::

    U-shape: forward (piece k) -> hidden;  backward (piece k) -> grad + grad_norm
    2-way:   forward (piece k, labels) -> loss;  backward (piece k, scalar) -> grad + grad_norm
    POST /v1/train/apply {client_id, step, pieces, lr, clip} -> x clip, guards, lr, optimizer step

The apply may instead ride on the next step's first request(s): metadata ``apply``, the same
JSON as the apply's body (:func:`splitlearn.api.protocol.carried_apply`), is applied first, exactly as
``POST /v1/train/apply`` would be (the same ledger record: a retry of the carrying request gets the
stored apply; an apply of a step the ledger already has passed is a no-op), and the piece's answer
carries the apply's answer as metadata ``apply`` (JSON). A 2-way piece may be **fused**
(``POST /v1/train/step``: forward, loss and backward at once, the loss's gradient sent as
``loss_scale``: one request per piece when the client knows that gradient)::

    U-shape: forward (piece 0 of step s+1, apply of s) -> apply s, then the trunk output
    2-way:   step (piece k, labels, loss_scale) -> loss + grad + grad_norm (fused)

Pieces may come in any order and be retried: each piece's answer is kept until the step is
applied (the ledger keeps their digests after), so a retry gets the same bytes. On the shared
segment a step holds the :class:`~.lease.StepLease` from its first piece to its apply, so no
other client's step touches the weights or the accumulated gradients in between. A poisoned
piece (see :mod:`.guard`) aborts the whole step: gradients zeroed, pieces dropped, lease
released, weights and optimizer state unchanged.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Optional, Union

import torch

from ...api import protocol as P
from ...errors import BadRequest, Conflict, TooManyRequests
from ...model.headloss import IGNORE, head_loss
from ...api.wire import pack
from . import guard
from ..federation.modes import Replica
from .budget import graph_bytes, padded
from .gradclip import MIN_SHARE, partial_step
from .priority import step_in_parts
from .ledger import APPLIED, Answer, Pending, answer_bytes
from ..tenants import SEP, client_of, tenant_of

log = logging.getLogger(__name__)


@dataclass
class StepInFlight:
    """A step whose pieces are arriving."""

    rep: Replica  # the segment (or the client's copy / adapter) being trained
    leased: bool  # holds the shared segment's lease: the state is shared between tenants
    forwards: dict[int, tuple] = field(default_factory=dict)  # micro -> (inputs, outputs, answer)
    answers: dict[int, Answer] = field(default_factory=dict)  # micro -> backward/step answer
    held: dict = field(default_factory=dict)  # micro -> memory Hold: its graph, then its answers (memory.py)
    waiting: dict[int, int] = field(default_factory=dict)  # micro -> target tokens of a forward awaiting its backward
    tokens: dict[int, int] = field(default_factory=dict)  # micro -> target tokens trained (FedAvg weight)


def target_tokens(shape: torch.Size, mask: Optional[torch.Tensor],
                  labels: Optional[torch.Tensor]) -> Union[int, torch.Tensor]:
    """A piece's FedAvg weight: its tokens that carry a target (counted once its backward is in).
    2-way: the labels kept after the causal shift (not -100), a 0-dim tensor on the labels'
    device (read back with the piece's checks, :func:`.guard.settle`); U-shape, where the labels
    never leave the client: the real positions after each row's first (the mask is in host
    memory), the targets of the stock collator's labels (the padding -100): a left-padded row's
    first real token is one (the last pad's position predicts it), the row's position 0 never is.
    It is what the batch shows, so a client cannot buy weight beyond the positions it sends
    (labels that leave more out, a masked prompt, weigh as these: docs/FEDERATION.md). A
    right-padded or full 1-token row counts 0, so rows of nothing buy no weight."""
    if labels is not None:
        return (labels[:, 1:] != IGNORE).sum()
    if mask is None:
        return shape[0] * (shape[1] - 1)
    return int(mask[:, 1:].sum())


def release(st: StepInFlight, account) -> None:
    """Give back a step's memory reservations (applied, aborted or dropped)."""
    for hold in st.held.values():
        account.release(hold)
    st.held.clear()


class Training:
    """The runtime's training steps; every method runs on the compute thread under its lock."""

    def __init__(self, rt):
        self.rt = rt

    # -- bookkeeping ---------------------------------------------------------------------

    def _in_flight(self, meta: P.StepMeta) -> StepInFlight:
        """The step's state: existing, or new (next step only, lease taken, gradients zeroed)."""
        rt = self.rt
        pend = rt.ledger.pending(meta.client_id, meta.step)
        if pend is not None:
            pend.since = time.monotonic()  # alive while its pieces keep coming
            return pend.state
        rt.ledger.expect_next(meta.client_id, meta.step)
        self._admit(meta.client_id)
        rep = rt.federation.replica_for(meta.client_id, meta.fed_version)
        leased = rep is rt.federation.base
        if leased:
            rt.lease.acquire(meta.client_id, meta.step)
        rep.optimizer.zero_grad(set_to_none=True)
        st = StepInFlight(rep, leased)
        rt.ledger.set_pending(meta.client_id, Pending(meta.step, st, time.monotonic(), meta.run))
        return st

    def _take_over(self, meta: P.StepMeta) -> None:
        """A piece of a new run of this client id (its ``run`` is not the pending step's: the
        process that opened that step died between a forward and the apply): that step is dropped
        now, its lease given back, instead of after the lease timeout, and the new run's step
        starts afresh at the same number (never answered from the dead run's pieces)."""
        pend = self.rt.ledger.pending(meta.client_id)
        if pend is not None and other_run(pend, meta.run):
            self.rt.drop_pending(meta.client_id, taken_over=True)

    def _admit(self, key: str) -> None:
        """A tenant's fair share: at most ``max_clients_per_tenant`` client ids and
        ``max_pending_per_tenant`` steps in flight (429 beyond); pending steps older than the
        lease timeout are dropped first (a vanished client's graph does not live for ever)."""
        rt, cfg = self.rt, self.rt.cfg
        now = time.monotonic()
        for cid, since in rt.ledger.pending_since().items():
            if now - since > cfg.lease_timeout_s:
                rt.drop_pending(cid)
        ids, pending = rt.ledger.count(tenant_of(key) + SEP if SEP in key else "")
        if not rt.ledger.known(key) and ids >= cfg.max_clients_per_tenant:
            raise TooManyRequests(f"this tenant already trains {ids} client ids, the server's limit "
                                  f"(--max-clients-per-tenant {cfg.max_clients_per_tenant}): reuse one",
                                  retry_after=60.0)
        if pending >= cfg.max_pending_per_tenant:
            raise TooManyRequests(f"this tenant has {pending} training steps in flight, the server's limit "
                                  f"(--max-pending-per-tenant {cfg.max_pending_per_tenant}): finish them first",
                                  retry_after=1.0)

    def _hold(self, meta: P.StepMeta, st: StepInFlight, nbytes: int, what: str) -> None:
        """Reserve what piece ``meta.micro`` leaves waiting in its step (:mod:`.memory`)."""
        st.held[meta.micro] = self.rt.memory.reserve(tenant_of(meta.client_id), nbytes,
                                                     f"{what} of step {meta.step}")

    def abort(self, meta: P.StepMeta, st: StepInFlight) -> None:
        st.rep.optimizer.zero_grad(set_to_none=True)
        release(st, self.rt.memory)
        self.rt.ledger.set_pending(meta.client_id, None)
        if st.leased:
            self.rt.lease.release(meta.client_id)

    @staticmethod
    def _settle(st: StepInFlight, flags: list, values: list = ()) -> list:
        """A piece's checks (``flags``, :func:`.guard.settle`), its ``values`` and the norm of the
        gradients accumulated so far, read back in one copy after its backward: the values, then
        the norm (400 if it is not finite). The caller aborts the step on a refusal."""
        *read, norm = guard.settle(flags, [*values, guard.norm_tensor(st.rep.segment.parameters())])
        return [*read, guard.checked_norm(0.0 if norm is None else norm)]

    def _piece_done(self, meta: P.StepMeta, st: StepInFlight, answer: Answer, norm: float) -> Answer:
        """Accumulated: the client learns the norm so far (a global clip)."""
        st.answers[meta.micro] = answer
        answer.meta["grad_norm"] = repr(norm)
        answer.meta["accumulated"] = str(len(st.answers))  # the pieces that norm covers
        if st.leased and self.rt.lease.contended(meta.client_id):  # others wait for the shared segment:
            answer.meta["apply_now"] = "1"  # the client applies at once, not on its next step's request
        return answer

    # -- the routes ----------------------------------------------------------------------

    def carried(self, meta: P.StepMeta) -> Optional[Answer]:
        """The previous step's apply carried by this request (metadata ``apply``), applied as
        ``POST /v1/train/apply`` would be, exactly once: its answer, or None (none carried, or a
        step the ledger has already passed: the apply was made and this request is a late retry)."""
        req = meta.apply
        if req is None or req.step < self.rt.ledger.last_step(meta.client_id):
            return None
        return self.apply(meta.client_id, req)

    @staticmethod
    def with_apply(answer: Answer, applied: Optional[Answer]) -> Answer:
        """The piece's answer with the carried apply's answer in its metadata (``apply``: the
        JSON ``POST /v1/train/apply`` answers), before it is encoded and kept."""
        if applied is not None and answer._bytes is None and "apply" not in answer.meta:
            answer.meta["apply"] = json.dumps(apply_json(applied), separators=(",", ":"))
        return answer

    def step(self, meta: P.StepMeta, hidden: torch.Tensor, labels: torch.Tensor,
             mask: Optional[torch.Tensor], positions: Optional[torch.Tensor] = None) -> Answer:
        """2-way, a fused piece: loss of the top on ``hidden``, backpropagated from ``loss_scale``
        (the gradient of its loss); gradients accumulated until the apply."""
        rt = self.rt
        self._take_over(meta)
        applied = self.carried(meta)
        replay = rt.ledger.replay(meta.client_id, meta.step, meta.micro)
        if replay is not None:
            return replay
        st = self._in_flight(meta)
        if meta.micro in st.forwards:
            raise Conflict(f"piece {meta.micro} of step {meta.step} was sent to {P.TRAIN_FORWARD}")
        if meta.micro in st.answers:
            return st.answers[meta.micro]
        try:  # its answer waits for the apply: reserved (tensor + bytes, float32 at most)
            self._hold(meta, st, 2 * (4 * hidden.numel() + 4), f"the answer of piece {meta.micro}")
            st.rep.segment.train()
            h = rt.to_model(hidden).requires_grad_()  # (B, T, d)
            # the logits (B, T, V) never exist whole: chunks of positions (splitlearn/model/headloss.py)
            pos = positions.to(h.device) if positions is not None else None  # (B|1, T): the client's
            loss = head_loss(st.rep.segment, st.rep.segment(h, mask, position_ids=pos, head=False), labels,
                             grad_scale=meta.loss_scale)  # backpropagated with it just below
            # the loss's check is read back with the gradients' (one read, guard.settle): a loss
            # that is not finite is refused after its backward, and the abort below zeroes
            # what that accumulated (a refused piece always dropped its whole step)
            (loss * meta.loss_scale).backward()
            value, tokens, norm = self._settle(
                st, [(guard.finite_flag(loss), guard.refusal("loss")),
                     (guard.finite_flag(h.grad), guard.refusal("the gradient sent back to the client"))],
                [loss.detach().float(), target_tokens(h.shape, mask, labels)])
        except Exception:
            self.abort(meta, st)
            raise
        answer = Answer({**pack(P.GRAD, h.grad, meta.wire_dtype),
                         P.LOSS: torch.tensor([value], dtype=torch.float32)}, meta.to_meta())
        st.tokens[meta.micro] = int(tokens)
        return self._piece_done(meta, st, self.with_apply(answer, applied), norm)

    def forward(self, meta: P.StepMeta, hidden: torch.Tensor, mask: Optional[torch.Tensor],
                labels: Optional[torch.Tensor] = None, positions: Optional[torch.Tensor] = None) -> Answer:
        """U-shape: trunk output for ``hidden``; the graph waits for the backward. 2-way
        (``labels`` given): the top's loss; the graph waits for its scalar gradient. ``positions``:
        the client's ``position_ids`` (B|1, T), or None (derived from the mask)."""
        rt = self.rt
        self._take_over(meta)
        applied = self.carried(meta)
        pend = rt.ledger.pending(meta.client_id, meta.step)
        if pend is not None and meta.micro in pend.state.forwards:
            return pend.state.forwards[meta.micro][2]
        if pend is not None and meta.micro in pend.state.answers:
            raise Conflict(f"piece {meta.micro} of step {meta.step} was sent to {P.TRAIN_STEP}")
        if pend is None:
            replay = rt.ledger.replay_forward(meta.client_id, meta.step, meta.micro)
            if replay is not None:  # the step is applied; its backward will be replayed too
                return replay
        st = self._in_flight(meta)
        waiting = sum(1 for f in st.forwards.values() if f[0] is not None)
        if waiting >= P.MAX_MICROS:  # graphs kept at once: a bound on the step's memory
            raise TooManyRequests(f"step {meta.step} already has {waiting} forwards waiting for their "
                                  f"backward (at most {P.MAX_MICROS}): send their backwards first",
                                  retry_after=1.0)
        try:  # the graph waits for its backward: its own size reserved (429/503 past the budget)
            self._hold(meta, st, graph_bytes(rt.budget.dims, hidden.shape[0], hidden.shape[1], padded(mask),
                                             loss=labels is not None), f"the graph of piece {meta.micro}")
            st.rep.segment.train()
            h = rt.to_model(hidden).requires_grad_()  # (B, T, d)
            tokens = target_tokens(h.shape, mask, labels)
            pos = positions.to(h.device) if positions is not None else None
            if labels is not None:  # 2-way: the loss (chunked head), graph kept; one read
                out = head_loss(st.rep.segment, st.rep.segment(h, mask, position_ids=pos, head=False), labels)  # ()
                value, tokens = guard.settle([(guard.finite_flag(out), guard.refusal("loss"))],
                                             [out.detach().float(), tokens])
            else:
                out = st.rep.segment(h, mask, position_ids=pos)  # (B, T, d)
                guard.finite("the trunk's output for these activations", out)
        except Exception:
            rt.memory.release(st.held.pop(meta.micro, None))
            if not st.forwards:  # nothing else of this step exists yet
                self.abort(meta, st)
            raise
        if labels is not None:
            answer = Answer({P.LOSS: torch.tensor([value], dtype=torch.float32)}, meta.to_meta())
        else:
            answer = Answer(pack(P.HIDDEN, out, meta.wire_dtype), meta.to_meta())
        self.with_apply(answer, applied)
        st.forwards[meta.micro] = (h, out, answer)
        st.waiting[meta.micro] = int(tokens)
        return answer

    def backward(self, meta: P.StepMeta, grad: torch.Tensor) -> Answer:
        """Backpropagate ``grad`` of a piece's output (2-way: its loss); the gradient of its input."""
        rt = self.rt
        replay = rt.ledger.replay(meta.client_id, meta.step, meta.micro)
        if replay is not None:
            return replay
        pend = rt.ledger.pending(meta.client_id, meta.step)
        if pend is not None and other_run(pend, meta.run):
            raise Conflict(f"step {meta.step} of client {client_of(meta.client_id)!r} was taken over by a newer "
                           f"run of that client id: this run's pieces of it are gone")
        if pend is None or meta.micro not in pend.state.forwards:
            raise Conflict(f"no forward pending for step {meta.step} (micro-batch {meta.micro}) of client "
                           f"{client_of(meta.client_id)!r} (never sent, or dropped after "
                           f"{rt.cfg.lease_timeout_s:g}s): send {P.TRAIN_FORWARD} first")
        st = pend.state
        if meta.micro in st.answers:
            return st.answers[meta.micro]
        inputs, outputs, fwd = st.forwards[meta.micro]  # (B, T, d) each; 2-way: outputs = loss ()
        if outputs is None:  # a piece whose backward was answered, then the answer lost
            raise Conflict(f"piece {meta.micro} of step {meta.step} has had its backward")
        if outputs.ndim == 0 and grad.numel() == 1:
            grad = grad.reshape(())  # the scalar gradient of a 2-way loss
        if grad.shape != outputs.shape:
            raise BadRequest(f"grad has shape {list(grad.shape)}, the forward of step "
                             f"{meta.step} produced {list(outputs.shape) or [1]}")
        try:  # the check of the gradient sent back and the norm so far: one read
            outputs.backward(rt.to_model(grad))
            (norm,) = self._settle(st, [(guard.finite_flag(inputs.grad),
                                         guard.refusal("the gradient sent back to the client"))])
        except Exception:
            self.abort(meta, st)
            raise
        answer = Answer(pack(P.GRAD, inputs.grad, meta.wire_dtype), meta.to_meta())
        st.forwards[meta.micro] = (None, None, fwd)  # the graph is spent; keep the answer
        if meta.micro in st.held:  # what waits for the apply now: the two answers, tensors and bytes
            held = st.held[meta.micro]  # (never more than the graph's price: shrinking cannot fail)
            held.resize(min(held.nbytes, answer_bytes(fwd) + 2 * answer_bytes(answer)))
        st.tokens[meta.micro] = st.waiting.pop(meta.micro, 0)  # trained: it counts now
        return self._piece_done(meta, st, answer, norm)

    def _step(self, opt: torch.optim.Optimizer, st: StepInFlight, lr: float, saved: list) -> None:
        """The optimizer's step at ``lr`` (its own lr restored after)."""
        rt = self.rt
        for g in opt.param_groups:
            g["lr"] = lr
        try:
            # decode-first with generation sessions open: the step yields to decode between
            # parts of the parameters; decode reads the weights before the step (priority.py)
            if rt.preemptor is not None and st.rep.segment is rt.segment and rt.sessions.count():
                step_in_parts(opt, rt.preemptor.point)
            else:
                opt.step()
        finally:
            for g, own in zip(opt.param_groups, saved):
                g["lr"] = own

    def apply(self, key: str, req: P.ApplyRequest) -> Answer:
        """``POST /v1/train/apply``: the optimizer step of step ``req.step`` of client
        ``key``, at ``req.lr`` (capped at the server's own lr on state shared between tenants:
        the leased segment, never a client's own SplitFed copy or LoRA adapter; the answer's
        ``lr`` is the one applied; on shared state of several tenants an lr below ``MIN_SHARE`` of
        the server's is applied as 0, which steps nothing and moves no statistic, and a fraction
        of the server's lr is that fraction of a step in AdamW's moments: :mod:`.gradclip`), on
        its accumulated gradients times ``req.clip``; exactly once (a
        retry gets the stored answer). ``req.discard``: drop the step (gradients, graphs, lease)
        and apply nothing; the step number stays free. 409 when no such step is pending or the
        server holds another number of backward pieces than the client counted (nothing changes)."""
        rt = self.rt
        done = rt.ledger.replay_apply(key, req.step)
        if done is not None:
            return done
        pend = rt.ledger.pending(key, req.step)
        meta = P.StepMeta(key, req.step)
        if pend is not None and other_run(pend, req.run):  # a newer run's step: not this run's to touch
            if req.discard:
                return Answer({}, {"client_id": req.client_id, "step": str(req.step), "discarded": "1"})
            raise Conflict(f"step {req.step} of client {req.client_id!r} was taken over by a newer run of "
                           f"that client id: nothing was applied")
        if req.discard:
            if pend is not None:
                self.abort(meta, pend.state)
            return Answer({}, {"client_id": req.client_id, "step": str(req.step), "discarded": "1"})
        if pend is None:
            raise Conflict(f"no step {req.step} is pending for client {req.client_id!r} "
                           f"(the server has applied step {rt.ledger.last_step(key)}; a step is opened "
                           f"by its first piece, and dropped after "
                           f"{rt.cfg.lease_timeout_s:g}s without a piece)")
        st = pend.state
        if len(st.answers) != req.pieces:
            raise Conflict(f"step {req.step} has {len(st.answers)} backward pieces on the server, the "
                           f"apply counts {req.pieces}: nothing was applied")
        opt = st.rep.optimizer
        try:
            params = [p for p in st.rep.segment.parameters() if p.grad is not None]
            if req.clip < 1.0 and params:
                torch._foreach_mul_([p.grad for p in params], req.clip)
            # state shared between tenants: the norm clipped to a bound from the steps before (gradclip.py)
            clipped = rt.grad_clip.clip(params, guard.grad_norm(params), shared=st.leased)
            saved = [g["lr"] for g in opt.param_groups]
            # state shared between tenants (the segment in shared/sequential mode, a turn's adapter)
            # steps at most at the server's own lr; the client's lr rules only its own copy/adapter
            lr = min(req.lr, *saved) if st.leased else req.lr
            share = lr / max(saved) if st.leased and max(saved) > 0 else 1.0  # of the server's lr
            # other tenants' training to protect: shared state of several tenants, another of which has
            # stepped (a tenant alone trains as the unsplit model does, lr 0 and schedules included)
            walls = st.leased and len(rt.cfg.tenants) > 1 and rt.grad_clip.others(tenant_of(key))
            if walls and share < MIN_SHARE:  # moves no weight: moves no statistic (gradclip.py)
                lr, share = 0.0, 0.0
            if walls and 0.0 < share < 1.0:
                # AdamW's moments and step count move as far as the lr lets the step move the weights
                with partial_step(opt, share):
                    self._step(opt, st, lr, saved)
            elif lr > 0.0 or not walls:
                self._step(opt, st, lr, saved)
            opt.zero_grad(set_to_none=True)
        except Exception:
            self.abort(meta, st)
            raise
        if st.leased:
            rt.grad_clip.applied(clipped, tenant_of(key), share)
            rt.lease.release(key)
        answer = Answer({}, {"client_id": req.client_id, "step": str(req.step), APPLIED: "1",
                             "pieces": str(req.pieces), "lr": repr(lr), "grad_norm": repr(clipped.norm),
                             "clipped": "1" if clipped.clipped else "0"})
        if clipped.bound is not None:
            answer.meta["clip_norm"] = repr(clipped.bound)
        forwards = {i: f[2] for i, f in st.forwards.items()}
        release(st, rt.memory)  # the ledger keeps digests of the pieces' answers
        rt.federation.trained(key, sum(st.tokens.values()))
        rt.applied(meta, answer, st.answers, forwards)
        return answer


def other_run(pend, run: Optional[str]) -> bool:
    """Is the pending step ``pend`` another run's than ``run`` (both named)?"""
    return run is not None and pend.run is not None and pend.run != run


def apply_json(answer: Answer) -> dict:
    """An apply's answer as ``POST /v1/train/apply`` answers it (JSON), from its metadata."""
    out = {}
    for k, v in answer.meta.items():
        if k in ("step", "pieces", "durable"):
            out[k] = int(v)
        elif k in ("lr", "grad_norm", "clip_norm"):
            out[k] = float(v)
        elif k in ("applied", "discarded", "clipped"):
            out[k] = v == "1"
        elif k == "client_id":
            out[k] = v
    return out
