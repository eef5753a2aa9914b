"""SplitFed across replicas: one round over every replica's members, closed by torch.distributed.

A store holds the round's global counters, changed atomically (``Store.add``,
``Store.compare_set``): the cluster's on one host is a FileStore in its private run directory
(``--fed-store file:///...``: only its user may open it), replicas on several hosts meet at a
TCPStore (``HOST:PORT``, every user who reaches the port may write it: docs/SECURITY.md)::

    r<n>/members   members admitted to round n over all replicas (<= --clients-per-round)
    r<n>/started   wall time of round n's first member (its --round-timeout runs from it)
    r<n>/synced    members of round n that synced, over all replicas
    r<n>/close     set once: "full" (the K-th sync) or "timeout"; every replica polls it
    gen            the generation of the process group
    g<gen>/in/<index>, g<gen>/members   a generation's announcements and its fixed member list

A gloo process group over the live replicas closes a round with :func:`.rounds.close_round`
(one server runs the same function over a collective of one; here over :class:`TorchCollective`).
Design, equality to one server, generations, a dead replica, trust: docs/CLUSTER.md,
'SplitFed across replicas' and 'A dead replica and the round'.
"""
from __future__ import annotations

import hashlib
import logging
import math
import threading
import time
from datetime import timedelta
from typing import Callable, Optional

import torch

from ...errors import ConfigError, Conflict, ServiceUnavailable
from ..config import FILE_STORE, GroupSpec, parse_store
from .rounds import close_round, floating_keys

log = logging.getLogger(__name__)

Weights = dict[str, torch.Tensor]
TICK_S = 0.05  # how often a replica polls the store: close flags, timeouts, generations
STORE_PREFIX = "splitlearn/fed"


def weights_sha256(weights: Weights) -> str:
    """sha256 of the floating tensors as float32 bytes, in the dict's order: what every replica
    reports after a round (``GET /v1/federation`` ``replicas.weights_sha256``)."""
    h = hashlib.sha256()
    for k in floating_keys(weights):
        h.update(weights[k].detach().float().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()


def open_file_store(path: str):
    """The FileStore at ``path`` (made if missing), in a directory of this user's own that no one
    else may write, the file this user's own: else ConfigError. Unix permissions are its
    authentication: a stranger on the host can neither read nor write a key (docs/SECURITY.md,
    'The store'), where a TCPStore's port takes every local user's ``add``."""
    import os
    from pathlib import Path

    from ...model.checkpoint import check_private_dir, not_own

    where = Path(path)
    try:
        check_private_dir(where.parent)
        reason = not_own(os.lstat(where), directory=False) if os.path.lexists(where) else None
    except ConfigError as e:
        raise ConfigError(f"--fed-store file://{path}: {e}") from None
    if reason is not None:
        raise ConfigError(f"--fed-store file://{path}: the store file {reason}; refusing it (another local "
                          f"user could write the round's keys); remove it")
    return _dist().FileStore(str(where), -1)  # -1: never removed by its last user (the supervisor holds it)


def _dist():
    import torch.distributed as dist

    return dist


class TorchCollective:
    """The current torch.distributed process group as :func:`.rounds.close_round`'s collective."""

    @property
    def world(self) -> int:
        return _dist().get_world_size()

    @property
    def rank(self) -> int:
        return _dist().get_rank()

    def all_reduce(self, t: torch.Tensor) -> None:
        _dist().all_reduce(t)

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.zeros_like(t) for _ in range(self.world)]
        _dist().all_gather(out, t)
        return out

    def broadcast(self, t: torch.Tensor, src: int) -> None:
        _dist().broadcast(t, src=src)


# -- one replica's membership of the group ----------------------------------------------------

class ReplicaGroup:
    """The coordinator thread of one replica: store counters, generations, closes. ``fed``: the
    :class:`~.modes.Federation` (``freeze_round``, ``apply_close``, ``position``, ``state_flat``,
    ``flat_size``, ``adopt_state``); ``run`` executes a callable on the compute thread."""

    def __init__(self, spec: GroupSpec, fed, run: Callable):
        self.spec = spec
        self.fed = fed
        self.run = run
        self.ready = threading.Event()  # the first group formed and agreed on the state
        self.gen: Optional[int] = None  # generation of the process group this replica is in
        self.rank: Optional[int] = None
        self.members: list[int] = []  # replica indexes in the current group
        self.closes: list[dict] = []  # timings of the last closes (status)
        self.sha: Optional[dict] = None  # weights_sha256 after the last close or state agreement
        self.stopping = threading.Event()
        self._store = None
        self._thread: Optional[threading.Thread] = None

    # -- the store ---------------------------------------------------------------------

    @property
    def store(self):
        if self._store is None:
            dist = _dist()
            if self.spec.store.startswith(FILE_STORE):
                base = open_file_store(self.spec.store[len(FILE_STORE):])
            else:
                host, port = parse_store(self.spec.store)
                base = dist.TCPStore(host, port, None, False, timeout=timedelta(seconds=self.spec.timeout_s))
            self._store = dist.PrefixStore(STORE_PREFIX, base)
        return self._store

    def counter(self, key: str, delta: int = 0) -> int:
        if delta == 0:  # a read: nothing written (a FileStore appends every add, polls included)
            return int(self.store.get(key)) if self.store.check([key]) else 0
        return int(self.store.add(key, delta))

    def _float(self, key: str) -> Optional[float]:
        if not self.store.check([key]):
            return None
        try:
            v = float(self.store.get(key).decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            return None
        return v if math.isfinite(v) else None

    # -- what the federation asks (compute thread, under its lock) ------------------------

    def check_ready(self) -> None:
        if not self.ready.is_set():
            raise ServiceUnavailable("this replica is joining the SplitFed group of the cluster's replicas "
                                     "(agreeing on the shared weights); retry", retry_after=1.0)

    def closing(self, number: int) -> bool:
        return bool(self.store.check([f"r{number}/close"]))

    def admit(self, number: int, k: int) -> None:
        """A new member of round ``number`` on this replica: one of the round's K over all replicas."""
        if self.closing(number):
            raise ServiceUnavailable(f"round {number} is closing; wait for the next round", retry_after=0.5)
        count = self.counter(f"r{number}/members", 1)
        if count > k:
            self.counter(f"r{number}/members", -1)
            raise ServiceUnavailable(f"round {number} is full ({k} clients over all replicas); wait for the "
                                     f"next round", retry_after=1.0)
        if count == 1:
            self.store.compare_set(f"r{number}/started", "", repr(time.time()))

    def synced(self, number: int, k: int) -> None:
        """A member of round ``number`` synced on this replica; the K-th over all closes the round."""
        if self.closing(number):
            raise Conflict(f"round {number} closed (timed out) before this sync; the next training step "
                           f"downloads its result")
        if self.counter(f"r{number}/synced", 1) >= k:
            self.store.compare_set(f"r{number}/close", "", "full")

    def counts(self, number: int) -> tuple[int, int]:
        return self.counter(f"r{number}/members"), self.counter(f"r{number}/synced")

    def closes_in(self, number: int, timeout_s: float) -> Optional[float]:
        started = self._float(f"r{number}/started")
        return None if started is None else max(timeout_s - (time.time() - started), 0.0)

    def describe(self) -> dict:
        last = self.closes[-1] if self.closes else None
        return {"index": self.spec.index, "world_size": self.spec.world, "ready": self.ready.is_set(),
                "generation": self.gen, "group": list(self.members), "last_close": last,
                "weights_sha256": self.sha}

    # -- the thread ----------------------------------------------------------------------

    def start(self) -> "ReplicaGroup":
        self._thread = threading.Thread(target=self._loop, name="splitlearn-fed-group", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.stopping.set()

    def _loop(self) -> None:
        bump = True  # a new process always starts a new generation: no existing group has it
        while not self.stopping.is_set():
            try:
                if self.gen is None:
                    self._join(bump)
                    bump = False
                    self._agree()
                    self.ready.set()
                elif self.counter("gen") != self.gen:  # another replica (re)started or failed
                    log.info("SplitFed group: generation %s ended; joining the next", self.gen)
                    self._leave()
                    continue
                else:
                    self._tick()
            except Exception as e:  # noqa: BLE001 - a peer died, a timeout, the store: re-form
                if self.stopping.is_set():
                    return
                log.warning("SplitFed group (generation %s) failed: %s; forming the next", self.gen, e)
                self._leave()
                bump = True
                self.stopping.wait(1.0)  # (a store that is down: one try a second, not a storm of logs)
            self.stopping.wait(TICK_S)

    def _tick(self) -> None:
        fed = self.fed
        number = fed.round.number
        if self.closing(number):
            self._close(number)
            return
        left = self.closes_in(number, fed.round_timeout_s)
        if left is not None and left <= 0:
            log.warning("round %d timed out %gs after its first member: closing it on every replica",
                        number, fed.round_timeout_s)
            self.store.compare_set(f"r{number}/close", "", "timeout")

    def _close(self, number: int) -> None:
        t0 = time.perf_counter()
        contribution = self.run(self.fed.freeze_round, number)
        if contribution is None:  # the round is not open here any more
            return
        t1 = time.perf_counter()
        result = close_round(self.fed.strategy, contribution, TorchCollective(), self.run)
        t2 = time.perf_counter()

        def apply_and_record() -> None:
            # under the federation's lock, with the apply: a status read that sees the new
            # version sees this close (and its sha) too
            with self.fed.lock:
                sha = self.fed.apply_close(contribution, result)
                t3 = time.perf_counter()
                self.sha, self.closes = sha, [*self.closes[-9:], {
                    "round": number, "members": result.members, "local": len(contribution.samples),
                    "prepare_ms": round((t1 - t0) * 1e3, 2), "collective_ms": round((t2 - t1) * 1e3, 2),
                    "apply_ms": round((t3 - t2) * 1e3, 2)}]

        self.run(apply_and_record)
        log.info("round %d closed over %d replicas: %s", number, len(self.members), self.closes[-1])

    # -- generations ---------------------------------------------------------------------

    def _join(self, bump: bool) -> None:
        """Join the store's current generation (a new one if ``bump``) and form its group."""
        dist, spec = _dist(), self.spec
        g = self.counter("gen", 1 if bump else 0)
        if g == 0:
            g = self.counter("gen", 1)
        while not self.stopping.is_set():
            self.store.set(f"g{g}/in/{spec.index}", "1")
            deadline = time.monotonic() + spec.timeout_s
            members = None
            while members is None:
                cur = self.counter("gen")
                if cur != g:
                    break
                present = [i for i in range(spec.world) if self.store.check([f"g{g}/in/{i}"])]
                if (len(present) == spec.world or time.monotonic() > deadline
                        or self.store.check([f"g{g}/members"])):
                    members = self._members(self.store.compare_set(f"g{g}/members", "", ",".join(map(str, present))))
                else:
                    time.sleep(TICK_S)
            if members is None:
                g = cur
                continue
            if spec.index not in members:  # decided without us: the next generation has us
                g = self.counter("gen", 1)
                continue
            rank = members.index(spec.index)
            dist.init_process_group("gloo", store=dist.PrefixStore(f"g{g}/pg", self.store), rank=rank,
                                    world_size=len(members), timeout=timedelta(seconds=spec.timeout_s))
            self.gen, self.rank, self.members = g, rank, members
            log.info("SplitFed group generation %d: replicas %s, this one rank %d", g, members, rank)
            return

    def _members(self, value: bytes) -> list[int]:
        try:
            members = sorted({int(x) for x in value.decode("ascii").split(",") if x})
        except (UnicodeDecodeError, ValueError):
            raise ConfigError(f"the store's member list is malformed: {value[:80]!r}") from None
        if not members or any(not 0 <= m < self.spec.world for m in members):
            raise ConfigError(f"the store's member list {members} is not of {self.spec.world} replicas")
        return members

    def _leave(self) -> None:
        dist = _dist()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception as e:  # noqa: BLE001 - a broken group: nothing more to do with it
                log.debug("destroying the process group: %s", e)
        self.gen, self.rank, self.members = None, None, []

    def _agree(self) -> None:
        """The new group's members agree on the shared state: the most advanced broadcasts it."""
        dist = _dist()
        mine = torch.tensor(self.run(self.fed.position), dtype=torch.int64)  # (version, round)
        every = [torch.zeros(2, dtype=torch.int64) for _ in range(len(self.members))]
        dist.all_gather(every, mine)
        best = max(tuple(int(x) for x in e) for e in every)
        if all(tuple(int(x) for x in e) == best for e in every):
            return
        leader = next(r for r, e in enumerate(every) if tuple(int(x) for x in e) == best)
        flat, has_client = self.run(self.fed.state_flat)
        flag = torch.tensor([int(has_client)], dtype=torch.int64)
        dist.broadcast(flag, src=leader)
        if bool(flag.item()) != has_client:  # our flat lacks (or has) the client part: resize
            flat = torch.zeros(self.run(self.fed.flat_size, bool(flag.item())))
        dist.broadcast(flat, src=leader)
        if tuple(int(x) for x in mine) != best:
            if not bool(torch.isfinite(flat).all()):
                raise ConfigError("the shared state broadcast by the most advanced replica is not finite")
            self.sha = self.run(self.fed.adopt_state, best[0], best[1], flat, bool(flag.item()))
            log.info("SplitFed group: took version %d, round %d from replica %d", best[0], best[1],
                     self.members[leader])
