"""What open generation sessions cost the host: a real server's RSS growth against what its
memory account reserves for them (splitlearn/server/engine/budget.py, ``SESSION_SLACK``).

    python benchmarks/session_memory.py                  # 16 sessions of 32 x 128 (the issue 50 attack)
    python benchmarks/session_memory.py 16 64 16 32      # rows, prefill length, sessions, decode steps

A ``python -m splitlearn.server --model tiny-demo --cut 2 --cut 4`` process; one session opened,
stepped and closed first (kernels, packed weights, allocator warm), then N sessions opened,
prefilled (and decoded) and held open. Prints the RSS growth, the account's reservations and
their ratio (below 1: the reservations cover what the sessions cost). RSS is noisy (glibc);
run it twice.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import requests
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from serverproc import ServerProcess, auth  # noqa: E402

from splitlearn.api import protocol as P  # noqa: E402
from splitlearn.api.wire import encode  # noqa: E402

D = 128  # tiny-demo's n_embd


def rss(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) << 10
    raise RuntimeError("no VmRSS")


def main(rows: int = 32, T: int = 128, n: int = 16, decode_steps: int = 0) -> None:
    extra = ["--max-tokens-per-client", "10000000", "--max-sessions-per-tenant", "64"]
    with ServerProcess((2, 4), model="tiny-demo", extra=extra) as srv:
        def step(sid: str, x: torch.Tensor, position: int) -> None:
            r = requests.post(srv.url + P.SESSION_STEP.format(session_id=sid),
                              data=encode({P.HIDDEN: x}, {"position": str(position)}),
                              headers={**auth(), "Content-Type": P.CONTENT_TYPE}, timeout=60)
            assert r.status_code == 200, r.text

        def session(i: int) -> str:
            r = requests.post(srv.url + P.SESSIONS, json={"rows": rows}, headers=auth(), timeout=30)
            assert r.status_code == 201, r.text
            sid = r.json()["session_id"]
            step(sid, torch.randn(rows, T, D, generator=torch.Generator().manual_seed(i)), 0)
            for k in range(decode_steps):
                step(sid, torch.randn(rows, 1, D, generator=torch.Generator().manual_seed(1000 + k)), T + k)
            return sid

        def reserved() -> int:
            return requests.get(srv.url + P.INFO, headers=auth(), timeout=30).json()["memory"]["reserved_bytes"]

        pid = srv.proc.pid
        requests.delete(srv.url + P.SESSION.format(session_id=session(999)), headers=auth(), timeout=30)
        time.sleep(0.5)
        rss0, res0 = rss(pid), reserved()
        for i in range(n):
            session(i)
        time.sleep(0.5)
        grew, held = rss(pid) - rss0, reserved() - res0
        print(f"rows={rows} T={T} sessions={n} decode={decode_steps}: RSS +{grew / 2**20:.1f} MiB, reserved "
              f"{held / 2**20:.1f} MiB, ratio {grew / max(1, held):.2f}")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:]))
