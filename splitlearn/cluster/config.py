"""``ClusterConfig``: what ``python -m splitlearn.cluster`` is started with, validated once.

Replica i runs ``python -m splitlearn.server <args after -->`` plus ``--host 127.0.0.1
--port <its port>``, ``--state-dir`` (per-client LoRA, default ``RUN_DIR/state``), its share of
each per-tenant cap and, for SplitFed over several replicas, ``--fed-store``/``--fed-rank``/
``--fed-world-size``. What it refuses and why: docs/CLUSTER.md."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from ..errors import ConfigError

RESERVED = ("--host", "--port", "--checkpoint-dir")  # server flags the cluster sets or refuses
GROUP_FLAGS = ("--fed-store", "--fed-rank", "--fed-world-size")  # set by the cluster for splitfed
# per-tenant caps each replica counts on its own: divided among the replicas (ServerConfig field of each)
TENANT_CAPS = {"--max-sessions-per-tenant": "max_sessions_per_tenant", "--max-tokens-per-client": "max_tokens_per_client",
               "--max-clients-per-tenant": "max_clients_per_tenant", "--max-pending-per-tenant": "max_pending_per_tenant"}


def _value(args: tuple[str, ...], flag: str) -> Optional[str]:
    """The value of ``flag`` in a server command line (``--flag v`` or ``--flag=v``); None if absent."""
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def _has(args: tuple[str, ...], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


@dataclass
class ClusterConfig:
    replicas: int  # servers to start (>= 1)
    port: int  # HAProxy's port: where clients connect
    run_dir: str  # replicas.json, haproxy.cfg, the replicas' logs, state/ (per-client LoRA state)
    server_args: tuple[str, ...]  # python -m splitlearn.server arguments, the same for every replica
    host: str = "127.0.0.1"  # HAProxy's bind address (0.0.0.0 to serve other machines: put TLS in front)
    replica_port: Optional[int] = None  # replica i listens on replica_port + i (None: free ports)
    haproxy: str = "haproxy"  # HAProxy executable
    cores_per_replica: int = 0  # pin replica i to cores [i*k, (i+1)*k) mod the machine's (0: no pinning)
    restart: bool = True  # start a replica again when it dies (on its port; its owners come back)
    check_interval_ms: int = 200  # HAProxy health check interval, milliseconds
    fall: int = 2  # failed checks before HAProxy takes a replica out
    rise: int = 2  # good checks before it is back
    server_timeout_s: int = 600  # the longest request a replica may take, seconds
    startup_timeout_s: float = 300.0  # seconds a replica may take to load its model
    fed_store_port: Optional[int] = None  # splitfed: the TCPStore's port on 127.0.0.1 (None: a free one)
    metrics_port: Optional[int] = None  # HAProxy's Prometheus exporter on 127.0.0.1:<port>, replica i's on <port>+1+i (None: none)
    state_dir: Optional[str] = field(default=None, init=False)  # derived: the shared per-client state

    def __post_init__(self):
        if self.replicas < 1:
            raise ConfigError(f"--replicas must be >= 1, got {self.replicas}")
        if not 0 < self.port < 65536:
            raise ConfigError(f"--port must be in 1..65535, got {self.port}")
        if self.replica_port is not None and not 0 < self.replica_port <= 65536 - self.replicas:
            raise ConfigError(f"--replica-port must leave room for {self.replicas} ports below 65536")
        if self.cores_per_replica < 0:
            raise ConfigError(f"--cores-per-replica must be >= 0, got {self.cores_per_replica}")
        if self.check_interval_ms < 10 or self.fall < 1 or self.rise < 1:
            raise ConfigError("--check-interval-ms must be >= 10, --fall and --rise >= 1")
        if self.server_timeout_s < 1 or not self.startup_timeout_s > 0:
            raise ConfigError("--server-timeout and --startup-timeout must be > 0")
        self.server_args = tuple(self.server_args)
        if not (_has(self.server_args, "--model") or _has(self.server_args, "--segment")):
            raise ConfigError("give the replicas' server arguments after --, e.g. "
                              "-- --model gpt2 --cut 2 --cut 10 --lora-r 8")
        for flag in RESERVED:
            if _has(self.server_args, flag):
                raise ConfigError(f"{flag} is not a replica argument: the cluster sets the replicas' "
                                  f"host and port, and per-client state goes to --state-dir (docs/CLUSTER.md)")
        for flag in GROUP_FLAGS:
            if _has(self.server_args, flag):
                raise ConfigError(f"{flag} is not a replica argument: the cluster sets each replica's place in "
                                  f"the SplitFed group (--fed-timeout may be given)")
        if self.metrics_port is not None and not 0 < self.metrics_port < 65535 - self.replicas:
            raise ConfigError(f"--metrics-port must leave room for {self.replicas + 1} ports below 65536")
        if _has(self.server_args, "--metrics-port"):
            raise ConfigError("--metrics-port is not a replica argument: give it to the cluster, which serves "
                              "HAProxy's metrics there and replica i's on the port + 1 + i")
        if self.fed_store_port is not None and not 0 < self.fed_store_port < 65536:
            raise ConfigError(f"--fed-store-port must be in 1..65535, got {self.fed_store_port}")
        if not (_has(self.server_args, "--token-file") or os.environ.get("SPLITLEARN_TOKEN")):
            raise ConfigError("the replicas must accept the same tokens: set SPLITLEARN_TOKEN or give "
                              "--token-file after --")
        fed = _value(self.server_args, "--federation")
        if fed == "sequential" and self.replicas > 1:
            raise ConfigError("--federation sequential cannot span replicas: the turn is one lock over every "
                              "client (one holder at a time, the next downloads what it uploaded), so replicas "
                              "would only pass it around and add a hop to each step; run it on one server "
                              "(--replicas 1), or use --federation splitfed, whose rounds do span replicas "
                              "(docs/CLUSTER.md)")
        self.replica_caps()  # a malformed cap: ConfigError now
        run = Path(self.run_dir)
        if self.lora_per_client:
            self.state_dir = _value(self.server_args, "--state-dir") or str(run / "state")

    @property
    def splitfed(self) -> bool:
        """SplitFed over several replicas: they meet in a torch.distributed group to close rounds."""
        return _value(self.server_args, "--federation") == "splitfed" and self.replicas > 1

    @property
    def lora_per_client(self) -> bool:
        """Per-client LoRA on a frozen base: the mode whose owners fail over with their state."""
        return _has(self.server_args, "--lora-r") and _value(self.server_args, "--federation") in (None, "shared")

    def replica_caps(self) -> list[str]:
        """Each per-tenant cap (given after ``--``, or the server's default) divided among the replicas,
        at least 1 each (docs/CLUSTER.md, 'Caps over the cluster'). Nothing with one replica."""
        if self.replicas == 1:
            return []
        from ..server.config import ServerConfig

        defaults = {f.name: f.default for f in dataclasses.fields(ServerConfig)}
        out = []
        for flag, name in TENANT_CAPS.items():
            given = _value(self.server_args, flag)
            try:
                total = defaults[name] if given is None else int(given)
            except ValueError:
                raise ConfigError(f"{flag} must be an integer, got {given!r}") from None
            if total < 1:
                raise ConfigError(f"{flag} must be >= 1, got {total}")
            out += [flag, str(max(1, total // self.replicas))]
        return out

    def replica_args(self, port: int, index: int = 0, store: Optional[str] = None) -> list[str]:
        """The server arguments of replica ``index`` on ``port`` (splitfed: ``store``, the TCPStore's
        HOST:PORT), with its share of each per-tenant cap after the given one (argparse keeps the last)."""
        extra = ["--host", "127.0.0.1", "--port", str(port)]
        if self.state_dir is not None and not _has(self.server_args, "--state-dir"):
            extra += ["--state-dir", self.state_dir]
        if self.splitfed:
            if store is None:
                raise ConfigError("a SplitFed replica needs the group's store address")
            extra += ["--fed-store", store, "--fed-rank", str(index), "--fed-world-size", str(self.replicas)]
        if self.metrics_port is not None:
            extra += ["--metrics-port", str(self.replica_metrics_port(index))]
        return [*self.server_args, *self.replica_caps(), *extra]

    def replica_metrics_port(self, index: int) -> Optional[int]:
        """Where replica ``index`` serves its metrics on 127.0.0.1 (None without --metrics-port)."""
        return None if self.metrics_port is None else self.metrics_port + 1 + index

    def cores(self, index: int) -> Optional[list[int]]:
        """The cores replica ``index`` is pinned to (None: not pinned)."""
        k = self.cores_per_replica
        if not k:
            return None
        n = os.cpu_count() or 1
        return sorted({(index * k + j) % n for j in range(k)})
