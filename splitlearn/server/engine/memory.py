"""``MemoryAccount``: what the server holds for its tenants, reserved before it is allocated.

The per-request budget (:mod:`.budget`) bounds what *one* request computes (413 beyond). What
outlives a request, or waits beside the one computing, is counted here, per tenant and in
total, against two limits::

    held by                         reserved                          released
    a request                       its body, when announced (the     when its answer is built (a
                                    door, before a byte of it is      body refused or cut off: then)
                                    allocated); its price
                                    (:meth:`.Budget.check`), before
                                    computing
    a waiting graph (training)      its own size (:func:`.budget.      at its backward (then its
                                    graph_bytes`), before the forward  answers' bytes until the apply),
                                                                       the step's abort or drop
    a stored answer (ledger)        its encoded bytes, at the apply    at the client's next step, or
                                    (*evictable*: dropped to a digest  evicted: see below
                                    when room is needed)
    a generation session            its KV cache's bytes, grown at     at close or expiry
                                    each step before the forward

A reservation past the tenant's share is 429, past the server's total 503, both with
Retry-After and nothing allocated or changed. Stored answers never stand in the way: when a
reservation does not fit, the oldest stored answers (the tenant's own first) are evicted (the
ledger keeps their digests; a retry of such a piece gets a clear 409). A request's compute
price counts in the total only, not in its tenant's share: the compute thread runs one
request at a time, so a tenant's share bounds what it *holds* (bodies waiting, graphs,
answers, caches) beside what it computes.

Defaults (``ServerConfig.max_memory_bytes``, ``max_tenant_memory_bytes``): with the derived
per-request limit on the CPU (half of the memory free at start less the training state), the
total is ``HOST_SHARE`` (0.75) of that rest, the host keeping the other quarter; with
``--max-request-memory-gb`` given, twice it; on a GPU the derived limit is the whole rest and
the total the same bytes (:mod:`.budget`). A tenant's share is the total on a one-tenant
server, else the per-request limit (2/3 of the derived total: less would refuse with 429 a
step the budget admits). A generation session is reserved at ``budget.SESSION_SLACK`` times
its cache (what its RSS was measured to grow by). The fed and offload servers hold bodies
only: their total is ``HOST_SHARE`` of the memory free at start, a tenant's half of it with
several tenants (:func:`body_limits`). docs/OPERATIONS.md, 'Memory defaults'.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

from ...errors import ServiceUnavailable, TooManyRequests

GiB = 1 << 30
TOTAL_FLAG, TENANT_FLAG = "--max-memory-gb", "--max-tenant-memory-gb"
# The default total: this fraction of the memory left at start (less the training state on a
# segment server's CPU); the rest is the host's headroom (docs/OPERATIONS.md, 'Memory defaults')
HOST_SHARE = 0.75


@dataclass(eq=False)
class Hold:
    """Bytes reserved for ``tenant`` (``""``: no tenant) until :meth:`release`."""

    account: "MemoryAccount" = field(repr=False)
    tenant: str
    nbytes: int
    what: str
    shared: bool = True  # counts in the tenant's share (False: the total only)
    evict: Optional[Callable[[], None]] = field(default=None, repr=False)  # evictable: drops what it holds
    released: bool = False

    def release(self) -> None:
        self.account.release(self)

    def resize(self, nbytes: int) -> None:
        """To ``nbytes``: growing reserves the difference first (429/503), shrinking never fails."""
        self.account.resize(self, nbytes)


class MemoryAccount:
    """The server's reservations; thread-safe (any thread may reserve and release)."""

    def __init__(self, limit: int, tenant_limit: int, source: str = TOTAL_FLAG):
        self.limit = limit  # bytes the server may hold for requests, graphs, answers and caches
        self.tenant_limit = min(tenant_limit, limit)  # bytes one tenant may hold (shared holds)
        self.source = source
        self.reserved = 0  # bytes reserved now, in total
        self.tenants: dict[str, int] = {}  # tenant -> bytes of its shared holds
        self.evictions = 0  # stored answers dropped to make room
        self.refusals = 0  # reservations refused (429/503)
        self._evictable: "OrderedDict[Hold, None]" = OrderedDict()  # oldest first
        self._lock = threading.RLock()

    # -- reserving ------------------------------------------------------------------------

    def reserve(self, tenant: str, nbytes: int, what: str, shared: bool = True,
                evict: Optional[Callable[[], None]] = None, force: bool = False) -> Hold:
        """Reserve ``nbytes`` for ``tenant`` (429 past its share, 503 past the total).
        ``evict``: the hold is a stored answer, dropped (the callback, then released) when a
        later reservation needs the room. ``force``: what is made already and cannot be
        refused (a step's answer digests, made as its answers' larger holds go): stored answers
        are evicted for it as for any other, and it is counted even if it does not fit, so
        later reservations are refused until it is released."""
        nbytes = max(0, int(nbytes))
        with self._lock:
            try:
                self._make_room(tenant, nbytes, shared, what)
            except (TooManyRequests, ServiceUnavailable):
                if not force:
                    raise
                self.refusals -= 1  # counted, not refused
            hold = Hold(self, tenant, nbytes, what, shared, evict)
            self._add(hold, nbytes)
            if evict is not None:
                self._evictable[hold] = None
            return hold

    def resize(self, hold: Hold, nbytes: int) -> None:
        nbytes = max(0, int(nbytes))
        with self._lock:
            if hold.released:
                return
            grow = nbytes - hold.nbytes
            if grow > 0:
                self._make_room(hold.tenant, grow, hold.shared, hold.what, keep=hold)
            self._add(hold, grow)
            hold.nbytes = nbytes

    def release(self, hold: Optional[Hold]) -> None:
        if hold is None:
            return
        with self._lock:
            if hold.released:
                return
            self._add(hold, -hold.nbytes)
            hold.nbytes, hold.released = 0, True
            self._evictable.pop(hold, None)

    def _add(self, hold: Hold, delta: int) -> None:
        self.reserved += delta
        if hold.shared:
            left = self.tenants.get(hold.tenant, 0) + delta
            if left > 0:
                self.tenants[hold.tenant] = left
            else:
                self.tenants.pop(hold.tenant, None)

    def _fits(self, tenant: str, nbytes: int, shared: bool) -> tuple[bool, bool]:
        """(fits the tenant's share, fits the total)."""
        mine = self.tenants.get(tenant, 0) + nbytes
        return (not shared or mine <= self.tenant_limit), self.reserved + nbytes <= self.limit

    def _make_room(self, tenant: str, nbytes: int, shared: bool, what: str, keep: Optional[Hold] = None) -> None:
        """Evict stored answers (the tenant's own first, oldest first) until ``nbytes`` fit;
        429/503 if they cannot."""
        ok_tenant, ok_total = self._fits(tenant, nbytes, shared)
        for own in (True, False):  # the tenant's own answers, then (for the total) anyone's
            for hold in list(self._evictable):
                if (ok_tenant and ok_total) or (not own and not ok_tenant):
                    break  # done, or only the tenant's own holds would help
                if hold is not keep and (hold.tenant == tenant) == own:
                    self._evict(hold)
                    ok_tenant, ok_total = self._fits(tenant, nbytes, shared)
        if ok_tenant and ok_total:
            return
        self.refusals += 1
        if not ok_tenant:
            raise TooManyRequests(
                f"{what} needs {_gib(nbytes)} of server memory; this tenant holds {_gib(self.tenants.get(tenant, 0))} "
                f"(waiting graphs, answers kept until an apply, generation caches, request bodies) of "
                f"its share of {_gib(self.tenant_limit)} ({TENANT_FLAG}): finish or discard steps in "
                f"flight, close sessions, or send smaller pieces", retry_after=1.0)
        raise ServiceUnavailable(
            f"{what} needs {_gib(nbytes)} of server memory; the server holds {_gib(self.reserved)} of "
            f"its {_gib(self.limit)} ({self.source}) for its tenants: try again later", retry_after=1.0)

    def _evict(self, hold: Hold) -> None:
        try:
            if hold.evict is not None:
                hold.evict()
        finally:
            self.evictions += 1
            self.release(hold)

    def by_tenant(self) -> dict[str, int]:
        """Bytes each tenant's shared holds reserve now (``/metrics``)."""
        with self._lock:
            return dict(self.tenants)

    def to_dict(self, tenant: Optional[str] = None) -> dict:
        with self._lock:
            out = {"reserved_bytes": self.reserved, "limit_bytes": self.limit,
                   "tenant_limit_bytes": self.tenant_limit, "source": self.source,
                   "evictions": self.evictions, "refusals": self.refusals}
            if tenant is not None:
                out["tenant_reserved_bytes"] = self.tenants.get(tenant, 0)
            return out


class Request:
    """The holds of one request being served; :func:`charge` adds its compute price."""

    def __init__(self, account: Optional[MemoryAccount], tenant: str):
        self.account, self.tenant, self.holds = account, tenant, []

    def hold(self, nbytes: int, what: str, shared: bool = True, adopt: Optional[Hold] = None) -> None:
        """Reserve ``nbytes`` until :meth:`close`. ``adopt``: the hold a door made for the body as
        it arrived (frontdoor.py, unixdoor.py), grown to ``nbytes`` (only the difference is
        reserved) and released with this request's holds."""
        if self.account is None:
            return
        if adopt is not None and adopt.account is self.account and not adopt.released:
            if nbytes > adopt.nbytes:
                adopt.resize(nbytes)
            self.holds.append(adopt)
        elif nbytes > 0:
            self.holds.append(self.account.reserve(self.tenant, nbytes, what, shared))

    @contextmanager
    def on_this_thread(self) -> Iterator[None]:
        """Within: :func:`charge` on this thread charges this request."""
        before = getattr(_current, "request", None)
        _current.request = self
        try:
            yield
        finally:
            _current.request = before

    def close(self) -> None:
        for h in self.holds:
            self.account.release(h)
        self.holds.clear()


@contextmanager
def scope(account: Optional[MemoryAccount], tenant: str) -> Iterator[Request]:
    """:meth:`MemoryAccount.request`, or a request that reserves nothing (``account`` None)."""
    req = Request(account, tenant)
    try:
        yield req
    finally:
        req.close()


_current = threading.local()


def charge(nbytes: int, what: str) -> None:
    """Reserve a request's compute price (:meth:`.Budget.check`) for the request being served
    on this thread, until its answer is built; a no-op outside a request (503 if it does not fit)."""
    req = getattr(_current, "request", None)
    if req is not None:
        req.hold(nbytes, what, shared=False)


def default_limits(request_limit: int, tenants: int, total: Optional[int] = None,
                   per_tenant: Optional[int] = None) -> tuple[int, int]:
    """(total, per tenant) in bytes: as configured, else the module docstring's defaults."""
    total = total if total is not None else 2 * request_limit
    if per_tenant is None:
        per_tenant = total if tenants <= 1 else min(total, request_limit)
    return total, per_tenant


def body_limits(available: int, tenants: int, total: Optional[int] = None,
                per_tenant: Optional[int] = None) -> tuple[int, int]:
    """(total, per tenant) in bytes of a server that holds request bodies only (the fed and
    offload servers): as configured, else ``HOST_SHARE`` of ``available`` (the memory left at
    start), and with several tenants half of that a tenant."""
    total = total if total is not None else max(1, int(HOST_SHARE * available))
    if per_tenant is None:
        per_tenant = total if tenants <= 1 else total // 2
    return total, per_tenant


def _gib(n: int) -> str:
    return f"{n / GiB:.3f} GiB"
