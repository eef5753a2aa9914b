"""What a request makes a GPU server's host wait for: at most one read per check point.

A GPU server's Python thread stalls at every host read of a device value until the device's
queue drains; every op is a launch. The counts here (tests/synccount.py) play a server fed by the
``unix://`` device region on the CPU: the request's tensors are on the "device", the mask is in
host memory once the checks bring it there.
"""
import json

import pytest
import torch

from splitlearn.api import protocol as P
from splitlearn.api.wire import pack
from splitlearn.server.config import ServerConfig
from splitlearn.server.engine import guard
from splitlearn.server.engine.gradclip import NormClip
from splitlearn.server.http.app import create_app

from serverproc import TOKEN, assert_error, auth, post_tensors, tensors_of
import synccount
from synccount import counting

D, VOCAB, B, T = 32, 257, 2, 6
MASK = torch.tensor([[0, 0, 1, 1, 1, 1], [1] * 6])  # padded: the mask's checks run


def app_of(cuts, **kw):
    return create_app(ServerConfig(model="tiny", cuts=cuts, tokens=(TOKEN,), **kw))


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def apply(c, client_id, step, clip=1.0):
    body = json.dumps({"client_id": client_id, "step": step, "pieces": 1, "lr": P.MAX_LR, "clip": clip})
    r = c.post(P.TRAIN_APPLY, data=body, content_type="application/json", headers=auth())
    assert r.status_code == 200, r.get_data(as_text=True)
    return r.get_json()


def test_the_counter_sees_every_kind_of_read():
    x = rand(4)
    with counting() as c:
        y = x * 2  # an op, no read
        bool(y.sum() > 0), float(y[0]), y.tolist(), y.cpu()
    assert c.syncs == 4 and c.ops["mul"] == 1
    with counting() as c:
        h = y.cpu()  # in host memory from here: reading it waits for nothing; y stays on the device
        bool(h.sum() > 0), h.tolist(), bool(y.sum() > 0)
    assert c.syncs == 2 and c.reads["host"] == 2


def u_step(c, rt, step, mask=MASK, clip=1.0):
    """A U-shape step's three requests, each counted: {route: Counts}."""
    meta, out = P.StepMeta("a", step).to_meta(), {}
    body = pack(P.HIDDEN, rand(B, T, D, seed=step), "float32")
    if mask is not None:
        body[P.MASK] = mask
    with counting(rt) as out["forward"]:
        tensors_of(post_tensors(c, P.TRAIN_FORWARD, body, meta))
    with counting(rt) as out["backward"]:
        tensors_of(post_tensors(c, P.TRAIN_BACKWARD, pack(P.GRAD, rand(B, T, D, seed=9), "float32"), meta))
    with counting(rt) as out["apply"]:
        apply(c, "a", step, clip)
    return out


def test_a_u_shape_step_waits_once_per_check_point():
    """forward: the request's checks (and mask) in one read before the segment runs (a refusal
    must leave the dropout RNG and the step unopened), the output's after: 2. backward: the
    request's before the backward (it accumulates), the answer's + the norm after: 2. apply: 1
    (the norm; AdamW's step counters are host tensors on CUDA too)."""
    app = app_of((1, 3))
    counts = u_step(app.test_client(), app.extensions["splitlearn"], 1)
    assert {k: v.syncs for k, v in counts.items()} == {"forward": 2, "backward": 2, "apply": 1}


def test_a_two_way_step_waits_twice():
    """The fused step: the request's checks and mask (1); the loss's, the answer's, the norm, the
    loss's value and the tokens trained, after the backward (1)."""
    app = app_of((2,))
    rt, c = app.extensions["splitlearn"], app.test_client()
    body = {**pack(P.HIDDEN, rand(B, T, D), "float32"), P.MASK: MASK,
            P.LABELS: torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(1))}
    with counting(rt) as step:
        tensors_of(post_tensors(c, P.TRAIN_STEP, body, P.StepMeta("a", 1).to_meta()))
    apply(c, "a", 1)  # the shared segment's lease goes back
    with counting(rt) as fwd:  # split: the forward's loss + tokens in one read, then the backward's
        tensors_of(post_tensors(c, P.TRAIN_FORWARD, body, P.StepMeta("b", 1).to_meta()))
    with counting(rt) as bwd:
        tensors_of(post_tensors(c, P.TRAIN_BACKWARD, {P.GRAD: torch.ones(1)}, P.StepMeta("b", 1).to_meta()))
    assert (step.syncs, fwd.syncs, bwd.syncs) == (2, 2, 2)


def test_a_decode_step_reads_its_checks_once():
    """Ours: one read (the checks and the mask); transformers' ``create_causal_mask`` reads its
    padding mask once more (``_ignore_causal_mask_sdpa``), not counted against us here."""
    app = app_of((1, 3))
    rt, c = app.extensions["splitlearn"], app.test_client()
    sid = c.post(P.SESSIONS, json={"rows": 2}, headers=auth()).get_json()["session_id"]
    url = P.SESSION_STEP.format(session_id=sid)
    tensors_of(post_tensors(c, url, {P.HIDDEN: rand(2, 5, D), P.MASK: MASK[:, 1:]}, P.SessionStepMeta(0).to_meta()))
    with counting(rt) as k:
        tensors_of(post_tensors(c, url, {P.HIDDEN: rand(2, 1, D), P.MASK: torch.ones(2, 1, dtype=torch.long)},
                                P.SessionStepMeta(5).to_meta()))
    ours = sum(n for what, n in k.reads.items() if what != "host") - k.reads["_local_scalar_dense"]
    assert ours == 1 and k.syncs <= 2, k.reads


CHECKS = ("norm_tensor", "settle", "finite_flag")  # guard's functions: the norm, the reads, the flags


def count_checks(monkeypatch):
    """Ops dispatched inside guard's checks and the clip counted as region ``checks`` too."""
    def region(fn):
        def inner(*a, **kw):
            with synccount.active().region("checks"):
                return fn(*a, **kw)
        return inner
    for name in CHECKS:
        monkeypatch.setattr(guard, name, region(getattr(guard, name)))
    monkeypatch.setattr(NormClip, "clip", region(NormClip.clip))


def test_the_checks_ops_do_not_grow_with_the_segment(monkeypatch):
    """1 block vs 3 (12 vs 36 parameters) of a bfloat16 segment (no float32 copy a gradient): the
    checks, the norm and the clips (the client's factor, and a fixed --max-grad-norm that clips
    every step) dispatch as many ops."""
    count_checks(monkeypatch)
    per_route = {}
    for cuts, n_params in (((1, 2), 12), ((1, 4), 36)):
        app = app_of(cuts, dtype="bfloat16", max_grad_norm=1e-6)
        rt = app.extensions["splitlearn"]
        assert len(list(rt.segment.parameters())) == n_params
        counts = u_step(app.test_client(), rt, 1, clip=0.5)
        assert counts["apply"].ops["_foreach_mul_"] == 2  # the client's factor, then the clip to 1e-6
        per_route[cuts] = {k: v.region_ops("checks") for k, v in counts.items()}
    assert per_route[(1, 2)] == per_route[(1, 4)], per_route
    assert all(n > 0 for n in per_route[(1, 2)].values())


def test_grad_norm_is_a_constant_number_of_ops():
    """guard.grad_norm over 6 or 60 bfloat16 gradients: the same ops, one read, float32 exact."""
    ops = {}
    for n in (6, 60):
        params = [torch.nn.Parameter(torch.zeros(5, dtype=torch.bfloat16)) for _ in range(n)]
        for i, p in enumerate(params):
            p.grad = torch.full((5,), float(i % 3), dtype=torch.bfloat16)
        with counting() as k:
            norm = guard.grad_norm(params)
        expect = torch.linalg.vector_norm(torch.cat([p.grad.float() for p in params]))
        assert norm == pytest.approx(float(expect), rel=1e-6)
        assert k.syncs == 1
        ops[n] = k.n_ops
    assert ops[6] == ops[60]


def test_the_servers_optimizer_takes_torchs_foreach_path_on_cuda():
    """AdamW as torch builds it by default: ``foreach`` left to torch (its foreach kernels for CUDA
    tensors), not fused (fused changes the numerics against the unsplit reference)."""
    opt = app_of((1, 3)).extensions["splitlearn"].optimizer
    assert isinstance(opt, torch.optim.AdamW)
    assert opt.defaults["foreach"] is None and not opt.defaults.get("fused")


@pytest.mark.parametrize("bad, words", [
    ({P.HIDDEN: torch.full((B, T, D), float("nan")), P.MASK: torch.full((B, T), 2)}, "contains NaN"),
    ({P.HIDDEN: rand(B, T, D), P.MASK: torch.full((B, T), 2)}, "only 0 and 1"),
    ({P.HIDDEN: torch.full((B, T, D), float("inf")), P.MASK: torch.ones(B, T + 1, dtype=torch.long)}, "contains NaN"),
    ({P.HIDDEN: rand(B, T, D), P.MASK: MASK, P.LABELS: torch.full((B, T), VOCAB)}, "ids outside"),
    ({P.HIDDEN: rand(B, T, D), P.MASK: torch.full((B, T), 2), P.LABELS: torch.full((B, T), 1.0)}, "only 0 and 1"),
])
def test_checks_read_together_refuse_in_the_order_checked_one_by_one(bad, words):
    """Several defects: the first in the order of the sequential checks is the one refused, a
    shape check after a value check included (the flags before it are read first)."""
    app = app_of((2,) if P.LABELS in bad else (1, 3))
    r = post_tensors(app.test_client(), P.TRAIN_FORWARD, bad, P.StepMeta("a", 1).to_meta())
    assert_error(r, 400, words)
    assert app.extensions["splitlearn"].client_step("a") == 0
