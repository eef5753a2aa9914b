"""``python -m splitlearn.cluster --replicas R --port P --run-dir D -- <server args>``.

Starts R ``python -m splitlearn.server <server args>`` replicas and HAProxy in front of them on
port P (:mod:`.supervisor`), writes ``D/replicas.json`` (each replica's pid and port) and
``D/haproxy.cfg``, and runs until SIGTERM or SIGINT, which stop everything. Exit codes: 0 after
a stop, 1 if HAProxy died, 2 for a configuration error (message on stderr).
"""
from __future__ import annotations

import argparse
import logging
import signal
import sys

from ..errors import SplitLearnError
from .config import ClusterConfig


def parse_args(argv=None) -> ClusterConfig:
    argv = list(sys.argv[1:] if argv is None else argv)
    ours, server = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(prog="python -m splitlearn.cluster", allow_abbrev=False,
                                description="R splitlearn server replicas behind HAProxy "
                                            "(server arguments after --; docs/CLUSTER.md)",
                                epilog="Per-client LoRA (--lora-r) replicas share --state-dir RUN_DIR/state and fail "
                                       "over. --federation splitfed spans the replicas: one round over every "
                                       "replica's members, closed with a torch.distributed (gloo) collective on "
                                       "the replicas' group (its store hosted here; --fed-timeout S after -- bounds "
                                       "how long a close waits for a dead replica). --federation sequential is "
                                       "refused with more than one replica (the turn is one global lock).")
    p.add_argument("--replicas", type=int, required=True, help="servers to start")
    p.add_argument("--port", type=int, required=True, help="HAProxy's port: where clients connect")
    p.add_argument("--run-dir", required=True,
                   help="replicas.json, haproxy.cfg, logs, and state/ (per-client LoRA state, shared)")
    p.add_argument("--host", default="127.0.0.1", help="HAProxy's bind address")
    p.add_argument("--replica-port", type=int, default=None,
                   help="replica i listens on this port + i (default: free ports)")
    p.add_argument("--haproxy", default="haproxy", help="the HAProxy executable")
    p.add_argument("--cores-per-replica", type=int, default=0,
                   help="pin replica i to cores [i*k, (i+1)*k) (0: no pinning)")
    p.add_argument("--no-restart", action="store_true", help="leave a replica that dies down")
    p.add_argument("--check-interval-ms", type=int, default=200, help="HAProxy's health check interval")
    p.add_argument("--fall", type=int, default=2, help="failed checks before a replica is out")
    p.add_argument("--rise", type=int, default=2, help="good checks before it is back")
    p.add_argument("--server-timeout", type=int, default=600, help="seconds a request may take on a replica")
    p.add_argument("--startup-timeout", type=float, default=300.0, help="seconds a replica may take to start")
    p.add_argument("--fed-store-port", type=int, default=None,
                   help="--federation splitfed: the replicas meet at a TCPStore on 127.0.0.1:PORT, which "
                        "every local user may reach and write (default: none, a file in RUN_DIR only this "
                        "user may open; docs/SECURITY.md, 'The store')")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="Prometheus metrics on 127.0.0.1: HAProxy's exporter at this port's /metrics, "
                        "replica i's at port + 1 + i (docs/OPERATIONS.md)")
    p.add_argument("--log-level", default="INFO")
    a = p.parse_args(ours)
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return ClusterConfig(replicas=a.replicas, port=a.port, run_dir=a.run_dir, server_args=tuple(server),
                         host=a.host, replica_port=a.replica_port, haproxy=a.haproxy,
                         cores_per_replica=a.cores_per_replica, restart=not a.no_restart,
                         check_interval_ms=a.check_interval_ms, fall=a.fall, rise=a.rise,
                         server_timeout_s=a.server_timeout, startup_timeout_s=a.startup_timeout,
                         fed_store_port=a.fed_store_port, metrics_port=a.metrics_port)


def main(argv=None) -> int:
    from .supervisor import Supervisor

    try:
        cfg = parse_args(argv)
        sup = Supervisor(cfg)
        signal.signal(signal.SIGTERM, sup.request_stop)
        signal.signal(signal.SIGINT, sup.request_stop)
        sup.start()
    except SplitLearnError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"splitlearn cluster: {cfg.replicas} replicas behind HAProxy at {sup.url} (ready; "
          f"{sup.manifest})", file=sys.stderr, flush=True)
    return sup.run()


if __name__ == "__main__":
    sys.exit(main())
