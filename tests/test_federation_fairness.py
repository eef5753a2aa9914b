"""Fair federation: one tenant's many client ids against another tenant (issue 40, items 3-4).

The attacks, on in-process servers with two tenants (alice, mallory):

- **every SplitFed round** (item 3): mallory's m1 and m2 join each round first, so alice got
  "503 round N is full" in every round and, after three rounds, downloaded exactly mallory's
  upload as the shared client-side weights. Now, while alice waits, mallory takes at most her
  share of a round's seats (``--max-tenant-seats``, default ceil(K/2)) and a seat is held for
  alice: alice trains in rounds 2 and 3.
- **the sequential turn for ever** (item 4): mallory takes the turn and trains without syncing;
  every training step refreshed it, and all of alice's turn requests got 503. Now the turn
  passes once it trained ``--max-turn-steps`` steps (or lasted ``--max-turn-seconds``) while
  another tenant waits, and mallory's next step is a 409 that says why and when to retry.

The rules themselves run in process on :class:`Federation` with a fake clock (no sleeps).
"""
import pytest
import torch

from splitlearn.api import protocol as P
from splitlearn.client import SplitClient
from splitlearn.errors import NotYourTurn, ServiceUnavailable
from splitlearn.server.federation.fairness import Fairness
from splitlearn.hf.fedsync import untied_weights
from splitlearn.api.wire import decode, encode

from serverproc import OTHER, TENANTS, TOKEN, InprocServerProcess, auth, web
from test_client import LR

ALICE, MALLORY = TOKEN, OTHER


# -- over HTTP: the attacks as reported ---------------------------------------------------

def server(tmp_path, *extra) -> InprocServerProcess:
    (tmp_path / "tokens").write_text("\n".join(TENANTS) + "\n")
    return InprocServerProcess((1, 3), optimizer="sgd", lr=LR["sgd"], extra=[
        "--token-file", str(tmp_path / "tokens"), "--round-timeout", "300",
        "--fair-wait-seconds", "60", *extra])  # (waits never lapse here: the test is not about time)


def session(token):
    s = web.Session()
    s.headers.update(auth(token))
    return s


def step(s, url, cid, n, version):
    """Client ``cid``'s step ``n`` (one forward, its backward, the apply), stopping at the first
    refusal: the first answer that is not 200, or the apply's."""
    meta = P.StepMeta(cid, n, fed_version=version).to_meta()
    h = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(n))
    for path, name in ((P.TRAIN_FORWARD, P.HIDDEN), (P.TRAIN_BACKWARD, P.GRAD)):
        r = s.post(url + path, data=encode({name: h}, meta), headers={"Content-Type": P.CONTENT_TYPE}, timeout=30)
        if r.status_code != 200:
            return r
    return s.post(url + P.TRAIN_APPLY, json={"client_id": cid, "step": n, "pieces": 1, "lr": LR["sgd"]}, timeout=30)


def sync(s, url, cid, weights):
    return s.post(url + P.FEDERATION_SYNC, data=encode(weights, P.SyncMeta(cid, 1).to_meta()),
                  headers={"Content-Type": P.CONTENT_TYPE}, timeout=30)


def shared_weights(url) -> dict:
    r = web.get(url + P.FEDERATION_WEIGHTS, headers=auth(ALICE), timeout=30)
    assert r.status_code == 200, r.text
    return decode(r.content)[0]


@pytest.mark.slow
def test_one_tenants_client_ids_cannot_take_every_splitfed_round(tmp_path):
    """K = 2. Round 1 is mallory's (m1 and m2 joined before alice came: nobody waited). From then
    on m1 and m2 re-join the moment a round closes, and alice asks after them: m2 gets 503 (her
    tenant holds its share, 1 seat, while alice waits) and alice's step is in. After 3 rounds the
    shared client-side weights are the average of both tenants' uploads, not mallory's."""
    with server(tmp_path, "--federation", "splitfed", "--clients-per-round", "2") as srv:
        a, m = session(ALICE), session(MALLORY)
        schema = untied_weights(SplitClient(srv.url, "tiny", token=OTHER, device="cpu", client_id="m1").segments)
        evil = {k: v + 0.01 for k, v in schema.items()}  # mallory's upload (within --max-update-norm)
        mine = {k: v - 0.01 for k, v in schema.items()}  # alice's
        n, alice_in = {"m1": 0, "m2": 0, "a": 0}, []
        for version in range(3):  # round version + 1
            joined = {}
            for cid in ("m1", "m2"):
                n[cid] += 1
                joined[cid] = step(m, srv.url, cid, n[cid], version)
            n["a"] += 1
            r = step(a, srv.url, "a", n["a"], version)
            alice_in.append(r.status_code == 200)
            if not alice_in[-1]:
                n["a"] -= 1  # (a refused step is not a step)
                assert r.status_code == 503 and "full" in r.json()["message"], r.text
            for cid, answer in joined.items():
                if answer.status_code != 200:
                    n[cid] -= 1
                    assert answer.status_code == 503 and "its share" in answer.json()["message"], answer.text
                    assert answer.headers["Retry-After"] == "1"
            if alice_in[-1]:
                assert sync(a, srv.url, "a", mine).status_code == 200
            for cid, answer in joined.items():
                if answer.status_code == 200:
                    assert sync(m, srv.url, cid, evil).status_code == 200, cid
            st = web.get(srv.url + P.FEDERATION, headers=auth(ALICE), timeout=10).json()
            assert st["version"] == version + 1 and st["last_round"]["members"] == 2
        assert alice_in == [False, True, True]  # before: [False, False, False]
        assert joined["m2"].status_code == 503  # (in round 3 too)
        shared = shared_weights(srv.url)
        assert not all(torch.equal(shared[k], evil[k]) for k in shared)  # before: mallory's upload
        for k in shared:  # round 3 averaged alice's and mallory's uploads around round 2's average
            assert torch.allclose(shared[k], schema[k], atol=1e-5), k


@pytest.mark.slow
def test_the_sequential_turn_passes_after_its_steps_while_another_tenant_waits(tmp_path):
    """--max-turn-steps 3: mallory takes the turn and trains without syncing while alice asks for
    it after each step. Alice's first asks are 503; after mallory's third step she gets the turn,
    and mallory's fourth step is a 409 that names the bound and a Retry-After. Mallory's other id
    cannot take it back while alice holds it; after alice's sync, it can."""
    with server(tmp_path, "--federation", "sequential", "--max-turn-steps", "3") as srv:
        a, m = session(ALICE), session(MALLORY)
        assert m.post(srv.url + P.FEDERATION_TURN, json={"client_id": "m1"}, timeout=10).status_code == 200
        asks = []
        for i in range(1, 5):
            r = step(m, srv.url, "m1", i, 0)
            if r.status_code != 200:
                break
            turn = a.post(srv.url + P.FEDERATION_TURN, json={"client_id": "a"}, timeout=10)
            asks.append(turn.status_code)
            if turn.status_code == 200:
                continue
            assert turn.status_code == 503 and turn.headers["Retry-After"] == "1", turn.text
        assert asks == [503, 503, 200]  # before: 503 for ever
        assert i == 4 and r.status_code == 409, r.text
        body = r.json()
        assert body["error"] == "not_your_turn" and r.headers["Retry-After"] == "1"
        assert "trained 3 steps (--max-turn-steps 3)" in body["message"] and "retry" in body["message"]
        status = web.get(srv.url + P.FEDERATION, headers=auth(ALICE), timeout=10).json()
        assert (status["turn"], status["max_turn_steps"]) == ("a", 3)
        for cid in ("m1", "m2"):  # alice holds it: mallory's ids wait
            assert m.post(srv.url + P.FEDERATION_TURN, json={"client_id": cid}, timeout=10).status_code == 503
        assert step(a, srv.url, "a", 1, 0).status_code == 200
        weights = untied_weights(SplitClient(srv.url, "tiny", token=ALICE, device="cpu", client_id="a").segments)
        assert sync(a, srv.url, "a", weights).status_code == 200
        assert m.post(srv.url + P.FEDERATION_TURN, json={"client_id": "m2"}, timeout=10).status_code == 200


@pytest.mark.slow
def test_a_client_whose_turn_passed_is_told_at_its_sync_and_takes_the_turn_again(tmp_path, caplog):
    """SplitClient's side: mallory's client trains 2 steps (--max-turn-steps 2) while alice waits;
    alice's next ask takes the turn. Mallory's sync shares nothing and says why (it used to raise
    NotYourTurn into the training loop); her next step waits for alice's turn to end, then takes
    the turn again on the weights alice shared."""
    with server(tmp_path, "--federation", "sequential", "--max-turn-steps", "2") as srv:
        a = session(ALICE)
        m = SplitClient(srv.url, "tiny", token=OTHER, optimizer="sgd", lr=LR["sgd"], device="cpu", client_id="m")
        batch = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0)), None
        m.train_step(*batch)
        assert a.post(srv.url + P.FEDERATION_TURN, json={"client_id": "a"}, timeout=10).status_code == 503
        m.train_step(*batch)
        assert a.post(srv.url + P.FEDERATION_TURN, json={"client_id": "a"}, timeout=10).status_code == 200
        st = m.sync()
        assert "--max-turn-steps 2" in st["turn_lost"] and st["version"] == 0 and st["turn"] is None
        assert "nothing shared" in caplog.text
        assert step(a, srv.url, "a", 1, 0).status_code == 200
        weights = untied_weights(SplitClient(srv.url, "tiny", token=ALICE, device="cpu", client_id="a").segments)
        assert sync(a, srv.url, "a", weights).status_code == 200
        assert m.train_step(*batch) < 100 and m.federation.version == 1
        assert web.get(srv.url + P.FEDERATION, headers=auth(MALLORY), timeout=10).json()["turn"] == "m"
        m.close()


# -- in process: the rules, with a fake clock ----------------------------------------------

class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def federation(mode, k=2, timeout_s=300.0, **fair):
    from splitlearn import load_model, partition
    from splitlearn.model.checkpoint import make_optimizer
    from splitlearn.server.federation.modes import Federation, Replica

    trunk = partition(load_model("tiny"), (1, 3)).trunk
    opt = lambda ps: make_optimizer(ps, "sgd", 0.1)  # noqa: E731
    fed = Federation(mode, Replica(trunk, opt(trunk.parameters())), opt, k, timeout_s, fairness=Fairness(**fair))
    fed.clock = Clock()
    return fed


def join(fed, key) -> bool:
    """``key`` trains a step of the open round a moment later: True if it is a member, False on a 503."""
    fed.clock.t += 0.1
    try:
        fed.replica_for(key, fed.version)
    except ServiceUnavailable:
        return False
    fed.trained(key, 2)
    return True


def close(fed, *keys) -> None:
    fed.clock.t += 0.1
    for key in keys:
        fed.sync(key, {})
    assert not fed.round.members


def test_with_one_seat_the_rounds_go_round_the_waiting_tenants():
    fed = federation("splitfed", k=1)
    assert join(fed, "mallory:m1") and not join(fed, "alice:a")
    close(fed, "mallory:m1")
    assert not join(fed, "mallory:m1") and not join(fed, "mallory:m2")  # alice waited first
    assert join(fed, "alice:a")
    close(fed, "alice:a")
    assert not join(fed, "alice:a") and join(fed, "mallory:m2")
    close(fed, "mallory:m2")
    assert not join(fed, "bob:b")  # bob waits behind alice, who waits since her refusal
    assert not join(fed, "bob:b") and join(fed, "alice:a")


def test_a_seat_is_held_only_while_its_tenant_asks_and_one_tenant_alone_takes_every_seat():
    fed = federation("splitfed", k=3, wait_s=5.0)
    assert all(join(fed, f"alice:a{i}") for i in range(3))  # one tenant: no share applies
    assert not join(fed, "mallory:m")  # full
    close(fed, "alice:a0", "alice:a1", "alice:a2")
    assert join(fed, "alice:a0") and join(fed, "alice:a1")  # 2 = ceil(3 / 2): her share
    assert not join(fed, "alice:a2")  # the last seat is mallory's while she asks
    fed.clock.t += 6.0  # mallory stopped asking 6 s ago
    assert fed.status()["tenants_waiting"] == 0  # nobody asked in the last 5 s
    assert join(fed, "alice:a2") and not join(fed, "mallory:m")


def test_max_tenant_seats_is_each_tenants_share_while_another_below_it_waits():
    fed = federation("splitfed", k=4, seats=1)
    assert fed.status()["max_tenant_seats"] == 1
    assert join(fed, "mallory:m1") and join(fed, "mallory:m2") and join(fed, "alice:a1")  # nobody waited
    assert join(fed, "mallory:m3") and not join(fed, "alice:a2")  # full
    close(fed, "mallory:m1", "mallory:m2", "mallory:m3", "alice:a1")
    assert join(fed, "mallory:m1") and not join(fed, "mallory:m2")  # 1 seat while alice (0) waits
    assert join(fed, "alice:a1") and join(fed, "alice:a2")  # both at their share: the rest is first come
    assert join(fed, "mallory:m2") and not join(fed, "mallory:m3")  # full
    assert (fed.status("alice")["members"], fed.status("mallory")["members"]) == (["a1", "a2"], ["m1", "m2"])


def test_the_turn_passes_after_its_steps_while_another_tenant_waits():
    fed = federation("sequential", max_turn_steps=3)
    fed.take_turn("mallory:m1")
    for _ in range(2):
        fed.replica_for("mallory:m1", 0)
        with pytest.raises(ServiceUnavailable, match="holds the turn"):
            fed.take_turn("alice:a")
    fed.replica_for("mallory:m1", 0)  # her third step; alice waits and has not asked since
    with pytest.raises(NotYourTurn, match=r"is over: it trained 3 steps \(--max-turn-steps 3\).*retrying every 1s"):
        fed.replica_for("mallory:m1", 0)
    assert fed.status()["turn"] is None and fed.version == 0  # nothing shared
    with pytest.raises(ServiceUnavailable, match="held the last turn"):
        fed.take_turn("mallory:m2")
    assert fed.take_turn("alice:a")["turn"] == "a"


def test_the_turn_passes_after_its_seconds_and_waiting_tenants_go_in_turn():
    fed = federation("sequential", max_turn_s=60.0)
    fed.take_turn("mallory:m1")
    fed.replica_for("mallory:m1", 0)
    fed.clock.t += 1.0
    with pytest.raises(ServiceUnavailable, match="holds the turn"):
        fed.take_turn("alice:a")
    fed.clock.t += 30.0  # (alice asked 30 s ago: she waits no more)
    fed.replica_for("mallory:m1", 0)  # still hers
    with pytest.raises(ServiceUnavailable, match="holds the turn"):
        fed.take_turn("alice:a")
    fed.clock.t += 30.0  # 61 s since mallory took it, she trained 30 s ago: alice takes it
    assert fed.take_turn("alice:a")["turn"] == "a"
    with pytest.raises(NotYourTurn, match=r"turn passed: it lasted 61s \(--max-turn-seconds 60\)"):
        fed.replica_for("mallory:m1", 0)
    fed.clock.t += 1.0
    with pytest.raises(ServiceUnavailable):
        fed.take_turn("mallory:m1")  # waits from now
    fed.clock.t += 1.0
    with pytest.raises(ServiceUnavailable):
        fed.take_turn("bob:b")  # waits from now, behind mallory
    fed.sync("alice:a", {})
    with pytest.raises(ServiceUnavailable, match="waited longer"):
        fed.take_turn("bob:b")
    assert fed.take_turn("mallory:m1")["turn"] == "m1"
    fed.sync("mallory:m1", {})
    with pytest.raises(ServiceUnavailable, match="held the last turn"):
        fed.take_turn("mallory:m2")  # one tenant's other id: the same tenant
    assert fed.take_turn("bob:b")["turn"] == "b"


def test_one_tenant_alone_keeps_the_turn_past_its_bounds():
    fed = federation("sequential", max_turn_steps=2, max_turn_s=1.0)
    fed.take_turn("alice:a")
    for _ in range(5):
        fed.clock.t += 1.0
        fed.replica_for("alice:a", 0)
    with pytest.raises(ServiceUnavailable, match="holds the turn"):  # her other id waits for the turn's end
        fed.take_turn("alice:b")
    fed.replica_for("alice:a", 0)
    fed.sync("alice:a", {})
    assert fed.take_turn("alice:b")["turn"] == "b"


def test_the_options_come_from_the_command_line_and_bad_ones_are_refused():
    from splitlearn.errors import ConfigError
    from splitlearn.server.config import ServerConfig
    from splitlearn.server.federation.fairness import fairness_of
    from splitlearn.server.http.cli import parse_args

    base = ["--model", "tiny", "--cut", "1", "--log-level", "WARNING"]
    fair = fairness_of(parse_args([*base, "--max-tenant-seats", "3", "--max-turn-steps", "7", "--max-turn-seconds", "2.5",
                       "--fair-wait-seconds", "9"]))
    assert (fair.seats, fair.max_turn_steps, fair.max_turn_s, fair.wait_s) == (3, 7, 2.5, 9.0)
    default = fairness_of(parse_args(base))
    assert (default.share(1), default.share(2), default.share(5)) == (1, 1, 3)
    for bad in ({"max_tenant_seats": 0}, {"max_turn_steps": 0}, {"max_turn_s": 0.0}, {"fair_wait_s": -1.0}):
        with pytest.raises(ConfigError):
            ServerConfig(model="tiny", cuts=(1,), **bad)
