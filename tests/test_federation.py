"""Many data owners on one real server process: shared (concurrent), sequential and splitfed.

Every test runs ``python -m splitlearn.server`` and real ``SplitClient``s over loopback, several
at once from threads. Exactness is against the unsplit model (SGD, float32 wire).
"""
import random
import time

import pytest
import torch

from splitlearn.api import protocol as P
from splitlearn.client import SplitClient
from splitlearn.hf.fedsync import untied_weights
from splitlearn.errors import Conflict
from splitlearn.api.wire import decode, encode, pack

from serverproc import OTHER, TENANTS, TOKEN, InprocServerProcess, auth, run_threads, web
from test_client import BATCHES, LR, assert_both_sides_equal, unsplit_steps

pytestmark = pytest.mark.slow


def client_of(srv, name, optimizer="sgd", **kw) -> SplitClient:
    return SplitClient(srv.url, "tiny", token=TOKEN, optimizer=optimizer, lr=LR[optimizer],
                       device="cpu", client_id=name, **kw)


def same_batch(seed):
    return torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(seed)), None


@pytest.mark.parametrize("cuts", [(1, 3), (2,)], ids=["u", "2way"])
def test_shared_mode_concurrent_clients_each_step_applied_once(cuts, tmp_path):
    with InprocServerProcess(cuts, optimizer="adamw", lr=1e-3, extra=["--threads", "4"]) as srv:
        names, steps = ["a", "b", "c", "d"], 5
        clients = [client_of(srv, n, "adamw") for n in names]
        rng = random.Random(0)
        pauses = {n: [rng.uniform(0, 0.05) for _ in range(steps)] for n in names}

        def train(c):
            def go():
                for i in range(steps):
                    time.sleep(pauses[c.client_id][i])
                    loss = c.train_step(*BATCHES[i % len(BATCHES)])
                    assert loss == loss and loss < 100  # finite
            return go

        run_threads([train(c) for c in clients])
        for c in clients:
            c.flush()  # a last step's apply not yet carried by a next request
            state = web.get(srv.url + P.CLIENT_STATE.format(client_id=c.client_id),
                            headers=auth(), timeout=10).json()
            assert state["step"] == steps and c.step == steps
            c.close()


def test_a_client_that_vanishes_after_its_forward_blocks_others_only_until_the_lease_timeout():
    with InprocServerProcess((1, 3), extra=["--lease-timeout", "2"]) as srv:
        ghost = web.Session()
        ghost.headers.update({**auth(), "Content-Type": P.CONTENT_TYPE})
        h = torch.randn(2, 6, 32)
        meta = P.StepMeta("ghost", 1).to_meta()
        r = ghost.post(srv.url + P.TRAIN_FORWARD, data=encode(pack(P.HIDDEN, h, "float32"), meta))
        assert r.status_code == 200
        with client_of(srv, "alive") as c:
            t0 = time.monotonic()
            c.train_step(*BATCHES[0])
            waited = time.monotonic() - t0
        assert 1.5 < waited < 30, waited
        late = ghost.post(srv.url + P.TRAIN_BACKWARD, data=encode(pack(P.GRAD, h, "float32"), meta))
        assert late.status_code == 409 and "no forward pending" in late.json()["message"]


@pytest.mark.parametrize("cuts", [(1, 3), (2,)], ids=["u", "2way"])
def test_sequential_turns_equal_the_unsplit_model_in_the_servers_order(cuts, tmp_path):
    order = [("a", 0), ("a", 1), ("b", 2), ("c", 3), ("a", 0)]  # turns: a a | b | c | a
    with InprocServerProcess(cuts, optimizer="sgd", lr=LR["sgd"], checkpoint_dir=tmp_path,
                             extra=["--federation", "sequential"]) as srv:
        clients = {n: client_of(srv, n) for n in "abc"}
        prev = None
        for name, b in order:
            if prev is not None and prev != name:
                clients[prev].sync()
            clients[name].train_step(*BATCHES[b])
            prev = name
        clients[prev].sync()
        reference, _ = unsplit_steps(cuts, "sgd", [BATCHES[b] for _, b in order])
        assert_both_sides_equal(reference, clients["a"], srv)
        status = web.get(srv.url + P.FEDERATION, headers=auth(), timeout=10).json()
        assert status["mode"] == "sequential" and status["version"] == 4 and status["turn"] is None


def test_sequential_refuses_a_client_out_of_turn_and_reposting_the_turn_does_not_keep_it():
    with InprocServerProcess((1, 3), optimizer="sgd", lr=LR["sgd"],
                             extra=["--federation", "sequential", "--round-timeout", "2"]) as srv:
        with client_of(srv, "a") as a:
            a.train_step(*BATCHES[0])  # a holds the turn
            s = web.Session()
            s.headers.update({**auth(), "Content-Type": P.CONTENT_TYPE})
            meta = P.StepMeta("b", 1, fed_version=0).to_meta()
            r = s.post(srv.url + P.TRAIN_FORWARD, data=encode(pack(P.HIDDEN, torch.randn(1, 4, 32), "float32"), meta))
            assert r.status_code == 409 and r.json()["error"] == "not_your_turn"
            turn = web.post(srv.url + P.FEDERATION_TURN, json={"client_id": "b"}, headers=auth(), timeout=10)
            assert turn.status_code == 503 and "holds the turn" in turn.json()["message"]
            assert web.post(srv.url + P.FEDERATION_SYNC, data=encode({}, P.SyncMeta("b", 1).to_meta()),
                            headers={**auth(), "Content-Type": P.CONTENT_TYPE}, timeout=10).status_code == 409
            # a keeps re-posting /turn but trains no more: the turn lapses after --round-timeout anyway
            t0 = time.monotonic()
            while True:
                again = web.post(srv.url + P.FEDERATION_TURN, json={"client_id": "a"}, headers=auth(), timeout=10)
                assert again.status_code == 200 and again.json()["turn"] == "a"
                taken = web.post(srv.url + P.FEDERATION_TURN, json={"client_id": "b"}, headers=auth(), timeout=10)
                if taken.status_code == 200:
                    break
                assert time.monotonic() - t0 < 60, "re-posting /turn kept the turn"
                time.sleep(0.25)
            assert taken.json()["turn"] == "b" and time.monotonic() - t0 > 1.0


@pytest.mark.parametrize("cuts", [(1, 3), (2,)], ids=["u", "2way"])
def test_splitfed_round_equals_one_unsplit_sgd_step_weighted_by_the_rows_the_server_counted(cuts, tmp_path):
    """Members of 2 and 4 rows: the round equals one SGD step on the 6 rows concatenated (FedAvg
    weighted by the target tokens the server trained; no cap on a member's share), whatever
    samples they claim (10**12 is taken and ignored, 10**400 refused: it overflowed FedAvg's float sum)."""
    batches = [same_batch(10), (torch.cat([same_batch(11)[0], same_batch(12)[0]]), None)]  # (2, 12), (4, 12)
    with InprocServerProcess(cuts, optimizer="sgd", lr=LR["sgd"], checkpoint_dir=tmp_path,
                             extra=["--federation", "splitfed", "--clients-per-round", "2", "--max-member-share", "1"]) as srv:
        clients = [client_of(srv, n) for n in "ab"]
        # (before a trains: a member's refused sync would be its failure of the round, issue 29 item 11)
        huge = web.post(srv.url + P.FEDERATION_SYNC, headers={**auth(), "Content-Type": P.CONTENT_TYPE},
                        data=encode(untied_weights(clients[0].segments),
                                         {"client_id": "a", "samples": "1" + "0" * 400}), timeout=30)
        assert huge.status_code == 400 and "samples" in huge.json()["message"]
        clients[0].train_step(*batches[0])
        clients[0].federation.samples = 10**12  # what a's library reports: the server counts 22 target tokens

        def one_round(c, batch, first):
            return lambda: (None if first else c.train_step(*batch), c.sync())

        run_threads([one_round(c, b, i == 0) for i, (c, b) in enumerate(zip(clients, batches))])
        reference, _ = unsplit_steps(cuts, "sgd", [(torch.cat([b[0] for b in batches]), None)])
        for c in clients:  # every client continues from the average; the server checkpoints (not deferred)
            assert c.federation.version == 1
            assert_both_sides_equal(reference, c, srv)
        status = web.get(srv.url + P.FEDERATION, headers=auth(), timeout=10).json()
        assert status["round"] == 2 and status["members"] == [] and status["version"] == 1
        # samples: the target tokens trained, 2 x 11 + 4 x 11 (FedAvg weights 1:2, as the rows)
        assert status["last_round"] == {"round": 1, "members": 2, "samples": 66, "server_clipped": 0, "client_clipped": 0,
                                        "share_capped": 0, "failed": 0}
        assert clients[0].train_step(*batches[0]) < 100  # training goes on: no 500 after the round


def test_splitfed_round_timeout_runs_from_the_first_member_and_made_up_ids_leave_the_round():
    with InprocServerProcess((1, 3), optimizer="sgd", lr=LR["sgd"],
                             extra=["--federation", "splitfed", "--clients-per-round", "2", "--round-timeout", "2"]) as srv:
        a, b = client_of(srv, "a"), client_of(srv, "b")
        b.train_step(*same_batch(1))  # b trains but never syncs
        a.train_step(*same_batch(2))
        t0 = time.monotonic()
        status = a.sync()  # waits for b, then the round closes without it
        assert time.monotonic() - t0 < 60
        assert status["version"] == 1 and status["round"] == 2
        with pytest.raises(Conflict, match="not a member"):
            b.federation.sync(untied_weights(b.segments))
        t0 = time.monotonic()
        b.train_step(*same_batch(3))  # stale weights: b downloads the average, goes on, and is round 2's member
        assert b.federation.version == 1 and b.step == 2
        # a made-up id trains once and never syncs (nor does b): round 2 is full...
        ghost = client_of(srv, "ghost-1")
        ghost.train_step(*same_batch(4))
        c = client_of(srv, "c")
        c.train_step(*same_batch(5))  # ...until --round-timeout after its first member (b): they leave, c is in
        assert 1.9 < time.monotonic() - t0 < 60
        status = web.get(srv.url + P.FEDERATION, headers=auth(), timeout=10).json()
        assert status["version"] == 1 and status["round"] == 3 and status["members"] == ["c"]
        with pytest.raises(Conflict, match="not a member"):  # the ghost's late sync
            ghost.federation.sync(untied_weights(ghost.segments))


def bad_sync_bodies(client):
    good = untied_weights(client.segments)
    name = next(iter(good))
    missing = dict(good)
    missing.pop(name)
    return {
        "missing": missing,
        "extra": {**good, "transformer.h.9.ln_1.weight": torch.ones(32)},
        "shape": {**good, name: torch.ones(3, 3)},
        "dtype": {**good, name: good[name].to(torch.int64)},
        "float16": {**good, name: good[name].half()},  # 1e6 in float16 is inf: float32 only
        "nan": {**good, name: torch.full_like(good[name], float("nan"))},
    }


def test_bad_sync_bodies_are_400_and_average_nothing():
    with InprocServerProcess((1, 3), optimizer="sgd", lr=LR["sgd"],
                             extra=["--federation", "splitfed", "--clients-per-round", "1"]) as srv:
        with client_of(srv, "a") as a:
            s = web.Session()
            s.headers.update({**auth(), "Content-Type": P.CONTENT_TYPE})
            a.train_step(*same_batch(1))
            assert s.post(srv.url + P.FEDERATION_SYNC, data=b"not safetensors").status_code == 400  # nobody's
            assert s.get(srv.url + P.FEDERATION).json()["members"] == ["a"]
            bodies = {what: encode(w, P.SyncMeta("a", 2).to_meta()) for what, w in bad_sync_bodies(a).items()}
            bodies["no samples"] = encode({"x": torch.ones(1)}, {"client_id": "a"})
            for i, (what, body) in enumerate(bodies.items()):
                if i:
                    a.train_step(*same_batch(1 + i))  # a member of the next round
                r = s.post(srv.url + P.FEDERATION_SYNC, data=body)
                assert r.status_code == 400, (what, r.text)
                assert set(r.json()) == {"error", "message"}
                # a's failure of the round (issue 29, item 11): it closed with nothing averaged
                status = s.get(srv.url + P.FEDERATION).json()
                assert (status["version"], status["round"], status["members"]) == (0, i + 2, []), what
            a.train_step(*same_batch(0))
            assert a.sync()["version"] == 1  # the good one closes the round


# -- one member cannot break a round (issue 19, item 5) -----------------------------------

BOUND = 5.0  # --max-update-norm here: honest rounds of these tests move either side by < 2


@pytest.fixture(scope="module")
def two_tenants(tmp_path_factory):
    """A splitfed server, K=2, tenants alice (TOKEN) and mallory (OTHER)."""
    d = tmp_path_factory.mktemp("splitfed-tenants")
    (d / "tokens").write_text("\n".join(TENANTS) + "\n")
    with InprocServerProcess((1, 3), optimizer="sgd", lr=LR["sgd"], extra=[
            "--federation", "splitfed", "--clients-per-round", "2", "--max-update-norm", str(BOUND),
            "--token-file", str(d / "tokens")]) as srv:
        yield srv


def shared_weights(srv) -> dict:
    r = web.get(srv.url + P.FEDERATION_WEIGHTS, headers=auth(), timeout=30)
    assert r.status_code == 200, r.text
    return decode(r.content)[0]


def distance(a: dict, b: dict) -> float:
    return sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in a) ** 0.5


def test_one_members_upload_moves_the_model_by_at_most_the_bound_whatever_it_sends_or_claims(two_tenants):
    """3e38 everywhere (it made every next forward NaN) and 50.0 claiming 10**12 samples (it became
    the model exactly) from mallory's member: the shared weights stay finite, within the bound of
    where they were, and alice's next step trains."""
    srv = two_tenants
    a = client_of(srv, "a")
    m = SplitClient(srv.url, "tiny", token=OTHER, optimizer="sgd", lr=LR["sgd"], device="cpu", client_id="m")
    before = untied_weights(a.segments)  # version 0: where every client starts
    for i, (value, claimed) in enumerate(((3e38, 1), (50.0, 10**12))):
        a.train_step(*same_batch(40 + i))
        m.train_step(*same_batch(50 + i))
        m.flush()  # its step applied (the apply rides on a next request otherwise): it trained in the round
        mine = web.get(srv.url + P.FEDERATION, headers=auth(TOKEN), timeout=10).json()
        theirs = web.get(srv.url + P.FEDERATION, headers=auth(OTHER), timeout=10).json()
        assert (mine["members"], theirs["members"], mine["members_count"]) == (["a"], ["m"], 2)  # no other's ids
        evil = {k: torch.full_like(v, value) for k, v in before.items()}
        r = web.post(srv.url + P.FEDERATION_SYNC, headers={**auth(OTHER), "Content-Type": P.CONTENT_TYPE},
                     data=encode(evil, P.SyncMeta("m", claimed).to_meta()), timeout=30)
        assert r.status_code == 200, r.text
        a.sync()
        after = shared_weights(srv)
        assert all(bool(torch.isfinite(t).all()) for t in after.values())
        assert distance(after, before) <= BOUND * (1 + 1e-5)
        assert distance(after, evil) > 1.0
        status = web.get(srv.url + P.FEDERATION, headers=auth(TOKEN), timeout=10).json()
        assert status["last_round"]["client_clipped"] == 1 and status["last_round"]["samples"] == 44  # 2 x 11 target tokens each
        before = after
    loss = a.train_step(*same_batch(60))  # on the new shared weights: a finite forward
    assert loss == loss and loss < 100
    a.close()
    m.close()


# -- in process: the federation's bookkeeping ---------------------------------------------

def _federation(mode, k=2, timeout_s=60.0, **kw):
    from splitlearn import load_model, partition
    from splitlearn.model.checkpoint import make_optimizer
    from splitlearn.server.federation.modes import Federation, Replica

    trunk = partition(load_model("tiny"), (1, 3)).trunk
    opt = lambda ps: make_optimizer(ps, "sgd", 0.1)  # noqa: E731
    return Federation(mode, Replica(trunk, opt(trunk.parameters())), opt, k, timeout_s, **kw)


def test_status_shows_a_tenant_its_own_ids_and_counts_the_others():
    fed = _federation("splitfed")
    for key in ("alice:a", "mallory:m"):
        fed.replica_for(key, 0)
        fed.trained(key, 3)
    st = fed.status("alice")
    assert (st["members"], st["members_count"], st["synced"]) == (["a"], 2, [])
    fed.sync("mallory:m", {})
    st = fed.status("alice")
    assert (st["synced"], st["synced_count"]) == ([], 1) and "mallory" not in str(st)
    assert fed.status("mallory")["synced"] == ["m"]


def test_sequential_with_a_fed_server_tickets_only_the_turn_holder():
    from splitlearn.errors import NotYourTurn
    from splitlearn.server.federation import tickets

    secret = b"k" * 32
    fed = _federation("sequential", client_weights_at="external", secret=secret)
    fed.take_turn("alice:a")
    fed.replica_for("alice:a", 0)
    fed.trained("alice:a", 4)
    with pytest.raises(NotYourTurn):
        fed.sync("mallory:m", {})
    st = fed.sync("alice:a", {})
    t = tickets.verify(secret, st["ticket"], tickets.Ticket)
    assert (t.mode, t.version, t.tenant, t.client_id, t.samples) == ("sequential", 0, "alice", "a", 4)
    assert tickets.verify(secret, st["last_close"], tickets.Close).version == 1 == st["version"]
    with pytest.raises(NotYourTurn):  # the turn is given back: the same sync again gets no second ticket
        fed.sync("alice:a", {})


def test_a_turn_holders_refused_sync_ends_its_turn_and_shares_nothing():
    """Issue 29, item 11 in sequential mode: the holder's bad upload is 400 and ends its turn (as a
    turn left idle would): the next client takes it at once, the version stays."""
    from splitlearn.errors import BadRequest

    fed = _federation("sequential", client_weights_at="external", secret=b"k" * 32, timeout_s=300.0)
    fed.take_turn("mallory:m")
    fed.replica_for("mallory:m", 0)
    with pytest.raises(BadRequest):
        fed.sync("mallory:m", {"w": torch.ones(2)})  # external: no weights here
    assert fed.status()["turn"] is None and fed.version == 0
    assert fed.take_turn("alice:a")["turn"] == "a"


def test_a_u_shape_members_weight_is_the_stock_collators_targets_for_any_mask():
    """The server never sees a U-shape member's labels; what it counts from the mask (and the
    shape) equals the targets of the stock collator's labels (the padding -100) for any mask:
    left- and right-padded rows, holes, rows of padding, 1-token rows. It cannot be raised past
    the real positions a member sends."""
    from splitlearn.model.segments import labels_from_batch
    from splitlearn.server.engine.training import target_tokens

    g = torch.Generator().manual_seed(0)
    masks = [torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 1, 0, 1], [0, 0, 0, 0, 0], [0, 0, 0, 0, 1]]),
             torch.ones(3, 1, dtype=torch.long), (torch.rand(6, 9, generator=g) > 0.4).long()]
    for mask in masks:
        ids = torch.randint(0, 50, mask.shape, generator=g)
        want = int((labels_from_batch(ids, mask)[:, 1:] != -100).sum())
        assert target_tokens(ids.shape, mask, None) == want
        assert want <= int(mask.sum())
    assert target_tokens(torch.Size([2, 5]), None, None) == 8  # no mask: every position after the first
    assert target_tokens(masks[0].shape, masks[0], None) == 3 + 2 + 2 + 0 + 1  # was 2 + 2 + 2 + 0 + 0
