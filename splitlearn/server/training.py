"""Training steps on the server: whole batches or micro-batches, applied exactly once.

A step may arrive in ``micros`` pieces (GPipe micro-batching, Huang et al. 2019: the client
keeps several requests in flight so both sides compute at once). Every piece carries the
step's number, its ``micro`` index and ``micros``; the server accumulates the gradients of
the pieces and applies one optimizer step when the last backward arrives::

    2-way:   POST /v1/train/step     (micro i)  forward + backward of the top, loss x loss_scale
    U-shape: POST /v1/train/forward  (micro i)  trunk output; the graph waits
             POST /v1/train/backward (micro i)  gradient of the trunk's input
             ... after the M-th backward: guards, optimizer step, the ledger records the step

Pieces may come in any order and be retried: each piece's answer is kept until the step is
applied (and in the ledger after), so a retry gets the same bytes. On the shared segment a
multi-request step holds the :class:`~.lease.StepLease` from its first piece to its last, so no
other client's step touches the weights or the accumulated gradients in between. A poisoned
piece (see :mod:`.guard`) aborts the whole step: gradients zeroed, pieces dropped, lease
released, weights and optimizer state unchanged.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from .. import protocol as P
from ..errors import BadRequest, Conflict, TooManyRequests
from ..headloss import head_loss
from ..wire import pack
from . import guard
from .federation import Replica
from .ledger import Answer, Pending
from .tenants import SEP, tenant_of

log = logging.getLogger(__name__)


@dataclass
class StepInFlight:
    """A step whose pieces are arriving."""

    rep: Replica  # the segment (or the client's copy / adapter) being trained
    micros: int
    leased: bool  # holds the shared segment's lease
    forwards: dict[int, tuple] = field(default_factory=dict)  # micro -> (inputs, outputs, answer)
    answers: dict[int, Answer] = field(default_factory=dict)  # micro -> backward/step answer
    rows: dict[int, int] = field(default_factory=dict)  # micro -> its rows (what federation counts)


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
            st = pend.state
            if st.micros != meta.micros:
                raise BadRequest(f"step {meta.step} was started in {st.micros} micro-batches, "
                                 f"this piece says {meta.micros}")
            return st
        rt.ledger.expect_next(meta.client_id, meta.step)
        self._admit(meta.client_id)
        rep = rt.federation.replica_for(meta.client_id, meta.fed_version)
        leased = rep is rt.federation.base
        if leased:
            rt.lease.acquire(meta.client_id, meta.step)
        rep.optimizer.zero_grad(set_to_none=True)
        st = StepInFlight(rep, meta.micros, leased)
        rt.ledger.set_pending(meta.client_id, Pending(meta.step, st, time.monotonic()))
        return st

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

    def abort(self, meta: P.StepMeta, st: StepInFlight) -> None:
        st.rep.optimizer.zero_grad(set_to_none=True)
        self.rt.ledger.set_pending(meta.client_id, None)
        if st.leased:
            self.rt.lease.release(meta.client_id)

    def _piece_done(self, meta: P.StepMeta, st: StepInFlight, answer: Answer) -> Answer:
        st.answers[meta.micro] = answer
        if len(st.answers) < st.micros:
            return answer
        try:  # the last piece: guards, one optimizer step
            params = [p for p in st.rep.segment.parameters() if p.grad is not None]
            norm = guard.grad_norm(params)
            if self.rt.cfg.max_grad_norm is not None and norm > self.rt.cfg.max_grad_norm:
                torch.nn.utils.clip_grad_norm_(params, self.rt.cfg.max_grad_norm)
            st.rep.optimizer.step()
            st.rep.optimizer.zero_grad(set_to_none=True)  # the gradients' memory is free between steps
        except Exception:
            self.abort(meta, st)
            raise
        if st.leased:
            self.rt.lease.release(meta.client_id)
        forwards = {i: f[2] for i, f in st.forwards.items()}
        self.rt.federation.trained(meta.client_id, sum(st.rows.values()))  # a member's FedAvg weight
        self.rt.applied(meta, answer, st.answers, forwards)
        return answer

    # -- the routes ----------------------------------------------------------------------

    def step(self, meta: P.StepMeta, hidden: torch.Tensor, labels: torch.Tensor,
             mask: Optional[torch.Tensor]) -> Answer:
        """2-way: loss of the top on ``hidden`` (scaled by ``loss_scale``), gradients
        accumulated; the optimizer steps after the step's last piece."""
        rt = self.rt
        replay = rt.ledger.replay(meta.client_id, meta.step, meta.micro)
        if replay is not None:
            return replay
        st = self._in_flight(meta)
        if meta.micro in st.answers:
            return st.answers[meta.micro]
        try:
            st.rep.segment.train()
            h = rt.to_model(hidden).requires_grad_()  # (B, T, d)
            # the logits (B, T, V) never exist whole: chunks of positions (splitlearn/headloss.py)
            loss = head_loss(st.rep.segment, st.rep.segment(h, mask, head=False), labels,
                             grad_scale=meta.loss_scale)  # backpropagated with it just below
            guard.finite("loss", loss)
            (loss * meta.loss_scale).backward()
            guard.finite("the gradient sent back to the client", h.grad)
        except Exception:
            self.abort(meta, st)
            raise
        answer = Answer({**pack(P.GRAD, h.grad, meta.wire_dtype),
                         P.LOSS: loss.detach().float().reshape(1).cpu()}, meta.to_meta())
        st.rows[meta.micro] = h.shape[0]
        return self._piece_done(meta, st, answer)

    def forward(self, meta: P.StepMeta, hidden: torch.Tensor, mask: Optional[torch.Tensor]) -> Answer:
        """U-shape: trunk output for ``hidden``; the graph waits for the backward."""
        rt = self.rt
        pend = rt.ledger.pending(meta.client_id, meta.step)
        if pend is not None and meta.micro in pend.state.forwards:
            return pend.state.forwards[meta.micro][2]
        if pend is None:
            replay = rt.ledger.replay_forward(meta.client_id, meta.step, meta.micro)
            if replay is not None:  # the step is applied; its backward will be replayed too
                return replay
        st = self._in_flight(meta)
        try:
            st.rep.segment.train()
            h = rt.to_model(hidden).requires_grad_()  # (B, T, d)
            out = st.rep.segment(h, mask)  # (B, T, d)
            guard.finite("the trunk's output for these activations", out)
        except Exception:
            if not st.forwards:  # nothing else of this step exists yet
                self.abort(meta, st)
            raise
        answer = Answer(pack(P.HIDDEN, out, meta.wire_dtype), meta.to_meta())
        st.forwards[meta.micro] = (h, out, answer)
        st.rows[meta.micro] = h.shape[0]
        return answer

    def backward(self, meta: P.StepMeta, grad: torch.Tensor) -> Answer:
        """U-shape: backpropagate ``grad`` of a piece's trunk output; the gradient of its input."""
        rt = self.rt
        replay = rt.ledger.replay(meta.client_id, meta.step, meta.micro)
        if replay is not None:
            return replay
        pend = rt.ledger.pending(meta.client_id, meta.step)
        if pend is None or meta.micro not in pend.state.forwards:
            raise Conflict(f"no forward pending for step {meta.step} (micro-batch {meta.micro}) of client "
                           f"{meta.client_id!r} (never sent, or dropped after "
                           f"{rt.cfg.lease_timeout_s:g}s): send {P.TRAIN_FORWARD} first")
        st = pend.state
        if meta.micro in st.answers:
            return st.answers[meta.micro]
        inputs, outputs, fwd = st.forwards[meta.micro]  # (B, T, d) each
        if grad.shape != outputs.shape:
            raise BadRequest(f"grad has shape {list(grad.shape)}, the forward of step "
                             f"{meta.step} produced {list(outputs.shape)}")
        try:
            outputs.backward(rt.to_model(grad))
            guard.finite("the gradient sent back to the client", inputs.grad)
        except Exception:
            self.abort(meta, st)
            raise
        answer = Answer(pack(P.GRAD, inputs.grad, meta.wire_dtype), meta.to_meta())
        st.forwards[meta.micro] = (None, None, fwd)  # the graph is spent; keep the answer
        return self._piece_done(meta, st, answer)
