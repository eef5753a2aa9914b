"""``ServerConfig``: everything a splitlearn server is started with, validated once."""
from __future__ import annotations

import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from ..errors import ConfigError
from ..lora import LoraSpec
from .strategy import DEFAULT_MAX_MEMBER_SHARE, DEFAULT_MAX_UPDATE_NORM, make_strategy
from .tickets import check_secret
from .tenants import Tenants


@dataclass
class ServerConfig:
    model: Optional[str] = None  # model source (hub id, dir, JSON, spec name); or use `segment`
    cuts: tuple[int, ...] = ()  # one cut (server holds the top) or two (server holds the trunk)
    segment: Optional[str] = None  # an exported segment (its .json) to serve instead of `model`
    host: str = "127.0.0.1"
    port: int = 8000
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "float32"  # compute dtype of the segment: float32 | bfloat16 | float16
    optimizer: str = "adamw"  # adamw | sgd
    lr: float = 1e-3  # learning rate of the server's optimizer
    weight_decay: float = 0.0  # decoupled (AdamW) or L2 (SGD) weight decay
    seed: int = 0  # seed of random inits; must match the client's
    tokens: tuple[str, ...] = ()  # token-file lines ("<token>", "<name> <token> [operator]"; splitlearn/server/tenants.py); from SPLITLEARN_TOKEN (comma-separated) if empty
    allow_weak_tokens: bool = False  # accept tokens under 16 characters or the docs' examples
    checkpoint_dir: Optional[str] = None  # where the segment + optimizer state are saved
    checkpoint_every: int = 100  # steps between periodic checkpoints (0: only on SIGTERM/request)
    state_dir: Optional[str] = None  # replicas: per-client LoRA state in a directory shared by them (splitlearn/server/clientstate.py)
    max_body_bytes: int = 256 << 20  # requests larger than this get 413 unread
    max_echo_bytes: int = 4 << 20  # POST /v1/echo bodies (link diagnostics) larger than this get 413
    max_connections: int = 256  # open connections (splitlearn/server/frontdoor.py)
    request_timeout_s: float = 10.0  # seconds for a request's headers; bodies and answers get this + size / min rate
    min_rate_kib_s: float = 256.0  # KiB/s a request body must arrive at, and an answer be read at, on average
    idle_timeout_s: float = 300.0  # seconds a keep-alive connection with a valid token may idle
    token_out: Optional[str] = None  # where a generated token is written (0600); default <checkpoint_dir or cwd>/splitlearn-token
    max_request_memory_bytes: Optional[int] = None  # bytes of memory one request may cost (413 beyond); None: derived at start (splitlearn/server/budget.py)
    max_memory_bytes: Optional[int] = None  # bytes the server may hold for tenants in all (503 beyond); None: 2 x the per-request limit (splitlearn/server/memory.py)
    max_tenant_memory_bytes: Optional[int] = None  # bytes one tenant may hold (429 beyond); None: the total with one tenant, else the per-request limit
    max_batch: int = 64  # rows per request
    threads: int = 16  # WSGI worker threads (>= concurrent clients, so their decode steps can batch)
    torch_threads: Optional[int] = None  # intra-op threads of the compute thread (default: torch's)
    batching: bool = True  # batch concurrent sessions' decode steps into one forward
    packed_weights: bool = True  # decode on oneDNN prepacked weights (CPU float32; splitlearn/packed.py)
    poll_idle: bool = False  # keep the server's cores polling between requests (splitlearn/idlepoll.py)
    priority: str = "decode-first"  # decode-first: training yields to decode steps | fifo (splitlearn/server/priority.py)
    batch_wait_ms: float = 5.0  # how long a decode batch waits for the rest of the last batch's sessions
    decode_rows: int = 256  # rows of one decode batch at most, taken from tenants in turn (splitlearn/server/priority.py)
    decode_share: float = 0.5  # decode-first: seconds of decode per second of training at its preemption points
    session_ttl_s: float = 300.0  # idle seconds before a generation session is dropped
    max_sessions: int = 64  # open generation sessions on this server
    max_tokens_per_client: int = 65536  # cached tokens (rows x length) per tenant, over its sessions
    max_sessions_per_tenant: int = 16  # open generation sessions per tenant (of max_sessions in all)
    max_clients_per_tenant: int = 64  # client ids a tenant may train (each keeps a ledger entry, an adapter...)
    max_pending_per_tenant: int = 8  # training steps a tenant may have in flight at once
    federation: str = "shared"  # shared | sequential | splitfed (splitlearn/server/federation.py)
    clients_per_round: int = 2  # splitfed: clients whose sync closes a round
    round_timeout_s: float = 300.0  # seconds a splitfed round waits for syncs / a turn may idle
    lease_timeout_s: float = 60.0  # seconds a U-shape forward may wait for its backward
    client_weights: str = "server"  # server: syncs carry client weights | external: a fed server has them
    max_grad_norm: Optional[float] = None  # clip the server's gradient norm per step (None: off)
    aggregation: str = "fedavg"  # fedavg | median | trimmed-mean: how a round's updates combine (server/strategy.py)
    max_update_norm: Optional[float] = DEFAULT_MAX_UPDATE_NORM  # L2 bound of one member's update per round/turn, weight units (None: off)
    trim_beta: float = 0.2  # trimmed-mean: fraction of a round's members dropped at each end, per coordinate
    max_member_share: float = DEFAULT_MAX_MEMBER_SHARE  # fedavg: largest fraction of a round's weight (target tokens) one member holds (1: no cap)
    fed_secret: Optional[bytes] = field(default=None, repr=False)  # shared with the fed server: signs tickets (>= 32 bytes)
    fed_store: Optional[str] = None  # splitfed across replicas: HOST:PORT of their TCPStore (splitlearn/server/collective.py)
    fed_rank: int = 0  # this replica's index among --fed-world-size
    fed_world_size: int = 1  # replicas whose members form one round
    fed_timeout_s: float = 60.0  # longest wait of a collective close, or of a group's forming, seconds
    lora: Optional[LoraSpec] = None  # per-client LoRA adapters on a frozen segment (splitlearn/server/adapters.py)
    offload: bool = False  # serve the model's linear layers on masked inputs instead of a segment (docs/OFFLOAD.md)
    offload_plain: bool = False  # --offload: also answer unmasked float32 products (benchmark baseline)
    offload_record: Optional[str] = None  # test hook: save every offload input to this directory
    offload_tamper: int = 0  # test hook: alter one element of every offload answer from this product on (0: never)
    log_format: str = "text"  # text | json: one JSON object per log line (splitlearn/server/accesslog.py)
    request_log: bool = True  # count each request in /metrics and log its access line (False: the benchmark's baseline)
    metrics_port: Optional[int] = None  # also serve /metrics on 127.0.0.1:<port>, without a token (None: only GET /metrics, operator token)
    generated_token: bool = field(default=False, repr=False)  # True when we made the token up

    def __post_init__(self):
        if (self.model is None) == (self.segment is None):
            raise ConfigError("give exactly one of --model (with --cut) or --segment")
        if self.offload:
            self._check_offload()
        elif self.model is not None and not 1 <= len(self.cuts) <= 2:
            raise ConfigError("--model needs one --cut (2-way) or two (U-shape), or --offload")
        elif self.offload_plain or self.offload_record or self.offload_tamper:
            raise ConfigError("--offload-plain, --offload-record and --offload-tamper need --offload")
        if self.segment is not None and not Path(self.segment).with_suffix(".json").is_file():
            raise ConfigError(f"--segment {self.segment}: no such exported segment spec")
        if not 0 < self.port < 65536:
            raise ConfigError(f"--port must be in 1..65535, got {self.port}")
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
        if self.max_echo_bytes < 1 or self.max_connections < 1:
            raise ConfigError("--max-echo-mb and --max-connections must be > 0")
        if not (self.request_timeout_s > 0 and self.min_rate_kib_s > 0 and self.idle_timeout_s > 0):
            raise ConfigError("--request-timeout, --min-rate-kib and --idle-timeout must be > 0")
        if not (self.round_timeout_s > 0 and self.lease_timeout_s > 0):
            raise ConfigError("--round-timeout and --lease-timeout must be > 0 seconds")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ConfigError(f"--max-grad-norm must be > 0, got {self.max_grad_norm}")
        make_strategy(self.aggregation, self.max_update_norm, self.trim_beta, self.max_member_share)  # ConfigError if invalid
        if self.client_weights == "external" and self.federation != "shared" and self.fed_secret is None:
            raise ConfigError("--client-weights external needs --fed-secret-file (the secret shared with the "
                              "fed server, which signs each member's ticket: docs/FEDERATION.md)")
        if self.fed_secret is not None:
            check_secret(self.fed_secret)
        if self.fed_store is not None:
            if self.federation != "splitfed":
                raise ConfigError("--fed-store spans SplitFed rounds over replicas: it needs --federation splitfed "
                                  "(a sequential turn is one global lock; shared mode needs no group)")
            from .collective import GroupSpec
            GroupSpec(self.fed_store, self.fed_rank, self.fed_world_size, self.fed_timeout_s)  # ConfigError if invalid
        if self.priority not in ("decode-first", "fifo"):
            raise ConfigError(f"--priority must be decode-first or fifo, got {self.priority!r}")
        if self.decode_rows < 1 or not self.decode_share > 0:
            raise ConfigError(f"--decode-rows must be >= 1 and --decode-share > 0, got "
                              f"{self.decode_rows} and {self.decode_share}")
        if not 0 <= self.batch_wait_ms <= 1000:
            raise ConfigError(f"--batch-wait-ms must be in 0..1000, got {self.batch_wait_ms}")
        if self.max_request_memory_bytes is not None and self.max_request_memory_bytes < 1 << 20:
            raise ConfigError(f"--max-request-memory-gb must be at least 1 MiB (0.001), got "
                              f"{self.max_request_memory_bytes} bytes")
        for name in ("max_memory_bytes", "max_tenant_memory_bytes"):
            if getattr(self, name) is not None and getattr(self, name) < 1 << 20:
                raise ConfigError(f"--{name.replace('_bytes', '_gb').replace('_', '-')} must be at least "
                                  f"1 MiB (0.001), got {getattr(self, name)} bytes")
        if self.state_dir is not None and (self.lora is None or self.federation != "shared" or self.checkpoint_dir):
            raise ConfigError("--state-dir keeps each client's LoRA adapter apart: it needs --lora-r, "
                              "--federation shared and no --checkpoint-dir (the frozen base needs none)")
        if self.log_format not in ("text", "json"):
            raise ConfigError(f"--log-format must be text or json, got {self.log_format!r}")
        if self.metrics_port is not None and not (0 < self.metrics_port < 65536 and self.metrics_port != self.port):
            raise ConfigError(f"--metrics-port must be in 1..65535 and not --port, got {self.metrics_port}")
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

    def _check_offload(self) -> None:
        """``--offload``: a whole model, no cut, no training options; test hooks only when asked for."""
        if self.model is None or self.cuts or self.lora is not None:
            raise ConfigError("--offload serves a whole model's linear layers: give --model, no --cut, "
                              "--segment or --lora-r")
        if self.offload_tamper < 0:
            raise ConfigError(f"--offload-tamper must be >= 0, got {self.offload_tamper}")
        if (self.offload_record or self.offload_tamper) and os.environ.get("SPLITLEARN_TEST_HOOKS") != "1":
            raise ConfigError("--offload-record and --offload-tamper are test hooks: they need "
                              "SPLITLEARN_TEST_HOOKS=1 in the environment")
        if self.offload_record:
            Path(self.offload_record).mkdir(parents=True, exist_ok=True)

    def door_limits(self):
        """The connection limits as the front door takes them (:mod:`.frontdoor`)."""
        from .frontdoor import DoorLimits
        return DoorLimits(self.max_connections, self.request_timeout_s, self.min_rate_kib_s, self.idle_timeout_s)

