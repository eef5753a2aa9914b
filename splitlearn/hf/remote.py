"""The server's segment as an ``nn.Module`` whose forward and backward cross the wire.

:class:`RemoteSegment` stands in for the blocks a splitlearn server holds: the trunk
``blocks[c1:c2]`` of a U-shape server, or the top ``blocks[c:n] + final norm + head`` (with the
loss) of a 2-way server. With gradients enabled its forward is a ``torch.autograd.Function``
(:class:`_TrunkFunction`, :class:`_LossFunction`) so ``loss.backward()`` sends the gradient,
exactly as if the blocks were local; without gradients (``torch.no_grad()``, evaluation,
``generate``) it is one ``POST /v1/forward``.

This module is the face; the engine behind it is in rooms of one concept each, which the
segment holds and whose public API its callers use:

==========================  ====================================================================
``segment.steps``           :class:`~.pieces.StepPieces`: the step's number and pieces, the
                            piece protocol (wire layout in :mod:`.pieces`), the answer checks
``segment.applier``         :class:`~.applies.Applier`: how a step ends (its apply deferred,
                            carried, flushed; the idle timer), :mod:`.applies`
``segment.link``            :class:`~.optlink.OptimizerLink`: which optimizer's step applies,
                            at what lr, the gradient proxy and the clip across both sides
``segment.journal``         :class:`~.recovery.Recovery`: requests sent and logged, a crashed
                            server replayed, the client checkpoint (persist, restore, resume)
==========================  ====================================================================

A training step goes one way: the model's forward -> :meth:`RemoteSegment.trunk` (or
:meth:`RemoteSegment.loss`) -> ``steps.send_forward`` -> ``journal.call``; ``loss.backward()``
-> ``steps.send_backward``; ``optimizer.step()`` -> the link's hook -> ``applier.apply``. It
ends in :meth:`Applier.answered <splitlearn.hf.applies.Applier.answered>`, whoever sent it.
"""
from __future__ import annotations

import logging
import os
import uuid
from contextlib import contextmanager
from dataclasses import replace
from typing import Optional

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from ..api import protocol as P
from ..api import trust
from ..errors import ConfigError
from . import limits
from .applies import LAST_CALL_S, Applier, Outbox, bounded, register
from .config import RemoteConfig
from .journal import RequestLog
from .optlink import OptimizerLink
from .pieces import StepPieces
from .recovery import Recovery

log = logging.getLogger(__name__)


# -- autograd over the wire ------------------------------------------------------------------

class _TrunkFunction(torch.autograd.Function):
    """U-shape: hidden (B, T, d) -> the trunk's output (B, T, d) computed by the server."""

    @staticmethod
    def forward(ctx, hidden, proxy, remote: "RemoteSegment", mask, positions=None):
        out, ctx.piece = remote.steps.send_forward(hidden, mask, None, positions)
        ctx.remote, ctx.like = remote, (hidden.dtype, hidden.device)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        return ctx.remote.steps.send_backward(ctx.piece, grad, *ctx.like), None, None, None, None


class _LossFunction(torch.autograd.Function):
    """2-way: hidden (B, T, d) + labels -> the server's causal-LM loss (mean over targets), ()."""

    @staticmethod
    def forward(ctx, hidden, proxy, remote: "RemoteSegment", labels, mask, positions=None):
        loss, ctx.piece = remote.steps.send_forward(hidden, mask, labels, positions)
        ctx.remote, ctx.like = remote, (hidden.dtype, hidden.device)
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        return ctx.remote.steps.send_backward(ctx.piece, grad, *ctx.like), None, None, None, None, None


class RemoteSegment(nn.Module):
    """The server's blocks (and, 2-way, its head and loss) as a module of the client's model.

    Holds no weight of the server's: one connection, :attr:`grad_proxy` (see :mod:`.optlink`)
    and the rooms of the module docstring.
    """

    def __init__(self, cfg: RemoteConfig, transport=None, info: Optional[dict] = None,
                 state: Optional[dict] = None):
        super().__init__()
        from ..transport import Transport, TransportConfig  # requests: only when connecting

        self.cfg = cfg
        token = cfg.token or os.environ.get("SPLITLEARN_TOKEN")
        self.transport = transport or Transport(TransportConfig(cfg.server, token, read_timeout_s=cfg.timeout_s,
                                                                retries=cfg.retries))
        self.info = info or self.transport.get_json(P.INFO)
        self.cuts = trust.check_info(self.info, cfg.pins, f"the server at {cfg.server}")  # before anything is sent
        self.u_shape = len(self.cuts) == 2
        self.client_id = cfg.client_id or uuid.uuid4().hex[:16]
        self.transport.set_route(P.route_key(self.transport.cfg.token, self.client_id))
        self.fed = self.fed_transport()  # a separate fed server (checked now: before any training)
        self.grad_proxy = nn.Parameter(torch.zeros(1))  # .grad: the server's gradient norm
        if state is None:  # this client's last step on the server (a caller that knows it passes it)
            state = self.transport.get_json(P.CLIENT_STATE.format(client_id=self.client_id))
        self.defense = None  # a splitlearn.privacy.Defense on what crosses the cut (the model's .defense)
        self.loss_gradient: Optional[float] = None  # the gradient the loss will receive, when known: fused 2-way pieces, 1F1B
        self.federation = None  # the model's FederationState (.federation), made on the first step
        # this process's run of the client id: a new run takes over a step a dead one left (StepMeta.run)
        self.run = uuid.uuid4().hex[:16]
        # the requests since the server's last durable step, replayed if it restarts (.journal)
        requests = RequestLog(enabled=bool(self.info.get("checkpoint", {}).get("enabled")), directory=cfg.journal_dir)
        requests.durable(int(state.get("durable", 0)))
        lease = (self.info.get("limits") or {}).get("lease_timeout_s")
        idle_s = (min(float(lease) / 3, cfg.apply_wait_s)
                  if isinstance(lease, (int, float)) and lease > 0 else cfg.apply_wait_s)
        outbox = Outbox(self.transport, requests)  # the deferred apply: sent at exit, and when collected
        self.steps = StepPieces(self, int(state["step"]) + 1)
        self.applier = Applier(self, outbox, idle_s)
        self.link = OptimizerLink(self, self.grad_proxy)
        self.journal = Recovery(self, requests)
        # (detach() it to drop this segment without its last call: a test standing in for kill -9)
        self.last_call = register(self, outbox)

    # what callers read most, from the rooms
    step = property(lambda self: self.steps.step, doc="The optimizer step the next pieces belong to.")
    pieces = property(lambda self: self.steps.pieces, doc="Forwards sent in this step.")
    answered = property(lambda self: self.steps.answered, doc="Backwards answered in this step.")
    log = property(lambda self: self.journal.log, doc="The request log (:class:`~.journal.RequestLog`).")
    deferred = property(lambda self: self.applier.deferred, doc="The last step's apply, not yet answered.")
    last_apply = property(lambda self: self.applier.last, doc="The server's answer to the last apply.")
    applies = property(lambda self: self.applier.count, doc="Applies made.")

    def flush(self) -> Optional[dict]:
        """Send the deferred apply now (:meth:`Applier.flush <.applies.Applier.flush>`) -> its answer.
        First, as :meth:`close`: the step of an optimizer made after the step's backward (not hooked
        yet) is applied, a ``zero_grad`` since the backward discards the step (a generation's
        ``new_cache`` flushes: without this it read the server's weights before that step). Then
        a server behind the last applied step (restarted, or a replica that took this owner back)
        gets the steps it lost (:meth:`Recovery.current <.recovery.Recovery.current>`)."""
        self.link.notice_zero_grad()
        answer = self.applier.flush()
        self.journal.current()  # a restarted server (replica) holds every applied step before a read
        return answer

    def fed_transport(self):
        """The separate fed server's connection (``cfg.fed_url``), or None. Its token is its own:
        given, or ``$SPLITLEARN_FED_TOKEN``, never the segment server's (whose operator could then
        download the client-side weights)."""
        if self.cfg.fed_url is None:
            return None
        from ..transport import Transport, TransportConfig

        token = self.cfg.fed_token or os.environ.get("SPLITLEARN_FED_TOKEN")
        if not token:
            raise ConfigError("fed_url needs the fed server's own token: fed_token=... or $SPLITLEARN_FED_TOKEN "
                              "(the segment server's token is never sent to the fed server)")
        if token == self.transport.cfg.token:
            raise ConfigError("fed_token is the segment server's token: the fed server needs a token of its "
                              "own, or the segment server's operator could download the client-side weights")
        return Transport(TransportConfig(self.cfg.fed_url, token, read_timeout_s=self.cfg.timeout_s,
                                         retries=self.cfg.retries))

    def extra_repr(self) -> str:
        what = f"blocks [{self.cuts[0]}, {self.cuts[1]})" if self.u_shape else \
            f"blocks [{self.cuts[0]}, n) + final norm + head + loss"
        return f"{what} on {self.cfg.server}, client_id={self.client_id!r}, wire={self.cfg.wire_dtype}"

    @property
    def stats(self):
        """Calls (round trips), bytes, times: :class:`splitlearn.transport.WireStats`."""
        return self.transport.stats

    def close(self) -> None:
        """Send the last step's apply (and a late optimizer's step), drop whatever else this
        client has pending on the server (a forward with gradients on that was never
        backpropagated holds a shared segment until the lease timeout), then hang up."""
        try:
            self.link.notice_zero_grad()
            self.applier.flush()
            self.steps.discard(force=True)
        finally:
            self.transport.close()
            if self.fed is not None:
                self.fed.close()

    def settle(self) -> None:
        """The last call before the process ends (this segment's finalizer, :mod:`.applies`):
        :meth:`close` with every request bounded (:data:`~.applies.LAST_CALL_S`, no retry, no
        long wait for a crashed server), so the server holds exactly the steps the client's
        optimizer made. Nothing pending: nothing is sent."""
        if self.deferred is None and not self.steps.pieces and not self.steps.answered:
            return
        lock = self.applier.outbox.lock
        if not lock.acquire(timeout=LAST_CALL_S):  # the idle flusher is sending it, and waits
            log.warning("the last step's apply is still being sent to %s at exit", self.cfg.server)
            return
        try:
            bounded(self.transport)
            self.cfg = replace(self.cfg, wait_timeout_s=min(self.cfg.wait_timeout_s, LAST_CALL_S),
                               reconnect_timeout_s=min(self.cfg.reconnect_timeout_s, LAST_CALL_S))
            self.applier.carry = False  # a late optimizer's step goes now (no thread at exit)
            self.close()
        finally:
            lock.release()

    # -- the module's face ---------------------------------------------------------------

    _loss_only = False

    @contextmanager
    def loss_only(self):
        """Within: a 2-way evaluation with labels asks the server for the loss alone (its
        logits, (B, T, V), stay there; the model's ``logits`` is None)."""
        self._loss_only = True
        try:
            yield
        finally:
            self._loss_only = False

    def trunk(self, hidden: torch.Tensor, attention_mask: Optional[torch.Tensor],
              position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """U-shape: the trunk's output (B, T, d) for ``hidden`` (B, T, d); ``attention_mask``
        (B, T) 0/1 or None; ``position_ids`` (B|1, T): the positions the client used where they
        differ from the mask's (:meth:`~.splittrunk.SplitTrunk.wire_positions`), or None (the server
        derives them from the mask). Differentiable when
        gradients are enabled."""
        if torch.is_grad_enabled():
            return _TrunkFunction.apply(hidden, self.grad_proxy, self, attention_mask, position_ids)
        return self.evaluate(hidden, attention_mask, position_ids=position_ids)[0]

    def loss(self, hidden: torch.Tensor, labels: torch.Tensor,
             attention_mask: Optional[torch.Tensor], position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """2-way, gradients enabled: the server's causal-LM loss (a 0-dim tensor, differentiable)."""
        return _LossFunction.apply(hidden, self.grad_proxy, self, labels, attention_mask, position_ids)

    def evaluate(self, hidden: torch.Tensor, attention_mask: Optional[torch.Tensor],
                 labels: Optional[torch.Tensor] = None, position_ids: Optional[torch.Tensor] = None):
        """No-grad ``POST /v1/forward`` (server in eval mode, nothing changes): U-shape
        ``(trunk output, None)``; 2-way ``(logits (B, T, V), loss or None)``. More rows than
        the server takes go as several requests (:func:`.limits.evaluate_in_groups`)."""
        groups = limits.row_groups(self.info, hidden.shape[0])
        if len(groups) > 1:
            pos = position_ids
            if pos is not None and pos.shape[0] == 1:
                pos = pos.expand(hidden.shape[0], -1)  # a row each, for the groups
            parts = iter(groups)  # evaluate_in_groups calls once per group, in order

            def one(h, m, y):
                g = next(parts)
                return self._evaluate(h, m, y, None if pos is None else pos[g])
            return limits.evaluate_in_groups(one, groups, hidden, attention_mask, labels)
        return self._evaluate(hidden, attention_mask, labels, position_ids)

    def _evaluate(self, hidden: torch.Tensor, attention_mask: Optional[torch.Tensor],
                  labels: Optional[torch.Tensor] = None, position_ids: Optional[torch.Tensor] = None):
        self.applier.flush()  # the server's weights hold the last step before they are evaluated
        self.journal.current()  # ...and every step before it, on a restarted server too
        tensors = self.steps.forward_tensors(hidden, attention_mask, labels, position_ids)
        meta = {"wire_dtype": self.cfg.wire_dtype, "padding": "any"}
        if not self.u_shape and not (self._loss_only and labels is not None):
            meta["logits"] = "all"
        if self.info.get("lora"):
            meta["client_id"] = self.client_id  # the server evaluates with this client's adapter
        out = self.transport.call(P.FORWARD, tensors, meta)
        if self.u_shape:
            trunk = trust.answer(out, P.HIDDEN, hidden.shape, "trunk output")
            return trunk.to(device=hidden.device, dtype=hidden.dtype), None
        loss = trust.loss(out).to(hidden.device).reshape(()) if labels is not None else None
        if "logits" not in meta:  # loss_only()
            return None, loss
        shape = (*hidden.shape[:2], int(self.info["model_config"]["vocab_size"]))
        return trust.answer(out, P.LOGITS, shape, "logits").to(device=hidden.device, dtype=hidden.dtype), loss
