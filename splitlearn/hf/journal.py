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
compared with the digest (BLAKE2b of its tensors) kept when it first came, and a difference
(a server restarted from another state, another tenant's step in between) raises
``Conflict`` instead of training on silently. With a float32 wire the run equals an
undisturbed one bit for bit.

What it costs: per logged step, the tensors sent (U-shape: the bottom's output and the
gradient of the trunk's output, two (B, T, d) per piece; 2-way: the bottom's output, the
labels and a scalar), kept until the server says the step is durable; at most the server's
checkpoint interval of steps. A server without a checkpoint directory cannot restart into
anything to replay into: then nothing is kept (``enabled`` False).
"""
from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..errors import Conflict

log = logging.getLogger(__name__)


def digest(tensors: dict[str, torch.Tensor]) -> bytes:
    """BLAKE2b of an answer's tensors (names, dtypes, shapes and bytes), in name order."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{list(t.shape)};".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.digest()


class Redo(Exception):
    """A step the server did not apply and that must be run again from the start."""


@dataclass
class Sent:
    """One training request as it was sent, and the digest of its answer."""

    path: str
    tensors: Optional[dict[str, torch.Tensor]]  # a tensor request's body (CPU), or None (JSON)
    meta: dict  # the tensor request's metadata, or the JSON body
    answer: Optional[bytes] = None  # digest(answer tensors); None for an apply (JSON)


class RequestLog:
    """The training requests of this client's steps the server has not made durable."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.steps: dict[int, list[Sent]] = {}  # step -> its requests in the order sent
        self.durable_step = 0  # the server's checkpoint holds this client's steps up to here
        self.replays: list[dict] = []  # one entry per recovery: {"server_step", "replayed"}

    def record(self, step: int, sent: Sent) -> None:
        if self.enabled and step > self.durable_step:
            self.steps.setdefault(step, []).append(sent)

    def durable(self, step: int) -> None:
        """The server's checkpoint holds this client's steps up to ``step``: forget them."""
        if step > self.durable_step:
            self.durable_step = step
            for s in [s for s in self.steps if s <= step]:
                del self.steps[s]

    def drop(self, step: int) -> None:
        """Step ``step`` was discarded (``zero_grad`` before a step): nothing of it to replay."""
        self.steps.pop(step, None)

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
                if r.answer is not None and digest(answer) != r.answer:
                    raise Conflict(f"the server's answer to {r.path} of step {s} differs from the one this "
                                   f"client trained on: the restarted server is not in the state it was "
                                   f"(another checkpoint, or another step in between); nothing more was "
                                   f"replayed")
        self.replays.append({"server_step": server_step, "replayed": n})
        log.warning("the server restarted at step %d of this client (at %d): %d requests replayed",
                    server_step, current, n)
        return n
