"""Tenants see their own (issue 50, item 9): ``/v1/info`` and a busy segment's 503 show a tenant
its own counters only; the operator's token still sees the server's.

The attack: mallory polls ``/v1/info`` (and reads the lease's 503s) to learn when and how much
the other tenants train or generate: ``steps_applied``, ``generation.sessions``,
``decode_steps``, the server's reserved memory, the queue waits, and how long another tenant's
step has held the segment. In-process (Flask's test client): alice is the operator, mallory and
bob are tenants (splitlearn/server/http/api_ops.py ``own_view``, server/engine/lease.py).
"""
import json

import pytest
import torch

from splitlearn.api import protocol as P
from splitlearn.server.config import ServerConfig
from splitlearn.server.http.app import create_app

from serverproc import OTHER, TENANTS, TOKEN, apply_step, auth, post_tensors, tensors_of

D, VOCAB = 32, 257  # models/tiny.json
BOB = "bob-5d0e7a91c3f84b26aa"
THREE = (*TENANTS, f"bob {BOB}")


def two_way_step(client, cid: str, step: int, token: str) -> None:
    g = torch.Generator().manual_seed(step)
    tensors = {P.HIDDEN: torch.randn(2, 6, D, generator=g), P.LABELS: torch.randint(0, VOCAB, (2, 6), generator=g)}
    tensors_of(post_tensors(client, P.TRAIN_STEP, tensors, P.StepMeta(cid, step).to_meta(), token=token))
    assert apply_step(client, cid, step, token=token).status_code == 200


def generate(client, token: str, n: int = 3) -> str:
    sid = client.post(P.SESSIONS, json={"rows": 1}, headers=auth(token)).get_json()["session_id"]
    for pos in range(n):
        h = torch.randn(1, 1, D, generator=torch.Generator().manual_seed(pos))
        tensors_of(post_tensors(client, P.SESSION_STEP.format(session_id=sid),
                                {P.HIDDEN: h, P.MASK: torch.ones(1, 1, dtype=torch.long)},
                                P.SessionStepMeta(pos).to_meta(), token=token))
    return sid


def info(client, token: str) -> dict:
    r = client.get(P.INFO, headers=auth(token))
    assert r.status_code == 200, r.get_data(as_text=True)
    return r.get_json()


@pytest.fixture
def client():
    return create_app(ServerConfig(model="tiny", cuts=(2,), tokens=THREE)).test_client()  # 2-way


def test_a_tenants_info_does_not_move_when_another_tenant_trains_or_generates(client):
    before = info(client, OTHER)
    operator_before = info(client, TOKEN)
    for step in (1, 2, 3):
        two_way_step(client, "b", step, BOB)
    sid = generate(client, BOB)  # a session bob keeps open, with its KV cache reserved
    after = info(client, OTHER)
    assert after == before  # nothing of bob's: not his steps, session, decode steps, memory or waits
    operator = info(client, TOKEN)  # the operator's token still sees the server's counters
    assert operator["steps_applied"] == operator_before["steps_applied"] + 3
    assert operator["generation"]["sessions"] == 1 and operator["generation"]["decode_steps"] >= 3
    assert operator["memory"]["reserved_bytes"] > 0 and "waits" in operator["priority"]
    # bob sees his own: 3 steps, 1 session, his reservation; and none of the server-wide counters
    mine = info(client, BOB)
    assert mine["steps_applied"] == 3 and mine["generation"]["sessions"] == 1
    assert mine["memory"]["tenant_reserved_bytes"] > 0
    for section, key in [("priority", "waits"), ("priority", "preemptions"), ("generation", "decode_steps"),
                         ("memory", "reserved_bytes"), ("memory", "evictions")]:
        assert key not in mine[section], (section, key)
    assert mine["limits"] == operator["limits"] and mine["cuts"] == operator["cuts"]  # the server's rules: the same
    assert client.delete(P.SESSION.format(session_id=sid), headers=auth(BOB)).status_code in (200, 204)
    two_way_step(client, "m", 1, OTHER)  # mallory's own step moves her own count
    assert info(client, OTHER)["steps_applied"] == 1 and info(client, BOB)["steps_applied"] == 3


def test_a_busy_segments_503_holds_nothing_of_the_other_tenant():
    """U-shape: bob's forward holds the lease; mallory's forward gets 503 that says the segment is
    busy and to retry, with no client id, step, time held or left (the same body at any moment),
    and Retry-After 1. Bob's own second client is told its sibling's step and time."""
    c = create_app(ServerConfig(model="tiny", cuts=(1, 3), tokens=THREE, lease_timeout_s=60.0)).test_client()
    h = torch.randn(2, 8, D)
    assert post_tensors(c, P.TRAIN_FORWARD, {P.HIDDEN: h}, P.StepMeta("secret-run", 1).to_meta(),
                        token=BOB).status_code == 200
    bodies = set()
    for _ in range(2):
        r = post_tensors(c, P.TRAIN_FORWARD, {P.HIDDEN: h}, P.StepMeta("m", 1).to_meta(), token=OTHER)
        assert r.status_code == 503 and r.headers["Retry-After"] == "1"
        bodies.add(r.get_data(as_text=True))
    assert len(bodies) == 1, bodies  # it does not change as bob's step goes on
    message = json.loads(bodies.pop())["message"]
    assert "busy" in message and "retry" in message
    assert "secret-run" not in message and "bob" not in message and not any(ch.isdigit() for ch in message)
    r = post_tensors(c, P.TRAIN_FORWARD, {P.HIDDEN: h}, P.StepMeta("sibling", 1).to_meta(), token=BOB)
    assert r.status_code == 503 and "'secret-run'" in r.get_json()["message"]  # its own tenant's: named
