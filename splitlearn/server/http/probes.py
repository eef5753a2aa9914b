"""Readiness: may this server take traffic? (``GET /v1/ready``, beside the liveness ``GET /v1/health``)

:func:`readiness` (the segment server: ``model``, ``compute_thread`` alive, ``checkpoint_dir``
and ``state_dir`` take a new file, ``accepting`` false from SIGTERM) and :func:`fed_readiness`
(the fed server). 200 ``{"ready": true, "checks": {...}}`` when all pass, else 503 with the same
body (``null``: a check that does not apply); no token. Checks and draining: docs/OPERATIONS.md,
'Probes' and 'The fed server'.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Optional

from flask import jsonify

from ...api import protocol as P


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


def health():
    """``GET /v1/health``'s answer (both servers): alive."""
    return jsonify(status="ok", protocol_version=P.PROTOCOL_VERSION)


def ready_answer(ok: bool, checks: dict):
    """``GET /v1/ready``'s answer (both servers): 200 when every check passes, else 503."""
    return jsonify(ready=ok, checks=checks), 200 if ok else 503


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
    """``(ready, checks)`` of the fed server's ``rounds``: its client-side schema and its ticket
    secret (docs/OPERATIONS.md, 'The fed server'); a round being averaged is busy, not unready."""
    side = getattr(rounds, "side", None)
    checks = {"client_side_schema": bool(getattr(side, "schema", None)),
              "fed_secret": bool(getattr(getattr(rounds, "cfg", None), "secret", None))}
    return all(checks.values()), checks
