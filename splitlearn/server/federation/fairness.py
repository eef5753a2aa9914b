"""Fair federation: no tenant takes every SplitFed seat, or the sequential turn for ever, while
another tenant waits.

A tenant *waits* from the first time it asks for a seat or the turn until it gets one, or until
it has not asked again for ``wait_s`` (its client retries within a second: ``Retry-After`` is at
most 1 s).
A tenant whose member synced in the round that just closed waits for the next round from the
close (its client is downloading the result). Fairness is between tenants: one tenant's client
ids share its seats and its turns, and with no other tenant waiting nothing here refuses anyone.

- **Seats** (``splitfed``): while a tenant below its share waits, another takes at most
  ``seats`` of a round's K (its share), and a free seat goes first to the tenants with no seat
  that began to wait earlier. The members' tenants of a closed round wait from the close, behind
  those refused in it: with K = 1 the rounds go round the waiting tenants.
- **Turns** (``sequential``): a tenant that held the last turn yields to a waiting tenant, and
  waiting tenants go in the order they began to wait. A turn lasts at most ``max_turn_steps``
  training steps and ``max_turn_s`` seconds while another tenant waits; then the turn passes.

Design and the attacks: docs/FEDERATION.md, 'Fair federation'.
"""
from __future__ import annotations

import logging
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable, Optional

from ...errors import NotYourTurn, ServiceUnavailable
from ..config import DEFAULT_MAX_TURN_S, DEFAULT_MAX_TURN_STEPS, DEFAULT_WAIT_S
from ..tenants import client_of, tenant_of

log = logging.getLogger(__name__)



@dataclass
class Wait:
    since: float  # clock of its first refusal (its place in the queue)
    last: float  # clock of its last refusal (or of the close it synced in)


@dataclass
class Turn:
    """The sequential turn: who holds it, since when, how many steps it trained."""

    key: str  # the holder
    started: float  # clock of the take
    seen: float  # clock of the holder's last training step or take (idle since)
    steps: int = 0  # training steps admitted in this turn
    tokens: int = 0  # target tokens trained in this turn (the holder's ticket)


@dataclass
class Fairness:
    """Who may take a seat of the round or the turn next, by tenant (every method is called
    under the federation's lock; ``now``: its clock, seconds)."""

    seats: Optional[int] = None  # seats of a round one tenant may take while another waits (None: ceil(K/2))
    max_turn_steps: int = DEFAULT_MAX_TURN_STEPS  # steps of a turn while another tenant waits
    max_turn_s: float = DEFAULT_MAX_TURN_S  # seconds of a turn while another tenant waits
    wait_s: float = DEFAULT_WAIT_S  # seconds a refused tenant still counts as waiting after its last try
    waiting: dict[str, Wait] = field(default_factory=dict)  # tenant -> its wait
    turn: Optional[Turn] = None  # sequential: the turn now
    last_tenant: Optional[str] = None  # the tenant of the last turn
    ended: Optional[tuple[str, str]] = None  # (key, why) of the last turn passed at its bound

    def share(self, k: int) -> int:
        """Seats of a round of ``k`` one tenant may take while another waits."""
        return max(1, math.ceil(k / 2) if self.seats is None else min(self.seats, k))

    # -- who waits ----------------------------------------------------------------------

    def wants(self, tenant: str, now: float) -> None:
        """``tenant`` asked for a seat or the turn (kept until it gets one or stops asking)."""
        w = self.waiting.get(tenant)
        if w is None or now - w.last > self.wait_s:
            self.waiting[tenant] = Wait(now, now)
        else:
            w.last = now

    def got(self, tenant: str) -> None:
        """``tenant`` got a seat or the turn: it waits no more."""
        self.waiting.pop(tenant, None)

    def closed(self, tenants: Iterable[str], now: float) -> None:
        """A round closed with members of ``tenants``: each waits for the next round from now."""
        for t in tenants:
            self.waiting.setdefault(t, Wait(now, now)).last = now

    def others(self, tenant: str, now: float) -> list[str]:
        """The tenants other than ``tenant`` waiting now, longest first."""
        self._forget(now)
        return sorted((t for t in self.waiting if t != tenant), key=lambda t: self.waiting[t].since)

    def _ahead(self, tenant: str, others: list[str]) -> list[str]:
        """Those of ``others`` that began to wait before ``tenant`` (all if it does not wait)."""
        mine = self.waiting.get(tenant)
        return [t for t in others if mine is None or self.waiting[t].since < mine.since]

    def _forget(self, now: float) -> None:
        for t in [t for t, w in self.waiting.items() if now - w.last > self.wait_s]:
            del self.waiting[t]

    # -- seats (splitfed) ---------------------------------------------------------------

    def seat_refusal(self, tenant: str, member_tenants: list[str], k: int, now: float) -> Optional[str]:
        """Why ``tenant`` (waiting: :meth:`wants` first) may not take a seat of a round of ``k``
        seats whose members are of ``member_tenants`` (one entry each), or None: it holds its
        share while a tenant below its share waits, or the free seats are held for tenants
        with no seat that waited longer. Never names another tenant."""
        others = self.others(tenant, now)
        if not others:
            return None
        seats, share = Counter(member_tenants), self.share(k)
        if seats[tenant] >= share and any(seats[t] < share for t in others):
            return (f"your tenant holds {seats[tenant]} of its {k} seats, its share while another tenant "
                    f"waits (--max-tenant-seats {share})")
        ahead = [t for t in self._ahead(tenant, others) if not seats[t]]
        free = k - len(member_tenants)
        if free <= len(ahead):
            return f"its last {free} seat(s) are held for {len(ahead)} tenant(s) that waited longer"
        return None

    # -- turns (sequential) -------------------------------------------------------------

    def holds(self, key: str) -> bool:
        return self.turn is not None and self.turn.key == key

    def take(self, key: str, now: float, idle_s: float) -> None:
        """Give ``key`` the turn if it is free (or idle for ``idle_s``, or past its bound while
        another tenant waits) and no other tenant goes first; else 503. Taking the turn it
        holds changes nothing (only training or syncing keeps it)."""
        tenant, t = tenant_of(key), self.turn
        if t is not None and t.key == key:
            return
        self.wants(tenant, now)
        if t is not None:
            idle, over = now - t.seen, self.turn_over(t, now)
            if idle < idle_s and over is None:
                raise ServiceUnavailable("another client holds the turn; retry", retry_after=min(1.0, idle_s - idle))
            if over is None:
                log.warning("turn of %s expired after %.0fs idle", t.key, idle)
            self.end(over)
        why = self.turn_refusal(tenant, now)
        if why:
            raise ServiceUnavailable(f"the turn is free but not yet for client {client_of(key)!r}: {why}; "
                                     f"retry in 1s", retry_after=1.0)
        self.got(tenant)
        self.turn = Turn(key, now, now)

    def step(self, key: str, now: float) -> None:
        """Admit a training step of the holder ``key``: 409 for anyone else, and for a holder
        whose turn reached its bound while another tenant waits (the turn passes)."""
        t = self.turn
        if t is None or t.key != key:
            if self.passed(key):
                raise NotYourTurn(f"client {client_of(key)!r} does not hold the turn{self.passed(key)}: "
                                  f"{self._retake()}", retry_after=1.0)
            raise NotYourTurn(f"client {client_of(key)!r} does not hold the turn: take it with "
                              f"POST /v1/federation/turn first")
        over = self.turn_over(t, now)
        if over is not None:
            self.end(over)
            raise NotYourTurn(f"the turn of client {client_of(key)!r} is over: {over}. Its applied steps "
                              f"stay; its client-side weights since its last sync are not shared. "
                              f"{self._retake()}", retry_after=1.0)
        t.seen, t.steps = now, t.steps + 1

    def end(self, why: Optional[str] = None) -> None:
        """The turn ends: synced, its sync refused, idle past the timeout, or passed at its
        bound (``why``, told to its holder's next request)."""
        t = self.turn
        if why is not None:
            log.warning("the turn of %s passes after %d steps: %s", t.key, t.steps, why)
            self.ended = (t.key, why)
        self.last_tenant, self.turn = tenant_of(t.key), None

    def turn_refusal(self, tenant: str, now: float) -> Optional[str]:
        """Why ``tenant`` may not take the free turn now, or None."""
        others = self.others(tenant, now)
        if not others:
            return None
        if tenant == self.last_tenant:
            return "your tenant held the last turn and another tenant waits for it"
        if self._ahead(tenant, others):
            return "another tenant has waited longer"
        return None

    def turn_over(self, turn: Turn, now: float) -> Optional[str]:
        """Why ``turn`` is over, or None: a bound reached while another tenant waits."""
        if not self.others(tenant_of(turn.key), now):
            return None
        if turn.steps >= self.max_turn_steps:
            return f"it trained {turn.steps} steps (--max-turn-steps {self.max_turn_steps}) and another tenant waits"
        if now - turn.started >= self.max_turn_s:
            return (f"it lasted {now - turn.started:.0f}s (--max-turn-seconds {self.max_turn_s:g}) and another "
                    f"tenant waits")
        return None

    def _retake(self) -> str:
        return (f"take the turn again with POST /v1/federation/turn, retrying every 1s: the waiting tenant's "
                f"turn comes first, at most {self.max_turn_steps} steps or {self.max_turn_s:g}s")

    def passed(self, key: str) -> str:
        """Why ``key``'s turn passed at its bound, for its next refusal (empty if it did not)."""
        return f" (its turn passed: {self.ended[1]})" if self.ended is not None and self.ended[0] == key else ""

    def describe(self, k: int, now: float) -> dict:
        """The rules and how many tenants wait, for the federation's status."""
        self._forget(now)
        return {"max_tenant_seats": self.share(k), "max_turn_steps": self.max_turn_steps,
                "max_turn_s": self.max_turn_s, "tenants_waiting": len(self.waiting)}


def fairness_of(cfg) -> Fairness:
    """The seats and turns policy of a config's :class:`~splitlearn.server.config.FederationOptions`."""
    return Fairness(cfg.max_tenant_seats, cfg.max_turn_steps, cfg.max_turn_s, cfg.fair_wait_s)
