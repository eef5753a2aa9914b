"""Issue 30: the apply of open-ended step s carried on step s+1's first request (metadata
``apply``), and the fused 2-way piece (``POST /v1/train/step``).

The carried apply is the explicit one: the same weights after it, the same ledger record (a
retry of the carrying request applies nothing twice), the same lr rule on shared state; a
malformed ``apply`` is a 400 that changes nothing.
"""
import json

import pytest
import torch

from splitlearn.api import protocol as P
from splitlearn.api.wire import decode, encode

from serverproc import TOKEN, InprocServerProcess, auth, web

pytestmark = pytest.mark.slow

SERVER_LR = 1e-2


def hidden(seed: int, rows: int = 2, length: int = 8) -> torch.Tensor:
    return torch.randn(rows, length, 32, generator=torch.Generator().manual_seed(seed))  # tiny: n_embd 32


def session():
    s = web.Session()
    s.headers.update(auth(TOKEN))
    return s


def post(s, url: str, path: str, tensors: dict, meta: dict):
    return s.post(url + path, data=encode(tensors, meta), timeout=30, headers={"Content-Type": P.CONTENT_TYPE})


def meta(step: int, apply: dict = None, **kw) -> dict:
    m = P.StepMeta("c", step, **kw).to_meta()
    if apply is not None:
        m["apply"] = json.dumps(apply)
    return m


def evaluation(s, url: str) -> torch.Tensor:
    r = post(s, url, P.FORWARD, {P.HIDDEN: hidden(99)}, {})
    assert r.status_code == 200, r.text
    return decode(r.content)[0][P.HIDDEN]


def u_step(s, url: str, step: int, apply: dict = None):
    """Forward (carrying ``apply``) and backward of one piece of ``step`` -> the forward's answer meta."""
    r = post(s, url, P.TRAIN_FORWARD, {P.HIDDEN: hidden(step)}, meta(step, apply))
    assert r.status_code == 200, r.text
    info = decode(r.content)[1]
    r = post(s, url, P.TRAIN_BACKWARD, {P.GRAD: hidden(100 + step)}, meta(step))
    assert r.status_code == 200, r.text
    return info


def apply_of(step: int, lr: float = SERVER_LR) -> dict:
    return {"client_id": "c", "step": step, "pieces": 1, "lr": lr}


@pytest.fixture
def servers():
    with InprocServerProcess((1, 3), lr=SERVER_LR) as a, InprocServerProcess((1, 3), lr=SERVER_LR) as b:
        yield a, b


def test_a_carried_apply_equals_the_explicit_one_and_a_retry_applies_it_once(servers):
    explicit, carried = servers
    s = session()
    u_step(s, explicit.url, 1)
    r = s.post(explicit.url + P.TRAIN_APPLY, json=apply_of(1), timeout=30)
    assert r.status_code == 200 and r.json()["applied"], r.text
    u_step(s, explicit.url, 2)

    u_step(s, carried.url, 1)
    assert s.get(carried.url + "/v1/clients/c", timeout=30).json()["step"] == 0  # nothing applied yet
    body = encode({P.HIDDEN: hidden(2)}, meta(2, apply_of(1)))
    first = s.post(carried.url + P.TRAIN_FORWARD, data=body, timeout=30, headers={"Content-Type": P.CONTENT_TYPE})
    assert first.status_code == 200, first.text
    carried_answer = json.loads(decode(first.content)[1]["apply"])
    assert carried_answer["applied"] and carried_answer["step"] == 1 and carried_answer["pieces"] == 1
    assert carried_answer["lr"] == SERVER_LR and carried_answer == {**r.json(), "durable": carried_answer["durable"]}
    assert s.get(carried.url + "/v1/clients/c", timeout=30).json()["step"] == 1
    again = s.post(carried.url + P.TRAIN_FORWARD, data=body, timeout=30, headers={"Content-Type": P.CONTENT_TYPE})
    assert again.status_code == 200 and again.content == first.content  # the retry: the stored bytes
    r = post(s, carried.url, P.TRAIN_BACKWARD, {P.GRAD: hidden(102)}, meta(2))
    assert r.status_code == 200, r.text
    # an explicit apply of step 1 now: the ledger's stored answer, nothing applied twice
    r2 = s.post(carried.url + P.TRAIN_APPLY, json=apply_of(1), timeout=30)
    assert r2.status_code == 409 or r2.json()["applied"]  # step 2 pending: 1 is no longer the last one
    assert torch.equal(evaluation(s, explicit.url), evaluation(s, carried.url))
    # step 2's apply carried by step 3's forward; the same on both servers
    u_step(s, carried.url, 3, apply_of(2))
    r = s.post(explicit.url + P.TRAIN_APPLY, json=apply_of(2), timeout=30)
    assert r.status_code == 200
    u_step(s, explicit.url, 3)
    assert torch.equal(evaluation(s, explicit.url), evaluation(s, carried.url))


@pytest.mark.parametrize("bad, why", [
    ("not json", "not JSON"),
    ("[1, 2]", "JSON object"),
    (json.dumps({"client_id": "c", "step": 1, "pieces": 1}), "'lr'"),
    (json.dumps({"client_id": "c", "step": 1, "pieces": 1, "lr": 1e-3, "x": 1}), "unknown fields"),
    (json.dumps({"client_id": "c", "step": 2, "pieces": 1, "lr": 1e-3}), "step 2"),
    (json.dumps({"client_id": "d", "step": 1, "pieces": 1, "lr": 1e-3}), "names client"),
    (json.dumps({"client_id": "c", "step": 1, "discard": True}), "cannot discard"),
    (json.dumps({"client_id": "c", "step": 1, "pieces": 1, "lr": 1e-3, "clip": 2}), "'clip'"),
    ("x" * 600, "at most"),
])
def test_a_malformed_carried_apply_is_a_400_that_changes_nothing(servers, bad, why):
    srv, _ = servers
    s = session()
    u_step(s, srv.url, 1)
    before = evaluation(s, srv.url)
    m = meta(2)
    m["apply"] = bad
    r = post(s, srv.url, P.TRAIN_FORWARD, {P.HIDDEN: hidden(2)}, m)
    assert r.status_code == 400 and why in r.json()["message"], r.text
    assert s.get(srv.url + "/v1/clients/c", timeout=30).json()["step"] == 0  # step 1 still pending
    assert torch.equal(before, evaluation(s, srv.url))
    r = s.post(srv.url + P.TRAIN_APPLY, json=apply_of(1), timeout=30)  # and still appliable
    assert r.status_code == 200 and r.json()["applied"], r.text


def test_a_carried_apply_with_another_piece_count_is_409_and_changes_nothing(servers):
    srv, _ = servers
    s = session()
    u_step(s, srv.url, 1)
    before = evaluation(s, srv.url)
    r = post(s, srv.url, P.TRAIN_FORWARD, {P.HIDDEN: hidden(2)}, meta(2, {**apply_of(1), "pieces": 2}))
    assert r.status_code == 409, r.text
    assert torch.equal(before, evaluation(s, srv.url))
    assert s.get(srv.url + "/v1/clients/c", timeout=30).json()["step"] == 0


def test_a_carried_apply_on_the_shared_segment_steps_at_most_at_the_servers_lr(servers):
    attacked, honest = servers
    s = session()
    u_step(s, attacked.url, 1)
    info = u_step(s, attacked.url, 2, apply_of(1, lr=P.MAX_LR))
    assert json.loads(info["apply"])["lr"] == SERVER_LR  # the lr applied, not the one asked
    u_step(s, honest.url, 1)
    u_step(s, honest.url, 2, apply_of(1))
    assert torch.equal(evaluation(s, attacked.url), evaluation(s, honest.url))


def test_a_fused_two_way_piece_equals_a_forward_and_a_backward():
    """POST /v1/train/step (a fused piece): loss, dL/dhidden and grad_norm as forward (labels) +
    backward (the loss's gradient) give them; the apply carried on the next step's fused piece."""
    labels = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(5))
    with InprocServerProcess((2,), lr=SERVER_LR) as fused, InprocServerProcess((2,), lr=SERVER_LR) as split:
        s = session()
        for step in (1, 2):
            carry = apply_of(step - 1) if step > 1 else None
            m = meta(step, carry, loss_scale=0.5)
            r = post(s, fused.url, P.TRAIN_STEP, {P.HIDDEN: hidden(step), P.LABELS: labels}, m)
            assert r.status_code == 200, r.text
            got, info = decode(r.content)
            r = post(s, split.url, P.TRAIN_FORWARD, {P.HIDDEN: hidden(step), P.LABELS: labels}, meta(step, carry))
            assert r.status_code == 200, r.text
            loss = decode(r.content)[0][P.LOSS]
            r = post(s, split.url, P.TRAIN_BACKWARD, {P.GRAD: torch.tensor([0.5])}, meta(step))
            assert r.status_code == 200, r.text
            want, winfo = decode(r.content)
            assert torch.allclose(got[P.LOSS], loss, rtol=0, atol=1e-6)
            assert torch.allclose(got[P.GRAD], want[P.GRAD], rtol=1e-5, atol=1e-7)
            assert float(info["grad_norm"]) == pytest.approx(float(winfo["grad_norm"]), rel=1e-5)
            assert info["accumulated"] == "1"
            assert ("apply" in info) == (step > 1)
        for srv in (fused, split):
            r = s.post(srv.url + P.TRAIN_APPLY, json=apply_of(2), timeout=30)
            assert r.status_code == 200 and r.json()["applied"], r.text
