"""Micro-batch pipelining of a training step (GPipe, Huang et al. 2019).

``SplitClient(..., micro_batches=M)`` splits each batch into M micro-batches along the rows
and keeps requests in flight on up to ``MAX_LANES`` transport lanes, so the client and the
server compute at the same time. U-shape, M = 3 (f: trunk forward, b: trunk backward,
bottom⁻¹: the bottom's backward)::

    client:  bottom(0) bottom(1) bottom(2) . top(0) ....... top(1) bottom⁻¹(0) top(2) bottom⁻¹(1) . bottom⁻¹(2)
    server:            f(0) ..... f(1) ..... f(2) .. b(0) ...... b(1) ........ b(2) ....

Every forward is sent as soon as its bottom is done; top(i) starts as soon as f(i) is back
(not when all forwards are); the bottom's backward of micro-batch j runs as soon as b(j) is
back, between two tops, so the client never waits while it has work. The server runs the
pieces in arrival order. 2-way: the client runs bottom(i+1) while the server runs the top's
forward and backward of micro-batch i, then each bottom⁻¹(i) as its answer comes.

Gradients accumulate on both sides and each side applies one optimizer step per step. Each
micro-batch's loss is weighted by its share of the step's target tokens, so the step equals
the unpipelined one (float32, up to summation order; the bottom's gradients are always summed
in micro-batch order, so a redone step is bit-identical).
"""
from __future__ import annotations

from typing import Optional

import torch

from .. import protocol as P
from ..errors import Conflict, NotYourTurn, StaleWeights
from ..segments import labels_from_batch, loss_from_logits
from ..wire import pack, unpack
from .recovery import Redo

MAX_LANES = 8  # requests in flight at once (one keep-alive connection each)


def split_rows(x: Optional[torch.Tensor], m: int) -> list[Optional[torch.Tensor]]:
    return [None] * m if x is None else list(torch.tensor_split(x, m, dim=0))


def token_shares(labels: torch.Tensor, m: int) -> list[float]:
    """Each micro-batch's share of the step's (shifted, non-ignored) target tokens."""
    counts = [int((y[:, 1:] != -100).sum()) for y in split_rows(labels, m)]
    total = sum(counts)
    return [n / total for n in counts]


class _Step:
    """One attempt of a micro-batched step; :meth:`run` -> (loss, answers, durable)."""

    def __init__(self, client, ids: torch.Tensor, mask: Optional[torch.Tensor], labels: torch.Tensor,
                 micros: int):
        self.c, self.micros = client, micros
        self.lanes = min(micros, MAX_LANES)
        self.parts = list(zip(split_rows(ids, micros), split_rows(mask, micros)))
        self.shares = token_shares(labels, micros)
        self.calls: dict = {}  # lane -> (kind, micro, PendingCall): the request in flight there
        self.results: dict = {}  # (kind, micro) -> the answer's tensors, once read
        self.sent: list = []  # (what was sent (b, T, d), the defense's extra loss) per micro-batch
        self.grads: list = []  # (b, T, d) per micro-batch, backpropagated through the bottom in order
        self.durable: Optional[int] = None

    def _meta(self, i: int) -> dict:
        c = self.c
        return P.StepMeta(c.client_id, c.step + 1, c.wire_dtype, c.federation.version, i, self.micros,
                          self.shares[i]).to_meta()

    def _send(self, kind: str, i: int, path: str, tensors: dict) -> None:
        lane = i % self.lanes
        if lane in self.calls:  # one request per lane: read the one before (more micros than lanes)
            self._read(lane)
        self.calls[lane] = (kind, i, self.c.transport.start_call(path, tensors, self._meta(i), lane=lane))

    def _read(self, lane: int) -> None:
        kind, i, call = self.calls.pop(lane)
        out, info = self.c.transport.finish_call_meta(call)
        if "durable" in info:
            self.durable = max(self.durable or 0, int(info["durable"]))
        self.results[(kind, i)] = out

    def _lane_of(self, kind: str, i: int) -> Optional[int]:
        """The lane ``(kind, i)`` went out on (``i % lanes``, as :meth:`_send` chose), if its
        request is still there."""
        entry = self.calls.get(i % self.lanes)
        return i % self.lanes if entry is not None and entry[:2] == (kind, i) else None

    def _ready(self, kind: str, i: int) -> bool:
        """True if the answer of ``(kind, i)`` can be had without waiting for the server."""
        lane = self._lane_of(kind, i)
        return lane is None or self.calls[lane][2].ready()

    def _result(self, kind: str, i: int) -> dict:
        """The answer of ``(kind, i)``, waiting for it if it is still on its way."""
        if (kind, i) not in self.results:
            self._read(self._lane_of(kind, i))
        return self.results.pop((kind, i))

    def run(self):
        try:
            return self._run()
        finally:
            for _, _, call in self.calls.values():  # an error left requests on the lanes: read them out
                try:
                    self.c.transport.finish_call_meta(call)
                except Exception:  # noqa: BLE001 - the step is redone or reported already
                    pass

    def _run(self):
        c = self.c
        for i, (x, m) in enumerate(self.parts):  # bottom(i + 1) while the server works on i
            h = c._defend(c.bottom(x, m), x)  # (b, T, d), what is sent
            self.sent.append((h, c._defense_loss))
            tensors = {**pack(P.HIDDEN, h, c.wire_dtype), **({} if m is None else {P.MASK: m.cpu()})}
            if not c.u_shape:
                tensors[P.LABELS] = labels_from_batch(x, m).cpu()
            self._send("f", i, P.TRAIN_FORWARD if c.u_shape else P.TRAIN_STEP, tensors)
        answers: dict = {}
        if not c.u_shape:
            loss = 0.0
            for i in range(self.micros):
                out = self._result("f", i)
                loss += self.shares[i] * float(out[P.LOSS])
                self._bottom_backward(c._local(unpack(out, P.GRAD)))
        else:
            try:
                loss, answers[P.HIDDEN] = self._top()
            except (StaleWeights, NotYourTurn):
                raise
            except Conflict as e:  # the server dropped the step (restart, lease timeout): redo it
                raise Redo(f"the server has no forward for it ({e.message})") from None
        answers[P.GRAD] = torch.cat(self.grads, dim=0)  # (B, T, d)
        return loss, answers, self.durable

    def _bottom_backward(self, grad: torch.Tensor) -> None:
        """The bottom's backward of the next micro-batch in order, with the server's ``grad``."""
        h, extra_loss = self.sent[len(self.grads)]
        self.c._defense_loss = extra_loss
        self.c._backward_bottom(h, grad)
        self.grads.append(grad)

    def _top(self):
        """U-shape: top(i) forward + backward while the server runs the other micro-batches'
        pieces; each bottom⁻¹ as soon as its gradient is back."""
        c = self.c
        h2s, loss = [], 0.0
        for i in range(self.micros):
            while len(self.grads) < i and self._ready("b", len(self.grads)):  # work that is here
                self._bottom_backward(c._local(unpack(self._result("b", len(self.grads)), P.GRAD)))
            h2 = c._local(unpack(self._result("f", i), P.HIDDEN))  # (b, T, d)
            h2s.append(h2)
            h2 = h2.detach().requires_grad_()
            x, m = self.parts[i]
            part = loss_from_logits(c.top(h2, m), labels_from_batch(x, m)) * self.shares[i]
            part.backward()
            loss += float(part.detach())
            self._send("b", i, P.TRAIN_BACKWARD, pack(P.GRAD, h2.grad, c.wire_dtype))
        while len(self.grads) < self.micros:
            self._bottom_backward(c._local(unpack(self._result("b", len(self.grads)), P.GRAD)))
        return loss, torch.cat(h2s, dim=0)


def pipelined_attempt(client, ids: torch.Tensor, mask: Optional[torch.Tensor], labels: torch.Tensor,
                      micros: int):
    """One attempt of a micro-batched step -> (loss, answers, durable) like the client's
    ``_attempt``; the answers are the micro-batches' concatenated, for the crash journal."""
    return _Step(client, ids, mask, labels, micros).run()
