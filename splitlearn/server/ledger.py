"""``StepLedger``: the exactly-once record of every client's training steps.

Each client numbers its steps 1, 2, 3...; the ledger keeps, per client, the last step
applied and the answer it got. For a request carrying step ``s`` of client ``c``:

=====================================  ====================================================
``s`` == last applied                   a retry: :meth:`replay` gives the stored answer back,
                                        the weights are not touched
``s`` == last applied + 1               the next step: :meth:`expect_next` lets it through
anything else                           409 (:class:`~splitlearn.errors.Conflict`)
=====================================  ====================================================

An open-ended step (``micros=0``: gradient accumulation) is applied by ``POST
/v1/train/apply``; its answer (metadata ``applied=1``, no tensors) is the step's stored answer,
replayed to a retried apply (:meth:`replay_apply`), and every piece's answer is kept beside it.

A U-shape step has two requests: the forward leaves a :class:`Pending` entry (the graph
waiting for its backward), which a retried forward replays and the backward consumes.

Answers are kept as tensors + metadata (:class:`Answer`); the route layer encodes them.
The ledger goes into the checkpoint as JSON counters (:meth:`to_counters`; answers as
base64 of their safetensors bytes) so a retry of the last step after a restart is replayed, not
refused. It holds no tensors of the model and does no compute; the runtime calls it under
its lock.
"""
from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from ..errors import Conflict
from ..wire import decode, encode


APPLIED = "applied"  # metadata of an apply's answer (open-ended steps): "1"


@dataclass
class Answer:
    """What a request is answered with: tensors (on the CPU) and string metadata.

    Encoded once: a replayed answer is byte for byte the first one.
    """

    tensors: dict[str, torch.Tensor]
    meta: dict[str, str] = field(default_factory=dict)
    _bytes: Optional[bytes] = field(default=None, repr=False)

    def encode(self) -> bytes:
        if self._bytes is None:
            self._bytes = encode(self.tensors, self.meta)
        return self._bytes

    @classmethod
    def decode(cls, body: bytes) -> "Answer":
        tensors, meta = decode(body)
        return cls(tensors, meta, body)


def _b64(a: Answer) -> str:
    # encoded here, not cached: the live answer may still get its "durable" field
    return base64.b64encode(encode(a.tensors, a.meta)).decode()


@dataclass
class Pending:
    """A U-shape forward waiting for its backward."""

    step: int
    state: Any  # what the rest of the step needs (the runtime's graphs, the pieces' answers)
    since: float = 0.0  # time.monotonic() of the step's first request


@dataclass
class ClientRecord:
    step: int = 0  # last step applied
    answer: Optional[Answer] = None  # the answer to it (its last piece), replayed to retries
    pieces: dict[int, Answer] = field(default_factory=dict)  # micro-batch -> answer, when several
    forwards: dict[int, Answer] = field(default_factory=dict)  # U-shape: micro-batch -> forward answer
    pending: Optional[Pending] = None


@dataclass
class StepLedger:
    clients: dict[str, ClientRecord] = field(default_factory=dict)
    steps_applied: int = 0  # over all clients, since the first start
    durable: dict[str, int] = field(default_factory=dict)  # each client's step in the last checkpoint

    def mark_durable(self) -> None:
        """A checkpoint of the current state has been written."""
        self.durable = {c: r.step for c, r in self.clients.items()}

    def durable_step(self, client_id: str) -> int:
        return self.durable.get(client_id, 0)

    def record(self, client_id: str) -> ClientRecord:
        return self.clients.setdefault(client_id, ClientRecord())

    def last_step(self, client_id: str) -> int:
        rec = self.clients.get(client_id)
        return rec.step if rec else 0

    def replay(self, client_id: str, step: int, micro: int = 0) -> Optional[Answer]:
        """The stored answer if ``step`` was the client's last applied step (a retry), else None."""
        rec = self.clients.get(client_id)
        if rec is None or step != rec.step or rec.answer is None:
            return None
        if rec.answer.meta.get(APPLIED) == "1":  # an open-ended step: its pieces' own answers
            return rec.pieces.get(micro)
        return rec.pieces.get(micro, rec.answer) if rec.pieces else rec.answer

    def replay_apply(self, client_id: str, step: int) -> Optional[Answer]:
        """The stored answer of ``POST /v1/train/apply`` if ``step`` was the client's last
        applied step and an open-ended one (a retried apply), else None."""
        rec = self.clients.get(client_id)
        if rec is None or step != rec.step or rec.answer is None or rec.answer.meta.get(APPLIED) != "1":
            return None
        return rec.answer

    def replay_forward(self, client_id: str, step: int, micro: int = 0) -> Optional[Answer]:
        """U-shape: the forward answer of the client's last applied step, if ``step`` is it
        (a client that lost the step's answers asks for both again)."""
        rec = self.clients.get(client_id)
        if rec is not None and step == rec.step:
            return rec.forwards.get(micro)
        return None

    def expect_next(self, client_id: str, step: int) -> None:
        """Raise 409 unless ``step`` is the client's next one."""
        last = self.last_step(client_id)
        if step != last + 1:
            raise Conflict(f"step {step} for client {client_id!r} is out of order: "
                           f"the server has applied step {last}, so the next is {last + 1}")

    def pending(self, client_id: str, step: Optional[int] = None) -> Optional[Pending]:
        """The client's pending forward (of ``step``, if given)."""
        rec = self.clients.get(client_id)
        p = rec.pending if rec else None
        return p if p is not None and (step is None or p.step == step) else None

    def set_pending(self, client_id: str, pending: Optional[Pending]) -> None:
        if pending is None and client_id not in self.clients:
            return  # nothing to clear; never create a record for it
        self.record(client_id).pending = pending

    def pending_since(self) -> dict[str, float]:
        """Every pending step's client and the time.monotonic() of its first request."""
        return {c: r.pending.since for c, r in self.clients.items() if r.pending is not None}

    def known(self, client_id: str) -> bool:
        return client_id in self.clients

    def count(self, prefix: str) -> tuple[int, int]:
        """(client ids, pending steps) of the keys starting with ``prefix`` (a tenant's)."""
        mine = [r for c, r in self.clients.items() if c.startswith(prefix)]
        return len(mine), sum(1 for r in mine if r.pending is not None)

    def applied(self, client_id: str, step: int, answer: Answer, pieces: Optional[dict[int, Answer]] = None,
                forwards: Optional[dict[int, Answer]] = None) -> int:
        """Record ``step`` of ``client_id`` as applied with ``answer`` (its last piece's, or the
        apply's for an open-ended step), the answers of all its pieces if it had several (an
        open-ended step: always), and its forwards' answers; returns the total of steps applied."""
        rec = self.record(client_id)
        rec.step, rec.answer, rec.pending = step, answer, None
        keep = pieces and (len(pieces) > 1 or answer.meta.get(APPLIED) == "1")
        rec.pieces = dict(pieces) if keep else {}
        rec.forwards = dict(forwards or {})
        self.steps_applied += 1
        return self.steps_applied

    # -- checkpoint --------------------------------------------------------------------

    def to_counters(self) -> dict:
        return {"clients": {c: r.step for c, r in self.clients.items()},
                # encoded here, not cached: the live answer still gets its "durable" field
                "answers": {c: base64.b64encode(encode(r.answer.tensors, r.answer.meta)).decode()
                            for c, r in self.clients.items() if r.answer is not None},
                "pieces": {c: {str(i): _b64(a) for i, a in r.pieces.items()}
                           for c, r in self.clients.items() if r.pieces},
                "forward_answers": {c: {str(i): _b64(a) for i, a in r.forwards.items()}
                                    for c, r in self.clients.items() if r.forwards},
                "steps_applied": self.steps_applied}

    @classmethod
    def from_counters(cls, counters: dict) -> "StepLedger":
        answers = counters.get("answers", {})
        pieces, forwards = counters.get("pieces", {}), counters.get("forward_answers", {})

        def decoded(table: dict) -> dict[int, Answer]:
            return {int(i): Answer.decode(base64.b64decode(b)) for i, b in table.items()}

        clients = {c: ClientRecord(step=int(s), answer=Answer.decode(base64.b64decode(answers[c]))
                                   if c in answers else None,
                                   pieces=decoded(pieces.get(c, {})), forwards=decoded(forwards.get(c, {})))
                   for c, s in counters.get("clients", {}).items()}
        led = cls(clients, int(counters.get("steps_applied", 0)))
        led.mark_durable()  # what was loaded is what the checkpoint holds
        return led
