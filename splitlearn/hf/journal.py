"""``RequestLog``: what the server saw since its last durable step, so a server crash loses nothing.

The model classes (:class:`~splitlearn.hf.remote.RemoteSegment`) train in open-ended steps
(optimizer step ``s``, pieces 0, 1, 2...; docs/PROTOCOL.md). A server started with
``--checkpoint-dir`` checkpoints every ``--checkpoint-every`` steps and says, in its answers,
which of this client's steps its last checkpoint holds (``durable``). Killed at any moment,
it restarts from that checkpoint, behind the client. The client's own state is already
right (it applied every step it finished); only the server's side of the lost steps is
missing. Those steps are exactly the requests the client sent since the durable step, so the
client keeps them, in order, and sends them again::

    step s   [forward piece 0: hidden (+mask, +labels)]  -> answer digest
             [backward piece 0: grad]                     -> answer digest
             [forward piece 1 ...] [backward piece 1 ...]
             [apply {step, pieces, lr, clip}]
    step s+1 ...                                          (the step in progress: its pieces so far)

Recovery (:meth:`RequestLog.replay`): the server says it has applied step ``k`` of this client
(``GET /v1/clients/<id>``). Every logged request of the steps after ``k`` is sent again in
order, then the request that failed is retried. The server's weights at ``k`` are those the
client trained against the first time, so every replayed answer is the first one: each is
compared with the digest kept when it first came (:func:`digest`: of its sums on a GPU, of its
bytes in host memory), and a difference
(a server restarted from another state, another tenant's step in between) raises
``Conflict`` instead of training on silently. With a float32 wire the run equals an
undisturbed one bit for bit.

What it costs: per logged step, the tensors sent (U-shape: the bottom's output and the
gradient of the trunk's output, two (B, T, d) per piece; 2-way: the bottom's output, the
labels and a scalar), kept until the server says the step is durable; at most the server's
checkpoint interval of steps. A server without a checkpoint directory cannot restart into
anything to replay into: then nothing is kept (``enabled`` False).

**On disk** (``directory``: ``RemoteConfig.journal_dir``, ``SplitClient(journal_dir=...)``, the
CLI's ``train --save DIR``), the same log survives a crash of the *client*. Every request is
appended, with its whole answer, to ``DIR/wal/<step>-<seq>.safetensors`` (0600 in a 0700
directory, fsynced, atomically renamed) before the next one goes; the client's own state (its
weights, optimizer state and step) is a client checkpoint in ``DIR`` (:mod:`splitlearn.model.checkpoint`),
rewritten when the server's durable step has moved past it, and the log keeps every step after
the server's durable one. A caller may add its own records of a step (:meth:`RequestLog.note`:
``SplitClient`` notes each batch and its RNG state), never sent. After a client crash
(``model.resume(optimizer)``, ``SplitClient.load``: :meth:`Recovery.load_journal
<splitlearn.hf.recovery.Recovery.load_journal>` reads :func:`read_log`): the server's lost
steps up to the checkpoint are replayed from the log; the steps after the checkpoint that the
server has applied are answered from the log when the client runs them again (no request; each
request must equal the logged one); the ones it lost are sent again.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from ..errors import Conflict, SegmentFileError
from ..api.fingerprint import digest as fingerprint_digest

log = logging.getLogger(__name__)


FINGERPRINT = b"F"  # the first of a 17-byte digest made of the tensors' sums (splitlearn.api.fingerprint)


def digest(tensors: dict[str, torch.Tensor]) -> bytes:
    """What names an answer in the log: for tensors on a GPU, ``FINGERPRINT`` + the digest of
    their sums made there (:mod:`splitlearn.api.fingerprint`: no copy to host memory, no hash of
    12.6 MB on one core per answer); for tensors in host memory, BLAKE2b-128 of their names,
    dtypes, shapes and bytes (:func:`bytes_digest`). :func:`matches` checks either kind."""
    if any(t.is_cuda for t in tensors.values()):
        return FINGERPRINT + fingerprint_digest(tensors)
    return bytes_digest(tensors)


def matches(tensors: dict[str, torch.Tensor], d: bytes) -> bool:
    """Is ``d`` the digest of ``tensors``, made the way ``d`` was? Both kinds are the same on
    any device: a log written on a GPU is checked on the CPU, and the other way round."""
    if len(d) == 1 + 16 and d[:1] == FINGERPRINT:
        return FINGERPRINT + fingerprint_digest(tensors) == d
    return bytes_digest(tensors) == d


def bytes_digest(tensors: dict[str, torch.Tensor]) -> bytes:
    """BLAKE2b of an answer's tensors (names, dtypes, shapes and bytes), in name order."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{list(t.shape)};".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.digest()


@dataclass
class Sent:
    """One training request as it was sent, and the digest of its answer."""

    path: str
    tensors: Optional[dict[str, torch.Tensor]]  # a tensor request's body (CPU), or None (JSON)
    meta: dict  # the tensor request's metadata, or the JSON body
    answer: Optional[bytes] = None  # digest(answer tensors); None for an apply (JSON)


LOCAL = "local"  # the path of a caller's own record of a step (never sent)


@dataclass
class Record:
    """One record of the on-disk log: a request as sent and its whole answer, or a note."""

    step: int
    sent: Sent
    answer: dict  # the answer's tensors; an apply's JSON answer; a note's tensors are sent.tensors
    file: Optional[Path] = None  # where it is on disk
    info: Optional[dict] = None  # a tensor answer's metadata (a backward's grad_norm...)


class RequestLog:
    """The training requests of this client's steps the server has not made durable (and, with
    a ``directory``, on disk with their answers: see the module docstring)."""

    def __init__(self, enabled: bool, directory=None):
        self.enabled = enabled
        self.steps: dict[int, list[Sent]] = {}  # step -> its requests in the order sent
        self.durable_step = 0  # the server's checkpoint holds this client's steps up to here
        self.replays: list[dict] = []  # one entry per recovery: {"server_step", "replayed", "steps"}
        self.directory: Optional[Path] = None
        self._seq = 0
        if directory is not None:
            self.open(directory)

    def open(self, directory) -> None:
        """Append to ``directory``'s log from now on (its later records numbered after its last)."""
        self.directory = Path(directory)
        last = [int(p.stem.split("-")[1]) for p in _wal_files(self.directory)]
        self._seq = max(last, default=0)

    def record(self, step: int, sent: Sent, answer: Optional[dict] = None, info: Optional[dict] = None) -> None:
        if self.enabled and step > self.durable_step:
            self.steps.setdefault(step, []).append(sent)
        if self.enabled and self.directory is not None:
            self._write(step, sent, answer if answer is not None else {}, info)

    def remember(self, step: int, sent: Sent) -> None:
        """Keep a request read back from disk (:func:`read_log`) for a replay; nothing is written."""
        if self.enabled and step > self.durable_step:
            self.steps.setdefault(step, []).append(sent)

    def note(self, step: int, tensors: dict[str, torch.Tensor], meta: Optional[dict] = None) -> None:
        """The caller's own record of step ``step`` (on disk only; never sent to the server)."""
        if self.enabled and self.directory is not None:
            self._write(step, Sent(LOCAL, tensors, meta or {}), {})

    def _write(self, step: int, sent: Sent, answer: dict, info: Optional[dict] = None) -> None:
        from safetensors.torch import save as st_save

        from ..model.checkpoint import open_private, private_dir

        wal = private_dir(self.directory / "wal")  # 0700: the records hold the training data
        self._seq += 1
        tensors = {f"sent.{k}": v.detach().cpu().contiguous() for k, v in (sent.tensors or {}).items()}
        json_answer = answer if sent.tensors is None else {}
        tensors.update({f"answer.{k}": v.detach().cpu().contiguous() for k, v in answer.items()
                        if isinstance(v, torch.Tensor)})
        meta = {"path": sent.path, "meta": json.dumps(sent.meta), "json": str(sent.tensors is None),
                "answer": json.dumps(json_answer, default=str), "digest": (sent.answer or b"").hex(),
                "info": json.dumps(info or {}, default=str)}
        name = f"{step:010d}-{self._seq:08d}"
        with open_private(wal / f"{name}.tmp") as f:  # 0600
            f.write(st_save(tensors, metadata=meta))
            f.flush()
            os.fsync(f.fileno())
        os.replace(wal / f"{name}.tmp", wal / f"{name}.safetensors")

    def prune(self, upto: int) -> None:
        """Drop the on-disk records of the steps up to ``upto`` (the client's checkpoint and the
        server's durable step both hold them)."""
        for path in _wal_files(self.directory):
            if int(path.stem.split("-")[0]) <= upto:
                path.unlink(missing_ok=True)

    def durable(self, step: int) -> None:
        """The server's checkpoint holds this client's steps up to ``step``: forget them."""
        if step > self.durable_step:
            self.durable_step = step
            for s in [s for s in self.steps if s <= step]:
                del self.steps[s]

    def drop(self, step: int) -> None:
        """Step ``step`` was discarded (``zero_grad`` before a step, a step redone from its
        start): nothing of it to replay; on disk its requests go, its notes stay."""
        self.steps.pop(step, None)
        from safetensors import safe_open

        for path in _wal_files(self.directory):
            if int(path.stem.split("-")[0]) == step:
                with safe_open(str(path), "pt") as f:
                    note = f.metadata().get("path") == LOCAL
                if not note:
                    path.unlink(missing_ok=True)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for reqs in self.steps.values() for r in reqs
                   for t in (r.tensors or {}).values())

    def replay(self, server_step: int, current: int, send: Callable[[Sent], Optional[dict]]) -> int:
        """Send again every logged request of the steps after ``server_step`` up to ``current``
        (the step in progress) through ``send`` (which returns the answer's tensors, or None
        for an apply); returns how many requests went out. ``Conflict`` if a step the server
        lacks is not logged, or a replayed answer differs from the first."""
        missing = [s for s in range(server_step + 1, current) if s not in self.steps]
        if missing:
            why = "" if self.enabled else "; the log is off: the server has no checkpoint directory"
            raise Conflict(f"the server holds step {server_step} of this client, which is at step {current}; "
                           f"steps {missing[0]}..{missing[-1]} are not in its request log (durable up to "
                           f"{self.durable_step}{why}), so they cannot be replayed")
        n = 0
        for s in sorted(x for x in self.steps if x > server_step):
            for r in self.steps[s]:
                answer = send(r)
                n += 1
                if r.answer is not None and not matches(answer, r.answer):
                    raise Conflict(f"the server's answer to {r.path} of step {s} differs from the one this "
                                   f"client trained on: the restarted server is not in the state it was "
                                   f"(another checkpoint, or another step in between); nothing more was "
                                   f"replayed")
        steps = sum(1 for s in self.steps if server_step < s < current)
        self.replays.append({"server_step": server_step, "replayed": n, "steps": steps})
        log.warning("the server restarted at step %d of this client (at %d): %d requests replayed",
                    server_step, current, n)
        return n


def _wal_files(directory: Optional[Path]) -> list[Path]:
    wal = Path(directory) / "wal" if directory is not None else None
    return sorted(wal.glob("*.safetensors")) if wal is not None and wal.is_dir() else []


def read_log(directory, after: int = 0) -> list[Record]:
    """The on-disk records of the steps after ``after``, in the order written (a torn last write,
    a ``.tmp``, is ignored; an unreadable record is a ``SegmentFileError`` naming it)."""
    from safetensors import SafetensorError, safe_open

    out = []
    for path in _wal_files(directory):
        step = int(path.stem.split("-")[0])
        if step <= after:
            continue
        try:
            with safe_open(str(path), "pt") as f:
                meta = f.metadata()
                tensors = {k: f.get_tensor(k) for k in f.keys()}
        except (SafetensorError, ValueError, OSError) as err:
            raise SegmentFileError(f"journal record {path} is unreadable: {err}") from None
        sent_t = {k.removeprefix("sent."): v for k, v in tensors.items() if k.startswith("sent.")}
        answer = {k.removeprefix("answer."): v for k, v in tensors.items() if k.startswith("answer.")}
        is_json = meta["json"] == "True"
        if is_json:
            answer = json.loads(meta["answer"])
        sent = Sent(meta["path"], None if is_json else sent_t, json.loads(meta["meta"]),
                    bytes.fromhex(meta["digest"]) or None)
        out.append(Record(step, sent, answer, path, json.loads(meta.get("info", "{}"))))
    return out
