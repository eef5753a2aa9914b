"""Per-client LoRA state in a directory shared by replicas (``--state-dir``; docs/CLUSTER.md).

With per-client LoRA on a frozen base (``--lora-r``, ``--federation shared``) everything a
client changes on the server is its own: its adapter, its optimizer state and its record in
the step ledger. Replicas behind HAProxy (:mod:`splitlearn.cluster`) each hold the frozen
base and the state of the clients routed to them; this module keeps that state where every
replica can read it, so a client whose replica dies continues on another::

    STATE_DIR/<tenant>:<client_id>/client.latest         pointer to the newest generation
    STATE_DIR/<tenant>:<client_id>/client-00000007/       adapter.safetensors, optim.safetensors,
                                                          state.json (ledger record, sha256s)

Each directory is a :mod:`splitlearn.model.checkpoint` generation store (atomic, sha256-checked,
0600 files, no pickle). A client's state is written every ``--checkpoint-every`` of *its own*
steps and on SIGTERM, and its answers then say that step is ``durable``: the client's journal
(the request log, :mod:`splitlearn.hf.journal`) keeps what came after, so a replica that loads the state
needs nothing else; the client replays the rest.

Ownership, without a lock service. The replica that loaded or wrote generation ``g`` of a
client remembers ``g`` (:attr:`ClientStates.gens`). On every request naming that client
(:meth:`ClientStates.claim`, one small file read) it compares ``g`` with the pointer on disk:

    disk == g    the state in memory is the newest (maybe with non-durable steps after g): keep it
    disk > g     another replica served this client since (a failover, or the hash ring moved
                 it back): drop the copy in memory, load the newest generation
    none held    load the newest generation, if there is one

and it writes generation ``g + 1`` only if the pointer still names ``g`` (compare-and-swap on
the generation number), so a replica that comes back with a stale copy never overwrites what
another replica wrote meanwhile. A replica that keeps non-durable steps of a client that has
moved away loses them at its next look (the disk is newer) or serves them if the client comes
back before anyone saved: either way the client's journal brings both sides to the same step,
because every step is a deterministic function of the state before it and its batch. Every
``SWEEP_EVERY`` requests a replica also drops the copies that another replica has saved past
(:meth:`ClientStates.sweep`), so owners that moved away do not stay in its memory for ever.
Replicas must see one file system (NFS, a shared volume); the pointer's atomic rename is what
makes a generation visible.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

from ...model.checkpoint import _tensors, latest, private_dir, read_meta, restore_optimizer, save_state
from ...errors import ConfigError
from ...model.lora import LoraSpec
from .ledger import StepLedger

log = logging.getLogger(__name__)

NAME = "client"  # the generation store's name inside each client's directory
SWEEP_EVERY = 1024  # claims between two sweeps of the copies other replicas made stale


def generation_of(path: Path) -> int:
    """``7`` for ``.../client-00000007``."""
    return int(path.name.rsplit("-", 1)[1])


class ClientStates:
    """The shared state directory, seen from one replica; every method runs on the runtime's
    compute thread (tensors) under its lock."""

    def __init__(self, directory: str, runtime, replica: Optional[str] = None):
        self.dir = private_dir(directory)
        self.rt = runtime
        self.every = runtime.cfg.checkpoint_every  # this client's steps between saves (0: SIGTERM only)
        self.replica = replica or f"{runtime.cfg.host}:{runtime.cfg.port}"  # written into each generation
        self.gens: dict[str, int] = {}  # scoped key -> generation this replica loaded or wrote
        self.loads = 0  # states loaded from the shared directory (a client arriving from elsewhere)
        self.saves = 0
        self.claims = 0  # requests checked; every SWEEP_EVERY-th also sweeps (:meth:`sweep`)

    def _path(self, key: str) -> Path:
        # one path component: a key is "<tenant>:<client_id>", both of [A-Za-z0-9_.-]
        return self.dir / key

    def disk_gen(self, key: str) -> int:
        """The generation the shared pointer names (0: none): one small read."""
        try:
            return generation_of(Path((self._path(key) / f"{NAME}.latest").read_text().strip()))
        except FileNotFoundError:
            return 0

    # -- ownership -------------------------------------------------------------------

    def claim(self, key: str) -> None:
        """Before serving ``key``: load its newest state if this replica's copy is older."""
        with self.rt.lock:
            self.claims += 1
            if self.claims % SWEEP_EVERY == 0:
                self.sweep()
            disk, held = self.disk_gen(key), self.gens.get(key, 0)
            if disk == held:
                return
            if disk < held:  # someone removed generations; keep serving what we have
                log.warning("client %s: the shared state is at generation %d, this replica wrote %d",
                            key, disk, held)
                return
            if held or self.rt.ledger.known(key):
                log.info("client %s: generation %d in %s is newer than this replica's (%d): reloading",
                         key, disk, self.dir, held)
            self._drop(key)
            self._load(key)

    def sweep(self) -> int:
        """Drop every copy another replica has saved past (its owners moved away and have
        not come back); one pointer read per client held. Returns how many were dropped."""
        with self.rt.lock:
            stale = [k for k, g in self.gens.items() if self.disk_gen(k) > g]
            for k in stale:
                self._drop(k)
            if stale:
                log.info("dropped %d clients whose state another replica has saved since", len(stale))
            return len(stale)

    def _drop(self, key: str) -> None:
        rt = self.rt
        rt.ledger.forget(key)  # (its kept answers' memory given back)
        with rt.adapters.lock:
            rt.adapters.replicas.pop(key, None)
        self.gens.pop(key, None)

    def _load(self, key: str) -> None:
        gen = latest(self._path(key), NAME)
        if gen is None:
            return
        meta = read_meta(gen)
        counters, bank = meta["counters"], self.rt.adapters
        if LoraSpec.from_dict(counters["spec"]) != bank.spec:
            raise ConfigError(f"the state of client {key} in {gen} has LoRA {counters['spec']}, this "
                              f"replica runs {bank.spec.to_dict()}: start every replica with the same --lora-*")
        rep = bank.new_replica(key)
        rep.segment.adapter.load_tensors(_tensors(gen, "adapter.safetensors", meta["files"]))
        restore_optimizer(rep.optimizer, _tensors(gen, "optim.safetensors", meta["files"]), meta["optimizer"])
        record = StepLedger.from_counters(counters["ledger"]).clients[key]
        with bank.lock:
            bank.replicas[key] = rep
        self.rt.ledger.adopt(key, record)  # (its kept answers reserved)
        self.rt.ledger.durable[key] = record.step
        self.gens[key] = generation_of(gen)
        self.loads += 1
        log.info("client %s: loaded step %d (generation %d, written by %s)", key, record.step,
                 self.gens[key], counters.get("replica"))

    # -- saving ----------------------------------------------------------------------

    def applied(self, key: str, step: int) -> None:
        """Step ``step`` of ``key`` is applied: save its state when due (every N of its steps)."""
        if self.every and step % self.every == 0:
            self.save(key)

    def save(self, key: str) -> bool:
        """Write ``key``'s adapter, optimizer and ledger record as the next generation, if the
        shared pointer still names the one this replica holds; then the step is durable."""
        rt = self.rt
        with rt.lock:
            rep, record = rt.adapters.replicas.get(key), rt.ledger.clients.get(key)
            if rep is None or record is None or record.pending is not None:
                return False
            disk, held = self.disk_gen(key), self.gens.get(key, 0)
            if disk != held:
                log.warning("client %s: another replica saved generation %d since this one's %d: "
                            "not overwriting it", key, disk, held)
                return False
            counters = {"ledger": StepLedger({key: record}, record.step).to_counters(),
                        "spec": rt.adapters.spec.to_dict(), "key": key, "replica": self.replica}
            try:
                path = save_state(self._path(key), NAME, [], rep.optimizer, counters,
                                  extra={"adapter": rep.segment.adapter.tensors()})
            except OSError as e:  # (a concurrent writer's generation, a full disk): not durable yet
                log.warning("client %s: state not saved to %s: %s", key, self._path(key), e)
                return False
            self.gens[key] = generation_of(path)
            rt.ledger.durable[key] = record.step
            self.saves += 1
            return True

    def save_all(self) -> int:
        """Every client with steps not yet durable (SIGTERM); returns how many were saved."""
        with self.rt.lock:
            keys = [k for k, r in self.rt.ledger.clients.items()
                    if r.step > self.rt.ledger.durable_step(k) and k in self.rt.adapters.replicas]
            return sum(self.save(k) for k in keys)

    def stats(self) -> dict:
        return {"dir": str(self.dir), "every": self.every, "clients": len(self.gens),
                "loads": self.loads, "saves": self.saves}
