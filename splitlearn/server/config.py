"""``ServerConfig``: everything a splitlearn server is started with, validated once.

The options come in groups, one dataclass each (:class:`Source`, :class:`Training`,
:class:`Access`, :class:`Door`, :class:`Limits`, :class:`Scheduling`,
:class:`FederationOptions`, :class:`StrategyOptions`, :class:`OffloadOptions`,
:class:`Observability`); ``ServerConfig`` is all of them (it inherits their fields, so
``cfg.max_batch`` and ``ServerConfig(max_batch=8)`` read and write one flat namespace), and
``python -m splitlearn.server``'s command line is generated from their fields
(:mod:`splitlearn.server.options`): each default and help text is written once, here. Every
group is keyword-only. The fed server's config reuses :class:`StrategyOptions` and
:class:`LoraOptions`.

Plain data the server's wings read (docs/ARCHITECTURE.md, 'The server'): this module imports
none of them. What the options' checks need lives here (the defaults, :class:`DoorLimits`,
:class:`GroupSpec`, the secret file, the strategy checks); what is built from a config is built
in the wing that owns it (``strategy_of`` and ``fairness_of`` in ``federation/``, the runtime in
``engine/``, the app and the doors in ``http/``).
"""
from __future__ import annotations

import os
import secrets
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional
from urllib.parse import urlsplit

from ..errors import ConfigError
from ..model.loraspec import LoraSpec  # plain data: --help imports no torch
from ..api.protocol import read_token_file
from .options import opt
from .tenants import Tenants

MiB, GiB = 1 << 20, 1 << 30
DEFAULT_GRAD_CLIP_FACTOR = 3.0  # x the typical step's gradient norm (splitlearn/server/engine/gradclip.py)
# the fairness options' defaults (federation/fairness.py): a turn of 100 steps or 60 s while another
# tenant waits (a client that syncs every 10 steps, as docs/FEDERATION.md's example, ends it long
# before); a refused tenant waits 5 s
DEFAULT_MAX_TURN_STEPS = 100
DEFAULT_MAX_TURN_S = 60.0
DEFAULT_WAIT_S = 5.0
# the strategy options (federation/strategy.py)
AGGREGATIONS = ("fedavg", "median", "trimmed-mean")
# --max-update-norm's default, above every honest round measured: docs/FEDERATION.md,
# '`--max-update-norm`: the default, measured'.
DEFAULT_MAX_UPDATE_NORM = 100.0
# --max-update-ratio's default: a member's update is also at most half the norm of the side it
# updates (honest rounds measured up to 0.43 of it; 100 alone is 2.7x tiny-demo's whole client
# side): docs/FEDERATION.md, the same section
DEFAULT_MAX_UPDATE_RATIO = 0.5
# --max-member-share's default: no member holds the majority of a round's FedAvg weight; it bites
# only when one member trained more target tokens than all the others together.
DEFAULT_MAX_MEMBER_SHARE = 0.5
MIN_SECRET_BYTES = 32  # the fed secret's (federation/tickets.py)
LINGER_S = 2.0  # after a refusal, what the client still sends is dropped this long, then we close (http/frontdoor.py)
MAX_HEADER_BYTES = 64 << 10  # a request line + headers (waitress's default: 256 KiB)
# connection slots beyond --max-connections that no tenant may hold: a tokenless probe (HAProxy's
# GET /v1/ready) always finds one, the oldest tokenless connection making room (http/frontdoor.py)
PROBE_SLOTS = 4


def _yes_no(v: str) -> bool:
    if v.lower() in ("yes", "on", "true", "1"):
        return True
    if v.lower() in ("no", "off", "false", "0"):
        return False
    raise ConfigError(f"--allow-weight-export takes yes or no (or nothing: yes), got {v!r}")


def check_bounds(max_update_norm: Optional[float], max_share: Optional[float]) -> None:
    """``--max-update-norm`` and ``--max-member-share`` of a strategy (ConfigError if invalid)."""
    if max_update_norm is not None and not max_update_norm > 0:
        raise ConfigError(f"--max-update-norm must be > 0, got {max_update_norm}")
    if max_share is not None and not 0 < max_share <= 1:
        raise ConfigError(f"--max-member-share must be in (0, 1], got {max_share}")


def check_ratio(max_update_ratio: Optional[float]) -> None:
    """``--max-update-ratio`` (ConfigError if invalid)."""
    if max_update_ratio is not None and not max_update_ratio > 0:
        raise ConfigError(f"--max-update-ratio must be > 0, got {max_update_ratio}")


def check_trim_beta(beta: float) -> None:
    if not 0 <= beta < 0.5:
        raise ConfigError(f"--trim-beta must be in [0, 0.5), got {beta}")


def check_aggregation(aggregation: str) -> None:
    if aggregation not in AGGREGATIONS:
        raise ConfigError(f"--aggregation must be one of {', '.join(AGGREGATIONS)}, got {aggregation!r}")


def check_strategy(aggregation: str, max_update_norm: Optional[float], trim_beta: float,
                   max_share: Optional[float]) -> None:
    """ConfigError unless these make a strategy: the checks ``federation.strategy.make_strategy``
    runs, in its order."""
    check_aggregation(aggregation)
    check_bounds(max_update_norm, max_share)
    if aggregation == "trimmed-mean":
        check_trim_beta(trim_beta)


def read_secret_file(path: str) -> bytes:
    """The shared secret: the file's contents, stripped; at least 32 bytes."""
    try:
        secret = Path(path).read_bytes().strip()
    except OSError as e:
        raise ConfigError(f"cannot read --fed-secret-file {path}: {e}") from None
    check_secret(secret)
    return secret


def check_secret(secret: bytes) -> None:
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigError(f"the fed secret must be at least {MIN_SECRET_BYTES} bytes (it has {len(secret)}): "
                          f"python -c 'import secrets; print(secrets.token_urlsafe(48))' > fed.secret")


def socket_path(url: str) -> str:
    """The socket file of a ``unix:///path`` URL (ConfigError for anything else)."""
    parts = urlsplit(url)
    if parts.scheme != "unix" or parts.netloc or not parts.path or parts.query or parts.fragment:
        raise ConfigError(f"--listen takes unix:///absolute/path.sock, got {url!r}")
    return parts.path


@dataclass(frozen=True)
class DoorLimits:
    """What one connection may hold and for how long (reported in ``/v1/info`` "limits")."""

    max_connections: int = 256  # open connections; more wait in the listen backlog
    request_timeout_s: float = 10.0  # headers complete by then; bodies and answers get this plus size / min rate
    min_rate_kib_s: float = 256.0  # KiB/s: a body's bytes are due at this rate as they come; an answer is read at it on average
    idle_timeout_s: float = 300.0  # a keep-alive connection with a valid token may idle this long
    max_tenant_connections: Optional[int] = None  # connections one tenant may hold (None: an equal share)

    def __post_init__(self):
        if self.max_connections < 1:
            raise ConfigError(f"--max-connections must be >= 1, got {self.max_connections}")
        if self.max_tenant_connections is not None and self.max_tenant_connections < 1:
            raise ConfigError(f"--max-tenant-connections must be >= 1, got {self.max_tenant_connections}")
        if not (self.request_timeout_s > 0 and self.min_rate_kib_s > 0 and self.idle_timeout_s > 0):
            raise ConfigError("--request-timeout, --min-rate-kib and --idle-timeout must be > 0")

    def at_min_rate_s(self, nbytes: int) -> float:
        """Seconds ``nbytes`` take at the minimum rate."""
        return nbytes / (self.min_rate_kib_s * 1024)

    def allowance_s(self, nbytes: int) -> float:
        """Seconds a transfer of ``nbytes`` may take: the grace plus the bytes at the minimum rate."""
        return self.request_timeout_s + self.at_min_rate_s(nbytes)

    def tenant_connections(self, tenants: int) -> int:
        """Connections one of ``tenants`` tenants may hold at once: ``max_tenant_connections``
        (at most ``max_connections``), else ``max_connections`` shared equally (at least 1)."""
        if self.max_tenant_connections is not None:
            return min(self.max_tenant_connections, self.max_connections)
        return max(1, self.max_connections // max(1, tenants))

    def as_info(self) -> dict:
        return {**asdict(self), "max_header_bytes": MAX_HEADER_BYTES, "linger_s": LINGER_S,
                "probe_slots": PROBE_SLOTS}


FILE_STORE = "file://"  # --fed-store file:///abs/path: a FileStore in a private directory (one host)


def parse_store(addr: str) -> tuple[str, int]:
    """``host:port`` of the TCPStore, or ``("file", 0)`` for ``file:///abs/path`` (a FileStore,
    the cluster's on one host: only this user may open it; docs/SECURITY.md, 'The store');
    ConfigError if malformed."""
    if str(addr).startswith(FILE_STORE):
        if not str(addr)[len(FILE_STORE):].startswith("/"):
            raise ConfigError(f"--fed-store file:// needs an absolute path (file:///dir/store), got {addr!r}")
        return "file", 0
    host, sep, port = str(addr).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--fed-store must be HOST:PORT (a TCPStore) or file:///PATH, got {addr!r}")
    return host.strip("[]"), int(port)


@dataclass(frozen=True)
class GroupSpec:
    """Where a replica finds the others: ``--fed-store``, ``--fed-rank``, ``--fed-world-size``."""

    store: str  # host:port of the TCPStore (python -m splitlearn.cluster hosts it)
    index: int  # this replica's index, 0 .. world - 1 (its rank when all are in)
    world: int  # replicas in the cluster
    timeout_s: float = 60.0  # a collective's, and a generation's join, longest wait

    def __post_init__(self):
        parse_store(self.store)
        if self.world < 1 or not 0 <= self.index < self.world:
            raise ConfigError(f"--fed-rank must be in 0..--fed-world-size - 1, got {self.index} of {self.world}")
        if not self.timeout_s > 0:
            raise ConfigError(f"--fed-timeout must be > 0, got {self.timeout_s}")


def norm_or_none(text: str) -> Optional[float]:
    """``--max-update-norm``, ``--grad-clip-factor``: a number, or ``none`` for no bound."""
    return None if str(text).strip().lower() == "none" else float(text)


@dataclass(kw_only=True)
class Source:
    """What the server serves"""

    model: Optional[str] = opt(None, "model source: hub id, local dir, JSON config or spec name (see models/)",
                               group="source")
    segment: Optional[str] = opt(None, "an exported segment (out_dir/trunk.json) to serve alone", group="source")
    cuts: tuple[int, ...] = opt((), "block index to cut at; once for 2-way (server holds the top), twice for U-shape",
                                flag="--cut")
    device: str = opt("auto", "where the segment runs", choices=("auto", "cpu", "cuda"))
    dtype: str = opt("float32", "compute dtype of the segment", choices=("float32", "bfloat16", "float16"))
    seed: int = opt(0, "seed of random inits (must match the client's)")


@dataclass(kw_only=True)
class Training:
    """Training the segment"""

    optimizer: str = opt("adamw", "the server's optimizer (AdamW: decoupled weight decay; SGD: L2)",
                         choices=("adamw", "sgd"))
    lr: float = opt(1e-3, "learning rate of the server's optimizer")
    weight_decay: float = opt(0.0, "weight decay of the server's optimizer")
    max_grad_norm: Optional[float] = opt(None, "clip the server's gradient norm per step to this fixed bound "
                                               "(replaces --grad-clip-factor)")
    grad_clip_factor: Optional[float] = opt(
        DEFAULT_GRAD_CLIP_FACTOR, f"on the segment tenants share (two or more), clip a step's gradient norm to "
                                  f"this many times the running geometric mean of the steps before it ('none': "
                                  f"no clip; default {DEFAULT_GRAD_CLIP_FACTOR:g}; splitlearn/server/engine/gradclip.py)",
        type=norm_or_none)
    grad_clip_window: int = opt(100, "steps the --grad-clip-factor mean spans (an EMA of weight 1/window)")
    grad_clip_warmup: int = opt(10, "first steps of the shared segment whose bound is --grad-clip-factor squared "
                                    "(the first steps of a training vary most)")
    checkpoint_dir: Optional[str] = opt(None, "save segment + optimizer state here periodically and on SIGTERM")
    checkpoint_every: int = opt(100, "steps between checkpoints (0: only on SIGTERM or request)")
    state_dir: Optional[str] = opt(None, "replicas (docs/CLUSTER.md): keep each client's LoRA adapter, optimizer "
                                         "and step record here, shared by the replicas, saved every "
                                         "--checkpoint-every steps of that client (needs --lora-r)")
    lease_timeout_s: float = opt(60.0, "seconds a U-shape forward holds the segment waiting for its backward")
    lora: Optional[LoraSpec] = opt(None, cli=False)  # per-client LoRA adapters on a frozen segment (--lora-*: LoraOptions)


@dataclass(kw_only=True)
class LoraOptions:
    """LoRA adapters per client (docs/LORA.md)"""

    lora_r: Optional[int] = opt(None, "train per-client LoRA adapters of this rank on a frozen segment (docs/LORA.md)")
    lora_alpha: Optional[float] = opt(None, "LoRA scale alpha/r (default: 2r)")
    lora_targets: Optional[str] = opt(None, "comma-separated module names of the model's layers (q_proj, v_proj, "
                                            "...: docs/LORA.md); default: the family's attention default "
                                            "(peft's table: Llama's q_proj,v_proj, GPT-2's fused q/k/v)")
    lora_dropout: float = opt(0.0, "dropout on the adapters' input")

    def spec(self) -> Optional[LoraSpec]:
        """These options as a :class:`LoraSpec` (ConfigError if invalid); None without ``--lora-r``."""
        if self.lora_r is None:
            if self.lora_alpha is not None or self.lora_targets is not None or self.lora_dropout:
                raise ConfigError("--lora-alpha, --lora-targets and --lora-dropout need --lora-r")
            return None
        alpha = 2.0 * self.lora_r if self.lora_alpha is None else self.lora_alpha
        return LoraSpec(self.lora_r, alpha, self.lora_targets, self.lora_dropout)


@dataclass(kw_only=True)
class Access:
    """Tenants and their tokens (docs/SECURITY.md)"""

    tokens: tuple[str, ...] = opt((), "the tenants' bearer tokens, one per line: '<token>', '<name> <token>' or "
                                      "'<name> <token> operator' (default: $SPLITLEARN_TOKEN, comma-separated; "
                                      "see docs/SECURITY.md)", flag="--token-file", parse=read_token_file,
                                  metavar="TOKEN_FILE")
    allow_weak_tokens: bool = opt(False, "accept tokens shorter than 16 characters or the docs' examples "
                                         "(never in production)")
    token_out: Optional[str] = opt(None, "where to write a generated token, mode 0600 (without --token-file and "
                                         "$SPLITLEARN_TOKEN; default <checkpoint-dir or .>/splitlearn-token)")
    generated_token: bool = field(default=False, repr=False)  # True when we made the token up
    # None: on for a server with one tenant and the operator, off for others (GET /v1/clients/<id>/weights)
    allow_weight_export: Optional[bool] = opt(
        None, "let a tenant read its segment's weights (GET /v1/clients/<id>/weights: merge_and_unload, "
              "train --export-merged); 'no' refuses it to every token (default: on for a server with one tenant "
              "and for the operator's token, off for the others)",
        parse=lambda v: v is None or _yes_no(v), nargs="?", metavar="yes|no")

    def weight_export(self, operator: bool) -> bool:
        """Whether a tenant (``operator``: the operator's token) may read the segment's weights:
        as ``--allow-weight-export`` says; by default the operator and the one tenant of a server."""
        if self.allow_weight_export is not None:
            return self.allow_weight_export
        return operator or len(self.tenants) == 1


@dataclass(kw_only=True)
class Door:
    """HTTP: the address, the WSGI threads and the front door's limits (splitlearn/server/http/frontdoor.py)"""

    host: str = opt("127.0.0.1", "address to listen on")
    port: int = opt(8000, "port to listen on")
    threads: int = opt(16, "WSGI threads; >= concurrent clients so decode steps batch")
    max_body_bytes: int = opt(256 * MiB, "larger request bodies get 413 (MiB)", flag="--max-body-mb", unit=MiB)
    max_echo_bytes: int = opt(4 * MiB, "larger POST /v1/echo bodies get 413 (MiB)", flag="--max-echo-mb", unit=MiB)
    max_connections: int = opt(256, "open connections at once")
    max_tenant_connections: Optional[int] = opt(
        None, "open connections one tenant may hold (429 beyond, at its token); default: --max-connections "
              "shared equally between the tenants")
    request_timeout_s: float = opt(10.0, "seconds for a request's headers; its body, and the reading of an answer, "
                                         "get this plus their size at --min-rate-kib "
                                         "(docs: splitlearn/server/http/frontdoor.py)")
    min_rate_kib_s: float = opt(256.0, "KiB/s a body's bytes must arrive at as they come (after --request-timeout), and an answer be read at")
    idle_timeout_s: float = opt(300.0, "seconds an authenticated keep-alive connection may idle")
    listen: tuple[str, ...] = opt((), "also serve on a Unix socket, unix:///PATH.sock (same routes, tokens and "
                                      "limits; bodies through shared memory: docs/TRANSPORT.md); repeatable")
    tcp: bool = opt(True, "with --listen: serve only on the Unix socket(s), not on --host/--port", flag="--no-tcp")
    unix_mode: str = opt("0600", "mode of the --listen socket file (0660: the group's processes may connect)",
                         choices=("0600", "0660"))
    drain_s: float = opt(0.0, "on SIGTERM, answer GET /v1/ready 503 (draining) and go on serving this many seconds, "
                              "so a load balancer moves traffic away first; then checkpoint and stop "
                              "(a second SIGTERM stops at once)", flag="--drain-seconds")

    def door_limits(self):
        """The connection limits as the doors take them (:mod:`splitlearn.server.http.frontdoor`)."""
        return DoorLimits(self.max_connections, self.request_timeout_s, self.min_rate_kib_s, self.idle_timeout_s,
                          self.max_tenant_connections)


@dataclass(kw_only=True)
class Limits:
    """What one request, tenant and the server may hold (splitlearn/server/engine/budget.py, memory.py)"""

    max_request_memory_bytes: Optional[int] = opt(
        None, "memory one request may cost (GiB; 413 beyond, before allocating); default: half of the memory "
              "free at start less the training state (splitlearn/server/engine/budget.py)",
        flag="--max-request-memory-gb", unit=GiB)
    max_memory_bytes: Optional[int] = opt(
        None, "memory (GiB) the server may hold for its tenants in all: request bodies and prices, waiting "
              "graphs, stored answers, generation caches (503 beyond); default: 0.75 of the memory free at start "
              "less the training state, or twice --max-request-memory-gb when it is given "
              "(splitlearn/server/engine/memory.py)", flag="--max-memory-gb", unit=GiB)
    max_tenant_memory_bytes: Optional[int] = opt(
        None, "what one tenant may hold of it (429 beyond); default: all with one tenant, else "
              "--max-request-memory-gb", flag="--max-tenant-memory-gb", unit=GiB)
    max_batch: int = opt(64, "rows per request")
    session_ttl_s: float = opt(300.0, "idle seconds before a session expires")
    max_sessions: int = opt(64, "open generation sessions on this server")
    max_tokens_per_client: int = opt(65536, "cached generation tokens (rows x length) per tenant, over its sessions")
    max_sessions_per_tenant: int = opt(16, "open generation sessions per tenant (--max-sessions is the server's total)")
    max_clients_per_tenant: int = opt(64, "client ids one tenant may train with (each holds server state)")
    max_pending_per_tenant: int = opt(8, "training steps one tenant may have in flight at once")


@dataclass(kw_only=True)
class Scheduling:
    """The compute thread: decode batches and priorities (splitlearn/server/engine/priority.py)"""

    profile_dir: Optional[str] = opt(None, "record torch.profiler on the compute thread (its CPU ops; every CUDA "
                                           "kernel and copy on a GPU) from start to SIGTERM/SIGINT, then write its "
                                           "tables to DIR/server-profile.txt (slows the server: for finding where "
                                           "time goes; docs/PERFORMANCE.md)", metavar="DIR")
    torch_threads: Optional[int] = opt(None, "intra-op threads for the segment (default: torch's, one per core)")
    batching: bool = opt(True, "run concurrent sessions' decode steps one at a time (for comparison)",
                         flag="--no-batching")
    packed_weights: bool = opt(True, "decode on the layers' own matrix products, not on oneDNN prepacked copies "
                                     "of the weights (which are faster for a few rows and cost a second copy in "
                                     "memory)", flag="--no-packed-weights")
    poll_idle: bool = opt(False, "keep this server's cores polling instead of sleeping between requests (Linux; "
                                 "lower latency per step for the cores' idle time: splitlearn/procs/idlepoll.py)")
    priority: str = opt("decode-first", "decode-first: a training step yields to queued decode steps between its "
                                        "linear layers (forward and backward); fifo: arrival order "
                                        "(splitlearn/server/engine/priority.py)", choices=("decode-first", "fifo"))
    batch_wait_ms: float = opt(5.0, "how long a decode batch may wait for the sessions of the previous batch still "
                                    "on their way (0: never wait; see splitlearn/server/engine/batching.py)")
    decode_rows: int = opt(256, "rows of one decode batch at most, taken from the tenants' queued steps in turn "
                                "(the rest wait for the next batch; splitlearn/server/engine/priority.py)")
    decode_graphs: int = opt(0, "CUDA: replay the row-wise parts of the batched decode (layer norms, matrix "
                                "products, MLP) as CUDA graphs for up to this many batch sizes (0: off; not yet "
                                "measured on a GPU: splitlearn/server/engine/graphs.py)")
    decode_share: float = opt(0.5, "decode-first: seconds of decode per second of training that a training step's "
                                   "preemption points may run (bounds how much decode steps slow a training step)")


@dataclass(kw_only=True)
class FederationOptions:
    """Several data owners (docs/FEDERATION.md, docs/CLUSTER.md)"""

    federation: str = opt("shared", "how several data owners share the model (docs/FEDERATION.md)",
                          choices=("shared", "sequential", "splitfed"))
    clients_per_round: int = opt(2, "splitfed: syncs that close a round")
    round_timeout_s: float = opt(300.0, "seconds a splitfed round waits for its syncs, or a sequential turn may idle")
    client_weights: str = opt("server", "external: clients share their client-side weights through a separate fed "
                                        "server (python -m splitlearn.server.http.fedapp); this one never "
                                        "sees them", choices=("server", "external"))
    fed_secret: Optional[bytes] = opt(None, "--client-weights external: file with the secret shared with the fed "
                                            "server (>= 32 bytes), which signs each member's ticket",
                                      flag="--fed-secret-file", parse=read_secret_file, repr=False)
    fed_store: Optional[str] = opt(None, "splitfed across replicas: the store where they meet, file:///PATH "
                                         "(one host: a file only this user may open) or a TCPStore's "
                                         "HOST:PORT (python -m splitlearn.cluster sets it; docs/CLUSTER.md); "
                                         "rounds close with a torch.distributed gloo collective",
                                   metavar="file:///PATH|HOST:PORT")
    fed_rank: int = opt(0, "--fed-store: this replica's index, 0..R-1")
    fed_world_size: int = opt(1, "--fed-store: the number of replicas R")
    fed_timeout_s: float = opt(60.0, "--fed-store: seconds a round's collective close (or the group's forming) "
                                     "waits for a replica")
    max_tenant_seats: Optional[int] = opt(
        None, "splitfed: seats of a round one tenant's client ids may take while another tenant waits for one "
              "(default: half of --clients-per-round, rounded up; docs/FEDERATION.md, 'Fair federation')")
    max_turn_steps: int = opt(DEFAULT_MAX_TURN_STEPS, "sequential: training steps a turn may take while another "
                                                      "tenant waits; then the turn passes to it")
    max_turn_s: float = opt(DEFAULT_MAX_TURN_S, "sequential: seconds a turn may last while another tenant waits; "
                                                "then the turn passes to it", flag="--max-turn-seconds")
    fair_wait_s: float = opt(DEFAULT_WAIT_S, "seconds a tenant refused a seat or the turn still counts as waiting "
                                             "after its last try (its client retries every second at most): "
                                             "seats and the next turn are held for it meanwhile",
                             flag="--fair-wait-seconds")


@dataclass(kw_only=True)
class StrategyOptions:
    """How a round's updates combine (splitlearn/server/federation/strategy.py)"""

    aggregation: str = opt("fedavg", "how a splitfed round's updates combine: sample-weighted mean, or the "
                                     "coordinate-wise median / trimmed mean (robust to a few bad members; "
                                     "docs/FEDERATION.md)", choices=AGGREGATIONS)
    max_update_norm: Optional[float] = opt(
        DEFAULT_MAX_UPDATE_NORM, f"bound on the L2 norm of one member's update per round or turn, around the shared "
                                 f"weights ('none': unbounded; default {DEFAULT_MAX_UPDATE_NORM:g}, docs/FEDERATION.md)",
        type=norm_or_none)
    max_update_ratio: Optional[float] = opt(
        DEFAULT_MAX_UPDATE_RATIO, f"... and at most this times the L2 norm of the weights it updates (each side its "
                                  f"own; 'none': --max-update-norm alone; default {DEFAULT_MAX_UPDATE_RATIO:g}, "
                                  f"docs/FEDERATION.md)", type=norm_or_none)
    trim_beta: float = opt(0.2, "--aggregation trimmed-mean: fraction of the members dropped at each end, per coordinate")
    max_member_share: float = opt(
        DEFAULT_MAX_MEMBER_SHARE, f"largest fraction of a splitfed round's FedAvg weight (target tokens trained) one "
                                  f"member may hold (1: no cap; default {DEFAULT_MAX_MEMBER_SHARE:g}, docs/FEDERATION.md)")

    def check_strategy(self) -> None:
        """ConfigError unless these options make a strategy (``federation.strategy.strategy_of`` makes it)."""
        check_strategy(self.aggregation, self.max_update_norm, self.trim_beta, self.max_member_share)
        check_ratio(self.max_update_ratio)


@dataclass(kw_only=True)
class OffloadOptions:
    """Masked offload (docs/OFFLOAD.md)"""

    offload: bool = opt(False, "serve the linear layers of --model's blocks and LM head as products on one-time-"
                               "padded inputs (no --cut; client: splitlearn.OffloadGPT2LMHeadModel; docs/OFFLOAD.md)")
    offload_plain: bool = opt(False, "--offload: also answer unmasked float32 products (the benchmark's baseline)")


@dataclass(kw_only=True)
class Observability:
    """Logs and metrics (docs/OPERATIONS.md)"""

    log_level: str = opt("INFO", "the log level (DEBUG, INFO, WARNING, ERROR)")
    log_format: str = opt("text", "json: every log line one JSON object, with one access line per request "
                                  "(request id, tenant, route, status, bytes, ms; docs/OPERATIONS.md)",
                          choices=("text", "json"))
    metrics_port: Optional[int] = opt(None, "also serve Prometheus metrics on 127.0.0.1:PORT, to the operator's "
                                            "token as GET /metrics on --port (every local user reaches "
                                            "loopback; docs/OPERATIONS.md)")
    access_log: Optional[str] = opt(None, "write one access line per request (request id, tenant, route, status, "
                                          "bytes, ms) to this file, or to stderr for '-' (default: no access "
                                          "lines; the metrics count every request either way); made 0600, an existing one "
                                          "must be this user's own file", metavar="FILE")
    request_log: bool = opt(True, "neither count requests in the metrics nor log access lines (for comparison)",
                            flag="--no-request-log")


# the command line's sections, in --help's order (LoraOptions: ServerConfig.lora)
GROUPS = (Source, Training, LoraOptions, Access, Door, Limits, Scheduling, FederationOptions, StrategyOptions,
          OffloadOptions, Observability)


@dataclass(kw_only=True)
class ServerConfig(Observability, OffloadOptions, StrategyOptions, FederationOptions, Scheduling, Limits, Door,
                   Access, Training, Source):
    """Every option of a segment server (or an offload server), validated."""

    def __post_init__(self):
        if (self.model is None) == (self.segment is None):
            raise ConfigError("give exactly one of --model (with --cut) or --segment")
        if self.offload:
            if self.model is None or self.cuts or self.lora is not None:
                raise ConfigError("--offload serves a whole model's linear layers: give --model, no --cut, "
                                  "--segment or --lora-r")
        elif self.model is not None and not 1 <= len(self.cuts) <= 2:
            raise ConfigError("--model needs one --cut (2-way) or two (U-shape), or --offload")
        elif self.offload_plain:
            raise ConfigError("--offload-plain: unmasked offload products need --offload")
        if self.segment is not None and not Path(self.segment).with_suffix(".json").is_file():
            raise ConfigError(f"--segment {self.segment}: no such exported segment spec")
        if not 0 < self.port < 65536:
            raise ConfigError(f"--port must be in 1..65535, got {self.port}")
        if self.listen:
            for url in self.listen:
                socket_path(url)
        elif not self.tcp:
            raise ConfigError("--no-tcp needs a --listen unix:///PATH.sock to serve on")
        if self.optimizer not in ("adamw", "sgd"):
            raise ConfigError(f"--optimizer must be adamw or sgd, got {self.optimizer!r}")
        if not self.lr > 0:
            raise ConfigError(f"--lr must be > 0, got {self.lr}")
        for name in ("max_body_bytes", "max_batch", "threads", "max_sessions", "max_tokens_per_client",
                     "max_sessions_per_tenant", "max_clients_per_tenant", "max_pending_per_tenant"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.federation not in ("shared", "sequential", "splitfed"):
            raise ConfigError(f"--federation must be shared, sequential or splitfed, got {self.federation!r}")
        if self.client_weights not in ("server", "external"):
            raise ConfigError(f"--client-weights must be server or external, got {self.client_weights!r}")
        if self.clients_per_round < 1:
            raise ConfigError(f"--clients-per-round must be >= 1, got {self.clients_per_round}")
        if self.max_tenant_seats is not None and self.max_tenant_seats < 1:
            raise ConfigError(f"--max-tenant-seats must be >= 1, got {self.max_tenant_seats}")
        if self.max_turn_steps < 1 or not (self.max_turn_s > 0 and self.fair_wait_s > 0):
            raise ConfigError(f"--max-turn-steps must be >= 1, --max-turn-seconds and --fair-wait-seconds > 0, "
                              f"got {self.max_turn_steps}, {self.max_turn_s} and {self.fair_wait_s}")
        if self.max_echo_bytes < 1 or self.max_connections < 1:
            raise ConfigError("--max-echo-mb and --max-connections must be > 0")
        if self.max_tenant_connections is not None and self.max_tenant_connections < 1:
            raise ConfigError(f"--max-tenant-connections must be >= 1, got {self.max_tenant_connections}")
        if not (self.request_timeout_s > 0 and self.min_rate_kib_s > 0 and self.idle_timeout_s > 0):
            raise ConfigError("--request-timeout, --min-rate-kib and --idle-timeout must be > 0")
        if not (self.round_timeout_s > 0 and self.lease_timeout_s > 0):
            raise ConfigError("--round-timeout and --lease-timeout must be > 0 seconds")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ConfigError(f"--max-grad-norm must be > 0, got {self.max_grad_norm}")
        if self.grad_clip_factor is not None and not self.grad_clip_factor >= 1:
            raise ConfigError(f"--grad-clip-factor must be >= 1 (or 'none'), got {self.grad_clip_factor}")
        if self.grad_clip_window < 1 or self.grad_clip_warmup < 0:
            raise ConfigError(f"--grad-clip-window must be >= 1 step and --grad-clip-warmup >= 0, got "
                              f"{self.grad_clip_window} and {self.grad_clip_warmup}")
        self.check_strategy()
        if self.client_weights == "external" and self.federation != "shared" and self.fed_secret is None:
            raise ConfigError("--client-weights external needs --fed-secret-file (the secret shared with the "
                              "fed server, which signs each member's ticket: docs/FEDERATION.md)")
        if self.fed_secret is not None:
            check_secret(self.fed_secret)
        if self.fed_store is not None:
            if self.federation != "splitfed":
                raise ConfigError("--fed-store spans SplitFed rounds over replicas: it needs --federation splitfed "
                                  "(a sequential turn is one global lock; shared mode needs no group)")
            GroupSpec(self.fed_store, self.fed_rank, self.fed_world_size, self.fed_timeout_s)  # ConfigError if invalid
        if self.priority not in ("decode-first", "fifo"):
            raise ConfigError(f"--priority must be decode-first or fifo, got {self.priority!r}")
        if self.decode_rows < 1 or not self.decode_share > 0:
            raise ConfigError(f"--decode-rows must be >= 1 and --decode-share > 0, got "
                              f"{self.decode_rows} and {self.decode_share}")
        if not 0 <= self.decode_graphs <= 64:
            raise ConfigError(f"--decode-graphs must be in 0..64, got {self.decode_graphs}")
        if not 0 <= self.batch_wait_ms <= 1000:
            raise ConfigError(f"--batch-wait-ms must be in 0..1000, got {self.batch_wait_ms}")
        if self.max_request_memory_bytes is not None and self.max_request_memory_bytes < MiB:
            raise ConfigError(f"--max-request-memory-gb must be at least 1 MiB (0.001), got "
                              f"{self.max_request_memory_bytes} bytes")
        for name in ("max_memory_bytes", "max_tenant_memory_bytes"):
            if getattr(self, name) is not None and getattr(self, name) < MiB:
                raise ConfigError(f"--{name.replace('_bytes', '_gb').replace('_', '-')} must be at least "
                                  f"1 MiB (0.001), got {getattr(self, name)} bytes")
        if self.state_dir is not None and (self.lora is None or self.federation != "shared" or self.checkpoint_dir):
            raise ConfigError("--state-dir keeps each client's LoRA adapter apart: it needs --lora-r, "
                              "--federation shared and no --checkpoint-dir (the frozen base needs none)")
        if self.log_format not in ("text", "json"):
            raise ConfigError(f"--log-format must be text or json, got {self.log_format!r}")
        if self.metrics_port is not None and not (0 < self.metrics_port < 65536 and self.metrics_port != self.port):
            raise ConfigError(f"--metrics-port must be in 1..65535 and not --port, got {self.metrics_port}")
        if not 0 <= self.drain_s <= 3600:
            raise ConfigError(f"--drain-seconds must be in 0..3600, got {self.drain_s}")
        if self.torch_threads is not None and self.torch_threads < 1:
            raise ConfigError(f"--torch-threads must be >= 1, got {self.torch_threads}")
        if not self.tokens:
            env = os.environ.get("SPLITLEARN_TOKEN", "")
            self.tokens = tuple(t.strip() for t in env.split(",") if t.strip())
        if not self.tokens:
            self.tokens = (secrets.token_urlsafe(32),)
            self.generated_token = True
        self.tokens = tuple(self.tokens)
        self.tenants = Tenants(self.tokens, self.allow_weak_tokens)  # ConfigError for weak or malformed ones
        self.cuts = tuple(self.cuts)
