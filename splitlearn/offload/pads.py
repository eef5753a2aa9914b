"""One-time pads and their unmasking factors, precomputed on the client, each used once::

    pool of layer L (capacity C rows)
    +--------+----------------------------+---------------------------------+
    | serial | R: int32 (2, in)           | U = R Wq mod pi: int32 (2, out) |   row k
    +--------+----------------------------+---------------------------------+
      take(n) hands out the n oldest rows and forgets them: a row is never handed out twice

``on_empty``: ``"compute"`` (make the rows now; counted in ``late``), ``"wait"`` (for the
refill thread), ``"raise"`` (:class:`~splitlearn.errors.ServiceUnavailable`). When pads are
made, their memory, and why offline: docs/OFFLOAD.md, 'Pads'."""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Iterable, Optional

import torch

from ..errors import ConfigError, ServiceUnavailable
from ..offloadmath.field import PRIMES, field_matmul, uniform
from ..offloadmath.layers import QuantisedLayer

log = logging.getLogger(__name__)

ON_EMPTY = ("compute", "wait", "raise")
CHUNK_ROWS = 64  # rows computed per refill step (the lock is not held while computing)


@dataclass
class Pads:
    r: torch.Tensor  # int32 (2, n, in): the pads, uniform over Z_pi
    u: torch.Tensor  # int32 (2, n, out): R Wq mod pi
    first: int  # serial number of the first row (rows are numbered in the order they were made)


def make_pads(layer: QuantisedLayer, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh pad rows for ``layer``: R int32 (2, rows, in), U int32 (2, rows, out)."""
    n_in = layer.shape[0]
    r = torch.stack([uniform((rows, n_in), p) for p in PRIMES])  # (2, rows, in)
    return r, field_matmul(r, layer.wq)


class PadPool:
    def __init__(self, layer: QuantisedLayer, capacity: int, on_empty: str = "compute"):
        if capacity < 1:
            raise ConfigError(f"a pad pool holds at least one row, got {capacity}")
        if on_empty not in ON_EMPTY:
            raise ConfigError(f"on_empty must be one of {ON_EMPTY}, got {on_empty!r}")
        self.layer, self.capacity, self.on_empty = layer, capacity, on_empty
        self._chunks: deque[list] = deque()  # [first serial, R (2, m, in), U (2, m, out)]
        self._cond = threading.Condition()
        self.level = 0  # rows ready
        self.made = 0  # rows ever made: the serial of the next one
        self.issued = 0  # rows ever handed out
        self.late = 0  # rows made on the spot because the pool was empty
        self.make_s = 0.0  # seconds spent making rows (precompute + refills + late)
        self._pending = 0  # rows being made outside the lock

    def _make(self, rows: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        with self._cond:
            first = self.made
            self.made += rows
        t0 = time.perf_counter()
        r, u = make_pads(self.layer, rows)
        with self._cond:
            self.make_s += time.perf_counter() - t0
        return first, r, u

    def refill(self, rows: Optional[int] = None) -> int:
        """Make rows until the pool holds ``capacity`` (or ``rows`` more); the rows made."""
        done = 0
        while True:
            with self._cond:
                room = self.capacity - self.level - self._pending
                want = min(CHUNK_ROWS, room if rows is None else min(room, rows - done))
                if want <= 0:
                    return done
                self._pending += want
            first, r, u = self._make(want)
            with self._cond:
                self._pending -= want
                self._chunks.append([first, r, u])
                self.level += want
                self._cond.notify_all()
            done += want

    def low(self) -> bool:
        return self.level + self._pending < self.capacity // 2

    def take(self, n: int, timeout_s: float = 60.0) -> Pads:
        """The next ``n`` rows, handed out once; an empty pool acts per ``on_empty``."""
        with self._cond:
            if self.level < n and self.on_empty == "wait":
                if not self._cond.wait_for(lambda: self.level >= n, timeout_s):
                    raise ServiceUnavailable(f"pads of {self.layer.name}: {n} rows wanted, "
                                             f"{self.level} made in {timeout_s}s")
            if self.level < n and self.on_empty == "raise":
                raise ServiceUnavailable(f"pads of {self.layer.name} exhausted: {n} rows wanted, "
                                         f"{self.level} left (never reused; refill the pool)")
            pieces, got = [], 0
            while got < n and self._chunks:
                chunk = self._chunks[0]
                m = chunk[1].shape[1]
                k = min(m, n - got)
                pieces.append((chunk[0], chunk[1][:, :k], chunk[2][:, :k]))
                if k == m:
                    self._chunks.popleft()
                else:  # the rest stays; the handed-out rows are no longer referenced by the pool
                    chunk[0], chunk[1], chunk[2] = chunk[0] + k, chunk[1][:, k:].clone(), chunk[2][:, k:].clone()
                got += k
                self.level -= k
        if got < n:  # on_empty == "compute": the missing rows, made now
            pieces.append(self._make(n - got))
            with self._cond:
                self.late += n - got
        first = pieces[0][0]
        with self._cond:
            self.issued += n
        r = pieces[0][1] if len(pieces) == 1 else torch.cat([p[1] for p in pieces], dim=1)
        u = pieces[0][2] if len(pieces) == 1 else torch.cat([p[2] for p in pieces], dim=1)
        return Pads(r, u, first)


class Refiller:
    """A daemon thread that tops up every pool that falls below half its capacity."""

    def __init__(self, pools: Iterable[PadPool], poll_s: float = 0.05):
        self.pools, self.poll_s = list(pools), poll_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="splitlearn-pads", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            low = [p for p in self.pools if p.low()]
            for pool in low:
                if self._stop.is_set():
                    return
                try:
                    pool.refill()
                except Exception:  # noqa: BLE001 - a refill failure must not kill the thread
                    log.exception("refilling the pads of %s failed", pool.layer.name)
            if not low:
                self._stop.wait(self.poll_s)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
