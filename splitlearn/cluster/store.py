"""The TCPStore where SplitFed replicas meet: ``python -m splitlearn.cluster.store --port P``.

``python -m splitlearn.cluster`` hosts it itself (on 127.0.0.1); run this module on one
machine when the replicas are started by hand on several (docs/CLUSTER.md, "Several
machines"), and give every replica ``--fed-store HOST:P``. It is torch.distributed's own
key-value store (``torch.distributed.TCPStore``): round counters, generations and the gloo
rendezvous (:mod:`splitlearn.server.collective`). It holds no weights. It authenticates
nobody: bind it to a private address. Exits on SIGTERM or SIGINT.
"""
from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from datetime import timedelta

log = logging.getLogger(__name__)


def host_store(host: str, port: int):
    """A TCPStore server on ``host:port`` (0: a free port; ``.port`` says which)."""
    import torch.distributed as dist

    return dist.TCPStore(host, port, None, True, timeout=timedelta(seconds=60), wait_for_workers=False)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m splitlearn.cluster.store",
                                description="the TCPStore where SplitFed replicas meet (docs/CLUSTER.md)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (a private network's)")
    p.add_argument("--port", type=int, default=29500)
    a = p.parse_args(argv)
    store = host_store(a.host, a.port)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    print(f"splitlearn fed store on {a.host}:{store.port}", file=sys.stderr, flush=True)
    stop.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
