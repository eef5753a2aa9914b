"""``StepLedger``: the exactly-once record of every client's training steps.

Each client numbers its steps 1, 2, 3...; the ledger keeps, per client, the last step
applied and the answer it got. For a request carrying step ``s`` of client ``c``:

=====================================  ====================================================
``s`` == last applied                   a retry: :meth:`replay` gives the stored answer back,
                                        the weights are not touched
``s`` == last applied + 1               the next step: :meth:`expect_next` lets it through
anything else                           409 (:class:`~splitlearn.errors.Conflict`)
=====================================  ====================================================

A step (gradient accumulation, its pieces in flight as a :class:`Pending` entry) is applied
by ``POST /v1/train/apply``; its answer (metadata ``applied=1``, no tensors) is the step's
stored answer, replayed to a retried apply (:meth:`replay_apply`). Its pieces' answers are not
kept after the apply (a client applies only once it holds every piece's answer; up to 4096
pieces a step): only their digests, and a retried piece of the applied step gets 409 naming
its digest, never a second application.

The apply's answer is kept as its encoded bytes (:class:`Kept`), reserved in the server's
:class:`~.memory.MemoryAccount` as *evictable*: when a reservation needs the room it is
dropped to a digest (BLAKE2b-128 of the bytes), and a retry gets 409 naming it. The ledger
goes into the checkpoint as JSON counters (:meth:`to_counters`; the kept answers as base64 of
their bytes, at most ``CHECKPOINT_ANSWER_BYTES`` per client, the others as digests) so a retry
of the last apply after a restart is replayed, not refused. It holds no tensors of the model
and does no compute; the runtime calls it under its lock.
"""
from __future__ import annotations

import base64
import hashlib
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from ...errors import Conflict, SplitLearnError
from ...api.fingerprint import digests as fingerprint_digests
from ...api.wire import Encoded, decode, encode
from ..tenants import client_of, tenant_of


APPLIED = "applied"  # metadata of an apply's answer: "1"
CHECKPOINT_ANSWER_BYTES = 1 << 20  # encoded answer bytes of one client in a checkpoint's state.json (the rest: digests)
# bytes one kept digest of a piece's answer costs in memory, reserved for its tenant while kept: a
# Kept, its __dict__, the 16-byte digest and its dict slot measured 211 B (tracemalloc, CPython
# 3.12; tests/test_server_ledger_digests.py), rounded up. Up to 2 x 4096 a client.
DIGEST_BYTES = 256


@dataclass
class Answer:
    """What a request is answered with: tensors (on the server's device) and string metadata.

    Encoded once: a replayed answer is byte for byte the first one.
    """

    tensors: dict[str, torch.Tensor]
    meta: dict[str, str] = field(default_factory=dict)
    _bytes: Optional[bytes] = field(default=None, repr=False)

    def encode(self) -> bytes:
        if self._bytes is None:
            self._bytes = encode(self.tensors, self.meta)
        return self._bytes

    def encoded(self, keep_device: bool = False):
        """Its bytes if made already, else an :class:`~splitlearn.api.wire.Encoded` of the same
        bytes, to be written where it goes (the unix door's shared memory; ``keep_device``: its
        CUDA tensors left on the device, for a device region)."""
        return self._bytes if self._bytes is not None else Encoded(self.tensors, self.meta, keep_device)

    def host_body(self):
        """Its bytes for a socket: CUDA tensors copied once, device to pinned host memory, into
        the body's own buffer (a ``memoryview``; not kept: a retry encodes the same bytes again);
        host tensors as :meth:`encode`."""
        if self._bytes is not None or not any(t.is_cuda for t in self.tensors.values()):
            return self.encode()
        return Encoded(self.tensors, self.meta, keep_device=True).host_body()

    @classmethod
    def decode(cls, body: bytes) -> "Answer":
        tensors, meta = decode(body)
        return cls(tensors, meta, body)


def answer_bytes(a: Answer) -> int:
    """What an answer holds: its tensors and, once encoded, its bytes."""
    return sum(t.numel() * t.element_size() for t in a.tensors.values()) + len(a._bytes or b"")


def digest_of(body: bytes) -> bytes:
    return hashlib.blake2b(body, digest_size=16).digest()


def answer_digests(answers: list[Answer]) -> list[bytes]:
    """What names each answer once its bytes are dropped (a retry's 409, the checkpoint).
    An answer in host memory (encoded already, or its tensors on the CPU): BLAKE2b-128 of its
    encoded bytes (:func:`digest_of`). An answer whose tensors are on a GPU is digested there
    (:func:`splitlearn.api.fingerprint.digests`: BLAKE2b-128 of its names, dtypes, shapes, metadata
    and each tensor's sums, read back in one copy of 24 bytes a tensor). Encoding it would copy
    each tensor to host memory and hash it on the CPU (~40 ms a step of GPT-2 small's shape on
    an H100 host, two 12.6 MB answers): the cost issue 42 removed (docs/PERFORMANCE.md)."""
    out: list = [None] * len(answers)
    on_device = []
    for i, a in enumerate(answers):
        if a._bytes is not None or not any(t.is_cuda for t in a.tensors.values()):
            out[i] = digest_of(a._bytes or encode(a.tensors, a.meta))
        else:
            on_device.append(i)
    for i, d in zip(on_device, fingerprint_digests([(answers[i].tensors, answers[i].meta) for i in on_device])):
        out[i] = d
    return out


@dataclass(eq=False)
class Kept:
    """A stored answer of an applied step: its encoded bytes while the server keeps them (a
    hold in the memory account), else only their digest."""

    body: Optional[bytes]
    digest: Optional[bytes] = None
    hold: Any = None  # the memory account's Hold of ``body``

    def evict(self) -> None:
        """Drop the bytes, keep their digest (the memory account calls it, on any thread)."""
        body = self.body
        if body is not None:
            self.digest = self.digest or digest_of(body)
            self.body = None

    def answer(self, what: str) -> Answer:
        """The stored answer; 409 if only its digest is left."""
        body = self.body  # read once: another thread may evict it
        if body is None:
            raise Conflict(f"{what} was applied; its answer is no longer held by the server (digest "
                           f"blake2b-128 {(self.digest or b'').hex()}): nothing was applied "
                           f"again")
        return Answer.decode(body)

    def digest_hex(self) -> str:
        body = self.body
        return (self.digest or digest_of(body)).hex() if body is not None or self.digest else ""


@dataclass
class Pending:
    """A step whose pieces are arriving (graphs waiting for their backward, answers)."""

    step: int
    state: Any  # what the rest of the step needs (the runtime's graphs, the pieces' answers)
    since: float = 0.0  # time.monotonic() of the step's first request
    run: Optional[str] = None  # the client process's run that opened it (StepMeta.run)


@dataclass
class ClientRecord:
    step: int = 0  # last step applied
    answer: Optional[Kept] = None  # the apply's answer, replayed to retries
    pieces: dict[int, Kept] = field(default_factory=dict)  # piece -> its answer's digest
    forwards: dict[int, Kept] = field(default_factory=dict)  # piece -> its forward answer's digest
    pending: Optional[Pending] = None
    live: Optional[tuple] = field(default=None, repr=False)  # (answer, pieces, forwards) until sealed
    digests_hold: Any = field(default=None, repr=False)  # the memory account's Hold of its digests

    def kept(self) -> list[Kept]:
        return [k for k in (self.answer, *self.pieces.values(), *self.forwards.values()) if k is not None]


def _sealed(rec: ClientRecord, final: bool) -> tuple[Kept, dict[int, Kept], dict[int, Kept]]:
    """A just-applied record's answers as kept: the apply's as bytes, the pieces' as digests.
    ``final=False`` (a checkpoint inside the apply) leaves the live answers unencoded:
    the last one still gets its "durable" field."""
    answer, pieces, forwards = rec.live

    body = answer.encode() if final else (answer._bytes or encode(answer.tensors, answer.meta))
    named = [*pieces.items(), *forwards.items()]
    digests = iter(answer_digests([a for _, a in named]))
    return (Kept(body), {i: Kept(None, next(digests)) for i, _ in pieces.items()},
            {i: Kept(None, next(digests)) for i, _ in forwards.items()})


@dataclass
class StepLedger:
    clients: dict[str, ClientRecord] = field(default_factory=dict)
    steps_applied: int = 0  # over all clients, since the first start
    durable: dict[str, int] = field(default_factory=dict)  # each client's step in the last checkpoint
    account: Any = field(default=None, repr=False)  # the server's MemoryAccount (None: nothing reserved)

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
        kept = rec.pieces.get(micro)  # its pieces' own answers: digests only (409), or not a piece of it
        return None if kept is None else kept.answer(f"piece {micro} of step {step}")

    def replay_apply(self, client_id: str, step: int) -> Optional[Answer]:
        """The stored answer of ``POST /v1/train/apply`` if ``step`` was the client's last
        applied step (a retried apply), else None."""
        rec = self.clients.get(client_id)
        if rec is None or step != rec.step or rec.answer is None:
            return None
        return rec.answer.answer(f"the apply of step {step}")

    def replay_forward(self, client_id: str, step: int, micro: int = 0) -> Optional[Answer]:
        """The forward answer of the client's last applied step, if ``step`` is it: its digest (409)."""
        rec = self.clients.get(client_id)
        kept = rec.forwards.get(micro) if rec is not None and step == rec.step else None
        return None if kept is None else kept.answer(f"the forward of piece {micro} of step {step}")

    def expect_next(self, client_id: str, step: int) -> None:
        """Raise 409 unless ``step`` is the client's next one."""
        last = self.last_step(client_id)
        if step != last + 1:
            raise Conflict(f"step {step} for client {client_of(client_id)!r} is out of order: "
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
                forwards: Optional[dict[int, Answer]] = None, seal: bool = True) -> int:
        """Record ``step`` of ``client_id`` as applied with ``answer`` (the apply's), the
        digests of its pieces' and forwards' answers; returns the total of steps applied. The
        answer is kept as bytes by :meth:`seal` (``seal=False``: the caller seals once the
        answer is final; until then a checkpoint encodes it as it is)."""
        rec = self.record(client_id)
        self._release(rec)
        rec.step, rec.pending = step, None
        rec.live = (answer, dict(pieces or {}), dict(forwards or {}))
        rec.answer, rec.pieces, rec.forwards = None, {}, {}
        self.steps_applied += 1
        if seal:
            self.seal(client_id)
        return self.steps_applied

    def seal(self, client_id: str) -> None:
        """The answers of the step just applied, final now: the apply's kept as bytes
        (reserved, evictable), its pieces' as digests (their bytes are dropped)."""
        rec = self.clients.get(client_id)
        if rec is None or rec.live is None:
            return
        rec.answer, rec.pieces, rec.forwards = _sealed(rec, final=True)
        rec.live = None
        self._hold_digests(client_id, rec)
        for k in reversed(rec.kept()):  # the last answer reserved last: the last one evicted
            self._hold(client_id, k)

    def _hold(self, client_id: str, kept: Kept) -> Kept:
        """Reserve ``kept``'s bytes (evictable); with no room even after evicting: a digest."""
        if self.account is not None and kept.body is not None:
            try:
                kept.hold = self.account.reserve(tenant_of(client_id), len(kept.body),
                                                 "a stored answer", evict=kept.evict)
            except SplitLearnError:
                kept.evict()
        return kept

    def _hold_digests(self, client_id: str, rec: ClientRecord) -> None:
        """Reserve what the record's digests cost in memory (:data:`DIGEST_BYTES` each), made
        already: counted even past the tenant's share (``force``), so the tenant's next
        reservations are refused until the record's next step or its forgetting frees it."""
        n = sum(1 for k in (*rec.pieces.values(), *rec.forwards.values()) if k.body is None and k.digest is not None)
        if self.account is not None and n and rec.digests_hold is None:
            rec.digests_hold = self.account.reserve(tenant_of(client_id), n * DIGEST_BYTES,
                                                    "a step's answer digests", force=True)

    def _release(self, rec: ClientRecord) -> None:
        if self.account is not None:
            self.account.release(rec.digests_hold)
        rec.digests_hold = None
        for k in rec.kept():
            if k.hold is not None and self.account is not None:
                self.account.release(k.hold)

    def forget(self, client_id: str) -> None:
        """Drop a client's record (replicas: another replica serves it now)."""
        rec = self.clients.pop(client_id, None)
        if rec is not None:
            self._release(rec)
        self.durable.pop(client_id, None)

    def adopt(self, client_id: str, rec: ClientRecord) -> None:
        """Take a record loaded from a checkpoint, its kept answers reserved (or digests)."""
        self.forget(client_id)
        self._hold_digests(client_id, rec)
        for k in rec.kept():
            self._hold(client_id, k)
        self.clients[client_id] = rec

    # -- checkpoint --------------------------------------------------------------------

    def to_counters(self) -> dict:
        """JSON: each client's step; the apply's answer as base64 (if at most
        ``CHECKPOINT_ANSWER_BYTES``), the other answers as digests."""
        answers, digests = {}, {}
        for c, r in self.clients.items():
            answer, ps, fs = (r.answer, r.pieces, r.forwards) if r.live is None else _sealed(r, final=False)
            if answer is not None and answer.body is not None and len(answer.body) <= CHECKPOINT_ANSWER_BYTES:
                answers[c] = base64.b64encode(answer.body).decode()
                answer = None
            tables = {"answer": {0: answer} if answer is not None else {}, "pieces": ps, "forwards": fs}
            for kind, table in tables.items():
                for i, k in table.items():
                    if k.body is not None or k.digest is not None:
                        digests.setdefault(c, {}).setdefault(kind, {})[str(i)] = k.digest_hex()
        return {"clients": {c: r.step for c, r in self.clients.items()}, "answers": answers,
                "digests": digests, "steps_applied": self.steps_applied}

    @classmethod
    def from_counters(cls, counters: dict) -> "StepLedger":
        answers, digests = counters.get("answers", {}), counters.get("digests", {})

        def table(c: str, kind: str) -> dict[int, Kept]:
            return {int(i): Kept(None, bytes.fromhex(d)) for i, d in digests.get(c, {}).get(kind, {}).items()}

        def record(c: str, s) -> ClientRecord:
            answer = Kept(base64.b64decode(answers[c])) if c in answers else table(c, "answer").get(0)
            if answer is not None and answer.body is not None and Answer.decode(answer.body).meta.get(APPLIED) != "1":
                return ClientRecord(step=int(s))  # a closed step's (an older checkpoint): its number only
            return ClientRecord(step=int(s), answer=answer, pieces=table(c, "pieces"), forwards=table(c, "forwards"))

        clients = {c: record(c, s) for c, s in counters.get("clients", {}).items()}
        led = cls(clients, int(counters.get("steps_applied", 0)))
        led.mark_durable()  # what was loaded is what the checkpoint holds
        return led

    def hold_all(self) -> None:
        """Reserve every kept answer (after :meth:`from_counters`, once ``account`` is set)."""
        for c, r in self.clients.items():
            self._hold_digests(c, r)
            for k in r.kept():
                if k.hold is None:
                    self._hold(c, k)
