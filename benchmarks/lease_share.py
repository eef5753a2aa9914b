"""The lease's share over time (issue 50, item 2): an honest tenant beside tenants that hold
each step just under ``--lease-timeout``.

    python benchmarks/lease_share.py                  # the policy on a fake clock, 3 s and 60 s (minutes)
    python benchmarks/lease_share.py --server 3 20    # and a real server: timeout 3 s, 20 s runs

**The policy** (:func:`simulate`): the server's own :class:`~splitlearn.server.engine.lease.StepLease`
on a fake clock, driven by an event loop. Alice's client is the library's: a step holds the
lease ``hold_s``, then ``gap_s`` until her next forward; refused, she waits 20 ms, 40 ms, ... up
to 1 s between retries (splitlearn/transport/busy.py). Each hog ("mallory", "mallory2", ...: N
other tenants) takes the lease, holds it ``timeout - 0.4`` s, gives it back and asks again at
once, retrying every ``hog_retry_s`` when refused (fast: the attacker's best). The share is
alice's steps with the hogs over her steps alone in the same time; the target is 1/(N+1).
Seconds of simulated time cost milliseconds, so the default 60 s timeout is measured over
hours of it.

**A real server** (``--server T D``): one ``python -m splitlearn.server`` process (tiny model,
U (1, 3), ``--lease-timeout T``), alice a ``SplitClient`` training for D seconds alone, then
with mallory (raw HTTP: a forward, ``T - 0.4`` s, the backward and the apply, again).
"""
from __future__ import annotations

import argparse
import heapq
import itertools
import json
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from splitlearn.errors import ServiceUnavailable  # noqa: E402
from splitlearn.server.engine.lease import StepLease  # noqa: E402

FIRST_WAIT_S, MAX_WAIT_S = 0.02, 1.0  # the client library's back-off (transport/busy.py)


@dataclass
class Share:
    timeout_s: float
    hogs: int
    seconds: float
    alone: int  # alice's steps alone in ``seconds``
    beside: int  # alice's steps beside the hogs
    hog_steps: int  # the hogs' steps, all together

    @property
    def share(self) -> float:
        """Over the whole window (which may start or end in the others' turns: up to N x the
        timeout of it, a share N x timeout / seconds)."""
        return self.beside / self.alone

    @property
    def target(self) -> float:
        return 1 / (self.hogs + 1)


def run(timeout_s: float, seconds: float, hogs: int, hold_s: float, gap_s: float, hog_retry_s: float,
         hog_hold_s: float | None = None) -> tuple[int, int]:
    """(alice's steps, the hogs' steps) in ``seconds`` of fake time."""
    now = [0.0]
    lease = StepLease(timeout_s, clock=lambda: now[0])
    events: list = []
    seq = itertools.count()
    hog_hold = timeout_s - 0.4 if hog_hold_s is None else hog_hold_s

    def at(t: float, what, *args):
        heapq.heappush(events, (t, next(seq), what, args))

    steps = {"alice": 0, "hogs": 0}

    def alice_ask(wait: float):
        try:
            lease.acquire("alice:a", steps["alice"] + 1)
        except ServiceUnavailable:
            at(now[0] + wait, alice_ask, min(wait * 2, MAX_WAIT_S))
            return
        at(now[0] + hold_s, alice_done)

    def alice_done():
        lease.release("alice:a")
        steps["alice"] += 1
        at(now[0] + gap_s, alice_ask, FIRST_WAIT_S)

    def hog_ask(cid: str):
        try:
            lease.acquire(cid, 1)
        except ServiceUnavailable:
            at(now[0] + hog_retry_s, hog_ask, cid)
            return
        at(now[0] + hog_hold, hog_done, cid)

    def hog_done(cid: str):
        lease.release(cid)
        steps["hogs"] += 1
        at(now[0], hog_ask, cid)

    for i in range(hogs):
        at(0.0, hog_ask, f"mallory{i}:m")
    at(0.001, alice_ask, FIRST_WAIT_S)  # the hogs first: the worst start for alice
    while events and events[0][0] <= seconds:
        t, _, what, args = heapq.heappop(events)
        now[0] = t
        what(*args)
    return steps["alice"], steps["hogs"]


def simulate(timeout_s: float, seconds: float, hogs: int = 1, hold_s: float = 0.008, gap_s: float = 0.004,
             hog_retry_s: float = 0.01) -> Share:
    """Alice's share beside ``hogs`` tenants holding each step ``timeout_s - 0.4`` s, on a fake
    clock over ``seconds`` (alice: ``hold_s`` a step, ``gap_s`` between steps)."""
    alone, _ = run(timeout_s, seconds, 0, hold_s, gap_s, hog_retry_s)
    beside, hog_steps = run(timeout_s, seconds, hogs, hold_s, gap_s, hog_retry_s)
    return Share(timeout_s, hogs, seconds, alone, beside, hog_steps)


# -- a real server ---------------------------------------------------------------------------

def hog(url: str, token: str, client_id: str, hold_s: float, stop, counts: dict) -> None:
    """Mallory: a forward, ``hold_s``, the backward and the apply, again until ``stop``; a
    refused forward is retried every 10 ms. ``counts``: her "steps", "refused" (503s) and
    "spans" (the monotonic times of each forward's answer and its apply's)."""
    import time

    import requests
    import torch

    from splitlearn.api import protocol as P
    from splitlearn.api.wire import encode

    s = requests.Session()
    s.headers["Authorization"] = f"Bearer {token}"
    h = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(1)) * 0.1
    step = 1
    while not stop.is_set():
        meta = P.StepMeta(client_id, step).to_meta()
        r = s.post(url + P.TRAIN_FORWARD, data=encode({P.HIDDEN: h}, meta), timeout=60,
                   headers={"Content-Type": P.CONTENT_TYPE})
        if r.status_code == 503:
            counts["refused"] = counts.get("refused", 0) + 1
            stop.wait(0.01)
            continue
        assert r.status_code == 200, r.text
        took = time.monotonic()
        stop.wait(hold_s)
        r = s.post(url + P.TRAIN_BACKWARD, data=encode({P.GRAD: h * 1e-3}, meta), timeout=60,
                   headers={"Content-Type": P.CONTENT_TYPE})
        assert r.status_code == 200, r.text
        r = s.post(url + P.TRAIN_APPLY, json={"client_id": client_id, "step": step, "pieces": 1, "lr": 1e-3},
                   timeout=60)
        assert r.status_code == 200, r.text
        counts.setdefault("spans", []).append((took, time.monotonic()))
        counts["steps"] = counts.get("steps", 0) + 1
        step += 1


def steps_in(client, seconds: float) -> int:
    """Alice's training steps (a ``SplitClient``, tiny batches) in ``seconds``."""
    import time

    import torch

    batch = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
    n, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        client.train_step(batch)
        n += 1
    return n


def alone_and_beside(url: str, alice_token: str, mallory_token: str, timeout_s: float, seconds: float) -> dict:
    """Alice's steps in ``seconds`` beside mallory holding each step ``timeout_s - 0.4``, and
    alone in as long: half before, half after (a loaded machine's drift falls on both)."""
    import threading
    import time

    from splitlearn import SplitClient

    with SplitClient(url, "tiny", token=alice_token, client_id="alice", optimizer="sgd", lr=0.01,
                     reconnect_timeout_s=120) as alice:
        alice.model.remote.applier.carry = False  # the apply a request of its own in both runs
        steps_in(alice, 0.5)  # warm-up
        alone = steps_in(alice, seconds / 2)
        stop, counts = threading.Event(), {}
        t = threading.Thread(target=hog, args=(url, mallory_token, "m", timeout_s - 0.4, stop, counts), daemon=True)
        t.start()
        try:
            while not counts.get("steps"):  # mallory's first step is through: she holds the next
                stop.wait(0.01)
            start = time.monotonic()
            beside = steps_in(alice, seconds)
            end = time.monotonic()
        finally:
            stop.set()
            t.join(timeout_s + 30)
        alone += steps_in(alice, seconds / 2)
    held = sum(max(0.0, min(b, end) - max(a, start)) for a, b in counts.get("spans", []))
    return {"timeout_s": timeout_s, "seconds": seconds, "alone": alone, "beside": beside,
            "share": beside / alone, "hog_steps": counts.get("steps", 0), "hog_refused": counts.get("refused", 0),
            "hog_time_share": held / (end - start)}


def measure(timeout_s: float, seconds: float) -> dict:
    """:func:`alone_and_beside` against a real server process (tiny, U (1, 3), two tenants)."""
    import os
    import secrets
    import tempfile

    from splitlearn.procs.localserver import LocalServer

    alice, mallory = secrets.token_hex(16), secrets.token_hex(16)
    with tempfile.TemporaryDirectory() as d:
        tokens = os.path.join(d, "tokens")
        with open(tokens, "w") as f:
            f.write(f"alice {alice} operator\nmallory {mallory}\n")
        args = ["--model", "tiny", "--cut", "1", "--cut", "3", "--optimizer", "sgd", "--lr", "0.01",
                "--threads", "1", "--token-file", tokens, "--lease-timeout", str(timeout_s)]
        with LocalServer(args, token=alice, env={"OMP_NUM_THREADS": "1"}) as srv:
            return alone_and_beside(srv.url, alice, mallory, timeout_s, seconds)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server", nargs=2, type=float, metavar=("TIMEOUT", "SECONDS"),
                    help="also measure a real server with this lease timeout for this many seconds")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    rows = []
    for timeout_s, seconds in ((3.0, 600.0), (60.0, 3600.0)):
        for hogs in (1, 2, 3):
            for hold_s, gap_s in ((0.05, 0.01), (0.5, 0.2)):
                s = simulate(timeout_s, seconds, hogs, hold_s, gap_s, hog_retry_s=0.02 if timeout_s < 10 else 0.1)
                rows.append({"kind": "policy", "timeout_s": timeout_s, "hogs": hogs, "seconds": seconds,
                             "hold_s": hold_s, "gap_s": gap_s, "alone": s.alone, "beside": s.beside,
                             "hog_steps": s.hog_steps, "share": round(s.share, 4), "target": round(s.target, 4)})
                print(f"policy  timeout {timeout_s:>4g}s  hogs {hogs}  alice hold {hold_s * 1e3:>4g} ms gap "
                      f"{gap_s * 1e3:>4g} ms: {s.beside:>7} of {s.alone:>7} steps alone = {s.share:.3f} "
                      f"(target {s.target:.3f}; the hogs' steps {s.hog_steps})")
    for other_hold_s in (0.01, 0.05, 0.5):  # an honest tenant of long steps beside one of short steps
        alone, _ = run(3.0, 600.0, 0, 2.6, 0.0, 0.02, hog_hold_s=other_hold_s)
        beside, other = run(3.0, 600.0, 1, 2.6, 0.0, 0.02, hog_hold_s=other_hold_s)
        rows.append({"kind": "long steps", "timeout_s": 3.0, "hold_s": 2.6, "other_hold_s": other_hold_s,
                     "alone": alone, "beside": beside, "share": round(beside / alone, 4)})
        print(f"long    timeout    3s  alice hold 2.6 s beside steps of {other_hold_s * 1e3:g} ms: {beside} of "
              f"{alone} steps alone = {beside / alone:.3f}")
    if args.server:
        r = measure(*args.server)
        rows.append({"kind": "server", **r})
        print(f"server  timeout {r['timeout_s']:g}s: alice {r['beside']} of {r['alone']} steps alone = "
              f"{r['share']:.3f} in {r['seconds']:g}s (mallory's steps {r['hog_steps']})")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
