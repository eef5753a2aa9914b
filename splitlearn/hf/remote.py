"""The server's segment as an ``nn.Module`` whose forward and backward cross the wire.

:class:`RemoteSegment` stands in for the blocks a splitlearn server holds: the trunk
``blocks[c1:c2]`` of a U-shape server, or the top ``blocks[c:n] + ln_f + lm_head`` (with the
loss) of a 2-way server. With gradients enabled its forward is a ``torch.autograd.Function``
(:class:`_TrunkFunction`, :class:`_LossFunction`) so ``loss.backward()`` sends the gradient,
exactly as if the blocks were local; without gradients (``torch.no_grad()``, evaluation,
``generate``) it is one ``POST /v1/forward``.

Training is numbered as everywhere in splitlearn (docs/PROTOCOL.md): every request carries
``client_id``, ``step`` (the optimizer step it belongs to, 1, 2, 3...) and ``micro`` (the
piece of that step, 0, 1, 2...), with ``micros = 0`` (the only kind of step: its pieces the
server accumulates until the client's optimizer steps)::

    forward (grad on)   POST /v1/train/forward   hidden [+ attention_mask] (+ labels, 2-way)
                                                 -> hidden (U) | loss F32 [1] (2-way)
    loss.backward()     POST /v1/train/backward  grad (B, T, d) (U) | grad F32 [1] (2-way)
                                                 -> grad (B, T, d); metadata grad_norm
    optimizer.step()    the apply {client_id, step, pieces, lr, clip}, carried by the next
                        step's first forward(s) (metadata ``apply``; its answer in theirs), or
                        POST /v1/train/apply when something needs the step now (:meth:`flush`)
                                                 -> {applied, step, pieces, lr, grad_norm, durable}

So a U-shape step is a forward and a backward per piece and nothing else. When the gradient the
loss will receive is known in advance (:attr:`RemoteSegment.loss_gradient`: ``SplitClient``'s
``loss.backward()``), a 2-way piece is one fused ``POST /v1/train/step`` (forward, loss and
backward at once, the gradient sent as ``loss_scale``) and the pipeline runs 1F1B
(:mod:`splitlearn.hf.pipeline`). The deferred apply goes as a request of its own before a sync,
a checkpoint of the client, an evaluation or a generation, ``close()``: whatever needs the
server's weights to hold the step; and when the process idles, exits, or drops the model
(:mod:`splitlearn.hf.applies`), so the server always holds exactly the client's steps. Every
request names this process's ``run``: a new run of the client id takes over a step a dead one
left pending (docs/PROTOCOL.md).

Tensor bodies are safetensors (``wire_dtype`` as chosen; the 2-way scalar gradient is always
F32), never pickle. A retry (a dropped connection) repeats the same numbers and gets the
stored answer. A server that crashed and restarted from its checkpoint, behind this client,
gets the requests it lost again from :class:`~splitlearn.hf.journal.RequestLog` (each answer
checked against the first), then the one that failed. Pieces in flight together (micro-batch
pipelining, :mod:`splitlearn.hf.pipeline`) go through :meth:`RemoteSegment.start_piece` /
:meth:`RemoteSegment.finish_piece` on separate connections. ``optimizer.step()`` of the
optimizer holding :attr:`RemoteSegment.grad_proxy` (found at the first backward) or of the one
given to :meth:`RemoteSegment.attach_optimizer` triggers the apply (that optimizer's own
``register_step_post_hook``: nothing of ``torch.optim`` is replaced), with its *current*
learning rate, so LR schedules drive both sides. A ``zero_grad`` (any optimizer's, whatever its
class does, or the model's) between a backward and the step shows as the proxy's gradient gone:
the next piece, the step or a sync first discards the step's pieces on the server
(``{"discard": true}``).

**Gradient clipping across both sides.** The server's gradient is represented on the client
by one parameter, :attr:`RemoteSegment.grad_proxy` (shape ``[1]``), whose ``.grad`` each
backward sets to the L2 norm of the server's accumulated parameter gradients. So
``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`` (what ``Trainer`` and
accelerate call) computes the *global* norm over both sides and scales the proxy like every
other gradient; the apply then sends the factor the proxy was scaled by (``clip``) and the
server multiplies its gradients by it before stepping: the same clip as the unsplit model.
Any other uniform scaling of gradients (``loss * k`` before backward is already exact)
reaches the server the same way. The proxy's value is never used (the optimizer moves it).
"""
from __future__ import annotations

import gc
import json
import logging
import os
import time
import uuid
import weakref
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Optional

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from ..api import protocol as P
from ..errors import (ConfigError, Conflict, IntegrityError, NotYourTurn, ServiceUnavailable, SplitLearnError,
                      StaleWeights, TransportError)
from ..api import trust
from ..api.wire import pack
from .config import RemoteConfig
from .applies import IDLE, LAST_CALL_S, Outbox, bounded, register
from .journal import Redo, RequestLog, Sent, digest

log = logging.getLogger(__name__)


# -- finding the optimizer ----------------------------------------------------------------

def optimizers_holding(params) -> list:
    """The live ``torch.optim`` optimizers with one of ``params`` in their ``param_groups``
    (found through the garbage collector's referrers: a group's ``params`` list, the group,
    ``param_groups``, the optimizer; four scans). Nothing of torch is patched; called once per
    training run of a model whose optimizer was not attached (:meth:`RemoteSegment.attach_optimizer`)."""
    params = list(params)
    if not params:
        return []
    lists = [r for r in gc.get_referrers(*params) if type(r) is list]
    if not lists:
        return []
    groups = [r for r in gc.get_referrers(*lists) if type(r) is dict and any(r.get("params") is x for x in lists)]
    if not groups:
        return []
    holders = [r for r in gc.get_referrers(*groups) if type(r) is list]
    if not holders:
        return []
    found = []
    for owner in gc.get_referrers(*holders):
        candidates = [owner] if isinstance(owner, torch.optim.Optimizer) else \
            [o for o in gc.get_referrers(owner) if isinstance(o, torch.optim.Optimizer)] if type(owner) is dict else []
        for opt in candidates:
            if any(opt.param_groups is h for h in holders) and all(opt is not f for f in found):
                found.append(opt)
    return found


# -- autograd over the wire ------------------------------------------------------------------

class _TrunkFunction(torch.autograd.Function):
    """U-shape: hidden (B, T, d) -> the trunk's output (B, T, d) computed by the server."""

    @staticmethod
    def forward(ctx, hidden, proxy, remote: "RemoteSegment", mask):
        out, ctx.piece = remote.send_forward(hidden, mask, None)
        ctx.remote, ctx.like = remote, (hidden.dtype, hidden.device)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        return ctx.remote.send_backward(ctx.piece, grad, *ctx.like), None, None, None


class _LossFunction(torch.autograd.Function):
    """2-way: hidden (B, T, d) + labels -> the server's causal-LM loss (mean over targets), ()."""

    @staticmethod
    def forward(ctx, hidden, proxy, remote: "RemoteSegment", labels, mask):
        loss, ctx.piece = remote.send_forward(hidden, mask, labels)
        ctx.remote, ctx.like = remote, (hidden.dtype, hidden.device)
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        return ctx.remote.send_backward(ctx.piece, grad, *ctx.like), None, None, None, None


class RemoteSegment(nn.Module):
    """The server's blocks (and, 2-way, its head and loss) as a module of the client's model.

    Holds no weight of the server's: one connection, the step and piece counters, and
    :attr:`grad_proxy` (see the module docstring).
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
        self._proxy_set: Optional[torch.Tensor] = None  # the value the last backward gave it
        if state is None:  # this client's last step on the server (a caller that knows it passes it)
            state = self.transport.get_json(P.CLIENT_STATE.format(client_id=self.client_id))
        self.step = int(state["step"]) + 1  # the optimizer step the next pieces belong to
        self.pieces = 0  # forwards sent in this step
        self.answered = 0  # backwards answered in this step
        self.server_norm: Optional[float] = None  # the server's accumulated gradient norm
        self._norm_pieces = 0  # how many pieces that norm covers
        self.last_apply: Optional[dict] = None  # the server's answer to the last apply
        self.applies = 0
        self._optimizer_ref = None  # attach_optimizer: only this one triggers the apply
        self._owner_ref = None  # the model whose parameters identify its optimizers
        self.defense = None  # a splitlearn.privacy.Defense on what crosses the cut (the model's .defense)
        lease = (self.info.get("limits") or {}).get("lease_timeout_s")
        self.idle_flush_s = (min(float(lease) / 3, self.cfg.apply_wait_s)
                             if isinstance(lease, (int, float)) and lease > 0 else self.cfg.apply_wait_s)
        self.carry_apply = True  # False: every apply is a POST /v1/train/apply of its own
        self.auto_apply = True  # False: the owner calls apply() itself (SplitClient); no optimizer hook applies
        self.loss_gradient: Optional[float] = None  # the gradient the loss will receive, when known: fused 2-way pieces, 1F1B
        self.federation = None  # the model's FederationState (.federation), made on the first step
        self._fed_version: Optional[int] = None  # the shared client-side weights' version this model holds
        self._forwards_ok = 0  # forwards of this step the server accepted
        self._shapes: dict[tuple[int, int], tuple[int, ...]] = {}  # (step, piece) -> its hidden's shape
        self._fused: dict[tuple[int, int], tuple] = {}  # fused 2-way piece -> (loss_scale, its answered grad)
        self._apply_now = False  # a piece's answer said others wait for the shared segment: no deferral
        # the requests since the server's last durable step, replayed if it restarts (.journal)
        self.log = RequestLog(enabled=bool(self.info.get("checkpoint", {}).get("enabled")), directory=cfg.journal_dir)
        self.log.durable(int(state.get("durable", 0)))
        self._redo: dict[int, list] = {}  # resume(): step -> its journal records, answered from there
        self._snap_step = 0  # the step of the client checkpoint in cfg.journal_dir
        self._hooked: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # optimizer -> its step hook
        self._proxy_grad: Optional[torch.Tensor] = None  # the .grad tensor the last backward gave the proxy
        self._proxy_version: Optional[int] = None  # the proxy's version counter then
        # this process's run of the client id: a new run takes over a step a dead one left (StepMeta.run)
        self.run = uuid.uuid4().hex[:16]
        # the deferred apply (self.deferred) and its last call: sent at exit and when this segment is collected
        self.outbox = Outbox(self.transport, self.log)
        self._carry = self.outbox.lock  # a forward carrying the deferred apply, a flush, the idle flush
        # (detach() it to drop this segment without its last call: a test standing in for kill -9)
        self.last_call = register(self, self.outbox)

    @property
    def deferred(self) -> Optional[P.ApplyRequest]:
        """The last step's apply, carried by the next step's first forwards (or sent alone)."""
        return self.outbox.req

    @deferred.setter
    def deferred(self, req: Optional[P.ApplyRequest]) -> None:
        self.outbox.req = req

    @property
    def _carrying(self) -> bool:  # a forward carries the deferred apply (the idle flush leaves it)
        return self.outbox.carrying

    @_carrying.setter
    def _carrying(self, value: bool) -> None:
        self.outbox.carrying = value

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
            f"blocks [{self.cuts[0]}, n) + ln_f + lm_head + loss"
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
            self.notice_zero_grad()
            self.flush()
            self.discard_pending(force=True)
        finally:
            self.transport.close()
            if self.fed is not None:
                self.fed.close()

    def settle(self) -> None:
        """The last call before the process ends (this segment's finalizer, :mod:`.applies`):
        :meth:`close` with every request bounded (:data:`~.applies.LAST_CALL_S`, no retry, no
        long wait for a crashed server), so the server holds exactly the steps the client's
        optimizer made. Nothing pending: nothing is sent."""
        if self.deferred is None and not self.pieces and not self.answered:
            return
        if not self._carry.acquire(timeout=LAST_CALL_S):  # the idle flusher is sending it, and waits
            log.warning("the last step's apply is still being sent to %s at exit", self.cfg.server)
            return
        try:
            bounded(self.transport)
            self.cfg = replace(self.cfg, wait_timeout_s=min(self.cfg.wait_timeout_s, LAST_CALL_S),
                               reconnect_timeout_s=min(self.cfg.reconnect_timeout_s, LAST_CALL_S))
            self.carry_apply = False  # a late optimizer's step goes now (no thread at exit)
            self.close()
        finally:
            self._carry.release()

    def bind(self, model: nn.Module) -> None:
        """The model this segment belongs to: an optimizer over any of its parameters applies."""
        self._owner_ref = weakref.ref(model)

    # -- the pieces of a step ------------------------------------------------------------

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

    def trunk(self, hidden: torch.Tensor, attention_mask: Optional[torch.Tensor]) -> torch.Tensor:
        """U-shape: the trunk's output (B, T, d) for ``hidden`` (B, T, d); ``attention_mask``
        (B, T) 0/1 or None. Differentiable when gradients are enabled."""
        if torch.is_grad_enabled():
            return _TrunkFunction.apply(hidden, self.grad_proxy, self, attention_mask)
        return self.evaluate(hidden, attention_mask)[0]

    def loss(self, hidden: torch.Tensor, labels: torch.Tensor,
             attention_mask: Optional[torch.Tensor]) -> torch.Tensor:
        """2-way, gradients enabled: the server's causal-LM loss (a 0-dim tensor, differentiable)."""
        return _LossFunction.apply(hidden, self.grad_proxy, self, labels, attention_mask)

    def _meta(self, step: int, micro: int, kind: str = "b", scale: Optional[float] = None) -> dict:
        """A piece's metadata; a forward of the step after a deferred apply carries it (``apply``);
        a fused 2-way piece (``scale``: the gradient its loss will receive) sends it as ``loss_scale``."""
        meta = P.StepMeta(self.client_id, step, self.cfg.wire_dtype, self._fed_version, micro=micro,
                          loss_scale=1.0 if scale is None else scale, run=self.run).to_meta()
        with self._carry:
            d = self.deferred
            if kind == "f" and d is not None and d.step == step - 1:
                meta["apply"] = json.dumps(d.to_json(), separators=(",", ":"))
                self._carrying = True
        return meta

    def forward_tensors(self, hidden: torch.Tensor, mask: Optional[torch.Tensor],
                        labels: Optional[torch.Tensor]) -> dict:
        """A forward piece's body: ``hidden`` in the wire dtype (+ mask, + labels in 2-way)."""
        tensors = pack(P.HIDDEN, hidden.detach(), self.cfg.wire_dtype)
        if mask is not None:
            tensors[P.MASK] = mask.detach().long().cpu()
        if labels is not None:
            tensors[P.LABELS] = labels.detach().long().cpu()
        return tensors

    def backward_tensors(self, grad: torch.Tensor) -> dict:
        """A backward piece's body: the gradient in the wire dtype; 2-way's scalar one in F32."""
        if grad.ndim == 0:  # 2-way: the scalar gradient of the loss, always float32
            return {P.GRAD: grad.detach().float().reshape(1).cpu()}
        return pack(P.GRAD, grad.detach(), self.cfg.wire_dtype)

    def fused_scale(self, weight: float = 1.0) -> Optional[float]:
        """2-way, the loss's gradient known (:attr:`loss_gradient`): the gradient a piece of
        ``weight`` (its share of the loss) will receive, sent as ``loss_scale`` with a fused
        piece; None: the piece's backward is a request of its own."""
        if self.u_shape or self.loss_gradient is None:
            return None
        scale = float(self.loss_gradient) * weight
        return scale if 0.0 < scale <= 1.0 else None

    def send_forward(self, hidden, mask, labels):
        """One forward piece of the current step -> (hidden or loss, (step, piece))."""
        scale = self.fused_scale() if labels is not None else None
        tensors = self.forward_tensors(hidden, mask, labels)
        call = self.start_piece("f", tensors, None) if scale is None else self.start_piece("f", tensors, None, scale=scale)
        _, piece, out = self.finish_piece(call)
        if labels is not None:
            return out[P.LOSS].to(hidden.device).reshape(()), piece
        return out[P.HIDDEN].to(device=hidden.device, dtype=hidden.dtype), piece

    def send_backward(self, piece: tuple[int, int], grad: torch.Tensor, dtype: torch.dtype,
                      device: torch.device) -> torch.Tensor:
        """The backward of ``piece``: the gradient of its input; the server accumulates."""
        _, _, out = self.finish_piece(self.start_piece("b", self.backward_tensors(grad), None, piece))
        return out[P.GRAD].to(device=device, dtype=dtype)  # (B, T, d)

    def _backward_done(self, piece: tuple[int, int], info: dict) -> None:
        """Count an answered backward; the proxy's gradient becomes the server's norm over the
        most pieces accumulated (answers of pieces in flight together may come in any order)."""
        if piece[0] != self.step:
            return
        self.answered += 1
        self._apply_now = self._apply_now or info.get("apply_now") == "1"  # others wait for the shared segment
        self._find_optimizer()
        accumulated = int(info.get("accumulated", self.answered))
        if accumulated < self._norm_pieces:
            return
        self._norm_pieces = accumulated
        self.server_norm = float(info["grad_norm"])  # checked finite, >= 0 (_verified)
        if self.grad_proxy.requires_grad:
            value = torch.full_like(self.grad_proxy, self.server_norm)
            self.grad_proxy.grad = value
            self._proxy_grad, self._proxy_set = value, value.clone()
            self._proxy_version = self.grad_proxy._version  # an optimizer's step moves it

    # -- pieces, one at a time or in flight together (micro-batch pipelining, .pipeline) ----

    def start_piece(self, kind: str, tensors: dict, lane: Optional[int] = None,
                    piece: Optional[tuple[int, int]] = None, scale: Optional[float] = None):
        """Send a forward (``kind`` "f": a new piece of the current step) or the backward of
        ``piece`` ("b"); on transport ``lane`` without waiting (None: wait in
        :meth:`finish_piece`, on lane 0). ``scale`` (2-way forwards, :meth:`fused_scale`): a fused
        piece, its backward done by the server at once with that gradient; its "b" sends nothing.
        :meth:`finish_piece` reads the answer."""
        if kind == "f":
            self.notice_zero_grad()
            self._before_piece(tensors[P.HIDDEN].shape[0])
            piece = (self.step, self.pieces)
            self.pieces += 1
            self._shapes[piece] = tuple(tensors[P.HIDDEN].shape)  # what its answers must match
            if scale is not None:
                self._fused[piece] = (scale, None)
        elif piece in self._fused:  # a fused piece's backward ran with its forward
            promised = self._fused[piece][0]
            if abs(float(tensors[P.GRAD]) - promised) > 1e-6 * promised:
                raise ConfigError(f"the loss received the gradient {float(tensors[P.GRAD]):g} where "
                                  f"{promised:g} was promised (loss_gradient): the server has already done "
                                  f"this piece's backward")
            return kind, piece, None, None
        path = (P.TRAIN_STEP if scale is not None else P.TRAIN_FORWARD) if kind == "f" else P.TRAIN_BACKWARD
        sent = Sent(path, tensors, self._meta(*piece, kind, scale))
        pending = None
        if lane is not None and piece[0] not in self._redo:
            try:
                pending = self.transport.start_call(sent.path, tensors, sent.meta, lane=lane)
            except (TransportError, ServiceUnavailable, Conflict):
                pass  # finish_piece sends it again, waiting and recovering as a lone call does
        return kind, piece, sent, pending

    def finish_piece(self, call) -> tuple[str, tuple[int, int], dict]:
        """The answer to :meth:`start_piece`'s call -> (kind, piece, tensors: ``hidden``,
        ``loss``, ``grad`` as the server answered them, unpacked). A busy segment, a dropped
        connection or a restarted server: sent again as a lone call would be (waits, replay of
        what the server lost; the numbers make it exactly once)."""
        kind, piece, sent, pending = call
        if sent is None:  # a fused 2-way piece's backward: the gradient came with the forward
            return kind, piece, {P.GRAD: self._fused.pop(piece)[1]}
        out = info = None
        if pending is not None:
            try:
                out, info = self.transport.finish_call_meta(pending)
                self._logged(piece[0], sent, out, info)
            except (StaleWeights, NotYourTurn):
                raise  # the federation's answer: sending it again would get the same
            except (TransportError, ServiceUnavailable, Conflict):
                out = None
        if out is None:
            try:
                out, info = self._train_call(piece[0], sent)
            except (StaleWeights, NotYourTurn):
                raise  # federation: the caller fetches the shared weights or the turn and redoes the step
            except Conflict as e:
                if not self.auto_apply and kind == "b":  # SplitClient: the server lost or dropped the forward
                    raise Redo(f"the server has no forward for it ({e.message})") from None
                raise
        try:
            out = self._verified(kind, piece, sent, out, info)  # before anything of it is kept
        except IntegrityError:
            self._drop_step()
            raise
        if kind == "b" or sent.path == P.TRAIN_STEP:  # a fused piece: its backward is done too
            if sent.path == P.TRAIN_STEP:
                self._fused[piece] = (self._fused[piece][0], out[P.GRAD])
            self._backward_done(piece, info)
        if kind == "f":
            self._forwards_ok += 1
        return kind, piece, out

    def _verified(self, kind: str, piece: tuple[int, int], sent: Sent, out: dict, info: dict) -> dict:
        """The answer's tensors, unpacked, if they are what was asked for (:mod:`splitlearn.trust`):
        a forward's trunk output (U-shape) of the hidden's shape, or its loss (2-way; a fused
        piece's also the gradient of the hidden and a finite ``grad_norm``); a backward's gradient of the piece's hidden and a
        finite ``grad_norm``. IntegrityError otherwise."""
        shape = self._shapes.get(piece)
        if shape is None:  # (a piece in flight when its step was dropped)
            raise IntegrityError(f"an answer to piece {piece[1]} of step {piece[0]}, which this client has dropped")
        if kind == "b":
            if "grad_norm" in info:
                trust.grad_norm(info["grad_norm"])
            return {P.GRAD: trust.answer(out, P.GRAD, shape, "gradient")}
        if self.u_shape:
            return {P.HIDDEN: trust.answer(out, P.HIDDEN, shape, "trunk output")}
        checked = {P.LOSS: trust.loss(out)}
        if sent.path == P.TRAIN_STEP:  # a fused 2-way piece: the backward came with the forward
            checked[P.GRAD] = trust.answer(out, P.GRAD, shape, "gradient")
            trust.grad_norm(info.get("grad_norm"))
        return checked

    def _drop_step(self) -> None:
        """An answer was refused: the step cannot complete. Drop its pieces on the server (an
        open-ended step) and here: the next forward starts the same step afresh."""
        try:
            self.discard_pending(force=True)
        except SplitLearnError as e:
            log.warning("could not drop the refused step on the server: %s", e.message)
        self.log.drop(self.step)
        self.pieces = self.answered = self._norm_pieces = self._forwards_ok = 0
        self.server_norm = self._proxy_set = None
        self._shapes.clear()
        self._fused.clear()
        self._apply_now = False

    def prepare_step(self, model: nn.Module) -> None:
        """Before a training forward of ``model`` that opens a step (open-ended, no piece yet):
        under a federation mode, take the turn and load the shared client-side weights if
        behind, before the client computes anything with them (:mod:`.federation`)."""
        self.notice_zero_grad()
        if self.pieces or not torch.is_grad_enabled() or \
                self.info.get("federation", "shared") == "shared":
            return
        from .federation import federation_of

        fed = federation_of(model)
        if not fed.shared:
            fed.before_step()
            self._fed_version = fed.version

    def _before_piece(self, rows: int) -> None:
        """A forward piece of an open-ended step counts its rows (a member's FedAvg weight)."""
        if self.federation is not None and not self.federation.shared:
            self.federation.samples += rows

    def refused_for_federation(self) -> bool:
        """After a ``StaleWeights``/``NotYourTurn``: True if nothing of this step exists on the
        server (so its forward may run again: the next one loads the weights and takes the turn)."""
        if self.federation is None or self._forwards_ok or self.answered:
            return False
        self.federation.stale()
        self.pieces = 0
        return True

    def evaluate(self, hidden: torch.Tensor, attention_mask: Optional[torch.Tensor],
                 labels: Optional[torch.Tensor] = None):
        """No-grad ``POST /v1/forward`` (server in eval mode, nothing changes): U-shape
        ``(trunk output, None)``; 2-way ``(logits (B, T, V), loss or None)``."""
        self.flush()  # the server's weights hold the last step before they are evaluated
        tensors = self.forward_tensors(hidden, attention_mask, labels)
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

    # -- sending, and recovering from a server crash (see .journal) -----------------------

    @property
    def recoveries(self) -> list[dict]:
        """One entry per recovery from a server restart: ``{"server_step", "replayed"}``."""
        return self.log.replays

    def _send_once(self, sent: Sent) -> tuple[dict, dict]:
        """One request (waiting out a segment busy with another client's step) -> (tensors, info)."""
        from ..transport.busy import wait_while_busy

        if sent.tensors is None:  # an apply: JSON both ways
            return {}, self.transport.post_json(sent.path, sent.meta)
        return wait_while_busy(lambda: self.transport.call_meta(sent.path, sent.tensors, sent.meta),
                               "the segment", self.cfg.wait_timeout_s)

    def _train_call(self, step: int, sent: Sent) -> tuple[dict, dict]:
        """Send one training request; log it for a replay; if the server crashed and restarted
        behind this client (a dropped connection past the transport's retries, or a 409 from
        a server that lost steps), wait for it, replay what it lost, and send it again."""
        if step in self._redo:  # resume(): a step the server has applied, answered from the journal
            return self._redone(step, sent)
        deadline = time.monotonic() + self.cfg.reconnect_timeout_s
        conflicts = 0
        while True:
            try:
                out, info = self._send_once(sent)
                break
            except TransportError as e:
                if not self.log.enabled:
                    raise
                log.warning("server unreachable (%s); waiting up to %gs", e.message, self.cfg.reconnect_timeout_s)
                self.transport.wait_until_up(deadline, self.cfg.reconnect_timeout_s)
            except (StaleWeights, NotYourTurn):
                raise  # not a restart: the federation's answer, for the caller
            except Conflict:
                conflicts += 1
                if not self.log.enabled or conflicts > 1:
                    raise
            try:
                self._recover()
            except TransportError:
                if time.monotonic() > deadline:
                    raise
        self._logged(step, sent, out, info)
        return out, info

    def _logged(self, step: int, sent: Sent, out: dict, info: dict) -> None:
        if "apply" in sent.meta and sent.tensors is not None:  # a forward that carried the last step's apply
            req, carried = self.deferred, info.get("apply")
            if req is not None and carried is not None and req.step == step - 1:
                answer = json.loads(carried)
                self._logged(req.step, Sent(P.TRAIN_APPLY, None, req.to_json()), {}, answer)  # logged as sent alone
                self._apply_answered(req, answer)
            sent = Sent(sent.path, sent.tensors, {k: v for k, v in sent.meta.items() if k != "apply"})
        if sent.tensors is not None and self.log.enabled:
            sent.answer = digest(out)
        self.log.record(step, sent, out if sent.tensors is not None else info, info if sent.tensors is not None else None)
        if "durable" in info:
            self.log.durable(int(info["durable"]))

    def _recover(self) -> None:
        """Bring a restarted server back to this client's step: replay the logged requests of the
        steps it lost and of the step in progress (a server that lost nothing answers them from
        its ledger)."""
        state = self.transport.get_json(P.CLIENT_STATE.format(client_id=self.client_id))
        server = int(state["step"])
        if server >= self.step:  # it applied the step in progress: the apply's retry gets its answer
            return
        self.log.durable(min(int(state.get("durable", 0)), server))
        self.log.replay(server, self.step, lambda r: self._send_once(r)[0])

    def recover(self) -> int:
        """Bring a server that restarted from its checkpoint back to this client's step (training
        does it by itself) -> the number of steps replayed."""
        before = len(self.log.replays)
        self._recover()
        return sum(r["steps"] for r in self.log.replays[before:])

    # -- the journal on disk: a crash of the client (cfg.journal_dir, see .journal) ----------

    def _is_journal(self, directory) -> bool:
        return self.log.directory is not None and Path(directory).resolve() == self.log.directory.resolve()

    def persist(self, optimizer: torch.optim.Optimizer, directory=None) -> None:
        """Write the model's weights, ``optimizer``'s state and the RNG state as the client
        checkpoint in ``directory`` (default: ``cfg.journal_dir``; between steps); drop the log
        the server's durable step and this checkpoint both hold."""
        from ..model.checkpoint import save_state

        self.flush()  # the step this checkpoint holds is on the server (and in the log) first
        directory = Path(directory) if directory is not None else self.log.directory
        owner = self._owner_ref() if self._owner_ref is not None else self
        weights = {k: v.detach().cpu().clone() for k, v in owner.state_dict().items()}
        save_state(directory, "client", [], optimizer,
                   {"client_id": self.client_id, "step": self.step - 1, "cuts": list(self.cuts)},
                   extra={"model": weights, "rng": {"cpu": torch.get_rng_state()}})
        if self._is_journal(directory):
            self._snap_step = self.step - 1
        RequestLog(True, directory).prune(min(self.log.durable_step, self.step - 1))

    def restore(self, directory, optimizer: torch.optim.Optimizer, rng: bool = True,
                client_id: Optional[str] = None) -> dict:
        """Load the client checkpoint in ``directory`` (:meth:`persist`'s) into the model and
        ``optimizer`` (and the RNG state if ``rng``) -> its counters (``client_id``, ``step``,
        ``cuts``). ConfigError if there is none, or it is not at the server's cuts (or not
        ``client_id``'s, if given)."""
        from ..model.checkpoint import has_state, load_state, read_extra

        if directory is None or not has_state(directory, "client"):
            raise ConfigError(f"no client checkpoint in {directory}")
        counters = load_state(directory, "client", [], optimizer)
        if tuple(counters["cuts"]) != self.cuts:
            raise ConfigError(f"checkpoint was made with cuts {counters['cuts']}, server has {list(self.cuts)}")
        if client_id is not None and counters["client_id"] != client_id:
            raise ConfigError(f"the checkpoint in {directory} is client {counters['client_id']!r}'s, not {client_id!r}")
        owner = self._owner_ref() if self._owner_ref is not None else self
        weights = read_extra(directory, "client", "model")
        with torch.no_grad():
            for k, v in owner.state_dict(keep_vars=True).items():
                v.copy_(weights[k])
        if rng:
            torch.set_rng_state(read_extra(directory, "client", "rng")["cpu"])
        if self._is_journal(directory):
            self._snap_step = int(counters["step"])
        return counters

    def resume(self, optimizer: torch.optim.Optimizer) -> int:
        """After a crash of the client: :meth:`restore` the client checkpoint of
        ``cfg.journal_dir``, then :meth:`load_journal`. Returns the step the loop starts again at
        (its data must be that step's)."""
        self.restore(self.log.directory, optimizer, client_id=self.client_id)
        self.attach_optimizer(optimizer)
        self.load_journal(self.log.directory, self._snap_step)
        return self.step

    def run_step(self, attempt, optimizer: torch.optim.Optimizer, lr: float) -> float:
        """One whole step for an owner that applies (:attr:`auto_apply` False, ``SplitClient``):
        ``attempt()`` (forward and backward of :attr:`step` -> its loss) runs again, the refused
        attempt's pieces dropped on both sides, while the segment is busy or the server refuses it
        (stale shared weights, a lapsed turn, a forward it no longer has), within
        ``wait_timeout_s``; then ``optimizer.step()``, the apply at ``lr`` and, with a journal on
        disk, a new client checkpoint once the server's is past the last. Returns the loss."""
        from ..transport.busy import wait_while_busy
        from .federation import federation_of

        fed, step = federation_of(self._owner_ref()), self.step
        deadline = time.monotonic() + self.cfg.wait_timeout_s

        def once() -> float:
            if self.pieces or self.answered:  # an earlier attempt's pieces: dropped on both sides
                self.discard_pending(force=True)
            return attempt()

        while True:
            try:
                fed.before_step()
                loss = wait_while_busy(once, "the segment", max(deadline - time.monotonic(), 0.0))
                break
            except (StaleWeights, NotYourTurn) as e:
                log.info("step %d redone: %s", step, e.message)
                fed.stale()
            except Redo as e:
                log.warning("step %d redone: %s", step, e)
            self.log.drop(step)  # what was logged of the refused attempt
            if time.monotonic() > deadline:
                raise ServiceUnavailable(f"step {step} could not be applied within {self.cfg.wait_timeout_s:g}s")
        optimizer.step()
        self.apply(lr)  # carried by the next step's first request (or flushed)
        if self.log.directory is not None and self.log.enabled and self.log.durable_step > self._snap_step:
            self.persist(optimizer)  # the server's checkpoint moved past this client's: a new one
        return loss

    def load_journal(self, directory, mine: int) -> dict[int, dict]:
        """This client is back at step ``mine`` (its checkpoint): the logged steps in
        ``directory`` up to ``mine`` are kept for a replay, and sent again now if the server lost
        them; those after ``mine`` that the server has applied are answered from the log when
        they run again (no request; each request must equal the logged one); those it lost are
        forgotten (they run again for real). ``Conflict`` if the server and the journal do not
        meet. Returns the notes (:meth:`RequestLog.note`) of the steps after ``mine``."""
        from .journal import LOCAL, read_log

        by_step: dict[int, list] = {}
        notes = {}
        for r in read_log(directory):
            if r.sent.path == LOCAL:
                notes[r.step] = r.sent.tensors
            else:
                by_step.setdefault(r.step, []).append(r)
        state = self.transport.get_json(P.CLIENT_STATE.format(client_id=self.client_id))
        server = int(state["step"])
        last = max([mine, *by_step, *notes])
        if server > last + 1 or any(s not in by_step for s in range(server + 1, mine + 1)):
            raise Conflict(f"client checkpoint is at step {mine} (journal to step {last}) but the server has "
                           f"applied step {server} for client {self.client_id!r}: resume both sides from "
                           f"checkpoints of the same step")
        self.log.steps.clear()
        self.log.durable_step = 0
        self.log.durable(min(int(state.get("durable", server)), server))
        self._redo.clear()
        for step in sorted(by_step):
            if step <= mine:
                for r in by_step[step]:
                    self.log.remember(step, r.sent)
            elif step <= server:
                self._redo[step] = by_step[step]
            else:  # the server does not have it: it runs again for real
                self.log.drop(step)
        self.step = mine + 1
        self.pieces = self.answered = self._norm_pieces = self._forwards_ok = 0
        if server < mine:
            self._recover()
        return {s: t for s, t in notes.items() if s > mine}

    def _redone(self, step: int, sent: Sent) -> tuple[dict, dict]:
        """The logged answer to ``sent`` of a step the server has applied (see :meth:`resume`)."""
        queue = self._redo[step]
        if sent.tensors is None:  # the apply: the server has it
            del self._redo[step]
            rec = next((r for r in queue if r.sent.tensors is None), None)
            if rec is not None:
                self.log.remember(step, rec.sent)
            return {}, rec.answer if rec is not None else {"applied": True, "step": step}
        micro = sent.meta.get("micro", "0")
        rec = next((r for r in queue if r.sent.path == sent.path and r.sent.meta.get("micro", "0") == micro), None)
        if rec is None and not self.auto_apply:  # its answer never reached the log: the server's
            del self._redo[step]  # ledger answers the retry of its last step
            return self._train_call(step, sent)
        same = rec is not None and set(rec.sent.tensors) == set(sent.tensors) and all(
            torch.equal(rec.sent.tensors[k].cpu(), sent.tensors[k].detach().cpu()) for k in sent.tensors)
        if not same:
            raise Conflict(f"step {step} run again after a resume differs from the one the journal holds "
                           f"({sent.path}, piece {micro}): run the same data in the same order")
        queue.remove(rec)
        self.log.remember(step, rec.sent)
        return rec.answer, dict(rec.info or {})

    # -- the optimizer step --------------------------------------------------------------

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Only ``optimizer``'s steps apply the server's step from now on (by default the
        optimizers holding :attr:`grad_proxy`, found at the first backward, do)."""
        self._optimizer_ref = weakref.ref(optimizer)
        self._hook(optimizer)
        if self.log.directory is not None and self.log.enabled and self.pieces == 0:
            from ..model.checkpoint import has_state

            if not has_state(self.log.directory, "client"):
                self.persist(optimizer)  # where a resume starts if nothing later is durable

    def _hook(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer.register_step_post_hook``: its steps apply this segment's (per instance:
        nothing of ``torch.optim`` is replaced)."""
        if optimizer in self._hooked:
            return
        me = weakref.ref(self)

        def after_step(opt, args, kwargs):
            remote = me()
            if remote is not None:
                remote.after_optimizer_step(opt)

        self._hooked[optimizer] = optimizer.register_step_post_hook(after_step)

    def _find_optimizer(self) -> None:
        """At a backward: hook the optimizers holding :attr:`grad_proxy` unless one is hooked."""
        if self._optimizer_ref is not None and self._optimizer_ref() is not None or len(self._hooked) or \
                getattr(self, "_searched", None) == self.step:
            return
        self._searched = self.step  # once a step (four scans of the collector's objects)
        owner = self._owner_ref() if self._owner_ref is not None else None
        params = [self.grad_proxy] + [p for p in (owner.parameters() if owner is not None else ())
                                      if p.requires_grad and p is not self.grad_proxy]
        for optimizer in optimizers_holding(params):
            self._hook(optimizer)

    def _covers(self, optimizer: torch.optim.Optimizer) -> bool:
        return self._optimizer_ref is None or self._optimizer_ref() is optimizer

    def zeroed(self) -> bool:
        """The client's gradients were cleared since this step's last backward (an optimizer's
        or the model's ``zero_grad``, whatever its class does): the proxy's gradient is gone, or
        zero where the server's norm was not."""
        if self.answered == 0:
            return False
        if not self.grad_proxy.requires_grad:  # (peft froze it): the hooked optimizers' gradients all gone
            opts = [o for o in self._hooked.keys() if self._covers(o)]
            return bool(opts) and all(p.grad is None for o in opts for g in o.param_groups for p in g["params"])
        if self._proxy_set is None:
            return False
        g = self.grad_proxy.grad
        return g is None or (g is not self._proxy_grad and not torch.equal(g, self._proxy_set)) or \
            (float(self._proxy_set) != 0.0 and not bool(g.any()))

    def notice_zero_grad(self) -> None:
        """Before a new piece, a sync or an apply: a ``zero_grad`` since the last backward
        discards the step's pending gradients on the server too; the step of an optimizer made
        after the step's backward (so not yet found) is applied now."""
        if not self.auto_apply:  # the owner clears and applies (SplitClient)
            return
        if self.answered and not len(self._hooked) and self._proxy_version is not None and \
                self.grad_proxy._version != self._proxy_version:  # an optimizer made after the backward stepped
            self._searched = None
            self._find_optimizer()
            late = [o for o in self._hooked.keys() if self._covers(o)]
            if late:
                self._stepped(late[0])  # its step (a zero_grad after it is no discard), applied now
                return
        if self.zeroed():
            self.discard_pending()

    def _lr_of(self, optimizer: torch.optim.Optimizer) -> float:
        """The learning rate of the group holding :attr:`grad_proxy` (else the first group)."""
        for g in optimizer.param_groups:
            if any(p is self.grad_proxy for p in g["params"]):
                return float(g["lr"])
        return float(optimizer.param_groups[0]["lr"])

    def after_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """The step hook: apply the server's step (at ``optimizer``'s learning rate)."""
        if (self.pieces == 0 and self.answered == 0) or not self._covers(optimizer) or not self.auto_apply:
            return
        self.notice_zero_grad()
        if self.pieces:
            self._stepped(optimizer)

    def _stepped(self, optimizer: torch.optim.Optimizer) -> None:
        if self.answered == 0:  # forwards with gradients on, never backpropagated: drop them
            self.discard_pending(force=True)
            return
        self._check_optimizer(optimizer)
        self.apply(self._lr_of(optimizer))
        if self.log.directory is not None and self.log.enabled and self.log.durable_step > self._snap_step:
            self.persist(optimizer)  # the server's checkpoint moved past this client's: a new one

    def _check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Warn once if the client's optimizer is not the server's kind (only the lr travels)."""
        if getattr(self, "_checked", None) is optimizer:
            return
        self._checked = optimizer
        server = self.info.get("optimizer", {})
        kind = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}.get(server.get("name"))
        wd = {float(g.get("weight_decay", 0.0)) for g in optimizer.param_groups}
        if kind is not None and not isinstance(optimizer, kind) or wd != {float(server.get("weight_decay", 0.0))}:
            log.warning("the server steps its own %s (weight_decay %s) with this optimizer's learning rate; this "
                        "optimizer is %s (weight_decay %s): the two sides differ from one unsplit optimizer",
                        server.get("name"), server.get("weight_decay"), type(optimizer).__name__, sorted(wd))

    def clip_factor(self) -> float:
        """The factor the server's gradients must be multiplied by: what happened to the
        proxy's gradient since the last backward set it (1.0 if nothing did)."""
        g = self.grad_proxy.grad
        if g is None or self._proxy_set is None or not self.grad_proxy.requires_grad:
            return 1.0
        if torch.equal(g, self._proxy_set):
            return 1.0
        if float(self._proxy_set) == 0.0:
            return 1.0
        factor = float(g.double() / self._proxy_set.double())
        if not 0.0 < factor <= 1.0:
            raise ConfigError(f"the server's gradient was scaled by {factor} on the client (its proxy "
                              f"{self.grad_proxy.grad.item()} vs {self._proxy_set.item()}): only a "
                              f"clip (0 < factor <= 1) can be sent to the server")
        return factor

    def apply(self, lr: float) -> Optional[dict]:
        """The apply of the current step at ``lr``; the next pieces belong to the next step.
        Carried by the next step's first forward(s) (:attr:`carry_apply`; returns None, the
        answer is :attr:`last_apply` once it came), else ``POST /v1/train/apply`` now (returns the
        server's answer). A step the journal answers (:meth:`resume`) is applied at once."""
        self.flush()
        req = P.ApplyRequest(self.client_id, self.step, self.answered, float(lr), self.clip_factor(), run=self.run)
        self.applies += 1
        if self.carry_apply and not self._apply_now and self.step not in self._redo:
            with self._carry:
                self.deferred, self._carrying = req, False
            if self.idle_flush_s:
                IDLE.schedule(self, req, self.idle_flush_s)
            self._next_step()
            return None
        _, answer = self._train_call(self.step, Sent(P.TRAIN_APPLY, None, req.to_json()))
        self._apply_answered(req, answer)
        self._next_step()
        return answer

    def flush(self) -> Optional[dict]:
        """Send the deferred apply now (``POST /v1/train/apply``; a retry of one a forward
        already carried gets its stored answer): before whatever needs the server to hold the
        step (a sync, a checkpoint, an evaluation, a generation, ``close``). Returns its answer."""
        with self._carry:
            req = self.deferred
            if req is None:
                return None
            _, answer = self._train_call(req.step, Sent(P.TRAIN_APPLY, None, req.to_json()))
            self._apply_answered(req, answer)
            return answer

    def _idle_flush(self, req: P.ApplyRequest) -> None:
        """The idle flusher's call: send ``req`` unless a forward carries it or it was answered."""
        with self._carry:
            if self.deferred is not req or self._carrying:
                return
            try:
                self.flush()
            except Exception as e:  # noqa: BLE001 - the next forward carries it again, or raises
                log.warning("sending the deferred apply of step %d failed (%s); the next step's forward carries it",
                            req.step, e)

    def _apply_answered(self, req: P.ApplyRequest, answer: dict) -> None:
        """The server's answer to ``req`` came (its own request's, or a carrying forward's)."""
        with self._carry:
            if self.deferred is req:
                self.deferred, self._carrying = None, False
        self.last_apply = answer
        applied = answer.get("lr") if isinstance(answer, dict) else None
        if isinstance(applied, (int, float)) and applied < float(req.lr) and not getattr(self, "_lr_capped", False):
            self._lr_capped = True  # once: a schedule asks for it every step
            log.warning("the server applied lr %g, not this optimizer's %g: on weights shared between tenants it "
                        "steps at most at its own --lr (docs/SECURITY.md); start it with --lr >= your peak lr",
                        applied, float(req.lr))

    def discard_pending(self, force: bool = False) -> None:
        """Drop the current step's gradients on the server (``zero_grad`` before a step). Not
        while no backward has been answered (``loss = model(x); opt.zero_grad(); loss.backward()``
        keeps its forward) unless ``force``."""
        if self.answered == 0 and not (force and self.pieces) or self.step in self._redo:
            return
        req = P.ApplyRequest(self.client_id, self.step, discard=True, run=self.run)
        self.transport.post_json(P.TRAIN_APPLY, req.to_json())
        self.log.drop(self.step)
        self.pieces = self.answered = self._norm_pieces = self._forwards_ok = 0
        self.server_norm = self._proxy_set = None
        self._shapes.clear()
        self._fused.clear()
        self._apply_now = False

    def _next_step(self) -> None:
        self.step += 1
        self.pieces = self.answered = self._norm_pieces = self._forwards_ok = 0
        self.server_norm = self._proxy_set = None
        self._shapes.clear()
        self._fused.clear()
        self._apply_now = False
