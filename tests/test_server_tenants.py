"""Tenants against a real server process: one data owner cannot read, steer, stall or squat
another's clients (issue: tenants who do not trust each other; docs/SECURITY.md).

One U-shape server with two tenants from a token file (alice, the operator, and mallory),
small per-tenant caps so the caps are reachable, shared by every test here.
"""
import threading
import time

import pytest
import requests
import torch

from splitlearn import SplitClient
from splitlearn.api import protocol as P
from splitlearn.api.wire import decode, encode

from serverproc import OTHER, TOKEN, ServerProcess, apply_step, auth

# measures time or fairness: `make test` runs it after the parallel phase, alone (pytest.ini)
pytestmark = pytest.mark.serial

ALICE, MALLORY = TOKEN, OTHER


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("tenants")
    (d / "tokens").write_text(f"# name token [operator]\nalice {ALICE} operator\nmallory {MALLORY}\n")
    srv = ServerProcess((1, 3), checkpoint_dir=d / "ckpt", extra=[
        "--token-file", str(d / "tokens"), "--max-sessions-per-tenant", "2", "--max-clients-per-tenant", "3",
        "--max-pending-per-tenant", "1", "--lease-timeout", "2"])
    with srv:
        yield srv


def client(server, token, cid, **kw):
    return SplitClient(server.url, "tiny", token=token, client_id=cid, optimizer="sgd", lr=0.05,
                       reconnect_timeout_s=5, **kw)


def batch(seed=0, rows=2, length=8):
    return torch.randint(0, 256, (rows, length), generator=torch.Generator().manual_seed(seed))


def post(server, path, tensors, meta, token):
    return requests.post(server.url + path, data=encode(tensors, meta), timeout=30,
                         headers={**auth(token), "Content-Type": P.CONTENT_TYPE})


def test_another_tenants_client_id_is_a_different_client(server):
    with client(server, ALICE, "alice") as alice:
        losses = [alice.train_step(batch(i)) for i in range(2)]
        alice.flush()  # her last apply (it would ride on her next step): the shared segment is free
        assert alice.step == 2 and all(isinstance(x, float) for x in losses)
        # Mallory reads "alice": a client that never trained (not Alice's step count)
        r = requests.get(server.url + P.CLIENT_STATE.format(client_id="alice"), headers=auth(MALLORY), timeout=10)
        assert r.json()["step"] == 0
        # Mallory retries Alice's last step (2) as "alice": no replay of Alice's stored answer
        h = torch.randn(2, 8, 32)
        r = post(server, P.TRAIN_FORWARD, {P.HIDDEN: h}, P.StepMeta("alice", 2).to_meta(), MALLORY)
        assert r.status_code == 409 and "applied step 0" in r.json()["message"]
        r = post(server, P.TRAIN_BACKWARD, {P.GRAD: h}, P.StepMeta("alice", 2).to_meta(), MALLORY)
        assert r.status_code == 409 and "no forward pending" in r.json()["message"]
        # Mallory's step 1 as "alice" is applied to Mallory's own "alice" ...
        r = post(server, P.TRAIN_FORWARD, {P.HIDDEN: h}, P.StepMeta("alice", 1).to_meta(), MALLORY)
        assert r.status_code == 200
        fwd, meta = decode(r.content)
        assert meta["client_id"] == "alice"  # the wire never shows the tenant-scoped key
        r = post(server, P.TRAIN_BACKWARD, {P.GRAD: torch.ones(2, 8, 32) * 1e-3}, P.StepMeta("alice", 1).to_meta(),
                 MALLORY)
        assert r.status_code == 200
        assert apply_step(requests, "alice", 1, token=MALLORY, url=server.url).json()["applied"]
        # ... and Alice's next step is hers, step 3, unaffected
        alice.train_step(batch(5))
        assert alice.step == 3
        mine = requests.get(server.url + P.CLIENT_STATE.format(client_id="alice"), headers=auth(ALICE), timeout=10)
        theirs = requests.get(server.url + P.CLIENT_STATE.format(client_id="alice"), headers=auth(MALLORY), timeout=10)
        assert (mine.json()["step"], theirs.json()["step"]) == (3, 1)


def test_operator_actions_need_the_operators_token(server):
    r = requests.post(server.url + P.CHECKPOINT, json={}, headers=auth(MALLORY), timeout=30)
    assert r.status_code == 403 and r.json()["error"] == "forbidden"
    r = requests.post(server.url + P.CHECKPOINT, json={}, headers=auth(ALICE), timeout=30)
    assert r.status_code == 200 and r.json()["saved"]
    info = requests.get(server.url + P.INFO, headers=auth(MALLORY), timeout=10).json()
    assert info["you"] == {"tenant": "mallory", "operator": False, "tenants": 2, "weight_export": False}
    assert info["limits"]["max_clients_per_tenant"] == 3


def test_caps_are_per_tenant(server):
    # sessions: mallory's third is refused; alice still opens hers
    opened = [requests.post(server.url + P.SESSIONS, json={"rows": 1}, headers=auth(MALLORY), timeout=10)
              for _ in range(3)]
    assert [r.status_code for r in opened] == [201, 201, 429]
    assert "max-sessions-per-tenant" in opened[2].json()["message"]
    r = requests.post(server.url + P.SESSIONS, json={"rows": 1}, headers=auth(ALICE), timeout=10)
    assert r.status_code == 201
    for s in opened[:2] + [r]:
        requests.delete(server.url + P.SESSION.format(session_id=s.json()["session_id"]),
                        headers=auth(ALICE if s is r else MALLORY), timeout=10)
    # pending steps: mallory may hold one forward in flight; a second is refused
    h = torch.randn(1, 4, 32)
    assert post(server, P.TRAIN_FORWARD, {P.HIDDEN: h}, P.StepMeta("m1", 1).to_meta(), MALLORY).status_code == 200
    r = post(server, P.TRAIN_FORWARD, {P.HIDDEN: h}, P.StepMeta("m2", 1).to_meta(), MALLORY)
    assert r.status_code in (429, 503), r.text  # 503 while m1 holds the shared segment's lease
    # a forward left without its backward is dropped after the lease timeout (2 s): its graph
    # does not live for ever, and its late backward is refused
    time.sleep(2.5)
    assert post(server, P.TRAIN_FORWARD, {P.HIDDEN: h}, P.StepMeta("m2", 1).to_meta(), MALLORY).status_code == 200
    r = post(server, P.TRAIN_BACKWARD, {P.GRAD: h}, P.StepMeta("m1", 1).to_meta(), MALLORY)
    assert r.status_code == 409 and "no forward pending" in r.json()["message"]
    assert post(server, P.TRAIN_BACKWARD, {P.GRAD: h}, P.StepMeta("m2", 1).to_meta(), MALLORY).status_code == 200
    assert apply_step(requests, "m2", 1, token=MALLORY, url=server.url).status_code == 200
    # client ids: mallory has alice (first test), m1, m2; a fourth id is refused, alice is not limited
    r = post(server, P.TRAIN_FORWARD, {P.HIDDEN: h}, P.StepMeta("m4", 1).to_meta(), MALLORY)
    assert r.status_code == 429 and "max-clients-per-tenant" in r.json()["message"]
    with client(server, ALICE, "alice-2") as a2:
        a2.train_step(batch(9))
        assert a2.step == 1


def test_a_waiting_tenant_gets_the_segment_before_the_holders_next_step(server):
    """Two owners on the shared U-shape segment: the one that arrives second is served
    step for step, not after the first has finished everything."""
    done: dict[str, list[float]] = {"busy": [], "late": []}
    stop = threading.Event()

    def busy():
        with client(server, ALICE, "busy") as c:
            while not stop.is_set() and len(done["busy"]) < 200:
                c.train_step(batch(len(done["busy"])))
                done["busy"].append(time.monotonic())

    t = threading.Thread(target=busy)
    t.start()
    try:
        while len(done["busy"]) < 3:
            time.sleep(0.01)
        with client(server, MALLORY, "m1") as c:  # an id it has (the cap on ids is 3)
            asked = time.monotonic()  # the late owner's first request (its set-up is not counted)
            for i in range(4):
                c.train_step(batch(100 + i))
                done["late"].append(time.monotonic())
    finally:
        stop.set()
        t.join(60)
    finished = done["late"][-1]
    busy_meanwhile = sum(1 for s in done["busy"] if asked < s <= finished)
    # alternating, the busy owner gets about one step per late step (allow slack for the
    # grace period and retries); monopolised, it would finish its 200 steps first
    assert busy_meanwhile <= 4 + 4, (busy_meanwhile, len(done["busy"]))


def test_malformed_json_of_any_depth_is_a_400(server):
    for body in ("[" * 100000, '{"rows": ' * 50000, '{"rows": [1, 2]}', "\xff\xfe", "x" * 10000):
        r = requests.post(server.url + P.SESSIONS, data=body.encode("utf-8", "surrogateescape"),
                          headers=auth(MALLORY), timeout=10)
        assert r.status_code in (400, 413), (body[:10], r.status_code, r.text)
        assert set(r.json()) == {"error", "message"} and "Traceback" not in r.text
    assert requests.get(server.url + P.HEALTH, timeout=10).status_code == 200
