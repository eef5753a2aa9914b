"""Where a federation round closes: :func:`close_round`, the one function every close calls.

Freeze (:class:`Contribution`: each upload bounded by :func:`bound`, flattened to one float32
buffer per side, with its FedAvg weight), combine (:func:`close_round` over a *collective*; the
:class:`Combined` answer is the same on every rank), apply (the caller). One server is a
collective of world size 1 (:data:`SOLO`); replicas pass a torch.distributed one
(:mod:`.collective`). Design: docs/FEDERATION.md, 'Where a round closes'.
"""
from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from typing import Callable, Optional, Protocol

import torch

from ...errors import BadRequest, ConfigError
from .aggregate import Aggregate, Weights, capped_weights, toward, update_limit, update_norm

log = logging.getLogger(__name__)

MAX_RANK_MEMBERS = 1 << 20  # a count any rank reports above this is refused (never a real round)


class Strategy(Protocol):
    """What a round reads of its rule (:class:`.strategy.Strategy`, which imports this module)."""

    name: str
    max_update_norm: Optional[float]
    max_update_ratio: Optional[float]
    max_share: Optional[float]

    def combine(self, bounded: list[torch.Tensor], samples: list[float]) -> torch.Tensor: ...


# -- flat buffers of weights ---------------------------------------------------------------

def floating_keys(reference: Weights) -> list[str]:
    return [k for k, t in reference.items() if t.is_floating_point()]


def flatten(weights: Weights, keys: list[str], dtype=torch.float32) -> torch.Tensor:
    if not keys:
        return torch.zeros(0, dtype=dtype)
    return torch.cat([weights[k].detach().reshape(-1).to(dtype) for k in keys])


def unflatten(flat: torch.Tensor, reference: Weights) -> Weights:
    """The reference's tensors with the floating ones taken from ``flat`` (float32); integer
    buffers kept (the strategies do not average them either)."""
    out, at = {}, 0
    for k, t in reference.items():
        if t.is_floating_point():
            n = t.numel()
            out[k] = flat[at:at + n].reshape(t.shape).float().clone()
            at += n
        else:
            out[k] = t.clone()
    if at != flat.numel():
        raise ConfigError(f"a flat buffer of {flat.numel()} values for weights of {at}")
    return out


def size_of(reference: Optional[Weights]) -> int:
    return 0 if reference is None else sum(t.numel() for t in reference.values() if t.is_floating_point())


def bound(strategy: Strategy, reference: Weights, weights: Weights) -> tuple[torch.Tensor, float, bool]:
    """One member's upload bounded around ``reference``: ``reference + d * min(1, M / ||d||)``
    (``M``: the strategy's ``max_update_norm``, at most ``max_update_ratio`` x ``||reference||``:
    :func:`.aggregate.update_limit`), float64 arithmetic, flattened to float32;
    with the update's norm as sent and whether it was scaled down."""
    norm = update_norm(reference, weights)
    limit = update_limit(strategy.max_update_norm, strategy.max_update_ratio, reference)
    scale = 1.0 if limit is None or norm <= limit else limit / norm
    parts = [(weights[k].float() if scale == 1.0 else toward(reference[k], weights[k], scale)).reshape(-1)
             for k in floating_keys(reference)]
    return (torch.cat(parts) if parts else torch.zeros(0)), norm, scale < 1.0


# -- a round, frozen and combined --------------------------------------------------------------

@dataclass
class Contribution:
    """One rank's part of a frozen round: its members' bounded uploads, flattened."""

    number: int  # the round
    samples: list[int]  # target tokens the server trained for each member (FedAvg weights)
    server: list[torch.Tensor]  # bounded flat uploads, float32, one per member
    client: list[torch.Tensor]  # the same for client-side weights (members that uploaded some)
    client_samples: list[int]
    server_size: int  # flat sizes, the same on every rank (one model)
    client_size: int
    norms: list[float] = field(default_factory=list)  # server side, as sent
    server_clipped: list[bool] = field(default_factory=list)  # per member: scaled down to the bound
    client_clipped: list[bool] = field(default_factory=list)
    client_reference: Optional[Weights] = None  # what the client side was bounded around (this rank's)

    @property
    def clipped(self) -> tuple[int, int]:
        return sum(self.server_clipped), sum(self.client_clipped)

    def add(self, strategy: Strategy, reference: Weights, weights: Weights, samples: int) -> None:
        """A member's server-side upload, bounded around ``reference``."""
        flat, norm, cut = bound(strategy, reference, weights)
        self.server.append(flat)
        self.samples.append(samples)
        self.norms.append(norm)
        self.server_clipped.append(cut)

    def add_client(self, strategy: Strategy, weights: Weights, samples: int) -> None:
        """A member's client-side upload, bounded around ``client_reference``."""
        flat, _, cut = bound(strategy, self.client_reference, weights)
        self.client.append(flat)
        self.client_samples.append(samples)
        self.client_clipped.append(cut)


def contribution(number: int, reference: Weights, client_reference: Optional[Weights] = None) -> Contribution:
    """An empty frozen round around the current shared weights (server side, client side)."""
    return Contribution(number, [], [], [], [], size_of(reference), size_of(client_reference),
                        client_reference=client_reference)


@dataclass
class Combined:
    """The round's result, the same on every rank."""

    server: Optional[torch.Tensor]  # flat float32 (None: nobody synced)
    client: Optional[torch.Tensor]
    members: int
    samples: int
    clipped: tuple[int, int]
    share_capped: int = 0  # members whose FedAvg weight --max-member-share lowered (server side)
    weights: list = field(default_factory=list)  # this rank's members' FedAvg weights as used


# -- collectives -------------------------------------------------------------------------------

class Collective(Protocol):
    """The reductions :func:`close_round` needs, over ``world`` ranks (tensors in place)."""

    world: int
    rank: int

    def all_reduce(self, t: torch.Tensor) -> None: ...  # SUM
    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]: ...  # every rank's t, in rank order
    def broadcast(self, t: torch.Tensor, src: int) -> None: ...


class Solo:
    """One server: a collective of world size 1, whose reductions are the identity."""

    world, rank = 1, 0

    def all_reduce(self, t: torch.Tensor) -> None:
        return None

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        return [t]

    def broadcast(self, t: torch.Tensor, src: int) -> None:
        return None


SOLO = Solo()


def _call(fn: Callable, *args):
    return fn(*args)


def close_round(strategy: Strategy, c: Contribution, comm: Collective = SOLO, run: Callable = _call) -> Combined:
    """Close one round: every rank of ``comm`` calls it with its own contribution and gets the
    same :class:`Combined`. ``run`` executes tensor work (a replica: on its compute thread)."""
    stats = torch.tensor([sum(c.samples), len(c.samples), sum(c.client_samples), len(c.client_samples),
                          *c.clipped], dtype=torch.float64)
    comm.all_reduce(stats)  # counts: exact in float64 (< 2^53)
    n, members, n_client, client_members = (int(x) for x in stats[:4])
    clipped = (int(stats[4]), int(stats[5]))
    if members == 0:
        return Combined(None, None, 0, 0, clipped)
    share_capped, weights = 0, list(c.samples)
    if strategy.name == "fedavg":
        client_weights = c.client_samples
        if strategy.max_share is not None:  # the cap weighs a member against the whole round
            weights, n, share_capped = capped_over(comm, strategy.max_share, c.samples)
            client_weights, n_client, _ = capped_over(comm, strategy.max_share, c.client_samples)
        flat = run(_weighted_sum, c, n, n_client, weights, client_weights)  # (Ps + Pc,) float64: this rank's share
        comm.all_reduce(flat)
        result = run(lambda: flat.float())
    else:
        result = _gather_robust(strategy, c, comm, run, client_members > 0)
    if not bool(torch.isfinite(result).all()):
        raise ConfigError("the round's combination is not finite: refused (a replica sent non-finite values)")
    if comm.world > 1:
        _check_same(comm, result)
    server = result[:c.server_size]
    client = result[c.server_size:] if client_members else None
    return Combined(server, client, members, int(stats[0]), clipped, share_capped, weights)


def capped_over(comm: Collective, max_share: float, samples: list[int]) -> tuple[list, float, int]:
    """This rank's members' FedAvg weights capped over the whole round
    (:func:`~.aggregate.capped_weights` on every rank's counts in rank order, so every rank
    computes the same), the round's total weight, and how many were lowered."""
    counts = [int(x) for x in comm.all_gather(torch.tensor([len(samples)], dtype=torch.int64))]
    if any(not 0 <= x <= MAX_RANK_MEMBERS for x in counts):
        raise ConfigError(f"a replica reports {counts} members")
    top = max(max(counts), 1)
    mine = torch.zeros(top, dtype=torch.float64)  # counts < 2^53: exact
    mine[:len(samples)] = torch.tensor(samples, dtype=torch.float64)
    every = comm.all_gather(mine)
    flat = [int(every[r][i]) for r in range(comm.world) for i in range(counts[r])]
    if not flat or sum(flat) <= 0:
        return samples, sum(samples), 0
    weights = capped_weights(flat, max_share)
    start = sum(counts[:comm.rank])
    return weights[start:start + len(samples)], sum(weights), sum(w != k for w, k in zip(weights, flat))


def _weighted_sum(c: Contribution, n: float, n_client: float, weights: list, client_weights: list) -> torch.Tensor:
    """``sum_k w'_k * (n_k / N)`` over this rank's members, as :class:`~.strategy.FedAvg`
    combines them (float64, weights as python numbers): server side, then client side."""
    acc = torch.zeros(c.server_size + c.client_size, dtype=torch.float64)
    srv, cli = acc[:c.server_size], acc[c.server_size:]
    for w, k in zip(c.server, weights):
        srv += w.double() * (k / n)
    for w, k in zip(c.client, client_weights):
        cli += w.double() * (k / n_client)
    return acc


def _gather_robust(strategy: Strategy, c: Contribution, comm: Collective, run: Callable,
                   with_client: bool) -> torch.Tensor:
    """Median / trimmed mean: every rank's bounded uploads to every rank (padded to the largest
    count), then the strategy's rule on all of them."""
    out = []
    for rows, size in ((c.server, c.server_size), (c.client if with_client else [], c.client_size if with_client else 0)):
        counts = [int(x) for x in comm.all_gather(torch.tensor([len(rows)], dtype=torch.int64))]
        if any(not 0 <= x <= MAX_RANK_MEMBERS for x in counts):
            raise ConfigError(f"a replica reports {counts} uploads")
        top = max(counts)
        if top == 0 or size == 0:
            out.append(torch.zeros(size))
            continue
        if comm.world == 1:
            uploads = list(rows)
        else:
            mine = torch.zeros(top, size)
            for i, w in enumerate(rows):
                mine[i] = w
            every = comm.all_gather(mine)
            uploads = [every[r][i] for r in range(comm.world) for i in range(counts[r])]
        out.append(run(lambda u=uploads: strategy.combine(u, [1] * len(u)).float()))
    return torch.cat(out)


def _digest(t: torch.Tensor) -> torch.Tensor:
    d = hashlib.sha256(t.detach().contiguous().numpy().tobytes()).digest()
    return torch.frombuffer(bytearray(d), dtype=torch.int64).clone()  # (4,)


def _check_same(comm: Collective, result: torch.Tensor) -> None:
    """Every rank holds the same bits (gloo's reductions give every rank the same result;
    checked, and repaired from rank 0 if not)."""
    every = comm.all_gather(_digest(result))
    if any(not torch.equal(e, every[0]) for e in every):
        log.error("replicas' round results differ: taking rank 0's")
        comm.broadcast(result, src=0)


# -- the weights API ---------------------------------------------------------------------------

def aggregate(strategy: Strategy, reference: Weights, updates: list[tuple[Weights, int]]) -> Aggregate:
    """A one-server round of ``updates`` ((weights, samples) per member) around ``reference``
    (the current shared weights, which every member started from): the new weights, float32."""
    if not updates:
        raise BadRequest("nothing to aggregate")
    samples = [int(n) for _, n in updates]
    if any(n < 0 for n in samples) or sum(samples) <= 0:
        raise BadRequest(f"sample counts must be >= 0 and add up to > 0, got {samples}")
    c = contribution(0, reference)
    for (w, _), n in zip(updates, samples):
        c.add(strategy, reference, w, n)
    result = close_round(strategy, c)
    return Aggregate(unflatten(result.server, reference), c.norms, c.server_clipped,
                     [w != n for w, n in zip(result.weights, samples)])
