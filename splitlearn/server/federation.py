"""Federation modes: who may train the server's segment now, on which copy, and the
client-side weights that data owners share.

=============  ==============================================================================
``shared``     (default) every client trains the one segment, concurrently or in turns; a
               U-shape step holds the :class:`~.lease.StepLease` from forward to backward.
               Client-side weights are never shared: each owner keeps its own bottom (+ top).
``sequential`` vanilla split learning (Gupta & Raskar 2018): one client at a time holds the
               *turn*, trains, and ends its turn with ``sync``, uploading its client-side
               weights; the next client downloads them before its first step. K clients
               taking turns equal one model trained on their batches in the server's order.
``splitfed``   SplitFed v1 (Thapa et al., AAAI 2022): the first ``clients_per_round``
               clients of a round each train their own copy of the server segment in
               parallel; each ends with ``sync`` (client-side weights + sample count); when
               all have synced, the copies and the client-side weights are averaged,
               weighted by samples (FedAvg), and every client continues from the average.
=============  ==============================================================================

Client-side weights are versioned: ``version`` counts the uploads (sequential) or the closed
rounds (splitfed). Training requests carry the version the client holds; a client behind
gets 409 ``stale_weights`` and the library downloads the latest and redoes its step.

Timeouts (``round_timeout_s``): a sequential turn idle that long may be taken by the next
client (the old holder's next step gets 409 ``not_your_turn``); a splitfed round whose
members have not all synced that long after its first sync closes with those that did (the
others' copies are dropped, their late sync gets 409, and they continue from the average).

Server memory per client: ``shared`` and ``sequential`` none beyond the ledger; ``splitfed``
one copy of the segment and its optimizer state per member of the current round (created at
the client's first step of the round, freed when the round closes): for GPT-2 small's trunk
of blocks 2-10, 57M parameters, that is 227 MB of parameters (+454 MB of AdamW state).
"""
from __future__ import annotations

import copy
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from ..errors import BadRequest, ConfigError, Conflict, NotFound, NotYourTurn, ServiceUnavailable, StaleWeights
from ..segments import Segment

log = logging.getLogger(__name__)

MODES = ("shared", "sequential", "splitfed")


@dataclass
class Replica:
    """A copy of the server segment that a client trains, with its optimizer."""

    segment: Segment
    optimizer: torch.optim.Optimizer


@dataclass
class Round:
    number: int = 1
    members: dict[str, Replica] = field(default_factory=dict)  # client id -> its copy
    synced: dict[str, int] = field(default_factory=dict)  # client id -> samples
    weights: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)  # client-side
    first_sync: Optional[float] = None  # time.monotonic()


def weighted_average(states: list[dict[str, torch.Tensor]], weights: list[float]) -> dict[str, torch.Tensor]:
    """FedAvg (McMahan et al. 2017, eq. 1 as used by SplitFed): sum_k n_k w_k / sum_k n_k."""
    total = float(sum(weights))
    out = {}
    for k, first in states[0].items():
        if not first.is_floating_point():  # integer/bool buffers are not averaged
            out[k] = first.clone()
            continue
        out[k] = sum(s[k].double() * (n / total) for s, n in zip(states, weights)).to(first.dtype)
    return out


class Federation:
    """State of the federation; every method is called under the runtime's lock."""

    def __init__(self, mode: str, base: Replica, make_optimizer: Callable, clients_per_round: int,
                 round_timeout_s: float):
        if mode not in MODES:
            raise BadRequest(f"unknown federation mode {mode!r}; choose one of {', '.join(MODES)}")
        self.mode = mode
        self.base = base
        self.make_optimizer = make_optimizer  # params -> optimizer (the server's rule)
        self.k = clients_per_round
        self.round_timeout_s = round_timeout_s
        self.version = 0  # of the shared client-side weights
        self.client_weights: Optional[dict[str, torch.Tensor]] = None
        self.turn: Optional[str] = None
        self.turn_seen = 0.0  # time.monotonic() of the holder's last request
        self.round = Round()
        self.lock = threading.RLock()
        self.client_weights_at = "server"  # or "external": a fed server holds them (server/fedavg.py)
        self.on_change: Callable[[], object] = lambda: None  # shared weights changed (the runtime checkpoints)

    # -- admission of a training request ----------------------------------------------

    def replica_for(self, client_id: str, version: Optional[int]) -> Replica:
        """The copy ``client_id`` trains now; raises 409/503 when it may not train now."""
        with self.lock:
            if self.mode == "shared":
                return self.base
            self._check_version(client_id, version)
            if self.mode == "sequential":
                if self.turn != client_id:
                    holder = self.turn or "nobody"
                    raise NotYourTurn(f"client {client_id!r} does not hold the turn ({holder} does): "
                                      f"take it with POST /v1/federation/turn first")
                self.turn_seen = time.monotonic()
                return self.base
            return self._member(client_id)

    def _check_version(self, client_id: str, version: Optional[int]) -> None:
        if version is None:
            raise BadRequest(f"this server runs federation mode {self.mode!r}: training requests "
                             f"must carry 'fed_version' (use SplitClient, which does)")
        if version != self.version:
            raise StaleWeights(f"client {client_id!r} holds client-side weights of version "
                               f"{version}, the latest is {self.version}: download them first")

    def _member(self, client_id: str) -> Replica:
        self._close_if_timed_out()
        r = self.round
        if client_id in r.synced:
            raise ServiceUnavailable(f"client {client_id!r} has synced in round {r.number}; it "
                                     f"waits for the round to close", retry_after=1.0)
        if client_id not in r.members:
            if len(r.members) >= self.k:
                raise ServiceUnavailable(f"round {r.number} is full ({self.k} clients); wait for "
                                         f"the next round", retry_after=1.0)
            seg = copy.deepcopy(self.base.segment)
            r.members[client_id] = Replica(seg, self.make_optimizer(seg.parameters()))
        return r.members[client_id]

    # -- turns (sequential) -------------------------------------------------------------

    def take_turn(self, client_id: str) -> dict:
        """Give ``client_id`` the turn if it is free (or idle past the timeout); else 503."""
        with self.lock:
            if self.mode != "sequential":
                raise BadRequest(f"turns exist in sequential mode only; this server runs {self.mode!r}")
            now = time.monotonic()
            if self.turn not in (None, client_id):
                idle = now - self.turn_seen
                if idle < self.round_timeout_s:
                    raise ServiceUnavailable(f"client {self.turn!r} holds the turn; retry",
                                             retry_after=min(1.0, self.round_timeout_s - idle))
                log.warning("turn of %s expired after %.0fs idle; given to %s", self.turn, idle, client_id)
            self.turn, self.turn_seen = client_id, now
            return self.status()

    # -- sync ------------------------------------------------------------------------

    def sync(self, client_id: str, weights: dict[str, torch.Tensor], samples: int) -> dict:
        """Take ``client_id``'s client-side weights at the end of its turn or round."""
        with self.lock:
            if self.mode == "shared":
                return self.status()  # nothing is shared in this mode
            if self.mode == "sequential":
                if self.turn != client_id:
                    raise NotYourTurn(f"client {client_id!r} does not hold the turn; only the holder syncs")
                self.client_weights, self.version = weights or None, self.version + 1
                self.turn = None
                self.on_change()
                return self.status()
            self._close_if_timed_out()
            r = self.round
            if client_id not in r.members:
                raise Conflict(f"client {client_id!r} is not a member of round {r.number}: it has "
                               f"not trained in it (or the round closed without its sync)")
            r.synced[client_id], r.weights[client_id] = samples, weights
            r.first_sync = r.first_sync or time.monotonic()
            if len(r.synced) >= self.k:
                self._close()
            return self.status()

    def _close_if_timed_out(self) -> None:
        r = self.round
        if r.first_sync is not None and time.monotonic() - r.first_sync > self.round_timeout_s:
            log.warning("round %d timed out: closing with %d of %d clients", r.number, len(r.synced), self.k)
            self._close()

    def _close(self) -> None:
        r = self.round
        ids = list(r.synced)
        samples = [r.synced[c] for c in ids]
        self._average_server([r.members[c] for c in ids], samples)
        uploads = [r.weights[c] for c in ids]
        self.client_weights = weighted_average(uploads, samples) if uploads[0] else None  # None: a fed server has them
        self.version += 1
        log.info("round %d closed: %d clients, %d samples", r.number, len(ids), sum(samples))
        self.round = Round(r.number + 1)
        self.on_change()

    def _average_server(self, replicas: list[Replica], samples: list[int]) -> None:
        avg = weighted_average([rep.segment.state_dict() for rep in replicas], samples)
        self.base.segment.load_state_dict(avg)

    def round_open(self) -> bool:
        """A splitfed round has members (their copies would be lost by a checkpoint now)."""
        return self.mode == "splitfed" and bool(self.round.members)

    def counters(self) -> dict:
        return {"mode": self.mode, "version": self.version, "round": self.round.number}

    def restore(self, counters: dict, client_weights: Optional[dict[str, torch.Tensor]]) -> None:
        """State from a checkpoint (a round in progress at the crash starts over)."""
        if counters and counters.get("mode") != self.mode:
            raise ConfigError(f"the checkpoint was written in federation mode {counters.get('mode')!r}, "
                             f"this server runs {self.mode!r}: start it with the same --federation")
        self.version = int(counters.get("version", 0))
        self.round = Round(int(counters.get("round", 1)))
        self.client_weights = client_weights

    def latest(self) -> tuple[int, dict[str, torch.Tensor]]:
        """The shared client-side weights and their version; 404 before the first sync."""
        with self.lock:
            if self.client_weights is None:
                raise NotFound("no client-side weights here: none synced yet, or a fed server holds them")
            return self.version, self.client_weights

    def status(self) -> dict:
        with self.lock:
            if self.mode == "splitfed":
                self._close_if_timed_out()
            r = self.round
            return {"mode": self.mode, "version": self.version, "round": r.number,
                    "clients_per_round": self.k if self.mode == "splitfed" else None,
                    "members": sorted(r.members) if self.mode == "splitfed" else [],
                    "synced": sorted(r.synced) if self.mode == "splitfed" else [],
                    "turn": self.turn, "round_timeout_s": self.round_timeout_s,
                    "client_weights": self.client_weights_at}
