"""Poisoning: finite but huge activations, gradients or losses are refused and change nothing."""
import pytest
import torch

from splitlearn.api import protocol as P
from splitlearn.server.engine import guard
from splitlearn.server.http.app import create_app
from splitlearn.server.config import ServerConfig
from splitlearn.errors import BadRequest
from splitlearn.api.wire import pack

from serverproc import TOKEN, apply_step, assert_error, post_tensors, same_weights, segment_of, snapshot, tensors_of

D, VOCAB = 32, 257


def app_of(cuts, **kw):
    return create_app(ServerConfig(model="tiny", cuts=cuts, tokens=(TOKEN,), **kw))


def optimizer_state(app):
    opt = app.extensions["splitlearn"].optimizer
    return {k: {n: v.clone() if torch.is_tensor(v) else v for n, v in st.items()} for k, st in opt.state.items()}


def test_guards():
    guard.finite("x", torch.ones(3))
    with pytest.raises(BadRequest, match="x is not finite"):
        guard.finite("x", torch.tensor([1.0, float("inf")]))
    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = torch.tensor([3.0, 4.0])
    assert guard.grad_norm([p]) == pytest.approx(5.0)
    p.grad = torch.tensor([1e30, 0.0])  # finite, but its square overflows AdamW's second moment
    with pytest.raises(BadRequest, match="not finite"):
        guard.grad_norm([p])


@pytest.mark.parametrize("scale", [3e38, 1e30])
def test_huge_activations_to_a_u_shape_forward_are_refused(scale):
    app = app_of((1, 3))
    c = app.test_client()
    before = snapshot(segment_of(app))
    h = torch.full((2, 6, D), scale)
    r = post_tensors(c, P.TRAIN_FORWARD, pack(P.HIDDEN, h, "float32"), P.StepMeta("evil", 1).to_meta())
    assert_error(r, 400, "not finite")
    assert same_weights(before, snapshot(segment_of(app)))
    # the lease was given back: another client steps at once
    ok = post_tensors(c, P.TRAIN_FORWARD, pack(P.HIDDEN, torch.randn(2, 6, D), "float32"),
                      P.StepMeta("good", 1).to_meta())
    tensors_of(ok)


def test_a_huge_gradient_to_a_u_shape_backward_is_refused_and_changes_nothing():
    app = app_of((1, 3))
    c = app.test_client()
    h = torch.randn(2, 6, D)
    meta = P.StepMeta("evil", 1).to_meta()
    tensors_of(post_tensors(c, P.TRAIN_FORWARD, pack(P.HIDDEN, h, "float32"), meta))
    before, opt_before = snapshot(segment_of(app)), optimizer_state(app)
    r = post_tensors(c, P.TRAIN_BACKWARD, pack(P.GRAD, torch.full((2, 6, D), 1e30), "float32"), meta)
    assert_error(r, 400, "not finite")
    assert same_weights(before, snapshot(segment_of(app))) and optimizer_state(app) == opt_before == {}
    assert app.extensions["splitlearn"].client_step("evil") == 0  # not applied
    assert app.extensions["splitlearn"].lease.held_by() is None
    # its forward is dropped: the backward again is 409, and a good step goes through
    assert_error(post_tensors(c, P.TRAIN_BACKWARD, pack(P.GRAD, torch.randn(2, 6, D), "float32"), meta), 409)
    good = P.StepMeta("good", 1).to_meta()
    tensors_of(post_tensors(c, P.TRAIN_FORWARD, pack(P.HIDDEN, h, "float32"), good))
    tensors_of(post_tensors(c, P.TRAIN_BACKWARD, pack(P.GRAD, torch.randn(2, 6, D), "float32"), good))
    assert apply_step(c, "good", 1).status_code == 200
    assert not same_weights(before, snapshot(segment_of(app)))


def test_huge_activations_to_a_two_way_step_are_refused():
    app = app_of((2,))
    c = app.test_client()
    before = snapshot(segment_of(app))
    tensors = {**pack(P.HIDDEN, torch.full((2, 6, D), 3e38), "float32"),
               P.LABELS: torch.randint(0, VOCAB, (2, 6))}
    assert_error(post_tensors(c, P.TRAIN_STEP, tensors, P.StepMeta("evil", 1).to_meta()), 400, "not finite")
    assert same_weights(before, snapshot(segment_of(app)))
    assert app.extensions["splitlearn"].client_step("evil") == 0


def test_max_grad_norm_clips_the_servers_step():
    """With SGD the update is lr * grad: clipped to norm 1e-3 it moves the weights by at most that."""
    steps = {}
    for clip in (None, 1e-3):
        app = app_of((2,), optimizer="sgd", lr=1.0, max_grad_norm=clip)
        c = app.test_client()
        before = snapshot(segment_of(app))
        g = torch.Generator().manual_seed(0)
        tensors = {**pack(P.HIDDEN, torch.randn(2, 6, D, generator=g), "float32"),
                   P.LABELS: torch.randint(0, VOCAB, (2, 6), generator=g)}
        tensors_of(post_tensors(c, P.TRAIN_STEP, tensors, P.StepMeta("a", 1).to_meta()))
        assert apply_step(c, "a", 1).get_json()["lr"] == 1.0  # the server's own lr (the cap)
        after = snapshot(segment_of(app))
        steps[clip] = sum(float((after[k] - before[k]).pow(2).sum()) for k in before) ** 0.5
    assert steps[1e-3] == pytest.approx(1e-3, rel=1e-2) and steps[None] > 10 * steps[1e-3]
