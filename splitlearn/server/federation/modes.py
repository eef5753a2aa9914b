"""Federation modes: who may train the server's segment now, on which copy, and the
client-side weights that data owners share: ``shared`` (default; a U-shape step holds the
:class:`~.lease.StepLease`), ``sequential`` (one turn holder at a time) and ``splitfed``
(a round's members train copies, combined by :mod:`.strategy` when all synced).

Keys are opaque: the app passes ``"<tenant>:<client_id>"``; :meth:`Federation.status` shows a
viewer its own tenant's ids only. Versions count the uploads (sequential) or closed rounds
(splitfed); a training request of an older version gets 409 ``stale_weights``. Across replicas
the round is global (:mod:`.collective`); ``--client-weights external`` answers syncs with
signed tickets (:mod:`.tickets`, :mod:`.fedserver`). Between tenants, seats and turns are
shared by :mod:`.fairness`.

Design, the modes, robustness against one member, memory per client: docs/FEDERATION.md;
across replicas: docs/CLUSTER.md, 'SplitFed across replicas'.
"""
from __future__ import annotations

import copy
import logging
import threading
import time
from typing import Callable, Optional

import torch

from ...errors import BadRequest, ConfigError, Conflict, NotFound, NotYourTurn, ServiceUnavailable, StaleWeights
from . import tickets
from .clientside import ClientSide
from .collective import ReplicaGroup
from .fairness import Fairness, fairness_of
from .replicas import Replica, Replicated, Round
from .rounds import Combined, Contribution, aggregate, close_round, contribution, unflatten
from .strategy import Aggregate, Strategy, coordinate_median, make_strategy, strategy_of
from ..tenants import client_of, tenant_of

log = logging.getLogger(__name__)

MODES = ("shared", "sequential", "splitfed")


def federation_options(cfg, config, cuts) -> dict:
    """The keyword options of :class:`Federation` from a ``ServerConfig`` (the model's
    config (any family's) and cuts for the client-side schema)."""
    side = None
    if cfg.federation != "shared":
        side = ClientSide(config, cuts, model=cfg.model, segment=cfg.segment, seed=cfg.seed, lora=cfg.lora)
    return {"strategy": strategy_of(cfg), "fairness": fairness_of(cfg),
            "clientside": side, "client_weights_at": cfg.client_weights, "secret": cfg.fed_secret}


class Federation(Replicated):
    """State of the federation; every method is called under the runtime's lock."""

    def __init__(self, mode: str, base: Replica, make_optimizer: Callable, clients_per_round: int,
                 round_timeout_s: float, *, strategy: Optional[Strategy] = None,
                 clientside: Optional[ClientSide] = None, client_weights_at: str = "server",
                 secret: Optional[bytes] = None, fairness: Optional[Fairness] = None):
        if mode not in MODES:
            raise BadRequest(f"unknown federation mode {mode!r}; choose one of {', '.join(MODES)}")
        if client_weights_at == "external" and mode != "shared" and secret is None:
            raise ConfigError("--client-weights external needs --fed-secret-file: the secret this server "
                              "shares with the fed server, which signs each member's ticket")
        self.mode = mode
        self.base = base
        self.make_optimizer = make_optimizer  # params -> optimizer (the server's rule)
        self.k = clients_per_round
        self.round_timeout_s = round_timeout_s
        self.strategy = strategy or make_strategy()
        self.clientside = clientside  # schema + initial weights of the client side (None: unchecked)
        self.client_weights_at = client_weights_at  # "server", or "external": a fed server holds them
        self.secret = secret  # shared with the fed server: signs tickets and close records
        self.version = 0  # of the shared client-side weights
        self.client_weights: Optional[dict[str, torch.Tensor]] = None
        self.fair = fairness or Fairness()  # seats and the sequential turn between tenants (:mod:`.fairness`)
        self.clock: Callable[[], float] = time.monotonic  # every time here (tests: a fake clock)
        self.round = Round()
        self.last_close: Optional[str] = None  # external: the signed record of the last close
        self.last_round: dict = {}  # what the last close did (members, clipped updates, norms)
        self.lock = threading.RLock()
        self.on_change: Callable[[], object] = lambda: None  # shared weights changed (the runtime checkpoints)
        self.group: Optional[ReplicaGroup] = None  # splitfed across replicas (:mod:`.collective`)
        self.closing = False  # group: this replica froze its round for the collective close

    @property
    def external(self) -> bool:
        return self.client_weights_at == "external"

    # -- admission of a training request ----------------------------------------------

    def replica_for(self, key: str, version: Optional[int]) -> Replica:
        """The copy ``key`` trains now; raises 409/503 when it may not train now."""
        with self.lock:
            if self.mode == "shared":
                return self.base
            if self.group is not None:
                self.group.check_ready()  # (a replica joining has not agreed on the version yet)
            self._check_version(key, version)
            if self.mode == "sequential":
                self.fair.step(key, self.clock())  # 409 unless key holds the turn, within its bounds
                return self.base
            return self._member(key)

    def trained(self, key: str, tokens: int) -> None:
        """A training step was applied for ``key``, its pieces' backwards carrying ``tokens``
        target tokens (:func:`.training.target_tokens`): what its FedAvg weight counts (called
        by :mod:`splitlearn.server.engine.training` when a step is applied)."""
        with self.lock:
            if self.mode == "splitfed" and key in self.round.members:
                self.round.tokens[key] = self.round.tokens.get(key, 0) + tokens
            elif self.mode == "sequential" and self.fair.holds(key):
                self.fair.turn.tokens += tokens

    def _check_version(self, key: str, version: Optional[int]) -> None:
        if version is None:
            raise BadRequest(f"this server runs federation mode {self.mode!r}: training requests "
                             f"must carry 'fed_version' (use SplitClient, which does)")
        if version != self.version:
            raise StaleWeights(f"client {client_of(key)!r} holds client-side weights of version "
                               f"{version}, the latest is {self.version}: download them first")

    def _member(self, key: str) -> Replica:
        self._close_if_timed_out()
        r = self.round
        if key in r.synced or key in r.failed:
            raise ServiceUnavailable(f"client {client_of(key)!r} has synced in round {r.number}; it "
                                     f"waits for the round to close", retry_after=1.0)
        if key not in r.members:
            if self.group is not None:  # one round over every replica's members
                self._group_open()
                self.group.admit(r.number, self.k)
                self._add_member(key)
                return r.members[key]
            tenant, now = tenant_of(key), self.clock()
            self.fair.wants(tenant, now)
            if len(r.members) >= self.k:
                raise ServiceUnavailable(f"round {r.number} is full ({self.k} clients); wait for the next "
                                         f"round (at most {self._time_left():.0f}s)",
                                         retry_after=min(1.0, max(self._time_left(), 0.05)))
            why = self.fair.seat_refusal(tenant, [tenant_of(m) for m in r.members], self.k, now)
            if why:
                raise ServiceUnavailable(f"no seat of round {r.number} for client {client_of(key)!r}: {why}; "
                                         f"retry in 1s (a seat opens when they join, or at the next round)",
                                         retry_after=1.0)
            self.fair.got(tenant)
            self._add_member(key)
        return r.members[key]

    def _add_member(self, key: str) -> None:
        r = self.round
        seg = copy.deepcopy(self.base.segment)
        r.members[key] = Replica(seg, self.make_optimizer(seg.parameters()))
        r.started = r.started or self.clock()

    def _group_open(self) -> None:
        """Across replicas: 503 while this replica joins the group or closes its round."""
        self.group.check_ready()
        if self.closing:
            raise ServiceUnavailable(f"round {self.round.number} is closing over the replicas; retry",
                                     retry_after=0.5)

    # -- turns (sequential) -------------------------------------------------------------

    def take_turn(self, key: str) -> dict:
        """Give ``key`` the turn if it may take it now (:meth:`.Fairness.take`); else 503."""
        with self.lock:
            if self.mode != "sequential":
                raise BadRequest(f"turns exist in sequential mode only; this server runs {self.mode!r}")
            self.fair.take(key, self.clock(), self.round_timeout_s)
            return self.status(tenant_of(key))

    # -- sync ------------------------------------------------------------------------

    def sync(self, key: str, weights: dict[str, torch.Tensor], samples: Optional[int] = None) -> dict:
        """``key``'s client-side weights at the end of its turn or round. ``samples`` (its
        FedAvg weight) is for in-process callers: every HTTP sync is weighted by the target
        tokens this server trained for the member (:meth:`trained`). A member's sync refused
        (bad schema, NaN, nothing trained) is that member's failure of the round (:meth:`refuse`)."""
        with self.lock:
            viewer = tenant_of(key)
            if self.mode == "shared":
                return self.status(viewer)  # nothing is shared in this mode
            if self.mode == "sequential":
                return self._end_turn(key, weights)
            self._close_if_timed_out()
            if self.group is not None:
                self._group_open()
            r = self.round
            try:  # the upload first (400 whoever sends it); refused, a member's failure of the round
                self._check_upload(weights)
            except BadRequest as e:
                self.refuse(key, e)
                raise
            if key in r.failed:
                raise Conflict(f"client {client_of(key)!r}'s sync was refused in round {r.number} "
                               f"({r.failed[key]}): it is out of this round; train again in the next")
            if key not in r.members:
                raise Conflict(f"client {client_of(key)!r} is not a member of round {r.number}: it has "
                               f"not trained in it (or the round closed without its sync)")
            if key not in r.synced:  # a repeated sync (a retry) changes nothing
                n = samples if samples is not None else r.tokens.get(key, 0)
                if n <= 0:
                    err = Conflict(f"client {client_of(key)!r} has no target token trained in round "
                                   f"{r.number}: train before syncing")
                    self.refuse(key, err)
                    raise err
                if self.group is not None:  # counted over every replica; the K-th closes the round
                    self.group.synced(r.number, self.k)
                r.synced[key], r.weights[key] = n, weights
                if self.external:
                    r.tickets[key] = self._sign(tickets.Ticket("splitfed", r.number, self.version, viewer,
                                                               client_of(key), n))
            ticket = r.tickets.get(key)
            if len(r.synced) + len(r.failed) >= self.k and self.group is None:
                self._close()
            return {**self.status(viewer), **({"ticket": ticket} if ticket else {})}

    def refuse(self, key: str, err: Exception) -> None:
        """``key``'s sync was refused (``err``: 400 or 409): a member of the open round is its
        *failure* (out of it); the turn holder's turn ends; anyone else: nothing changes."""
        with self.lock:
            why = f"{type(err).__name__}: {err}"[:200]
            r = self.round
            if self.mode == "sequential" and self.fair.holds(key):
                log.warning("the turn of %s ends: its sync was refused (%s)", key, why)
                self.fair.end()
            elif self.mode == "splitfed" and key in r.members and key not in r.synced and key not in r.failed:
                log.warning("round %d: the sync of %s was refused, a failure of the round (%s)", r.number, key, why)
                r.failed[key] = why
                if self.group is not None:  # done, counted over every replica
                    try:
                        self.group.synced(r.number, self.k)
                    except Conflict:
                        pass  # the round is closing already
                elif len(r.synced) + len(r.failed) >= self.k:
                    self._close()

    def _check_upload(self, weights: dict[str, torch.Tensor]) -> None:
        if self.external:
            if weights:
                raise BadRequest("this server keeps no client-side weights (--client-weights external): "
                                 "send them to the fed server and an empty sync here")
        elif self.clientside is not None:
            self.clientside.check(weights)

    def _end_turn(self, key: str, weights: dict[str, torch.Tensor]) -> dict:
        if not self.fair.holds(key):
            why = self.fair.passed(key)
            raise NotYourTurn(f"client {client_of(key)!r} does not hold the turn{why}; only the holder syncs")
        try:
            self._check_upload(weights)
        except BadRequest as e:
            self.refuse(key, e)
            raise
        out = {}
        if self.external:
            out["ticket"] = self._sign(tickets.Ticket("sequential", 0, self.version, tenant_of(key),
                                                      client_of(key), max(self.fair.turn.tokens, 1)))
            self.last_close = self._sign(tickets.Close("sequential", 0, self.version + 1, 1))
        elif weights:
            agg = self._aggregate_client([(weights, 1)])
            self.client_weights, out["clipped"] = agg.weights, agg.clipped[0]
        self.version += 1
        self.fair.end()
        self.on_change()
        return {**self.status(tenant_of(key)), **out}

    # -- rounds (splitfed) --------------------------------------------------------------

    def _time_left(self) -> float:
        started = self.round.started
        return self.round_timeout_s if started is None else self.round_timeout_s - (self.clock() - started)

    def _close_if_timed_out(self) -> None:
        r = self.round
        if self.group is not None:  # across replicas the group's thread closes rounds (.collective)
            return
        if r.started is not None and self._time_left() < 0:
            log.warning("round %d timed out %gs after its first member: closing with %d of %d members "
                        "synced (%d leave)", r.number, self.round_timeout_s, len(r.synced), len(r.members),
                        len(r.members) - len(r.synced))
            self._close()

    def _close(self) -> None:
        """Close the round on this server: a collective of one (:func:`.rounds.close_round`)."""
        c = self.freeze_round(self.round.number)
        self.apply_close(c, close_round(self.strategy, c))

    # -- closing a round: freeze, close_round (one server, or the replicas' group), apply -----

    def _client_reference(self) -> Optional[dict[str, torch.Tensor]]:
        """The shared client-side weights updates are bounded around (first: the initial ones);
        None when this server keeps none (external) or knows none."""
        if self.external:
            return None
        if self.client_weights is not None:
            return self.client_weights
        return None if self.clientside is None else self.clientside.initial()

    def freeze_round(self, number: int) -> Optional[Contribution]:
        """Freeze round ``number`` for its close: this server's synced members' uploads, bounded
        around the shared weights. None if this server is past that round already."""
        with self.lock:
            r = self.round
            if r.number != number:
                return None
            self.closing = True  # no new member, no sync until the round is closed
            keys = list(r.synced)
            ref, cref = self.base.segment.state_dict(), self._client_reference()
            uploads = [r.weights[k] for k in keys if r.weights.get(k)]
            if cref is None and uploads and not self.external and self.group is None:
                cref = coordinate_median(uploads)  # nothing known to bound around (see _aggregate_client)
            c = contribution(number, ref, cref)
            for k in keys:
                c.add(self.strategy, ref, r.members[k].segment.state_dict(), r.synced[k])
                if cref is not None and r.weights.get(k):
                    c.add_client(self.strategy, r.weights[k], r.synced[k])
            return c

    def apply_close(self, c: Contribution, result: Combined) -> dict:
        """Load the round's result (the same on every replica) and open the next round; the
        weights' sha256 (replicas)."""
        with self.lock:
            r = self.round
            if r.number != c.number:  # (cannot happen: rounds close on the compute thread, in order)
                raise Conflict(f"round {c.number} is not open here (round {r.number} is)")
            if result.server is not None:
                self._load_server(unflatten(result.server, self.base.segment.state_dict()))
                self.last_round = {"round": r.number, "members": result.members, "samples": result.samples,
                                   "server_clipped": result.clipped[0], "share_capped": result.share_capped,
                                   "failed": len(r.failed)}  # (this replica's)
                if self.external:
                    self.last_close = self._sign(tickets.Close("splitfed", r.number, self.version + 1,
                                                               result.members))
                elif result.client is not None:
                    self.client_weights = unflatten(result.client, c.client_reference)
                    if self.clientside is not None:
                        self.clientside.forget_initial()
                    self.last_round["client_clipped"] = result.clipped[1]
                self.version += 1
                log.info("round %d closed: %s; update norms here: server %s", r.number, self.last_round,
                         [round(x, 4) for x in c.norms])
            elif self.group is not None:
                log.warning("round %d closed over the replicas with no member synced: it starts over", r.number)
            self.fair.closed({tenant_of(k) for k in r.synced}, self.clock())  # they come back first
            self.round, self.closing = Round(r.number + 1), False
            self.on_change()
            return self._shas() if self.group is not None else {}  # (replicas report them; one server: no cost)

    def _aggregate_client(self, uploads: list[tuple[dict[str, torch.Tensor], int]]) -> Aggregate:
        """The strategy around the current shared client-side weights (first: the initial ones)."""
        ref = self.client_weights
        if ref is None and self.clientside is not None:
            ref = self.clientside.initial()
        if ref is None:  # nothing known to bound around: the uploads' coordinate-wise median
            ref = coordinate_median([w for w, _ in uploads])
        agg = aggregate(self.strategy, ref, uploads)  # a round of one server (.rounds)
        if self.clientside is not None:
            self.clientside.forget_initial()
        log.info("client-side update norms %s, clipped %s", [round(x, 4) for x in agg.norms], agg.clipped)
        return agg

    def _sign(self, statement) -> str:
        return tickets.sign(self.secret, statement)

    def round_open(self) -> bool:
        """A splitfed round has members (their copies would be lost by a checkpoint now)."""
        return self.mode == "splitfed" and bool(self.round.members)

    # -- persistence and reading --------------------------------------------------------

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
            if self.group is not None:
                self.group.check_ready()
            if self.client_weights is None:
                raise NotFound("no client-side weights here: none synced yet, or a fed server holds them")
            return self.version, self.client_weights

    def status(self, viewer: Optional[str] = None) -> dict:
        """The federation's state as ``viewer`` (a tenant name) may see it: its own client
        ids only, the others as counts. ``viewer=None``: every key (in-process use)."""
        with self.lock:
            if self.mode == "splitfed":
                self._close_if_timed_out()
            r, fed = self.round, self.mode == "splitfed"

            def mine(keys) -> list[str]:
                if viewer is None:
                    return sorted(keys)
                return sorted(client_of(k) for k in keys if tenant_of(k) == viewer)

            turn = None if self.fair.turn is None else mine([self.fair.turn.key])
            out = {"mode": self.mode, "version": self.version, "round": r.number,
                   "clients_per_round": self.k if fed else None,
                   "members": mine(r.members) if fed else [], "synced": mine(r.synced) if fed else [],
                   "members_count": len(r.members) if fed else 0, "synced_count": len(r.synced) if fed else 0,
                   "failed": mine(r.failed) if fed else [], "failed_count": len(r.failed) if fed else 0,
                   "round_closes_in_s": round(max(self._time_left(), 0.0), 3) if fed and r.started else None,
                   "turn": turn[0] if turn else None, "turn_held": self.fair.turn is not None,
                   "round_timeout_s": self.round_timeout_s, "client_weights": self.client_weights_at,
                   **self.strategy.describe(), **self.fair.describe(self.k, self.clock()),
                   "last_round": self.last_round}
            if self.external and self.last_close is not None:
                out["last_close"] = self.last_close
            if self.group is not None:  # the round over every replica: global counts
                out["replicas"] = self.group.describe()
                try:
                    out["members_count"], out["synced_count"] = self.group.counts(r.number)
                    left = self.group.closes_in(r.number, self.round_timeout_s)
                    out["round_closes_in_s"] = None if left is None else round(left, 3)
                except Exception as e:  # noqa: BLE001 - the store unreachable: this replica's view
                    log.warning("the SplitFed store did not answer: %s", e)
            return out
