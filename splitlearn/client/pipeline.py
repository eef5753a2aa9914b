"""Micro-batch pipelining of a training step (GPipe, Huang et al. 2019).

``SplitClient(..., micro_batches=M)`` splits each batch into M micro-batches along the rows
and keeps requests in flight on two transport lanes, so the client and the server compute at
the same time::

    client:  bottom(0) | bottom(1) | bottom(2) | top(0) | top(1) | top(2) | bottom⁻¹ ...
    server:            | trunk(0)  | trunk(1)  | trunk(2) | trunk⁻¹(0) | trunk⁻¹(1) | ...

(2-way: the client runs bottom(i+1) while the server runs the top's forward and backward of
micro-batch i.) Gradients accumulate on both sides and each side applies one optimizer step
per step. Each micro-batch's loss is weighted by its share of the step's target tokens, so the
step equals the unpipelined one (float32, up to summation order).
"""
from __future__ import annotations

from collections import deque
from typing import Optional

import torch

from .. import protocol as P
from ..errors import Conflict, NotYourTurn, StaleWeights
from ..segments import labels_from_batch, loss_from_logits
from ..wire import pack, unpack
from .recovery import Redo

LANES = 2  # requests in flight at once


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
        self.parts = list(zip(split_rows(ids, micros), split_rows(mask, micros)))
        self.shares = token_shares(labels, micros)
        self.inflight: deque = deque()  # (micro, PendingCall), oldest first
        self.durable: Optional[int] = None

    def _meta(self, i: int) -> dict:
        c = self.c
        return P.StepMeta(c.client_id, c.step + 1, c.wire_dtype, c.federation.version, i, self.micros,
                          self.shares[i]).to_meta()

    def _finish(self, results: list) -> None:
        j, call = self.inflight.popleft()
        out, info = self.c.transport.finish_call_meta(call)
        if "durable" in info:
            self.durable = max(self.durable or 0, int(info["durable"]))
        results[j] = out

    def _send(self, i: int, path: str, tensors: dict, results: list) -> None:
        if len(self.inflight) == LANES:  # wait for the oldest before reusing its lane
            self._finish(results)
        self.inflight.append((i, self.c.transport.start_call(path, tensors, self._meta(i), lane=i % LANES)))

    def _drain(self, results: list) -> None:
        while self.inflight:
            self._finish(results)

    def run(self):
        try:
            return self._run()
        finally:
            for _, call in self.inflight:  # an error left requests on the lanes: read them out
                try:
                    self.c.transport.finish_call_meta(call)
                except Exception:  # noqa: BLE001 - the step is redone or reported already
                    pass

    def _run(self):
        c = self.c
        sent, first = [], [None] * self.micros
        for i, (x, m) in enumerate(self.parts):  # bottom(i) while the server works on i-1
            h = c._defend(c.bottom(x, m), x)  # (b, T, d), what is sent
            sent.append((h, c._defense_loss))
            tensors = {**pack(P.HIDDEN, h, c.wire_dtype), **({} if m is None else {P.MASK: m.cpu()})}
            if not c.u_shape:
                tensors[P.LABELS] = labels_from_batch(x, m).cpu()
            self._send(i, P.TRAIN_FORWARD if c.u_shape else P.TRAIN_STEP, tensors, first)
        self._drain(first)
        answers: dict = {}
        if not c.u_shape:
            grads = [c._local(unpack(out, P.GRAD)) for out in first]  # (b, T, d) each
            loss = sum(s * float(out[P.LOSS]) for s, out in zip(self.shares, first))
        else:
            try:
                loss, grads, h2 = self._top(first)
            except (StaleWeights, NotYourTurn):
                raise
            except Conflict as e:  # the server dropped the step (restart, lease timeout): redo it
                raise Redo(f"the server has no forward for it ({e.message})") from None
            answers[P.HIDDEN] = h2
        for (h, extra_loss), g in zip(sent, grads):
            c._defense_loss = extra_loss
            c._backward_bottom(h, g)
        answers[P.GRAD] = torch.cat(grads, dim=0)  # (B, T, d)
        return loss, answers, self.durable

    def _top(self, first: list):
        """U-shape: top(i) forward + backward while the server backpropagates i-1."""
        c = self.c
        h2s, second, loss = [], [None] * self.micros, 0.0
        for i, out in enumerate(first):
            h2 = c._local(unpack(out, P.HIDDEN))  # (b, T, d)
            h2s.append(h2)
            h2 = h2.detach().requires_grad_()
            x, m = self.parts[i]
            part = loss_from_logits(c.top(h2, m), labels_from_batch(x, m)) * self.shares[i]
            part.backward()
            loss += float(part.detach())
            self._send(i, P.TRAIN_BACKWARD, pack(P.GRAD, h2.grad, c.wire_dtype), second)
        self._drain(second)
        grads = [c._local(unpack(out, P.GRAD)) for out in second]  # (b, T, d) each
        return loss, grads, torch.cat(h2s, dim=0)


def pipelined_attempt(client, ids: torch.Tensor, mask: Optional[torch.Tensor], labels: torch.Tensor,
                      micros: int):
    """One attempt of a micro-batched step -> (loss, answers, durable) like the client's
    ``_attempt``; the answers are the micro-batches' concatenated, for the crash journal."""
    return _Step(client, ids, mask, labels, micros).run()
