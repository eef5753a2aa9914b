"""A federation as one of several replicas (docs/CLUSTER.md, 'SplitFed across replicas'): what
a :class:`~.collective.ReplicaGroup` reads and sets of its :class:`~.modes.Federation` (the
position, the shared weights as one flat float32 buffer, the most advanced replica's weights
adopted), and the copies a federation hands out (:class:`Replica`, one :class:`Round`).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from ...errors import ConfigError
from ...model.segments import Segment
from ..config import GroupSpec
from .collective import ReplicaGroup, weights_sha256
from .rounds import flatten, floating_keys, size_of, unflatten

log = logging.getLogger(__name__)


@dataclass
class Replica:
    """A copy of the server segment that a client trains, with its optimizer."""

    segment: Segment
    optimizer: torch.optim.Optimizer


@dataclass
class Round:
    number: int = 1
    members: dict[str, Replica] = field(default_factory=dict)  # key -> its copy
    tokens: dict[str, int] = field(default_factory=dict)  # key -> target tokens this server trained for it
    synced: dict[str, int] = field(default_factory=dict)  # key -> samples (its FedAvg weight: those tokens)
    failed: dict[str, str] = field(default_factory=dict)  # key -> why its sync was refused (out of the round)
    weights: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)  # key -> client-side
    tickets: dict[str, str] = field(default_factory=dict)  # key -> its signed ticket (external)
    started: Optional[float] = None  # Federation.clock() of the first member


class Replicated:
    """The replica side of :class:`~.modes.Federation` (a mixin: every method reads its state,
    under its lock)."""

    def join_group(self, spec: GroupSpec, run: Callable) -> ReplicaGroup:
        """SplitFed across replicas: rounds over every replica's members, closed with
        torch.distributed (:mod:`.collective`); ``run`` executes on the compute thread."""
        if self.mode != "splitfed":
            raise ConfigError(f"--fed-store joins replicas' SplitFed rounds; federation mode {self.mode!r} "
                              f"cannot span replicas (a sequential turn is one global lock: run it on one server)")
        if not self.external and (self.clientside is None or self._client_reference() is None):
            raise ConfigError("SplitFed across replicas needs the initial client-side weights (every replica "
                              "bounds uploads around the same ones): serve --model, or use --client-weights external")
        self.group = ReplicaGroup(spec, self, run).start()
        return self.group

    def _shas(self) -> dict:
        return {"server": weights_sha256(self.base.segment.state_dict()),
                "client": None if self.client_weights is None else weights_sha256(self.client_weights)}

    def position(self) -> tuple[int, int]:
        with self.lock:
            return self.version, self.round.number

    def flat_size(self, with_client: bool) -> int:
        return size_of(self.base.segment.state_dict()) + (size_of(self._client_reference()) if with_client else 0)

    def state_flat(self) -> tuple[torch.Tensor, bool]:
        """The shared weights as one flat float32 buffer (server side, then client side if any)."""
        with self.lock:
            ref = self.base.segment.state_dict()
            server = flatten(ref, floating_keys(ref))
            if self.client_weights is None:
                return server, False
            return torch.cat([server, flatten(self.client_weights, floating_keys(self.client_weights))]), True

    def adopt_state(self, version: int, number: int, flat: torch.Tensor, with_client: bool) -> dict:
        """A replica behind the group takes the most advanced one's shared weights; its own
        round (if any) is dropped: its members' syncs were in the round that replica closed."""
        with self.lock:
            ref = self.base.segment.state_dict()
            n = size_of(ref)
            self._load_server(unflatten(flat[:n], ref))
            if with_client:
                self.client_weights = unflatten(flat[n:], self._client_reference())
                if self.clientside is not None:
                    self.clientside.forget_initial()
            if self.round.members:
                log.warning("round %d's %d members here are dropped: the group is at round %d",
                            self.round.number, len(self.round.members), number)
            self.version, self.round, self.closing = version, Round(number), False
            self.on_change()
            return self._shas()

    def _load_server(self, weights: dict[str, torch.Tensor]) -> None:
        self.base.segment.load_state_dict(weights)  # float32 -> the segment's dtype
