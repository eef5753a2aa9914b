"""The client engine's rooms on their own (splitlearn/hf/pieces.py, applies.py Applier,
optlink.py), against a stand-in segment that records what would go on the wire: the server
and the model classes are covered end to end by test_hf_modeling.py, test_hf_applies.py,
test_hf_journal.py and test_hf_pipeline.py."""
import json

import pytest
import torch
from torch import nn

from splitlearn.api import protocol as P
from splitlearn.errors import ConfigError, IntegrityError
from splitlearn.hf.applies import Applier, Outbox
from splitlearn.hf.config import RemoteConfig
from splitlearn.hf.journal import RequestLog, Sent
from splitlearn.hf.optlink import OptimizerLink, optimizers_holding
from splitlearn.hf.pieces import StepPieces


class Wire:
    """A transport that answers every JSON post and records it."""

    def __init__(self):
        self.posts = []

    def post_json(self, path, body):
        self.posts.append((path, body))
        return {"applied": True, "step": body["step"], "lr": body.get("lr")}


class Journal:
    """A journal that sends at once through the wire (no crash to recover from)."""

    on_disk = False

    def __init__(self, segment):
        self.segment, self.log = segment, RequestLog(False)

    def after_apply(self, optimizer):
        pass

    def answers(self, step):
        return False

    def call(self, step, sent, lane=0):
        return {}, self.segment.transport.post_json(sent.path, sent.meta)

    def logged(self, step, sent, out, info):
        self.log.record(step, sent, info, None)


class Segment:
    """What the rooms read of a RemoteSegment."""

    def __init__(self, u_shape=True, loss_gradient=None):
        self.cfg = RemoteConfig(server="http://nowhere")
        self.client_id, self.run, self.u_shape, self.loss_gradient = "alice", "r1", u_shape, loss_gradient
        self.info, self.federation = {}, None
        self.transport = Wire()
        self.grad_proxy = nn.Parameter(torch.zeros(1))
        self.journal = Journal(self)
        self.log = self.journal.log
        self.steps = StepPieces(self, 1)
        self.link = OptimizerLink(self, self.grad_proxy)
        self.applier = Applier(self, Outbox(self.transport, self.log), idle_s=0)


def test_optimizers_holding_finds_exactly_the_holders():
    a, b, c = (nn.Parameter(torch.zeros(2)) for _ in range(3))
    holds_a = torch.optim.SGD([{"params": [c]}, {"params": [a]}], lr=0.1)
    holds_b = torch.optim.AdamW([b], lr=0.1)
    assert optimizers_holding([a]) == [holds_a]
    assert {id(o) for o in optimizers_holding([a, b])} == {id(holds_a), id(holds_b)}
    assert optimizers_holding([nn.Parameter(torch.zeros(1))]) == []


def test_the_clip_factor_is_what_the_proxy_was_scaled_by():
    seg = Segment()
    link = seg.link
    assert link.clip_factor() == 1.0  # no backward yet
    link.server_norm_is(4.0)
    assert link.clip_factor() == 1.0  # nothing happened to it
    torch.nn.utils.clip_grad_norm_([seg.grad_proxy], max_norm=1.0)
    assert link.clip_factor() == pytest.approx(0.25, rel=1e-5)
    seg.grad_proxy.grad = torch.full((1,), 8.0)  # scaled up: not a clip, cannot be sent
    with pytest.raises(ConfigError, match="only a clip"):
        link.clip_factor()


def test_lr_is_the_proxy_groups_unless_fixed():
    seg = Segment()
    other = nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([{"params": [other], "lr": 0.5}, {"params": [seg.grad_proxy], "lr": 0.01}], lr=0.1)
    assert seg.link.lr_of(opt) == 0.01
    seg.link.fixed_lr = 3e-4  # SplitClient: the server's own
    assert seg.link.lr_of(opt) == 3e-4


def test_an_optimizer_step_applies_and_a_zero_grad_discards():
    seg = Segment()
    opt = torch.optim.SGD([seg.grad_proxy], lr=0.01)
    seg.link.attach(opt)
    seg.steps.pieces, seg.steps.answered = 2, 2  # two pieces answered
    seg.link.server_norm_is(1.0)
    opt.step()  # the hook: the apply, deferred (carried by the next forward)
    assert seg.applier.deferred.to_json() == {"client_id": "alice", "step": 1, "pieces": 2, "lr": 0.01, "run": "r1"}
    assert seg.steps.step == 2 and seg.steps.pieces == 0 and seg.transport.posts == []
    assert seg.applier.flush()["applied"] and seg.applier.deferred is None  # sent alone
    seg.steps.pieces, seg.steps.answered = 1, 1
    seg.link.server_norm_is(2.0)
    opt.zero_grad()  # the proxy's gradient gone: the step's pieces are dropped on the server too
    seg.link.notice_zero_grad()
    assert seg.transport.posts[-1] == (P.TRAIN_APPLY, {"client_id": "alice", "step": 2, "pieces": 0,
                                                       "discard": True, "run": "r1"})
    assert seg.steps.step == 2 and seg.steps.answered == 0


def test_only_the_next_steps_forward_carries_the_apply():
    seg = Segment()
    seg.steps.pieces = seg.steps.answered = 1
    seg.applier.apply(0.1)
    assert "apply" not in seg.steps.meta(3, 0, "f")  # not the step after
    assert "apply" not in seg.steps.meta(2, 0, "b")  # a backward never carries it
    carried = seg.steps.meta(2, 0, "f")["apply"]
    assert json.loads(carried)["step"] == 1 and seg.applier.outbox.carrying
    seg.applier.carried(2, {"apply": json.dumps({"applied": True, "step": 1})})  # the forward's answer
    assert seg.applier.deferred is None and seg.applier.last == {"applied": True, "step": 1}
    assert seg.transport.posts == []  # it rode on the forward


def test_an_answer_to_a_dropped_piece_is_refused():
    seg = Segment()
    sent = Sent(P.TRAIN_BACKWARD, {}, {})
    with pytest.raises(IntegrityError, match="dropped"):
        seg.steps._verified("b", (1, 0), sent, {P.GRAD: torch.zeros(1, 2, 4)}, {"grad_norm": "1.0"})


@pytest.mark.parametrize("g,weight,fused", [(1.0, 0.5, 0.5), (None, 1.0, None), (4.0, 1.0, None), (0.0, 1.0, None)])
def test_a_2way_piece_is_fused_only_with_a_known_gradient_in_0_1(g, weight, fused):
    assert Segment(u_shape=False, loss_gradient=g).steps.fused_scale(weight) == fused
    assert Segment(u_shape=True, loss_gradient=g).steps.fused_scale(weight) is None
