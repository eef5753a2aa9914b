"""``StepLease``: one U-shape step at a time on a shared segment, from forward to backward;
the segment's time shared equally between the owners that want it.

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

**Fair over time, not per request** (issue 50, item 2). An *owner* is a tenant (all its client
ids together). Each owner has a *lease clock* (:attr:`StepLease.vt`, seconds, like CFS's
virtual runtime) charged with the segment's time spent on it:

- the time it holds the lease (forward to apply);
- the time the free segment is *kept* for it: after its own release, while it may come back
  for its next step (``grace_s``: its *claim*, so another owner cannot slip a long step into
  the gap between two of its short ones), or after another's release while it is the next
  waiter (a *reservation*, until it takes it or stops asking for ``grace_s``);
- except that the first ``min(that step's hold, BACKOFF_S)`` of a reservation is charged to
  the owner that gave the lease back: the waiter's client is backing off because of that step
  (the client library waits up to 1 s between retries, no longer than it has waited), and a
  waiter late beyond that pays for its own lateness.

The free segment goes to the owner with the least lease time among those that want it now:
the one that asks, the waiting ones (refused, still asking within ``grace_s``) and the one
whose claim or reservation is live; anyone else asking gets 503. An owner that becomes active
starts at the least lease time of the active ones (:attr:`StepLease.floor`, which never goes
down), never below, so no owner banks time by staying away; its debt is capped at
``timeout_s + grace_s + BACKOFF_S`` above it, more than one step can make. So over time every active
owner gets the same lease time, whatever the length of its steps: a tenant that holds each
step just under the timeout gets one step while the others together get as much time as that
step held (attack: mallory held each step 2.6 s of a 3 s timeout; alice made 7 steps in 20 s
against 1,623 alone). With N other active owners, an owner keeps 1/(N+1) of the segment's
time, less one of its own steps and its share of the back-off (``BACKOFF_S``) per turn
(tests/test_server_lease_fair.py, benchmarks/lease_share.py).

No hogging: a lease held past ``timeout_s`` while another owner asked for it (taken over on
expiry by anyone, the owner's own other client ids included, or given back late) is a *lapse*
of its owner; only an uncontended takeover by its own tenant (a new run taking over the step
its dead one left) is none. After its k-th lapse an owner is
*demoted* for ``timeout_s * 2**k``: it is never kept for, and takes the lease only while no
other owner has held it or asked for it within ``timeout_s`` (otherwise 503). A lapse is
forgotten after 8 x its demotion without another. So a tenant that sends forwards and never
their backward holds the segment against a busy owner for ``timeout_s`` at most
1 + log2(D / timeout_s) times in D seconds, and each hold is charged to its clock as well;
an honest client whose lease lapsed once is demoted only while others are busy.

What a refused client learns: its own tenant's holder by name; of another tenant's, only that
the segment is busy (no step, no id, no time held: docs/SECURITY.md, 'Tenants see their own').
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

from ...errors import ServiceUnavailable
from ..tenants import client_of, tenant_of

MAX_LAPSES = 16  # the demotion stops doubling here (timeout_s * 65536)
BACKOFF_S = 1.0  # seconds: the client library's longest wait between retries (transport/busy.py)


def owner_of(client_id: str) -> str:
    """Who the lease is shared between: a client id's tenant (the id itself without one)."""
    return tenant_of(client_id) or client_id


@dataclass
class Holder:
    client_id: str
    step: int
    since: float  # clock of the lease's forward
    contended: bool = False  # another owner asked for the lease while this one held it


@dataclass
class Kept:
    """The free segment kept for ``owner`` (its claim after its own step, or its reservation
    as the next waiter) until ``until``; the kept time until ``paid_until`` is charged to
    ``payer`` (the owner whose step made the waiter back off) instead."""

    owner: str
    until: float
    payer: Optional[str] = None
    paid_until: float = 0.0
    claim: bool = False  # kept for its last holder's next step (not as a waiter's reservation)


class StepLease:
    def __init__(self, timeout_s: float, on_expire: Callable[[str], None] = lambda client_id: None,
                 grace_s: float = 2.0, clock: Callable[[], float] = time.monotonic):
        self.timeout_s = timeout_s  # seconds a forward may wait for its backward
        self.grace_s = grace_s  # seconds a waiter counts as waiting after its last try; a claim's length
        self.on_expire = on_expire
        self.clock = clock  # seconds, monotonic (a fake one in the policy's tests)
        self.holder: Optional[Holder] = None
        self.expired = 0  # leases taken from vanished holders
        self.waiting: dict[str, tuple[float, float]] = {}  # client -> (first refused, last asked)
        self.kept: Optional[Kept] = None  # whom the free segment is kept for
        self.vt: dict[str, float] = {}  # owner -> seconds of the segment's time charged to it
        self.floor = 0.0  # the least lease time of the active owners, never decreasing
        self.active: dict[str, float] = {}  # owner -> last time it took, gave back or asked for the lease
        self.lapses: dict[str, tuple[int, float]] = {}  # owner -> (lapses, clock of the last)
        self.used: dict[str, float] = {}  # owner -> last time it took, gave back or asked for the lease
        self.seen: dict[str, float] = {}  # client id -> last time it took or asked for the lease (contended())
        self._charged = clock()  # the clock up to which the segment's time is charged
        self._lock = threading.Lock()

    # -- the lease clocks ----------------------------------------------------------------

    def _charge(self, now: float) -> None:
        """Charge the segment's time since the last charge: to the holder, or to whom the free
        segment is kept for (its payer first)."""
        t0, self._charged = self._charged, max(self._charged, now)
        if now <= t0:
            return
        if self.holder is not None:
            o = owner_of(self.holder.client_id)
            self.vt[o] = self.vt.get(o, self.floor) + (now - t0)
            return
        k = self.kept
        if k is None:
            return
        if k.payer is not None and t0 < k.paid_until:
            cut = min(now, k.paid_until)
            self.vt[k.payer] = self.vt.get(k.payer, self.floor) + (cut - t0)
            t0 = cut
        end = min(now, k.until)
        if end > t0:
            self.vt[k.owner] = self.vt.get(k.owner, self.floor) + (end - t0)

    def _join(self, owner: str, now: float) -> None:
        """``owner`` asks, takes or gives back the lease: one that was not active starts at the
        floor (no banked time), its debt capped; its activity is noted."""
        if now - self.active.get(owner, -float("inf")) > self.grace_s and not self._holds(owner):
            cap = self.floor + self.timeout_s + self.grace_s + BACKOFF_S
            self.vt[owner] = min(max(self.vt.get(owner, self.floor), self.floor), cap)
        self.vt.setdefault(owner, self.floor)
        self.active[owner] = now

    def _holds(self, owner: str) -> bool:
        return self.holder is not None and owner_of(self.holder.client_id) == owner

    def _live(self, now: float) -> set[str]:
        """The owners that want the segment now: the holder's, the waiting ones', the kept one,
        and those active within ``grace_s``."""
        live = {o for o, t in self.active.items() if now - t <= self.grace_s}
        live |= {owner_of(c) for c in self.waiting}
        if self.holder is not None:
            live.add(owner_of(self.holder.client_id))
        if self.kept is not None and now < self.kept.until:
            live.add(self.kept.owner)
        return live

    def _raise_floor(self, now: float) -> None:
        live = [self.vt[o] for o in self._live(now) if o in self.vt]
        if live:
            self.floor = max(self.floor, min(live))

    def _next(self, now: float, asking: Optional[str] = None) -> Optional[str]:
        """The owner the free segment goes to now: the one it is reserved for, else the least
        lease time among ``asking``, the waiting owners (not demoted) and the one whose claim it
        is. Ties go to the longest waiting, then to the one asking, then to the claim's (an owner
        arriving at the floor takes a segment only kept as another's claim)."""
        k = self.kept
        if not self.waiting and (k is None or k.owner == asking or now >= k.until):
            return asking  # (the common case: nobody else wants it)
        order: dict[str, tuple] = {}
        if k is not None and now < k.until and not self.demoted_for(k.owner, now):
            if not k.claim:  # a reservation holds until its owner comes or stops asking, whatever it
                return k.owner  # is charged meanwhile (else a waiter backing off 1 s would lose it each time)
            order[k.owner] = (self.vt.get(k.owner, self.floor), 3, 0.0)
        for c, (first, _) in self.waiting.items():
            o = owner_of(c)
            key = (self.vt.get(o, self.floor), 1, first)
            if not self.demoted_for(c, now) and key < order.get(o, (float("inf"),)):
                order[o] = key
        if asking is not None:
            order[asking] = min(order.get(asking, (float("inf"),)), (self.vt.get(asking, self.floor), 2, now))
        return min(order, key=order.__getitem__) if order else None

    def _forget_stale(self, now: float) -> None:
        for cid in [c for c, (_, last) in self.waiting.items() if now - last > self.grace_s]:
            del self.waiting[cid]
        if self.kept is not None and now >= self.kept.until and now >= self.kept.paid_until:
            self.kept = None
        for owner in [o for o, t in self.used.items() if now - t > self.timeout_s]:
            del self.used[owner]
        for owner in [o for o, (k, at) in self.lapses.items() if now - at > 8 * self._demotion_s(k)]:
            del self.lapses[owner]
        forget_s = 4 * (self.timeout_s + self.grace_s + BACKOFF_S)  # longer than any debt: back at the floor
        for owner in [o for o, t in self.active.items() if now - t > forget_s and not self._holds(o)]:
            del self.active[owner]
            self.vt.pop(owner, None)

    # -- lapses ----------------------------------------------------------------------------

    def _demotion_s(self, lapses: int) -> float:
        return self.timeout_s * 2 ** min(lapses, MAX_LAPSES)

    def _lapse(self, client_id: str, now: float) -> None:
        """``client_id`` held the lease past ``timeout_s``: its owner is demoted (doubling)."""
        owner = owner_of(client_id)
        k = self.lapses.get(owner, (0, now))[0] + 1
        self.lapses[owner] = (k, now)

    def demoted_for(self, client_id: str, now: Optional[float] = None) -> float:
        """Seconds ``client_id``'s owner stays demoted (0: not demoted)."""
        now = self.clock() if now is None else now
        k, at = self.lapses.get(owner_of(client_id), (0, now))
        return max(0.0, at + self._demotion_s(k) - now) if k else 0.0

    def _others_busy(self, client_id: str, now: float) -> bool:
        owner = owner_of(client_id)
        return (any(o != owner for o in self.used)  # (entries older than timeout_s are forgotten)
                or any(owner_of(c) != owner for c in self.waiting))

    # -- the lease -------------------------------------------------------------------------

    def acquire(self, client_id: str, step: int) -> None:
        """Take the lease for ``client_id``'s ``step`` or raise 503 (another client holds it,
        or the segment goes to an owner that has had less of it)."""
        now = self.clock()
        owner = owner_of(client_id)
        with self._lock:
            self._charge(now)
            self._forget_stale(now)
            if now - self.active.get(owner, -float("inf")) > self.grace_s:
                self._raise_floor(now)  # (it joins: at the floor)
            self._join(owner, now)
            h = self.holder
            if h is not None and h.client_id != client_id:
                left = self.timeout_s - (now - h.since)
                if left > 0:
                    h.contended |= owner_of(h.client_id) != owner
                    self._wait(client_id, now)
                    raise self.busy_with(h, client_id, now, left)
                self.expired += 1
                if owner_of(h.client_id) != owner or h.contended:
                    # a lapse whoever takes it over: else a tenant's second client id, asking at
                    # once, takes its first id's expired lease and escapes the demotion (issue 50)
                    self._lapse(h.client_id, now)
                self.on_expire(h.client_id)
                self.holder = None
                self.kept = None
            demoted = self.demoted_for(client_id, now)
            if demoted > 0 and self._others_busy(client_id, now):
                self._wait(client_id, now)
                raise ServiceUnavailable(
                    f"this tenant held the segment past the lease timeout ({self.timeout_s:g}s) without "
                    f"finishing its step: it gets the segment only when other owners leave it idle, for "
                    f"{demoted:.1f}s more; retry", retry_after=min(1.0, demoted))
            if self.holder is None:
                nxt = self._next(now, None if demoted else owner)
                if nxt is not None and nxt != owner:
                    self._wait(client_id, now)
                    if self.kept is None or self.kept.owner != nxt or now >= self.kept.until:
                        self.kept = Kept(nxt, self._kept_until(nxt, now))
                    raise ServiceUnavailable("the segment is busy: it goes to the tenants that have had less "
                                             "of it first (each gets an equal share of its time); retry",
                                             retry_after=1.0)
            self.waiting.pop(client_id, None)
            self.kept = None
            self.holder = Holder(client_id, step, now)
            self.seen[client_id] = now
            self.used[owner] = now

    def _kept_until(self, owner: str, now: float) -> float:
        """Until when the free segment is kept for waiting ``owner``: until it stops asking."""
        last = max((t for c, (_, t) in self.waiting.items() if owner_of(c) == owner), default=now)
        return last + self.grace_s

    def busy_with(self, h: Holder, client_id: str, now: float, left: float) -> ServiceUnavailable:
        """The 503 for ``client_id`` while ``h`` holds the lease, as ``client_id`` may learn it: a
        client id of its own tenant by name, with its step and times (and how to take over a
        step its dead process left); of another tenant's, only that the segment is busy
        (docs/SECURITY.md: the wire never shows another tenant's ids, counters or timing)."""
        if tenant_of(h.client_id) != tenant_of(client_id):
            return ServiceUnavailable("the segment is busy with another tenant's step; retry", retry_after=1.0)
        return ServiceUnavailable(
            f"the segment is busy with step {h.step} of client {client_of(h.client_id)!r} of this tenant, "
            f"held for {now - h.since:.1f}s (at most {left:.1f}s more; a run that died mid-step holds it "
            f"until the lease timeout, {self.timeout_s:g}s; a new run with that client_id takes its step "
            f"over at once); retry", retry_after=min(1.0, left))

    def _wait(self, client_id: str, now: float) -> None:
        self.seen[client_id] = now
        first = self.waiting.get(client_id, (now, now))[0]
        self.waiting[client_id] = (first, now)
        self.used[owner_of(client_id)] = now

    def release(self, client_id: str) -> None:
        """Give the lease back (a no-op unless ``client_id`` holds it); keep the free segment
        for the owner with the least lease time that wants it (this one's claim, or a waiter)."""
        with self._lock:
            if self.holder is None or self.holder.client_id != client_id:
                return
            now = self.clock()
            self._charge(now)
            h, owner = self.holder, owner_of(client_id)
            if h.contended and now - h.since > self.timeout_s:
                self._lapse(client_id, now)  # given back late (or dropped as stale) while others asked
            self.holder = None
            self.used[owner] = now
            self.active[owner] = now
            self._forget_stale(now)
            self.kept = None if self.demoted_for(client_id, now) else Kept(owner, now + self.grace_s, claim=True)
            nxt = self._next(now)
            if nxt is not None and nxt != owner:
                self.kept = Kept(nxt, self._kept_until(nxt, now), owner,
                                 now + min(now - h.since, BACKOFF_S))

    def contended(self, client_id: str) -> bool:
        """Has another client id (of any tenant) taken or asked for the lease within
        ``timeout_s``? Then the holder should give it back at once: a client applies its step
        now instead of on its next step's first request (:mod:`.training`)."""
        with self._lock:
            now = self.clock()
            for c in [c for c, t in self.seen.items() if now - t > self.timeout_s]:
                del self.seen[c]
            return any(c != client_id for c in self.seen)

    def held_by(self) -> Optional[str]:
        with self._lock:
            return None if self.holder is None else self.holder.client_id

    def shares(self) -> dict[str, float]:
        """Each owner's lease time above the floor, seconds (the policy's tests)."""
        with self._lock:
            self._charge(self.clock())
            return {o: t - self.floor for o, t in self.vt.items()}
