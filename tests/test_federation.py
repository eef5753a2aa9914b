"""Many data owners on one real server process: shared (concurrent), sequential and splitfed.

Every test runs ``python -m splitlearn.server`` and real ``SplitClient``s over loopback, several
at once from threads. Exactness is against the unsplit model (SGD, float32 wire).
"""
import random
import time

import pytest
import requests
import torch

from splitlearn import protocol as P
from splitlearn.client import SplitClient
from splitlearn.client.federation import untied_weights
from splitlearn.errors import BadRequest, Conflict, SplitLearnError
from splitlearn.wire import encode, pack

from serverproc import TOKEN, ServerProcess, auth, run_threads
from test_client import BATCHES, LR, assert_both_sides_equal, unsplit_steps

pytestmark = pytest.mark.slow


def client_of(srv, name, optimizer="sgd", **kw) -> SplitClient:
    return SplitClient(srv.url, "tiny", token=TOKEN, optimizer=optimizer, lr=LR[optimizer],
                       device="cpu", client_id=name, **kw)


def same_batch(seed):
    return torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(seed)), None


@pytest.mark.parametrize("cuts", [(1, 3), (2,)], ids=["u", "2way"])
def test_shared_mode_concurrent_clients_each_step_applied_once(cuts, tmp_path):
    with ServerProcess(cuts, optimizer="adamw", lr=1e-3, extra=["--threads", "4"]) as srv:
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
            state = requests.get(srv.url + P.CLIENT_STATE.format(client_id=c.client_id),
                                 headers=auth(), timeout=10).json()
            assert state["step"] == steps and c.step == steps
            c.close()


def test_a_client_that_vanishes_after_its_forward_blocks_others_only_until_the_lease_timeout():
    with ServerProcess((1, 3), extra=["--lease-timeout", "2"]) as srv:
        ghost = requests.Session()
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
    with ServerProcess(cuts, optimizer="sgd", lr=LR["sgd"], checkpoint_dir=tmp_path,
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
        status = requests.get(srv.url + P.FEDERATION, headers=auth(), timeout=10).json()
        assert status["mode"] == "sequential" and status["version"] == 4 and status["turn"] is None


def test_sequential_refuses_a_client_out_of_turn():
    with ServerProcess((1, 3), optimizer="sgd", lr=LR["sgd"], extra=["--federation", "sequential"]) as srv:
        with client_of(srv, "a") as a:
            a.train_step(*BATCHES[0])  # a holds the turn
            s = requests.Session()
            s.headers.update({**auth(), "Content-Type": P.CONTENT_TYPE})
            meta = P.StepMeta("b", 1, fed_version=0).to_meta()
            r = s.post(srv.url + P.TRAIN_FORWARD, data=encode(pack(P.HIDDEN, torch.randn(1, 4, 32), "float32"), meta))
            assert r.status_code == 409 and r.json()["error"] == "not_your_turn"
            turn = requests.post(srv.url + P.FEDERATION_TURN, json={"client_id": "b"}, headers=auth(), timeout=10)
            assert turn.status_code == 503 and "holds the turn" in turn.json()["message"]


@pytest.mark.parametrize("cuts", [(1, 3), (2,)], ids=["u", "2way"])
def test_splitfed_round_equals_one_unsplit_sgd_step_on_the_concatenated_batches(cuts, tmp_path):
    batches = [same_batch(10), same_batch(11), same_batch(12)]
    with ServerProcess(cuts, optimizer="sgd", lr=LR["sgd"], checkpoint_dir=tmp_path,
                       extra=["--federation", "splitfed", "--clients-per-round", "3"]) as srv:
        clients = [client_of(srv, n) for n in "abc"]

        def one_round(c, batch):
            return lambda: (c.train_step(*batch), c.sync())

        run_threads([one_round(c, b) for c, b in zip(clients, batches)])
        whole = torch.cat([b[0] for b in batches])  # (6, 12): equal sizes, no padding
        reference, _ = unsplit_steps(cuts, "sgd", [(whole, None)])
        for c in clients:  # every client continues from the average
            assert c.federation.version == 1
            assert_both_sides_equal(reference, c, srv)
        status = requests.get(srv.url + P.FEDERATION, headers=auth(), timeout=10).json()
        assert status["round"] == 2 and status["members"] == [] and status["version"] == 1


def test_splitfed_round_timeout_closes_with_the_clients_that_synced():
    with ServerProcess((1, 3), optimizer="sgd", lr=LR["sgd"],
                       extra=["--federation", "splitfed", "--clients-per-round", "2", "--round-timeout", "2"]) as srv:
        a, b = client_of(srv, "a"), client_of(srv, "b")
        b.train_step(*same_batch(1))  # b trains but never syncs
        a.train_step(*same_batch(2))
        t0 = time.monotonic()
        status = a.sync()  # waits for b, then the round closes without it
        assert 1.5 < time.monotonic() - t0 < 60
        assert status["version"] == 1 and status["round"] == 2
        with pytest.raises(Conflict, match="not a member"):
            b.federation.sync(untied_weights(b.segments))
        b.train_step(*same_batch(3))  # stale weights: b downloads the average and goes on
        assert b.federation.version == 1 and b.step == 2


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
        "nan": {**good, name: torch.full_like(good[name], float("nan"))},
    }


def test_bad_sync_bodies_are_400_and_average_nothing():
    with ServerProcess((1, 3), optimizer="sgd", lr=LR["sgd"],
                       extra=["--federation", "splitfed", "--clients-per-round", "1"]) as srv:
        with client_of(srv, "a") as a:
            a.train_step(*same_batch(1))
            s = requests.Session()
            s.headers.update({**auth(), "Content-Type": P.CONTENT_TYPE})
            for what, weights in bad_sync_bodies(a).items():
                r = s.post(srv.url + P.FEDERATION_SYNC, data=encode(weights, P.SyncMeta("a", 2).to_meta()))
                assert r.status_code == 400, (what, r.text)
                assert set(r.json()) == {"error", "message"}
            for body in (b"not safetensors", encode({"x": torch.ones(1)}, {"client_id": "a"})):
                assert s.post(srv.url + P.FEDERATION_SYNC, data=body).status_code == 400
            status = s.get(srv.url + P.FEDERATION).json()
            assert status["version"] == 0 and status["members"] == ["a"] and status["synced"] == []
            assert a.sync()["version"] == 1  # the good one closes the round


def test_a_separate_fed_server_averages_the_client_weights_the_segment_server_never_sees(tmp_path):
    """SplitFed with the client-side weights on a fed server: still one unsplit SGD step per round."""
    import sys

    from splitlearn.localserver import ChildServer, free_port

    batches = [same_batch(20), same_batch(21)]
    port = free_port()
    fed = ChildServer([sys.executable, "-m", "splitlearn.server.fedavg", "--mode", "splitfed",
                       "--clients-per-round", "2", "--port", str(port)], port, env={"SPLITLEARN_TOKEN": TOKEN})
    with fed, ServerProcess((1, 3), optimizer="sgd", lr=LR["sgd"], checkpoint_dir=tmp_path,
                            extra=["--federation", "splitfed", "--clients-per-round", "2",
                                   "--client-weights", "external"]) as srv:
        with pytest.raises(SplitLearnError, match="fed_url"):
            client_of(srv, "x")  # this server wants a fed server
        clients = [client_of(srv, n, fed_url=fed.url) for n in "ab"]
        run_threads([lambda c=c, b=b: (c.train_step(*b), c.sync()) for c, b in zip(clients, batches)])
        reference, _ = unsplit_steps((1, 3), "sgd", [(torch.cat([b[0] for b in batches]), None)])
        for c in clients:
            assert_both_sides_equal(reference, c, srv)
        # the segment server holds no client-side weights; the fed server does
        r = requests.get(srv.url + P.FEDERATION_WEIGHTS, headers=auth(), timeout=10)
        assert r.status_code == 404 and "fed server" in r.json()["message"]
        assert requests.get(fed.url + P.FEDERATION_WEIGHTS, headers=auth(), timeout=10).status_code == 200
        s = requests.Session()
        s.headers.update({**auth(), "Content-Type": P.CONTENT_TYPE})
        weights = untied_weights(clients[0].segments)
        refused = s.post(srv.url + P.FEDERATION_SYNC, data=encode(weights, P.SyncMeta("a", 2).to_meta()))
        assert refused.status_code == 400  # weights sent to the segment server are refused, not kept
        bad = {**weights, next(iter(weights)): torch.full_like(next(iter(weights.values())), float("nan"))}
        assert s.post(fed.url + P.FEDERATION_SYNC, data=encode(bad, P.SyncMeta("a", 2).to_meta())).status_code == 400


def test_fed_server_averager_rounds_and_refusals():
    from splitlearn.server.fedavg import WeightAverager

    avg = WeightAverager("splitfed", 2, round_timeout_s=60)
    a, b = {"w": torch.ones(2)}, {"w": torch.full((2,), 4.0)}
    assert avg.sync("a", 1, a)["version"] == 0
    with pytest.raises(BadRequest, match="shape"):
        avg.sync("b", 1, {"w": torch.ones(3)})
    with pytest.raises(BadRequest, match="NaN"):
        avg.sync("b", 1, {"w": torch.tensor([1.0, float("nan")])})
    assert avg.sync("b", 3, b)["version"] == 1
    version, w = avg.latest()
    assert version == 1 and torch.allclose(w["w"], torch.full((2,), (1 + 3 * 4) / 4))
