"""Readiness: may this server take traffic? (``GET /v1/ready``, beside the liveness ``GET /v1/health``)

The segment server's checks (:func:`readiness`; the fed server's: :func:`fed_readiness`).

``/v1/health`` says the process answers HTTP; ``/v1/ready`` says it can do its work::

    model            the runtime holds its segment (or, --offload, its layers)
    compute_thread   the one thread every tensor operation runs on (.compute) is alive
    checkpoint_dir   --checkpoint-dir, if given, takes a new file (one created and removed: a
                     read-only mount, a full inode table or a file in the directory's place
                     fail it, root or not; a directory not made yet: its nearest ancestor)
    state_dir        the same for --state-dir (replicas' per-client state)
    accepting        false from SIGTERM until the process stops (--drain-seconds: it still serves
                     what comes, but a load balancer should send nothing new)

200 ``{"ready": true, "checks": {...}}`` when every check passes, else 503 with the same body
(``false`` on the failing checks; a check that does not apply is ``null``). Like
``/v1/health`` it needs no token (a load balancer or an orchestrator probes it) and says
nothing about tenants. The compute thread is checked for life, not for an answer: a training
step of seconds keeps it busy, and a probe must not pull a busy server out of rotation.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Optional


def writable(directory: Optional[str]) -> Optional[bool]:
    """Whether a file can be created in ``directory`` now (not made yet: in the nearest
    ancestor that exists, where the first checkpoint will make it); None without one."""
    if not directory:
        return None
    where = Path(directory).absolute()
    while not where.exists() and where != where.parent:
        where = where.parent
    if not where.is_dir():
        return False
    try:
        fd, path = tempfile.mkstemp(prefix=".ready-", dir=where)
    except OSError:
        return False
    os.close(fd)
    try:
        os.unlink(path)
    except OSError:
        pass
    return True


def readiness(rt) -> tuple[bool, dict]:
    """``(ready, checks)`` of runtime ``rt``."""
    compute = getattr(rt, "compute", None)
    checks = {
        "model": getattr(rt, "segment", None) is not None or getattr(rt, "layers", None) is not None,
        "compute_thread": compute is not None and compute.alive(),
        "checkpoint_dir": writable(getattr(rt.cfg, "checkpoint_dir", None)),
        "state_dir": writable(getattr(rt.cfg, "state_dir", None)),
        "accepting": not getattr(rt, "draining", False),
    }
    return all(v is not False for v in checks.values()), checks


def fed_readiness(rounds) -> tuple[bool, dict]:
    """``(ready, checks)`` of the fed server's ``rounds`` (splitlearn/server/federation/fedserver.py).

    Its state is in memory and it runs no model: it can take uploads once it holds the
    client-side schema it checks them against (built from ``--model``/``--cut``/``--lora-*``
    at start) and a secret to verify tickets with. A round being averaged (the rounds' lock
    held) is busy, not unready, as the segment server's busy compute thread."""
    side = getattr(rounds, "side", None)
    checks = {"client_side_schema": bool(getattr(side, "schema", None)),
              "fed_secret": bool(getattr(getattr(rounds, "cfg", None), "secret", None))}
    return all(checks.values()), checks
