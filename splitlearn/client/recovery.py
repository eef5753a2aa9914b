"""``Journal``: what a client keeps so that a server crash loses nothing.

The server checkpoints every ``--checkpoint-every`` steps (and at syncs). Its answers say
which of this client's steps its last checkpoint holds (``durable``). A server killed at any
moment restarts from that checkpoint, behind its clients. To catch up, a client needs its own
state at the server's checkpoint and its inputs since::

    snapshot (client weights + optimizer + RNG at step k, the last durable step it heard of)
    entries  k+1 .. N: input ids, mask, RNG state, and the server's answers of each step

Recovery (:meth:`SplitClient.recover <splitlearn.client.core.SplitClient.recover>`): the
server says it holds step ``s`` (k <= s <= N). The client loads the snapshot, re-applies
entries k+1..s locally with the stored answers (the server's side of those steps is in its
checkpoint), and sends entries s+1..N to the server again. With a float32 wire the result is
bit-identical to a run without the crash: the same inputs meet the same weights on both
sides. When ``durable`` advances to m, the snapshot moves to m (a copy when m is the current
step, otherwise a local replay of k+1..m) and older entries are dropped.

What it costs: one copy of the client's weights and optimizer state, plus per step since
the last durable one the batch's ids and the answers (2-way: one (B, T, d) gradient; U-shape:
the trunk's output and the gradient, two (B, T, d) tensors). The number of entries is bounded
by the server's checkpoint interval (counted in all clients' steps), e.g. GPT-2 small, U-shape,
batch 8 x 128, float32: 6.3 MB per step, 630 MB at the default interval of 100. A server
without ``--checkpoint-dir`` cannot recover anything, and the journal stays empty.

With a ``journal_dir`` the journal is also kept on disk (the snapshot as a checkpoint, each
step appended to a write-ahead log), so a *client* killed at any moment resumes exactly with
``load(journal_dir)``: it returns to the server's durable step, re-applies the logged steps
the server has applied, and sends the ones it has not. If the client died after the server
applied a step but before logging it, the server is one step ahead: training on with that
step's batch gets the server's stored answer (a retry), so nothing is applied twice.
"""
from __future__ import annotations

import copy
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from ..checkpoint import open_private, private_dir
from ..errors import SegmentFileError
from ..hf.journal import Redo  # noqa: F401 (re-exported for SplitClient)

log = logging.getLogger(__name__)



@dataclass
class Entry:
    step: int
    ids: torch.Tensor  # (B, T) input ids, on the CPU
    mask: Optional[torch.Tensor]  # (B, T) or None
    rng: torch.Tensor  # torch's CPU RNG state before the step (dropout)
    answers: dict[str, torch.Tensor]  # the server's answers: "hidden" (U-shape forward), "grad"


@dataclass
class Snapshot:
    step: int
    weights: list[dict[str, torch.Tensor]]  # one state_dict per client segment
    optimizer: dict
    rng: torch.Tensor


class Journal:
    def __init__(self, enabled: bool):
        self.enabled = enabled  # False: the server keeps no checkpoints, nothing to recover to
        self.snapshot: Optional[Snapshot] = None
        self.entries: list[Entry] = []

    def start(self, take: Callable[[], Snapshot]) -> None:
        """The client's state now is what the server holds (a fresh client, or after load())."""
        if self.enabled:
            self.snapshot, self.entries = take(), []

    def record(self, entry: Entry) -> None:
        if self.enabled:
            self.entries.append(entry)

    def durable(self, step: int, current: int, take: Callable[[], Snapshot],
                roll: Callable[[Snapshot, list[Entry]], Snapshot]) -> None:
        """The server's checkpoint holds this client's steps up to ``step``."""
        if not self.enabled or self.snapshot is None or step <= self.snapshot.step:
            return
        done = [e for e in self.entries if e.step <= step]
        self.snapshot = take() if step == current else roll(self.snapshot, done)
        self.entries = [e for e in self.entries if e.step > step]

    def covers(self, step: int) -> bool:
        """Can the client return to its state after ``step``?"""
        return self.snapshot is not None and self.snapshot.step <= step


def snapshot_of(step: int, segments, optimizer: torch.optim.Optimizer) -> Snapshot:
    """A deep copy of the client's state."""
    return Snapshot(step, [{k: v.detach().clone() for k, v in s.state_dict().items()} for s in segments],
                    copy.deepcopy(optimizer.state_dict()), torch.get_rng_state())


def load_snapshot(snap: Snapshot, segments, optimizer: torch.optim.Optimizer) -> None:
    with torch.no_grad():
        for seg, weights in zip(segments, snap.weights):
            for k, v in seg.state_dict(keep_vars=True).items():
                v.copy_(weights[k])
    optimizer.load_state_dict(copy.deepcopy(snap.optimizer))
    torch.set_rng_state(snap.rng)


# -- on disk (``journal_dir``): the same journal, surviving a crash of the client -------------
#
#   DIR/client.latest, DIR/client-<gen>/   the snapshot (splitlearn.checkpoint layout)
#   DIR/wal/<step>.safetensors              one entry per step since: ids, mask, rng, answers

def write_entry(directory: Path, e: Entry) -> None:
    """Append step ``e`` to the write-ahead log (fsynced, atomically named)."""
    wal = private_dir(Path(directory) / "wal")  # 0700: the entries hold the training tokens
    tensors = {"ids": e.ids.cpu().contiguous(), "rng": e.rng.contiguous(),
               **{f"answer.{k}": v.detach().cpu().contiguous() for k, v in e.answers.items()}}
    if e.mask is not None:
        tensors["mask"] = e.mask.cpu().contiguous()
    tmp = wal / f"{e.step:010d}.tmp"
    with open_private(tmp) as f:  # 0600
        f.write(st_save(tensors))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, wal / f"{e.step:010d}.safetensors")


def read_entries(directory: Path, after: int, device: torch.device) -> list[Entry]:
    """The logged steps after ``after``, in order (a torn last write is ignored)."""
    out = []
    for path in sorted((Path(directory) / "wal").glob("*.safetensors")):
        step = int(path.stem)
        if step <= after:
            continue
        try:
            t = st_load(path.read_bytes())
        except (SafetensorError, ValueError, OSError) as err:
            raise SegmentFileError(f"journal entry {path} is unreadable: {err}") from None
        answers = {k.removeprefix("answer."): v.to(device) for k, v in t.items() if k.startswith("answer.")}
        out.append(Entry(step, t["ids"].to(device), t["mask"].to(device) if "mask" in t else None,
                         t["rng"], answers))
    return out


def prune_entries(directory: Path, upto: int) -> None:
    """Drop logged steps up to ``upto`` (the snapshot holds them now)."""
    for path in (Path(directory) / "wal").glob("*.safetensors"):
        if int(path.stem) <= upto:
            path.unlink(missing_ok=True)
