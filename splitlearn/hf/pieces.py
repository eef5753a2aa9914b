"""A training step's state and its pieces: their numbers, their bodies, and the checks on
their answers.

Training is numbered as everywhere in splitlearn (docs/PROTOCOL.md): every request carries
``client_id``, ``step`` (the optimizer step it belongs to, 1, 2, 3...) and ``micro`` (the
piece of that step, 0, 1, 2...), with ``micros = 0`` (the only kind of step: its pieces the
server accumulates until the client's optimizer steps)::

    forward (grad on)   POST /v1/train/forward   hidden [+ attention_mask] (+ labels, 2-way)
                                                 -> hidden (U) | loss F32 [1] (2-way)
    loss.backward()     POST /v1/train/backward  grad (B, T, d) (U) | grad F32 [1] (2-way)
                                                 -> grad (B, T, d); metadata grad_norm
    fused 2-way piece   POST /v1/train/step      hidden + labels, metadata loss_scale
                                                 -> loss and grad (B, T, d); metadata grad_norm
    optimizer.step()    the apply {client_id, step, pieces, lr, clip} (:mod:`.applies`), carried
                        by the next step's first forward(s) as metadata ``apply``

So a U-shape step is a forward and a backward per piece and nothing else. When the gradient the
loss will receive is known in advance (``RemoteSegment.loss_gradient``: ``SplitClient``'s
``loss.backward()``), a 2-way piece is one fused ``POST /v1/train/step`` (forward, loss and
backward at once, the gradient sent as ``loss_scale``) and the pipeline runs 1F1B
(:mod:`splitlearn.hf.pipeline`). Every request names this process's ``run``: a new run of the
client id takes over a step a dead one left pending (docs/PROTOCOL.md).

Tensor bodies are safetensors (``wire_dtype`` as chosen; the 2-way scalar gradient is always
F32), never pickle. Pieces in flight together (micro-batch pipelining) go through
:meth:`StepPieces.start` / :meth:`StepPieces.finish` on separate connections; one at a time,
:meth:`StepPieces.send_forward` / :meth:`StepPieces.send_backward` (the autograd Functions of
:mod:`.remote`). Every answer is checked (:mod:`splitlearn.api.trust`) before anything of it is kept;
a refused answer drops the step on both sides (the next forward starts it afresh).
"""
from __future__ import annotations

import logging
import weakref
from typing import Optional

import torch
from torch import nn

from ..api import protocol as P
from ..api import trust
from ..errors import (ConfigError, Conflict, ForwardLost, IntegrityError, NotYourTurn, ServiceUnavailable,
                      SplitLearnError, StaleWeights, TransportError)
from ..api.wire import pack
from .journal import Sent
from .limits import check_training_rows

log = logging.getLogger(__name__)


def echo_of(meta: dict, path: str) -> str:
    """The ``echo`` a server puts in a training answer's metadata: the request's ``step/micro
    path`` (the server's twin: :func:`splitlearn.server.http.routing.echo_of`)."""
    return f"{meta.get('step')}/{meta.get('micro')} {path}"


def answers(sent: Sent, info: dict) -> bool:
    """Is ``info`` (an answer's metadata) the answer to ``sent``? A piece's answer read off the
    wrong connection or out of order (an answer left unread on a keep-alive connection, a relay
    that reorders, a resend on a lane that was busy) names another request. An answer without
    an ``echo`` (a server before it) is taken as the shape checks allow."""
    echo = info.get("echo")
    return echo is None or echo == echo_of(sent.meta, sent.path)


class StepPieces:
    """The current step's number, its pieces on the server, and the protocol that sends them.

    ``segment``: the :class:`~splitlearn.hf.remote.RemoteSegment` (held weakly; its connection,
    ``client_id``, ``run`` and split), whose :class:`~.applies.Applier` a first forward carries,
    whose :class:`~.recovery.Recovery` sends and logs, and whose
    :class:`~.optlink.OptimizerLink` learns each backward's server norm. ``step``: the
    optimizer step the next pieces belong to.
    """

    def __init__(self, segment, step: int):
        self._segment = weakref.proxy(segment)
        self.step = step
        self.pieces = 0  # forwards sent in this step
        self.answered = 0  # backwards answered in this step
        self.server_norm: Optional[float] = None  # the server's accumulated gradient norm
        self.apply_now = False  # a piece's answer said others wait for the shared segment: no deferral
        self.fed_version: Optional[int] = None  # the shared client-side weights' version this model holds
        self._norm_pieces = 0  # how many pieces that norm covers
        self._forwards_ok = 0  # forwards of this step the server accepted
        self._shapes: dict[tuple[int, int], tuple[int, ...]] = {}  # (step, piece) -> its hidden's shape
        self._fused: dict[tuple[int, int], tuple] = {}  # fused 2-way piece -> (loss_scale, its answered grad)

    # -- the step's life -----------------------------------------------------------------

    def reset(self) -> None:
        """Forget the step's pieces here (dropped, discarded or applied)."""
        self.pieces = self.answered = self._norm_pieces = self._forwards_ok = 0
        self.server_norm = None
        self._shapes.clear()
        self._fused.clear()
        self.apply_now = False
        self._segment.link.forget()

    def next(self) -> None:
        """The step was applied (or its apply deferred): the next pieces belong to the next."""
        self.step += 1
        self.reset()

    def discard(self, force: bool = False) -> None:
        """Drop the current step's gradients on the server (``zero_grad`` before a step). Not
        while no backward has been answered (``loss = model(x); opt.zero_grad(); loss.backward()``
        keeps its forward) unless ``force``."""
        seg = self._segment
        if self.answered == 0 and not (force and self.pieces) or seg.journal.answers(self.step):
            return
        if seg.applier.made(self.step):  # an interrupt came between its apply and the step moving on:
            self.next()  # the step is complete (its apply owed or answered), never dropped (issue 51)
            return
        req = P.ApplyRequest(seg.client_id, self.step, discard=True, run=seg.run)
        seg.transport.post_json(P.TRAIN_APPLY, req.to_json())
        seg.log.drop(self.step)
        self.reset()

    def drop(self) -> None:
        """An answer was refused: the step cannot complete. Drop its pieces on the server (an
        open-ended step) and here: the next forward starts the same step afresh."""
        try:
            self.discard(force=True)
        except SplitLearnError as e:
            log.warning("could not drop the refused step on the server: %s", e.message)
        self._segment.log.drop(self.step)
        self.reset()

    # -- federation ------------------------------------------------------------------------

    def prepare(self, model: nn.Module) -> None:
        """Before a training forward of ``model`` that opens a step (no piece yet): under a
        federation mode, take the turn and load the shared client-side weights if behind, before
        the client computes anything with them (:mod:`.federation`)."""
        seg = self._segment
        seg.link.notice_zero_grad()
        if self.pieces or not torch.is_grad_enabled() or seg.info.get("federation", "shared") == "shared":
            return
        from .federation import federation_of

        fed = federation_of(model)
        if not fed.shared:
            fed.before_step()
            self.fed_version = fed.version

    def refused_for_federation(self) -> bool:
        """After a ``StaleWeights``/``NotYourTurn``: True if nothing of this step exists on the
        server (so its forward may run again: the next one loads the weights and takes the turn)."""
        fed = self._segment.federation
        if fed is None or self._forwards_ok or self.answered:
            return False
        fed.stale()
        self.pieces = 0
        return True

    # -- bodies ----------------------------------------------------------------------------

    def meta(self, step: int, micro: int, kind: str = "b", scale: Optional[float] = None) -> dict:
        """A piece's metadata; a forward of the step after a deferred apply carries it (``apply``);
        a fused 2-way piece (``scale``: the gradient its loss will receive) sends it as ``loss_scale``."""
        seg = self._segment
        meta = P.StepMeta(seg.client_id, step, seg.cfg.wire_dtype, self.fed_version, micro=micro,
                          loss_scale=1.0 if scale is None else scale, run=seg.run).to_meta()
        carried = seg.applier.carried_by(step) if kind == "f" else None
        if carried is not None:
            meta["apply"] = carried
        return meta

    def forward_tensors(self, hidden: torch.Tensor, mask: Optional[torch.Tensor],
                        labels: Optional[torch.Tensor], positions: Optional[torch.Tensor] = None) -> dict:
        """A forward piece's body: ``hidden`` in the wire dtype (+ mask, + labels in 2-way, +
        the caller's ``position_ids`` (B|1, T) when it gave its own: the server derives them from
        the mask otherwise); ConfigError for more rows than the server takes
        (:func:`.limits.check_training_rows`)."""
        check_training_rows(self._segment.info, hidden.shape[0])
        tensors = pack(P.HIDDEN, hidden.detach(), self._segment.cfg.wire_dtype)
        if mask is not None:
            tensors[P.MASK] = mask.detach().long().cpu()
        if labels is not None:
            tensors[P.LABELS] = labels.detach().long().cpu()
        if positions is not None:
            tensors[P.POSITIONS] = positions.detach().long().cpu()
        return tensors

    def backward_tensors(self, grad: torch.Tensor) -> dict:
        """A backward piece's body: the gradient in the wire dtype; 2-way's scalar one in F32."""
        if grad.ndim == 0:  # 2-way: the scalar gradient of the loss, always float32
            return {P.GRAD: grad.detach().float().reshape(1).cpu()}
        return pack(P.GRAD, grad.detach(), self._segment.cfg.wire_dtype)

    def fused_scale(self, weight: float = 1.0) -> Optional[float]:
        """2-way, the loss's gradient known (``RemoteSegment.loss_gradient``): the gradient a
        piece of ``weight`` (its share of the loss) will receive, sent as ``loss_scale`` with a
        fused piece; None: the piece's backward is a request of its own."""
        seg = self._segment
        if seg.u_shape or seg.loss_gradient is None:
            return None
        scale = float(seg.loss_gradient) * weight
        return scale if 0.0 < scale <= 1.0 else None

    # -- one piece at a time (the autograd Functions) ----------------------------------------

    def send_forward(self, hidden, mask, labels, positions=None):
        """One forward piece of the current step -> (hidden or loss, (step, piece))."""
        scale = self.fused_scale() if labels is not None else None
        tensors = self.forward_tensors(hidden, mask, labels, positions)
        call = self.start("f", tensors, None) if scale is None else self.start("f", tensors, None, scale=scale)
        _, piece, out = self.finish(call)
        if labels is not None:
            return out[P.LOSS].to(hidden.device).reshape(()), piece
        return out[P.HIDDEN].to(device=hidden.device, dtype=hidden.dtype), piece

    def send_backward(self, piece: tuple[int, int], grad: torch.Tensor, dtype: torch.dtype,
                      device: torch.device) -> torch.Tensor:
        """The backward of ``piece``: the gradient of its input; the server accumulates."""
        _, _, out = self.finish(self.start("b", self.backward_tensors(grad), None, piece))
        return out[P.GRAD].to(device=device, dtype=dtype)  # (B, T, d)

    # -- pieces in flight together (micro-batch pipelining, .pipeline) ------------------------

    def start(self, kind: str, tensors: dict, lane: Optional[int] = None,
              piece: Optional[tuple[int, int]] = None, scale: Optional[float] = None):
        """Send a forward (``kind`` "f": a new piece of the current step) or the backward of
        ``piece`` ("b"); on transport ``lane`` without waiting (None: wait in :meth:`finish`,
        on lane 0). ``scale`` (2-way forwards, :meth:`fused_scale`): a fused piece, its backward
        done by the server at once with that gradient; its "b" sends nothing. :meth:`finish`
        reads the answer."""
        seg = self._segment
        if kind == "f":
            seg.link.notice_zero_grad()
            self._count_rows(tensors[P.HIDDEN].shape[0])
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
            return kind, piece, None, None, lane or 0
        path = (P.TRAIN_STEP if scale is not None else P.TRAIN_FORWARD) if kind == "f" else P.TRAIN_BACKWARD
        sent = Sent(path, tensors, self.meta(*piece, kind, scale))
        pending = None
        if lane is not None and not seg.journal.answers(piece[0]):
            try:
                pending = seg.transport.start_call(sent.path, tensors, sent.meta, lane=lane)
            except (TransportError, ServiceUnavailable, Conflict):
                pass  # finish sends it again, waiting and recovering as a lone call does
        return kind, piece, sent, pending, lane or 0

    def finish(self, call) -> tuple[str, tuple[int, int], dict]:
        """The answer to :meth:`start`'s call -> (kind, piece, tensors: ``hidden``, ``loss``,
        ``grad`` as the server answered them, unpacked). A busy segment, a dropped connection or
        a restarted server: sent again as a lone call would be (waits, replay of what the server
        lost; the numbers make it exactly once). A backward whose forward the server no longer
        has: :class:`~splitlearn.errors.ForwardLost` (the step must run again from the start).

        Sent again on the call's own lane, never on another: the pieces in flight together hold
        the other lanes, and a second request on a lane whose answer is unread would be answered
        with that answer (a forward given a backward's gradient: the H100 run of issue 42)."""
        kind, piece, sent, pending, lane = call
        if sent is None:  # a fused 2-way piece's backward: the gradient came with the forward
            return kind, piece, {P.GRAD: self._fused.pop(piece)[1]}
        journal = self._segment.journal
        out = info = None
        if pending is not None:
            try:
                out, info = self._segment.transport.finish_call_meta(pending)
                if not answers(sent, info):  # another request's answer: this one's is sent again
                    log.warning("an answer on lane %d was %r's, not %r's: the lane is closed and the piece "
                                "sent again", lane, info.get("echo"), echo_of(sent.meta, sent.path))
                    self._segment.transport.drop_lane(lane)
                    out = None
                else:
                    journal.logged(piece[0], sent, out, info)
            except (StaleWeights, NotYourTurn):
                raise  # the federation's answer: sending it again would get the same
            except (TransportError, ServiceUnavailable, Conflict):
                out = None
        if out is None:
            try:
                out, info = journal.call(piece[0], sent, lane)
            except (StaleWeights, NotYourTurn):
                raise  # federation: the caller fetches the shared weights or the turn and redoes the step
            except Conflict as e:
                if kind == "b":  # the server lost or dropped the forward
                    raise ForwardLost(f"the server has no forward for this backward ({e.message}): "
                                      f"step {piece[0]} must run again from its first forward") from None
                raise
        try:
            if not answers(sent, info):
                self._segment.transport.drop_lane(lane)
                raise IntegrityError(f"the answer to piece {piece[1]} of step {piece[0]} ({sent.path}) answers "
                                     f"another request ({info.get('echo')})")
            out = self._verified(kind, piece, sent, out, info)  # before anything of it is kept
        except IntegrityError:
            self.drop()
            raise
        if kind == "b" or sent.path == P.TRAIN_STEP:  # a fused piece: its backward is done too
            if sent.path == P.TRAIN_STEP:
                self._fused[piece] = (self._fused[piece][0], out[P.GRAD])
            self._backward_done(piece, info)
        if kind == "f":
            self._forwards_ok += 1
        return kind, piece, out

    def _verified(self, kind: str, piece: tuple[int, int], sent: Sent, out: dict, info: dict) -> dict:
        """The answer's tensors, unpacked, if they are what was asked for (:mod:`splitlearn.api.trust`):
        a forward's trunk output (U-shape) of the hidden's shape, or its loss (2-way; a fused
        piece's also the gradient of the hidden and a finite ``grad_norm``); a backward's gradient
        of the piece's hidden and a finite ``grad_norm``. IntegrityError otherwise."""
        shape = self._shapes.get(piece)
        if shape is None:  # (a piece in flight when its step was dropped)
            raise IntegrityError(f"an answer to piece {piece[1]} of step {piece[0]}, which this client has dropped")
        if kind == "b":
            if "grad_norm" in info:
                trust.grad_norm(info["grad_norm"])
            return {P.GRAD: trust.answer(out, P.GRAD, shape, "gradient")}
        if self._segment.u_shape:
            return {P.HIDDEN: trust.answer(out, P.HIDDEN, shape, "trunk output")}
        checked = {P.LOSS: trust.loss(out)}
        if sent.path == P.TRAIN_STEP:  # a fused 2-way piece: the backward came with the forward
            checked[P.GRAD] = trust.answer(out, P.GRAD, shape, "gradient")
            trust.grad_norm(info.get("grad_norm"))
        return checked

    def _backward_done(self, piece: tuple[int, int], info: dict) -> None:
        """Count an answered backward; the proxy's gradient becomes the server's norm over the
        most pieces accumulated (answers of pieces in flight together may come in any order)."""
        if piece[0] != self.step:
            return
        link = self._segment.link
        self.answered += 1
        self.apply_now = self.apply_now or info.get("apply_now") == "1"  # others wait for the shared segment
        link.find(self.step)
        accumulated = int(info.get("accumulated", self.answered))
        if accumulated < self._norm_pieces:
            return
        self._norm_pieces = accumulated
        self.server_norm = float(info["grad_norm"])  # checked finite, >= 0 (_verified)
        link.server_norm_is(self.server_norm)

    def _count_rows(self, rows: int) -> None:
        """A forward piece of an open-ended step counts its rows (a member's FedAvg weight)."""
        fed = self._segment.federation
        if fed is not None and not fed.shared:
            fed.samples += rows
