"""``StepLease``: one U-shape step at a time on a shared segment, from forward to backward.

A U-shape step is two requests: the forward keeps the autograd graph of the trunk, and the
backward uses it and then applies the optimizer step. If another client's step changes the
weights in between, the first client's backward either fails ("modified by an inplace
operation") or, worse, mixes two versions of the weights. So a client's forward takes the
segment's lease, and its backward (applied or refused) gives it back::

    A: forward ──lease(A)───────────── backward ──release──┐
    B:         forward → 503 busy, retry ... ... ... ...    └→ forward ──lease(B)── ...

Why a lease rather than per-client gradient accumulation: every step stays the exact
sequential SGD/AdamW step of the unsplit model on that client's batch, and a forward and its
backward see the same weights. The cost is that U-shape steps of different clients do not
overlap on the server (2-way steps are one request each and never need the lease).

A request that finds the lease held by another client is answered at once with 503 and a
``Retry-After`` (never by parking a server thread: with as many waiting clients as server
threads, the holder's backward could not get in). The client library waits and retries.
A holder that vanishes blocks nobody for longer than ``timeout_s``: the next forward of any
client takes the expired lease, ``on_expire(client_id)`` drops the vanished client's pending
forward, and that client's late backward gets 409 and redoes its forward.

No monopoly: a client that was refused because another held the lease is *waiting*; when the
holder gives the lease back, it is reserved for the longest-waiting client for ``grace_s``
(longer than the client library's longest back-off between retries, 1 s), so the holder's
next step waits (503) until the waiter has had its step. Waiters that stop asking are
forgotten after ``grace_s``; a reservation nobody claims lapses after ``grace_s``. So clients
alternate step for step instead of the fastest one keeping the segment.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

from ..errors import ServiceUnavailable


@dataclass
class Holder:
    client_id: str
    step: int
    since: float  # time.monotonic() of the lease's forward


class StepLease:
    def __init__(self, timeout_s: float, on_expire: Callable[[str], None] = lambda client_id: None,
                 grace_s: float = 2.0):
        self.timeout_s = timeout_s  # seconds a forward may wait for its backward
        self.grace_s = grace_s  # seconds a released lease stays reserved for the longest waiter
        self.on_expire = on_expire
        self.holder: Optional[Holder] = None
        self.expired = 0  # leases taken from vanished holders
        self.waiting: dict[str, tuple[float, float]] = {}  # client -> (first refused, last asked)
        self.reserved: Optional[tuple[str, float]] = None  # (client, until) after a release
        self._lock = threading.Lock()

    def _forget_stale(self, now: float) -> None:
        for cid in [c for c, (_, last) in self.waiting.items() if now - last > self.grace_s]:
            del self.waiting[cid]
        if self.reserved is not None and now > self.reserved[1]:
            self.reserved = None

    def acquire(self, client_id: str, step: int) -> None:
        """Take the lease for ``client_id``'s ``step`` or raise 503 (another client holds
        it, or it is reserved for a client that has been waiting)."""
        now = time.monotonic()
        with self._lock:
            self._forget_stale(now)
            h = self.holder
            if h is not None and h.client_id != client_id:
                left = self.timeout_s - (now - h.since)
                if left > 0:
                    self._wait(client_id, now)
                    raise ServiceUnavailable(
                        f"the segment is busy with another client's step (at most {left:.1f}s "
                        f"more); retry", retry_after=min(1.0, left))
                self.expired += 1
                self.on_expire(h.client_id)
            elif h is None and self.reserved is not None and self.reserved[0] != client_id:
                self._wait(client_id, now)
                raise ServiceUnavailable("the segment is reserved for a client that has waited "
                                         "longer; retry", retry_after=min(1.0, self.reserved[1] - now))
            self.waiting.pop(client_id, None)
            self.reserved = None
            self.holder = Holder(client_id, step, now)

    def _wait(self, client_id: str, now: float) -> None:
        first = self.waiting.get(client_id, (now, now))[0]
        self.waiting[client_id] = (first, now)

    def release(self, client_id: str) -> None:
        """Give the lease back (a no-op unless ``client_id`` holds it); reserve it for the
        longest-waiting other client, if any."""
        with self._lock:
            if self.holder is not None and self.holder.client_id == client_id:
                self.holder = None
                now = time.monotonic()
                self._forget_stale(now)
                others = [(first, c) for c, (first, _) in self.waiting.items() if c != client_id]
                if others:
                    self.reserved = (min(others)[1], now + self.grace_s)

    def held_by(self) -> Optional[str]:
        with self._lock:
            return None if self.holder is None else self.holder.client_id
