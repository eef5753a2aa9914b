"""The TCPStore where SplitFed replicas meet: ``python -m splitlearn.cluster.store --port P``.

Run it on one machine when the replicas are started by hand on several and give every replica
``--fed-store HOST:P``. It listens on the one address it is given and no other
(:func:`host_store`); exits on SIGTERM or SIGINT. See docs/CLUSTER.md, 'Several machines'."""
from __future__ import annotations

import argparse
import logging
import signal
import socket
import sys
import threading
from datetime import timedelta

log = logging.getLogger(__name__)


def listen_on(host: str, port: int) -> socket.socket:
    """A listening TCP socket bound to ``host:port`` only (0: a free port); IPv4 or IPv6 as
    ``host`` resolves."""
    family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    return socket.create_server(addr[:2], family=family, backlog=128)


def host_store(host: str, port: int):
    """A TCPStore server listening on ``host:port`` and nowhere else (0: a free port; ``.port``
    says which)."""
    import torch.distributed as dist

    sock = listen_on(host, port)
    bound = sock.getsockname()[1]
    # the store owns the descriptor from here (detach: Python will not close it under it)
    return dist.TCPStore(host, bound, None, True, timeout=timedelta(seconds=60), wait_for_workers=False,
                         master_listen_fd=sock.detach())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m splitlearn.cluster.store",
                                description="the TCPStore where SplitFed replicas meet (docs/CLUSTER.md)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (a private network's)")
    p.add_argument("--port", type=int, default=29500)
    a = p.parse_args(argv)
    stop = threading.Event()  # the handlers first: a SIGTERM as soon as the port is open ends it cleanly
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    store = host_store(a.host, a.port)
    print(f"splitlearn fed store on {a.host}:{store.port}", file=sys.stderr, flush=True)
    stop.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
