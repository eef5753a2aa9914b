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

No hogging: a lease held past ``timeout_s`` while another owner asked for it (taken over on
expiry, or given back late) is a *lapse* of its owner (the tenant: every client id of a tenant counts as one owner). After its
k-th lapse an owner is *demoted* for ``timeout_s * 2**k``: it gets no reservation, and takes
the lease only while no other owner has held it or asked for it within ``timeout_s``
(otherwise 503). A lapse is forgotten after 8 x its demotion without another. So a tenant
that sends forwards and never their backward holds the segment against a busy owner for
``timeout_s`` at most 1 + log2(D / timeout_s) times in D seconds (it used to retake it at
once, each time: another owner made 56 steps in 20 s against ~3,600 alone), and an honest
client whose lease lapsed once is demoted only while others are busy.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

from ...errors import ServiceUnavailable
from ..tenants import client_of, tenant_of

MAX_LAPSES = 16  # the demotion stops doubling here (timeout_s * 65536)


@dataclass
class Holder:
    client_id: str
    step: int
    since: float  # time.monotonic() of the lease's forward
    contended: bool = False  # another owner asked for the lease while this one held it


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
        self.lapses: dict[str, tuple[int, float]] = {}  # owner -> (lapses, time.monotonic() of the last)
        self.used: dict[str, float] = {}  # owner -> last time it took, gave back or asked for the lease
        self.seen: dict[str, float] = {}  # client id -> last time it took or asked for the lease (contended())
        self._lock = threading.Lock()

    def _forget_stale(self, now: float) -> None:
        for cid in [c for c, (_, last) in self.waiting.items() if now - last > self.grace_s]:
            del self.waiting[cid]
        if self.reserved is not None and now > self.reserved[1]:
            self.reserved = None
        for owner in [o for o, t in self.used.items() if now - t > self.timeout_s]:
            del self.used[owner]
        for owner in [o for o, (k, at) in self.lapses.items() if now - at > 8 * self._demotion_s(k)]:
            del self.lapses[owner]

    def _demotion_s(self, lapses: int) -> float:
        return self.timeout_s * 2 ** min(lapses, MAX_LAPSES)

    def _lapse(self, client_id: str, now: float) -> None:
        """``client_id`` held the lease past ``timeout_s``: its owner is demoted (doubling)."""
        owner = tenant_of(client_id) or client_id
        k = self.lapses.get(owner, (0, now))[0] + 1
        self.lapses[owner] = (k, now)

    def demoted_for(self, client_id: str, now: Optional[float] = None) -> float:
        """Seconds ``client_id``'s owner stays demoted (0: not demoted)."""
        now = time.monotonic() if now is None else now
        k, at = self.lapses.get(tenant_of(client_id) or client_id, (0, now))
        return max(0.0, at + self._demotion_s(k) - now) if k else 0.0

    def _others_busy(self, client_id: str, now: float) -> bool:
        owner = tenant_of(client_id) or client_id
        return (any(o != owner for o in self.used)  # (entries older than timeout_s are forgotten)
                or any((tenant_of(c) or c) != owner for c in self.waiting))

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
                    h.contended |= (tenant_of(h.client_id) or h.client_id) != (tenant_of(client_id) or client_id)
                    self._wait(client_id, now)
                    raise ServiceUnavailable(f"{self.busy_with(h, client_id, now)} (at most {left:.1f}s more); "
                                             f"retry", retry_after=min(1.0, left))
                self.expired += 1
                if (tenant_of(h.client_id) or h.client_id) != (tenant_of(client_id) or client_id):
                    self._lapse(h.client_id, now)
                self.on_expire(h.client_id)
            elif h is None and self.reserved is not None and self.reserved[0] != client_id:
                self._wait(client_id, now)
                raise ServiceUnavailable("the segment is reserved for a client that has waited "
                                         "longer; retry", retry_after=min(1.0, self.reserved[1] - now))
            demoted = self.demoted_for(client_id, now)
            if demoted > 0 and self._others_busy(client_id, now):
                raise ServiceUnavailable(
                    f"this tenant held the segment past the lease timeout ({self.timeout_s:g}s) without "
                    f"finishing its step: it gets the segment only when other owners leave it idle, for "
                    f"{demoted:.1f}s more; retry", retry_after=min(1.0, demoted))
            self.waiting.pop(client_id, None)
            self.reserved = None
            self.holder = Holder(client_id, step, now)
            self.seen[client_id] = now
            self.used[tenant_of(client_id) or client_id] = now

    def busy_with(self, h: Holder, client_id: str, now: float) -> str:
        """Who holds the lease and since when, as ``client_id`` may learn it: a client id of its
        own tenant by name (with how to take over a step its dead process left), another
        tenant's not at all (docs/SECURITY.md: the wire never shows another tenant's ids)."""
        held = now - h.since
        if tenant_of(h.client_id) != tenant_of(client_id):
            return f"the segment is busy with another tenant's step, held for {held:.1f}s"
        return (f"the segment is busy with step {h.step} of client {client_of(h.client_id)!r} of this tenant, "
                f"held for {held:.1f}s (a run that died mid-step holds it until the lease timeout, "
                f"{self.timeout_s:g}s; a new run with that client_id takes its step over at once)")

    def _wait(self, client_id: str, now: float) -> None:
        self.seen[client_id] = now
        first = self.waiting.get(client_id, (now, now))[0]
        self.waiting[client_id] = (first, now)
        self.used[tenant_of(client_id) or client_id] = now

    def release(self, client_id: str) -> None:
        """Give the lease back (a no-op unless ``client_id`` holds it); reserve it for the
        longest-waiting other client, if any."""
        with self._lock:
            if self.holder is not None and self.holder.client_id == client_id:
                now = time.monotonic()
                if self.holder.contended and now - self.holder.since > self.timeout_s:
                    self._lapse(client_id, now)  # given back late (or dropped as stale) while others asked
                self.holder = None
                self.used[tenant_of(client_id) or client_id] = now
                self._forget_stale(now)
                others = [(first, c) for c, (first, _) in self.waiting.items()
                          if c != client_id and not self.demoted_for(c, now)]
                if others:
                    self.reserved = (min(others)[1], now + self.grace_s)

    def contended(self, client_id: str) -> bool:
        """Has another client id (of any tenant) taken or asked for the lease within
        ``timeout_s``? Then the holder should give it back at once: a client applies its step
        now instead of on its next step's first request (:mod:`.training`)."""
        with self._lock:
            now = time.monotonic()
            for c in [c for c, t in self.seen.items() if now - t > self.timeout_s]:
                del self.seen[c]
            return any(c != client_id for c in self.seen)

    def held_by(self) -> Optional[str]:
        with self._lock:
            return None if self.holder is None else self.holder.client_id
