"""No tenant moves the shared optimizer's statistics by more than a bounded factor (issue 50, items 1, 3).

Two tenants on one in-process server (tiny U (1, 3), AdamW, lr 0.01, the default clip). Alice's
steps are driven on the engine (the routes' own methods on the compute thread); mallory's go
through the app with her own token, as an attacker's would.

- deflation: mallory's applies carry ``"clip": 1e-12`` (or a gradient x 1e-12) between alice's
  steps. Before issue 50 one running mean of every apply's log-norm took them in: the bound fell
  to ~1e-11 within a few steps and alice's training stopped. Now each tenant has its own mean and
  the bound is Huber's estimate over tenants: hers moves it by at most x 2 (gradclip.REACH).
- inflation while alice is idle: x 1e6 gradients at lr 0 (nothing at all happens: an apply that
  moves no weight moves no statistic), at a tiny lr (a step at a fraction of the lr is that
  fraction of a step in AdamW's moments, its step count and the clip's votes), at the full lr
  (the bound rises by at most x 2).
"""
import functools
import json
import math

import pytest
import torch

from splitlearn.api import protocol as P
from splitlearn.server.config import ServerConfig
from splitlearn.server.engine.gradclip import REACH, NormClip
from splitlearn.server.http.app import create_app

from serverproc import OTHER, TENANTS, auth, post_tensors, tensors_of

D, LR = 32, 1e-2  # models/tiny.json's width; the server's --lr
ALICE = "alice:a"  # her scoped key (tenant:client)
WARM, AFTER = 16, 24  # alice's steps before mallory starts; after
DATA = [(torch.randn(4, 8, D, generator=g), torch.randn(4, 8, D, generator=g))
        for g in [torch.Generator().manual_seed(0)] for _ in range(4)]  # alice's batches: inputs, targets


def server():
    app = create_app(ServerConfig(model="tiny", cuts=(1, 3), tokens=TENANTS, lr=LR, torch_threads=1))
    rt = app.extensions["splitlearn"]
    rt.lease.grace_s = 0.0  # no segment kept for a tenant between its steps: the two alternate at once
    return app, rt


def alice_step(rt, i: int, lr: float = LR) -> float:
    """Alice's step ``i``: her loss (0.5 * mean squared distance of the trunk's output to her target)."""
    h, target = DATA[i % len(DATA)]
    meta = P.StepMeta(ALICE, i)

    def step():
        out = rt.training.forward(meta, h, None).tensors[P.HIDDEN]
        rt.training.backward(meta, (out - target) / out.numel())
        rt.training.apply(ALICE, P.ApplyRequest(ALICE, i, 1, lr))
        return 0.5 * float(((out - target) ** 2).mean())
    with rt.lock:
        return rt.compute.run(step)


def mallory_step(app, step: int, *, scale: float = 1.0, clip: float = 1.0, lr: float = P.MAX_LR) -> dict:
    """Mallory's step ``step`` through the app: her gradient times ``scale``, applied with
    ``clip`` at ``lr``; the apply's answer."""
    c = app.test_client()
    h, target = DATA[1]
    meta = P.StepMeta("m", step).to_meta()
    out = tensors_of(post_tensors(c, P.TRAIN_FORWARD, {P.HIDDEN: h}, meta, token=OTHER))[P.HIDDEN]
    tensors_of(post_tensors(c, P.TRAIN_BACKWARD, {P.GRAD: (out - target) / out.numel() * scale}, meta,
                            token=OTHER))
    body = {"client_id": "m", "step": step, "pieces": 1, "lr": lr, **({"clip": clip} if clip != 1.0 else {})}
    r = c.post(P.TRAIN_APPLY, data=json.dumps(body), headers={**auth(OTHER), "Content-Type": "application/json"})
    assert r.status_code == 200, r.get_data(as_text=True)
    return r.get_json()


def final_loss(losses: list[float]) -> float:
    return sum(losses[-len(DATA):]) / len(DATA)  # one of each batch


@functools.lru_cache(maxsize=1)
def undisturbed() -> tuple[float, ...]:
    """Alice's losses alone (deterministic: computed once)."""
    _, rt = server()
    return tuple(alice_step(rt, i) for i in range(1, WARM + AFTER + 1))


def optimizer_state(rt) -> dict:
    return {k: {n: v.clone() for n, v in st.items()} for k, st in rt.optimizer.state.items()}


def same_state(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k][n], b[k][n]) for k in a for n in a[k])


def attacked(attack: dict, factor=3.0) -> tuple[list[float], list[float]]:
    """Alice's losses with mallory's ``attack`` applied between each two of her steps after
    ``WARM``; the log-bound's distance below alice's own statistic after each of mallory's steps."""
    app, rt = server()
    rt.grad_clip.factor = factor
    losses, below = [alice_step(rt, i) for i in range(1, WARM + 1)], []
    for k in range(1, AFTER + 1):
        answer = mallory_step(app, k, **attack)
        assert answer["applied"]
        if factor is not None:
            below.append(rt.grad_clip.means()["alice"] - rt.grad_clip.log_mean)
        losses.append(alice_step(rt, WARM + k))
    return losses, below


@pytest.mark.parametrize("attack", [dict(clip=1e-12, lr=0.0), dict(clip=1e-12), dict(scale=1e-12)],
                         ids=["clip-lr0", "clip", "tiny-gradient"])
def test_tiny_norms_between_alices_steps_move_the_bound_at_most_x2_and_she_trains(attack):
    twin = undisturbed()
    assert final_loss(twin) < 0.25 * twin[0]  # she learns in these steps (the test can fail)
    losses, below = attacked(attack)
    if attack.get("lr") == 0.0:  # applies at lr 0 did nothing at all: her training is her twin's, bit for bit
        assert tuple(losses) == twin
        return
    assert max(below) <= math.log(REACH) + 1e-9  # the bound never fell below half alice's (was: 1e-11)
    # mallory's steps are AdamW steps (of a gradient ~0: alice's momentum decays, the weights move
    # with it): they cost alice 1.47x with no clip at all; the clip adds at most 25% to that
    # (measured 1.06x; before issue 50 the bound fell to ~1e-11 and her loss stayed at its start)
    if "scale" in attack:  # the server sees what it saw with "clip" (a step of norm ~0): the bound is enough
        return
    unclipped, _ = attacked(attack, factor=None)
    assert final_loss(losses) <= 1.25 * final_loss(unclipped), (final_loss(losses), final_loss(unclipped))


def test_an_apply_that_moves_no_weight_moves_no_statistic():
    app, rt = server()
    for i in range(1, 6):
        alice_step(rt, i)
    before = (optimizer_state(rt), json.dumps(rt.grad_clip.state()), [p.detach().clone() for p in rt.segment.parameters()])
    for k, lr in enumerate([0.0, 1e-30, LR * 2.0 ** -21], start=1):  # 0, and below gradclip.MIN_SHARE of --lr
        answer = mallory_step(app, k, scale=1e6, lr=lr)
        assert answer["applied"] and answer["lr"] == 0.0
        assert same_state(before[0], optimizer_state(rt))  # exp_avg, exp_avg_sq, step
        assert json.dumps(rt.grad_clip.state()) == before[1]  # the clip's statistic
        assert all(torch.equal(p, q) for p, q in zip(before[2], rt.segment.parameters()))
    assert rt.client_step("mallory:m") == 3  # applied as steps (exactly once), at lr 0
    answer = mallory_step(app, 4, scale=1e6, lr=LR / 4)  # a quarter of the lr: a quarter of a step
    assert answer["clipped"] and not same_state(before[0], optimizer_state(rt))
    assert all(float(st["step"]) == 5.25 for st in rt.optimizer.state.values())  # alice's 5, and 1/4


def test_a_tenant_alone_steps_as_torch_adamw_does():
    """Until another tenant has stepped there is no one else's training to protect: a schedule's
    lower lr and lr 0 are whole AdamW steps, as in the unsplit model (the exactness tests)."""
    _, rt = server()
    for i, lr in enumerate([LR / 2, 0.0, LR], start=1):
        alice_step(rt, i, lr)
        assert all(float(st["step"]) == i for st in rt.optimizer.state.values())


@pytest.mark.parametrize("share", [1e-4, 1.0], ids=["tiny-lr", "full-lr"])
def test_huge_gradients_while_alice_is_idle_raise_the_bound_at_most_x2(share):
    app, rt = server()
    twin = undisturbed()
    losses = [alice_step(rt, i) for i in range(1, WARM + 1)]
    bound = rt.grad_clip.bound()
    for k in range(1, 31):  # alice idle
        assert mallory_step(app, k, scale=1e6, lr=LR * share)["clipped"]
    assert rt.grad_clip.bound() <= REACH * bound * (1 + 1e-9)  # (before issue 50: x 3.2 in these 30 steps)
    if share < 1.0:  # steps at 1e-4 of the lr buy 1e-4 of a vote each
        assert rt.grad_clip.bound() <= 1.01 * bound
    losses += [alice_step(rt, i) for i in range(WARM + 1, WARM + AFTER + 1)]
    if share < 1.0:  # her steps moved (almost) no weight: they moved (almost) nothing of alice's training
        assert final_loss(losses) <= 1.5 * final_loss(twin), (final_loss(losses), final_loss(twin))


def test_the_estimate_one_vote_a_tenant():
    clip = NormClip(3.0, 100)
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.ones(3)
    clip.applied(clip.clip([p], 1.0), "a")
    for _ in range(1000):  # mallory alone, for ever, norms 1e-12: the bound halves, no more
        clip.applied(clip.clip([p], 1e-12), "m")
    assert clip.bound() == pytest.approx(3.0 / REACH, rel=1e-3) and clip.bound() >= 3.0 / REACH
    for _ in range(1000):  # then x 1e6: twice, no more
        clip.applied(clip.clip([p], 1e6), "m")
    assert clip.bound() == pytest.approx(3.0 * REACH, rel=2e-2) and clip.bound() <= 3.0 * REACH
    assert clip.means()["a"] == 0.0  # alice's own statistic did not move while she was idle
    for name in "bc":  # with three tenants, sqrt(2)
        clip.applied(clip.clip([p], 1.0), name)
    for _ in range(1000):
        clip.applied(clip.clip([p], 1e-12), "m")
    assert clip.bound() >= 3.0 / REACH ** 0.5
    clip.applied(clip.clip([p], 1e-12), "m", share=0.0)  # at lr 0: nothing
    # a checkpoint of the one statistic before issue 50 restores as one voter
    old = NormClip(3.0, 100)
    old.restore({"log_ema": 0.5 * math.log(2.0), "weight": 0.5, "steps": 20})
    assert old.bound() == pytest.approx(6.0) and old.steps == 20
    again = NormClip(3.0, 100)
    again.restore(json.loads(json.dumps(clip.state())))
    assert again.bound() == clip.bound() and again.means() == clip.means()
