"""HAProxy in front of the replicas: the configuration, checked, and the process.

The configuration written (routing on ``X-Splitlearn-Route`` rewritten to the authenticated
tenant, consistent hashing, health checks on ``/v1/ready``, failover, the metrics frontend) and why each line:
docs/CLUSTER.md, 'Routing'."""
from __future__ import annotations

import logging
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from ..api import protocol as P
from ..errors import ConfigError

log = logging.getLogger(__name__)

TEMPLATE = """\
# Written by python -m splitlearn.cluster (splitlearn/cluster/haproxy.py); docs/CLUSTER.md.
global
    maxconn {maxconn}
    nbthread {threads}

defaults
    mode http
    timeout connect {connect_ms}ms
    timeout client {client_s}s
    timeout server {server_s}s
    timeout http-request 60s
    timeout http-keep-alive {client_s}s
    timeout queue 30s
    timeout check 2s
    retries 3
    option redispatch 1

frontend splitlearn
    bind {bind}
    # the route names the authenticated tenant (a hash of the Authorization header) + the client id:
    # a tenant cannot route as another one, whatever it sends
    http-request set-header {route_header} %[req.hdr(Authorization),sha2(256),hex]:%[req.hdr({route_header}),field(2,:)]
    default_backend replicas

backend replicas
    balance hdr({route_header})
    hash-type consistent
    # a connection to a replica carries one client connection's requests, never another's: the
    # replica counts it against that tenant's own --max-tenant-connections (a probe's slot is
    # never a tenant's: splitlearn/server/http/frontdoor.py)
    http-reuse never
    # readiness, not liveness: a replica up but not ready (model not loaded, compute thread gone,
    # state dir not writable) answers 503 and gets no traffic (splitlearn/server/http/probes.py)
    option httpchk GET {ready}
    http-check expect status 200
    http-response set-header {replica_header} %[srv_name]
    default-server check inter {inter_ms}ms fastinter {inter_ms}ms downinter {down_ms}ms fall {fall} rise {rise} observe layer4 error-limit 1 on-error mark-down on-marked-down shutdown-sessions
{servers}
{metrics}"""

METRICS_FRONTEND = """
frontend metrics
    # HAProxy's own Prometheus exporter, on loopback only (docs/OPERATIONS.md)
    bind {bind}
    http-request use-service prometheus-exporter if {{ path {path} }}
    http-request return status 404 content-type text/plain string "metrics are at {path}\\n"
    no log
"""


@dataclass
class HAProxySettings:
    bind: str  # "host:port" HAProxy listens on (where clients connect)
    servers: Sequence[tuple[str, str]]  # (name, "host:port") of each replica, in ring order
    inter_ms: int = 200  # health check interval, milliseconds
    fall: int = 2  # failed checks before a replica is out
    rise: int = 2  # good checks before it is back
    connect_ms: int = 1000  # timeout to connect to a replica, milliseconds
    server_s: int = 600  # the longest a replica may take to answer, seconds
    client_s: int = 600  # the longest a client connection may idle, seconds
    maxconn: int = 4096  # connections HAProxy accepts at once
    threads: int = 1  # HAProxy's threads (one is plenty for a few thousand requests/s)
    metrics: Optional[str] = None  # "127.0.0.1:port" of HAProxy's Prometheus exporter (None: none)

    def __post_init__(self):
        if not self.servers:
            raise ConfigError("HAProxy needs at least one replica")
        for name, value in (("inter_ms", self.inter_ms), ("fall", self.fall), ("rise", self.rise),
                            ("connect_ms", self.connect_ms), ("server_s", self.server_s),
                            ("client_s", self.client_s), ("maxconn", self.maxconn), ("threads", self.threads)):
            if value < 1:
                raise ConfigError(f"HAProxy setting {name} must be >= 1, got {value}")

    def render(self) -> str:
        servers = "\n".join(f"    server {name} {addr}" for name, addr in self.servers)
        metrics = METRICS_FRONTEND.format(bind=self.metrics, path=P.METRICS) if self.metrics else ""
        return TEMPLATE.format(maxconn=self.maxconn, threads=self.threads, connect_ms=self.connect_ms,
                               client_s=self.client_s, server_s=self.server_s, bind=self.bind,
                               route_header=P.ROUTE_HEADER, ready=P.READY, replica_header=P.REPLICA_HEADER,
                               inter_ms=self.inter_ms, down_ms=max(self.inter_ms, 500), fall=self.fall,
                               rise=self.rise, servers=servers, metrics=metrics)


def find_haproxy(binary: str = "haproxy") -> str:
    """The HAProxy executable's path; ConfigError naming the package when it is missing."""
    path = shutil.which(binary)
    if path is None:
        raise ConfigError(f"{binary!r} not found: install HAProxy (Debian/Ubuntu: apt-get install haproxy; "
                          f"it is the router in front of the replicas, docs/CLUSTER.md)")
    return path


def write_config(settings: HAProxySettings, path: Path, binary: str) -> Path:
    """Write the configuration and have HAProxy check it (``haproxy -c``); ConfigError if it
    does not pass."""
    path.write_text(settings.render())
    check = subprocess.run([binary, "-c", "-q", "-f", str(path)], capture_output=True, text=True)
    if check.returncode != 0:
        raise ConfigError(f"HAProxy refuses {path}: {(check.stderr or check.stdout).strip()[-800:]}")
    return path


def command(binary: str, config: Path) -> list[str]:
    """HAProxy in the foreground (``-db``: no daemon), as a child of the supervisor."""
    return [binary, "-db", "-f", str(config)]
