"""A separate "fed server" for client-side weights: the segment server never sees them.

Runs beside a ``--client-weights external`` segment server with the same model, cuts, LoRA
options and a shared secret::

    python -m splitlearn.server.http.fedapp --model tiny-demo --cut 2 --cut 4 --mode splitfed \\
        --fed-secret-file fed.secret --token-file fed-tokens.txt --port 8001

This module is the fed server's state (:class:`FedRounds`); its options (:class:`FedConfig`,
:class:`FedServe`) are :mod:`.fedoptions` (no torch: its ``--help``); its app, metrics and command are :mod:`splitlearn.server.http.fedapp`, built
from the segment server's http pieces. Takes an upload only with the segment server's ticket (:mod:`.tickets`) for the round being
collected, from the tenant it names, once per member, in its own schema (:mod:`.clientside`);
combines with the same :mod:`.strategy`. A round closes on the forwarded close record's members
all uploaded, a later round's ticket, or ``--upload-timeout``. State is in memory.
Design and trust: docs/FEDERATION.md, 'Who sees the client-side weights'; operating it and
its metrics: docs/OPERATIONS.md, 'The fed server'.
"""
from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Optional

if __name__ == "__main__":  # the command moved to its wing: this state imports no app (no loop); said
    # before torch is imported (a second, not ~8 s on 2 cores)
    sys.exit("the fed server's command is now: python -m splitlearn.server.http.fedapp ARGS")

import torch

from ...api import protocol as P
from ...errors import BadRequest, Conflict, Forbidden, NotFound
from . import tickets
from .clientside import ClientSide
from .fedoptions import FedConfig, FedServe  # noqa: F401 (re-exported: its options, plain data without torch)
from .rounds import aggregate
from .strategy import Strategy, coordinate_median

log = logging.getLogger(__name__)

Weights = dict[str, torch.Tensor]


class FedRounds:
    """The shared client-side weights and the uploads of the round (splitfed) or turn
    (sequential) being collected; thread-safe."""

    def __init__(self, cfg: FedConfig, side: ClientSide, strategy: Strategy):
        self.cfg, self.side, self.strategy = cfg, side, strategy
        self.version = 0  # equals the segment server's once a round closes here too
        self.weights: Optional[Weights] = None
        self.round: Optional[int] = None  # splitfed: the segment server's round being collected
        self.round_version = 0  # the version that round's members trained from
        self.uploads: dict[str, tuple[Weights, int]] = {}  # "<tenant>:<client>" -> (weights, samples)
        self.failed: set[str] = set()  # members whose upload was refused: out of the round (accept_failures)
        self.expected: Optional[int] = None  # members of the closed round (its close record)
        self.target: Optional[int] = None  # the version the segment server reached (a close record)
        self.target_seen = 0.0  # time.monotonic() that record first came
        self.last_round: dict = {}
        self.closed = dict.fromkeys(CLOSE_REASONS, 0)  # rounds closed here, by why (/metrics)
        self.lock = threading.Lock()

    # -- uploads and close records ----------------------------------------------------

    def upload(self, tenant: str, meta: P.SyncMeta, weights: Weights) -> dict:
        """A member's client-side weights with its ticket (see the module docstring)."""
        if meta.ticket is None:
            raise BadRequest("an upload needs the ticket the segment server answered this sync "
                             "(metadata 'ticket'); SplitClient sends it")
        t = tickets.verify(self.cfg.secret, meta.ticket, tickets.Ticket)
        if t.mode != self.cfg.mode:
            raise BadRequest(f"a {t.mode} ticket, but this fed server runs {self.cfg.mode}")
        if t.tenant != tenant:
            raise Forbidden("this ticket was given to another tenant's member: upload with your own")
        if t.client_id != meta.client_id:
            raise BadRequest(f"the ticket is client {t.client_id!r}'s, the upload says {meta.client_id!r}")
        try:
            self.side.check(weights)
        except BadRequest:
            if self.cfg.mode == "splitfed":  # a ticketed member's bad upload: its failure of the round
                with self.lock:
                    self._expire()
                    key = f"{tenant}:{t.client_id}"
                    if t.version >= self.version and self._collect(t) and key not in self.uploads:
                        self.failed.add(key)
                        self._maybe_close()
            raise
        with self.lock:
            self._expire()
            if t.version < self.version:
                raise Conflict(f"the fed server holds version {self.version}: the round or turn of this "
                               f"ticket (version {t.version}) closed without this upload")
            if self.cfg.mode == "sequential":  # the turn holder's weights, bounded, are the latest
                agg = self._aggregate([(weights, 1)])
                self.version = t.version + 1
                self.target = None if self.target is not None and self.target <= self.version else self.target
                return {**self._status(tenant), "clipped": agg.clipped[0]}
            if not self._collect(t):
                raise Conflict(f"round {t.round} is closed here; this fed server collects round {self.round}")
            key = f"{tenant}:{t.client_id}"
            if key in self.failed:
                raise Conflict(f"client {t.client_id!r}'s upload was refused in round {t.round}: it is out "
                               f"of this round")
            self.uploads.setdefault(key, (weights, t.samples))  # a retry changes nothing
            self._maybe_close()
            return self._status(tenant)

    def _collect(self, t: tickets.Ticket) -> bool:
        """Make ``t``'s round the one collected (a later round closes the current one); False
        if that round is closed here already."""
        if self.round is not None and t.round != self.round:
            if t.round < self.round:
                return False
            self._close(f"a ticket of round {t.round} came", "later_round")
        if self.round is None:
            self._open(t.round, t.version)
        return True

    def close(self, tenant: str, record: object) -> dict:
        """The segment server's signed word that a round or turn closed (any member sends it)."""
        c = tickets.verify(self.cfg.secret, record, tickets.Close)
        if c.mode != self.cfg.mode:
            raise BadRequest(f"a {c.mode} close record, but this fed server runs {self.cfg.mode}")
        with self.lock:
            self._expire()
            if c.version > self.version and (self.round is None or c.round >= self.round):
                if self.round is not None and c.round > self.round:
                    self._close(f"the segment server closed round {c.round}", "later_round")
                if self.cfg.mode == "splitfed" and self.round is None:
                    self._open(c.round, c.version - 1)
                if self.target != c.version:
                    self.target, self.target_seen = c.version, time.monotonic()
                self.expected = c.synced if self.cfg.mode == "splitfed" else None
                self._maybe_close()
            return self._status(tenant)

    def _open(self, number: int, version: int) -> None:
        self.round, self.round_version, self.uploads, self.expected = number, version, {}, None
        self.failed = set()

    def _maybe_close(self) -> None:
        if self.expected is not None and len(self.uploads) + len(self.failed) >= self.expected:
            self._close("every member's upload is here (or was refused)", "complete")

    def _expire(self) -> None:
        if self.target is not None and time.monotonic() - self.target_seen > self.cfg.upload_timeout_s:
            if self.cfg.mode == "splitfed":
                self._close(f"uploads still missing {self.cfg.upload_timeout_s:g}s after the close record", "timeout")
            else:
                log.warning("the turn holder's upload for version %d never came: keeping version %d's weights",
                            self.target - 1, self.version)
                self.version, self.target = max(self.version, self.target), None

    def _close(self, why: str, reason: str) -> None:
        self.closed[reason] += 1
        if self.uploads:
            agg = self._aggregate(list(self.uploads.values()))
            self.last_round = {"round": self.round, "members": len(self.uploads),
                               "samples": sum(n for _, n in self.uploads.values()), "clipped": sum(agg.clipped)}
            self.version = max(self.version, self.round_version + 1)
        if self.target is not None:
            self.version = max(self.version, self.target)
        log.info("round %s closed (%s): %d uploads, version %d", self.round, why, len(self.uploads), self.version)
        self.round, self.uploads, self.expected, self.target, self.failed = None, {}, None, None, set()

    def _aggregate(self, uploads: list[tuple[Weights, int]]):
        ref = self.weights if self.weights is not None else self.side.initial()
        if ref is None:
            ref = coordinate_median([w for w, _ in uploads])
        agg = aggregate(self.strategy, ref, uploads)  # the round closes as every round does (.rounds)
        self.weights = agg.weights
        self.side.forget_initial()
        log.info("update norms %s, clipped %s", [round(x, 4) for x in agg.norms], agg.clipped)
        return agg

    # -- reading ---------------------------------------------------------------------

    def latest(self) -> tuple[int, Weights]:
        with self.lock:
            if self.weights is None:
                raise NotFound("no member has uploaded its weights yet")
            return self.version, self.weights

    def status(self, tenant: str) -> dict:
        with self.lock:
            self._expire()
            return self._status(tenant)

    def _status(self, tenant: str) -> dict:
        mine = sorted(k.split(":", 1)[1] for k in self.uploads if k.split(":", 1)[0] == tenant)
        return {"mode": self.cfg.mode, "version": self.version, "round": self.round, "fed_server": True,
                "synced": mine, "synced_count": len(self.uploads), "failed_count": len(self.failed),
                "expected": self.expected,
                "upload_timeout_s": self.cfg.upload_timeout_s, "last_round": self.last_round,
                **self.strategy.describe()}


CLOSE_REASONS = ("complete", "later_round", "timeout")  # every upload in; a later round's ticket or record; --upload-timeout

