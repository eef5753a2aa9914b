"""Per-client LoRA adapters on the server: one frozen segment, an adapter + optimizer per client.

Started with ``--lora-r R --lora-alpha A [--lora-targets q_proj,...]`` (no targets: the family's
attention default, peft's table), the server freezes its segment and trains adapters only
(:mod:`splitlearn.model.lora`)::

    shared      each client id gets its own adapter and optimizer at its first training
                step; a step changes that client's adapter only, so clients never wait for
                each other's U-shape steps (no lease: nothing they share changes)
    sequential  one adapter, trained in turns (the turn, versions and syncs as without LoRA)
    splitfed    SplitLoRA (Lin et al. 2024, arXiv 2407.00952): each member of a round trains
                a copy of the round's adapter; the copies (and the client-side adapters)
                are aggregated by the federation's strategy (bounded updates, weighted by
                the rows trained: :mod:`splitlearn.server.federation.strategy`); the base is never copied

The runtime's training paths get the client's copy from ``Federation.replica_for`` as
always: :class:`LoraFederation` answers with an :class:`~splitlearn.model.lora.AdaptedSegment`
(the shared segment with that adapter switched on) and an optimizer over the adapter alone.

Ownership: adapters are keyed by the scoped key ``<tenant>:<client_id>``
(:mod:`.tenants`), so a client id belongs to its tenant and nothing is first-come: another
tenant's request for ``alice`` reaches its own ``alice`` (or nothing), never this one. Memory per
client (GPT-2 small, blocks 2-10, r=8 on its default target, the fused q/k/v projection): the adapter
(8 x (768 + 2304) x 9 = 221k parameters, 0.88 MB) plus AdamW's two moments (1.8 MB),
against 680 MB for a full copy of the segment with AdamW state (benchmarks/lora.py).

Checkpoints: every adapter and optimizer tensor (keyed ``<client>/<name>``) is the
``adapters`` tensor set of the server's checkpoint generation, the spec and optimizer
settings its ``counters["adapters"]`` (JSON), so adapters and the step ledger are saved
atomically together (:mod:`splitlearn.model.checkpoint`); no pickle.
"""
from __future__ import annotations

import json
import logging
import threading
from typing import Callable, Optional

import torch

from ...model.checkpoint import has_state, latest, optimizer_state, read_extra, read_meta, restore_optimizer
from ...errors import ConfigError, NotFound, SegmentFileError
from ...model.lora import AdaptedSegment, Adapter, LoraRouter, LoraSpec
from ...model.segments import Segment
from ...api.wire import encode
from ..federation.modes import Federation, Replica
from ..tenants import client_of

log = logging.getLogger(__name__)

GLOBAL = "*"  # the round's / the turn's adapter in sequential and splitfed (not a client id)


class AdapterBank:
    """Adapters and their optimizers, keyed by scoped client key; called on the compute thread."""

    def __init__(self, segment: Segment, spec: LoraSpec, seed: int, make_optimizer: Callable):
        self.spec = spec = spec.for_config(segment.config)  # no targets given: the family's default
        self.seed = seed
        self.make_optimizer = make_optimizer  # params -> the server's optimizer
        self.router = LoraRouter(segment, spec)
        self.replicas: dict[str, Replica] = {}  # client id (or GLOBAL) -> its adapter + optimizer
        self.lock = threading.Lock()
        self.on_lookup: Optional[Callable[[str], None]] = None  # replicas: load a newer state first (.clientstate)

    # -- adapters --------------------------------------------------------------------

    def new_replica(self, client_id: str) -> Replica:
        # seeded by the client's own id (not its tenant), as the client inits its side
        seed_id = "" if client_id == GLOBAL else client_of(client_id)
        seg = AdaptedSegment(self.router, self.router.new_adapter(self.seed, seed_id))
        return Replica(seg, self.make_optimizer(seg.parameters()))

    def replica(self, client_id: str) -> Replica:
        """``client_id``'s adapter + optimizer, created at its first training step."""
        with self.lock:
            if client_id not in self.replicas:
                self.replicas[client_id] = self.new_replica(client_id)
                log.info("client %s: new adapter (%d parameters)", client_id,
                         self.replicas[client_id].segment.adapter.numel())
            return self.replicas[client_id]

    def adapter_for(self, client_id: Optional[str], mode: str) -> Optional[Adapter]:
        """The adapter inference uses for ``client_id``: its own (shared mode) or the
        federation's (sequential, splitfed); None (the base model) before it has one."""
        key = client_id if mode == "shared" else GLOBAL
        if key is not None and key != GLOBAL and self.on_lookup is not None:
            self.on_lookup(key)
        rep = self.replicas.get(key) if key is not None else None
        return rep.segment.adapter if rep is not None else None

    def client_ids(self) -> list[str]:
        return sorted(k for k in self.replicas if k != GLOBAL)

    # -- reading ---------------------------------------------------------------------

    def adapter_bytes(self, key: str, mode: str, trained: bool) -> bytes:
        """``GET /v1/clients/<id>/adapter``: the adapter the caller's client ``key`` trains
        (scoped to its tenant, so another tenant's is never found) with peft's names;
        ``trained``: the key has a training record (the turn's or round's adapter is shown
        only to the clients that train it)."""
        adapter = self.adapter_for(key, mode) if trained else None
        if adapter is None:
            raise NotFound(f"client {client_of(key)!r} has no server-side adapter yet (it has not trained)")
        return encode(adapter.tensors(), {"lora": json.dumps(self.spec.to_dict())})

    # -- memory ----------------------------------------------------------------------

    def bytes_of(self, client_id: str) -> dict[str, int]:
        """Bytes the server holds for ``client_id``: adapter and optimizer state."""
        rep = self.replicas[client_id]
        adapter = sum(p.numel() * p.element_size() for p in rep.segment.parameters())
        state = sum(v.numel() * v.element_size() for st in rep.optimizer.state.values()
                    for v in st.values() if isinstance(v, torch.Tensor))
        return {"adapter": adapter, "optimizer": state}

    # -- checkpoints -----------------------------------------------------------------

    def state(self) -> tuple[dict[str, torch.Tensor], dict]:
        """Every adapter and optimizer tensor (keyed ``<client>/<name>``) and the rest as JSON:
        the runtime writes both into the same checkpoint generation as the step ledger."""
        tensors, optim = {}, {}
        with self.lock:
            for cid, rep in self.replicas.items():
                for k, v in rep.segment.adapter.tensors().items():
                    tensors[f"{cid}/{k}"] = v
                opt_tensors, optim[cid] = optimizer_state(rep.optimizer)
                tensors.update({f"{cid}/optim/{k}": v for k, v in opt_tensors.items()})
            return tensors, {"spec": self.spec.to_dict(), "optimizers": optim}

    def restore(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        """Put back what :meth:`state` gave: every adapter, optimizer and owner."""
        if LoraSpec.from_dict(meta["spec"]) != self.spec:
            raise ConfigError(f"the checkpointed adapters have LoRA {meta['spec']}, this server runs "
                              f"{self.spec.to_dict()}: start it with the same --lora-* options")
        with self.lock:
            self.replicas = {}
            for cid, opt in meta["optimizers"].items():
                rep = self.new_replica(cid)
                prefix = f"{cid}/"
                mine = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
                try:
                    rep.segment.adapter.load_tensors(mine)
                except KeyError as e:
                    raise SegmentFileError(f"the adapter checkpoint lacks {cid}/{e.args[0]}") from None
                restore_optimizer(rep.optimizer, {k[6:]: v for k, v in mine.items() if k.startswith("optim/")}, opt)
                self.replicas[cid] = rep
        log.info("restored %d adapters", len(self.replicas))


class LoraFederation(Federation):
    """:class:`Federation` over adapters: ``shared`` gives each client its own; the other
    modes train (and aggregate, with the same strategy and bounds) the one adapter of the
    turn or round, never the base. ``options``: :class:`Federation`'s keyword options
    (strategy, client-side schema, where client weights live, the fed secret)."""

    def __init__(self, bank: AdapterBank, mode: str, clients_per_round: int, round_timeout_s: float,
                 **options):
        super().__init__(mode, bank.replica(GLOBAL) if mode != "shared" else bank.new_replica(GLOBAL),
                         bank.make_optimizer, clients_per_round, round_timeout_s, **options)
        self.bank = bank

    def replica_for(self, client_id: str, version: Optional[int]) -> Replica:
        if self.mode == "shared":
            return self.bank.replica(client_id)
        return super().replica_for(client_id, version)

    def _load_server(self, weights: dict[str, torch.Tensor]) -> None:
        super()._load_server(weights)  # AdaptedSegment's state dict: the adapter only
        self.bank.replicas[GLOBAL] = self.base


def attach(runtime) -> AdapterBank:
    """Freeze the runtime's segment, give it an :class:`AdapterBank` and a :class:`LoraFederation`,
    and restore checkpointed adapters (called once from ``SegmentRuntime._load``)."""
    cfg = runtime.cfg
    bank = AdapterBank(runtime.segment, cfg.lora, cfg.seed, runtime.make_optimizer)
    cfg.lora = bank.spec  # the targets fixed (the family's default): what /v1/info and checkpoints say
    old = runtime.federation
    # the same options as the federation it replaces (strategy, schema, --client-weights, secret, fairness)
    runtime.federation = LoraFederation(bank, cfg.federation, cfg.clients_per_round, cfg.round_timeout_s,
                                        strategy=old.strategy, clientside=old.clientside,
                                        client_weights_at=old.client_weights_at, secret=old.secret,
                                        fairness=old.fair)
    runtime.federation.on_change = getattr(old, "on_change", runtime.federation.on_change)
    if cfg.checkpoint_dir and has_state(cfg.checkpoint_dir, "server"):
        meta = read_meta(latest(cfg.checkpoint_dir, "server"))["counters"].get("adapters")
        if meta is not None:
            bank.restore(read_extra(cfg.checkpoint_dir, "server", "adapters") or {}, meta)
        if GLOBAL in bank.replicas and cfg.federation != "shared":
            runtime.federation.base = bank.replicas[GLOBAL]
    return bank
