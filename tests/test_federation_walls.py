"""One SplitFed member against the others, on real server processes (issue 29, items 9-11).

- **Weight is paid for** (item 9): a member's FedAvg weight is the target tokens the server
  trained for it (backwards received); forward-only pieces and 1-token rows buy nothing, and
  no member holds more than ``--max-member-share`` (default 0.5) of a round.
- **Bad JSON is a 4xx, and 409s name the client as sent** (item 10).
- **A refused sync is a failure, not a stall** (item 11): as Flower's ``accept_failures``, the
  member is out of the round and the round closes with the others, long before
  ``--round-timeout``.
"""
import time

import pytest
import requests
import torch

from splitlearn.api import protocol as P
from splitlearn.client import SplitClient
from splitlearn.hf.fedsync import untied_weights
from splitlearn.api.wire import decode, encode

from serverproc import OTHER, TENANTS, TOKEN, InprocServerProcess, auth, run_threads, web
from test_client import LR

pytestmark = pytest.mark.slow

ALICE, MALLORY = TOKEN, OTHER


def splitfed(tmp_path, k: int, *extra) -> InprocServerProcess:
    (tmp_path / "tokens").write_text("\n".join(TENANTS) + "\n")
    return InprocServerProcess((1, 3), optimizer="sgd", lr=LR["sgd"], extra=[
        "--federation", "splitfed", "--clients-per-round", str(k), "--round-timeout", "300",
        "--token-file", str(tmp_path / "tokens"), *extra])


def member(srv, token, cid) -> SplitClient:
    return SplitClient(srv.url, "tiny", token=token, optimizer="sgd", lr=LR["sgd"], device="cpu", client_id=cid)


def batch(seed, rows=2, length=12):
    return torch.randint(0, 256, (rows, length), generator=torch.Generator().manual_seed(seed)), None


def session(token) -> requests.Session:
    s = web.Session()
    s.headers.update(auth(token))
    return s


def post(s, url, path, tensors, meta):
    return s.post(url + path, data=encode(tensors, meta), headers={"Content-Type": P.CONTENT_TYPE}, timeout=30)


def status(srv, token=ALICE) -> dict:
    return web.get(srv.url + P.FEDERATION, headers=auth(token), timeout=10).json()


def test_forward_only_pieces_and_one_token_rows_buy_no_weight_and_one_member_holds_at_most_the_cap(tmp_path):
    """K=3: alice's a and b train 2 x 12 tokens each (22 targets); mallory's m sends 64 x 16
    with its backward (960 targets), two 64 x 16 forwards never backpropagated and 64 1-token
    rows with their backward. The server counts 22 + 22 + 960; uncapped, m would hold 96% of
    the average, it holds exactly half (--max-member-share 0.5 default): the shared
    client-side weights are 0.25 a + 0.25 b + 0.5 m of the uploads."""
    with splitfed(tmp_path, 3) as srv:
        a, b, m = member(srv, ALICE, "a"), member(srv, ALICE, "b"), member(srv, MALLORY, "m")
        w_m = {k: v + 0.01 for k, v in untied_weights(m.segments).items()}  # mallory's upload, in the schema
        a.train_step(*batch(1))
        b.train_step(*batch(2))
        s = session(MALLORY)
        meta = lambda i: P.StepMeta("m", 1, fed_version=0, micro=i).to_meta()  # noqa: E731
        grad = lambda rows, length: torch.full((rows, length, 32), 1e-4)  # noqa: E731
        for i, (rows, length, backward) in enumerate([(64, 16, True), (64, 16, False), (64, 16, False),
                                                      (64, 1, True)]):
            assert post(s, srv.url, P.TRAIN_FORWARD, {P.HIDDEN: torch.randn(rows, length, 32)}, meta(i)).ok
            if backward:
                assert post(s, srv.url, P.TRAIN_BACKWARD, {P.GRAD: grad(rows, length)}, meta(i)).ok
        r = s.post(srv.url + P.TRAIN_APPLY, json={"client_id": "m", "step": 1, "pieces": 2, "lr": 1e-3}, timeout=30)
        assert r.status_code == 200, r.text
        r = post(s, srv.url, P.FEDERATION_SYNC, w_m, P.SyncMeta("m", 10**12).to_meta())
        assert r.status_code == 200, r.text
        w_a, w_b = ({k: v.clone() for k, v in untied_weights(c.segments).items()} for c in (a, b))  # as uploaded
        run_threads([b.sync, a.sync])  # a member's sync returns once its round closed
        last = status(srv)["last_round"]
        assert (last["members"], last["samples"], last["share_capped"]) == (3, 22 + 22 + 960, 1)
        r = web.get(srv.url + P.FEDERATION_WEIGHTS, headers=auth(), timeout=30)
        shared = decode(r.content)[0]
        for k in shared:
            want = 0.25 * w_a[k].double() + 0.25 * w_b[k].double() + 0.5 * w_m[k].double()
            assert torch.allclose(shared[k].double(), want, atol=1e-6), k
        uncapped = {k: (22 * w_a[k].double() + 22 * w_b[k].double() + 960 * w_m[k].double()) / 1004 for k in shared}
        assert not all(torch.allclose(shared[k].double(), uncapped[k], atol=1e-4) for k in shared)


def test_bad_json_is_a_4xx_and_a_409_names_the_client_as_sent(tmp_path):
    with splitfed(tmp_path, 2) as srv:
        s = session(MALLORY)
        for path in (P.FEDERATION_TURN, P.TRAIN_APPLY):
            for body in ("[" * 100000, '{"client_id": ' * 50000, "\xff\xfe", '{"client_id": ["m"]}'):
                r = s.post(srv.url + path, data=body.encode("utf-8", "surrogateescape"), timeout=10)
                assert r.status_code in (400, 413), (path, body[:10], r.status_code, r.text)
                assert set(r.json()) == {"error", "message"} and "Traceback" not in r.text
        h = torch.randn(2, 8, 32)
        refused = [post(s, srv.url, P.TRAIN_FORWARD, {P.HIDDEN: h}, P.StepMeta("m", 5, fed_version=0).to_meta()),
                   post(s, srv.url, P.TRAIN_BACKWARD, {P.GRAD: h}, P.StepMeta("m", 1, fed_version=0).to_meta())]
        for r in refused:
            assert r.status_code == 409, r.text
            assert "'m'" in r.json()["message"] and "mallory" not in r.text, r.text
        assert web.get(srv.url + P.HEALTH, timeout=10).status_code == 200


def test_a_refused_sync_is_the_members_failure_and_the_round_closes_with_the_others(tmp_path):
    """Round 1: mallory's NaN upload; round 2: mallory's 10**400 samples. Each is 400, counts as
    mallory's failure of the round (her good sync after it is 409), and alice's sync closes the
    round at once: --round-timeout is 300 s."""
    with splitfed(tmp_path, 2) as srv:
        a, m = member(srv, ALICE, "a"), member(srv, MALLORY, "m")
        s = session(MALLORY)
        for rnd in (1, 2):
            a.train_step(*batch(10 + rnd))
            m.train_step(*batch(20 + rnd))
            good = untied_weights(m.segments)
            name = next(iter(good))
            bad = ((untied_weights(m.segments) | {name: torch.full_like(good[name], float("nan"))},
                    P.SyncMeta("m", 2).to_meta()) if rnd == 1 else
                   (good, {"client_id": "m", "samples": "1" + "0" * 400}))
            r = post(s, srv.url, P.FEDERATION_SYNC, *bad)
            assert r.status_code == 400 and set(r.json()) == {"error", "message"}, r.text
            mine = status(srv, MALLORY)
            assert (mine["failed"], mine["failed_count"], mine["version"]) == (["m"], 1, rnd - 1)
            assert status(srv)["failed"] == []  # alice sees her own ids only
            r = post(s, srv.url, P.FEDERATION_SYNC, good, P.SyncMeta("m", 2).to_meta())
            assert r.status_code == 409 and "refused" in r.json()["message"], r.text
            t0 = time.monotonic()
            st = a.sync()
            assert time.monotonic() - t0 < 30 and st["version"] == rnd and st["round"] == rnd + 1
            last = status(srv)["last_round"]
            assert (last["members"], last["failed"], last["samples"]) == (1, 1, 22)
