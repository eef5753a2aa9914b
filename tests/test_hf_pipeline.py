"""Micro-batch pipelining on the model classes (splitlearn/hf/pipeline.py), against real servers.

A pipelined plain loop (gradient accumulation, a clip, an LR schedule) equals the unsplit
model; the forwards of a step are in flight together; bad settings are refused.
"""
import pytest
import torch

from splitlearn.errors import ConfigError
from splitlearn.hf import SplitGPT2ForSequenceClassification, SplitGPT2LMHeadModel

from serverproc import TOKEN
from test_hf_modeling import LR, adamw_with, assert_weights_equal, batches, reference, server, split_lm, step_apply  # noqa: F401

pytestmark = pytest.mark.slow

M = 3


def test_pipelined_loop_equals_unsplit(server):
    model = split_lm(server, micro_batches=M)
    assert model.micro_batches == M
    ref, state = reference(server)
    ref.train()
    opt, ref_opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0), adamw_with(ref, state)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda s: 1.0 / (1 + s))
    data = batches(4, seed=2, rows=7)  # 7 rows: micro-batches of 3, 2 and 2 rows, padded both ways
    accum, clip = 2, 0.6
    for step in range(2):
        calls = model.remote.stats.calls
        for k in range(accum):
            ids, mask, labels = data[step * accum + k]
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            ref_loss = ref(input_ids=ids, attention_mask=mask, labels=labels).loss
            assert float(loss) == pytest.approx(float(ref_loss), rel=1e-5)
            (loss / accum).backward()
            (ref_loss / accum).backward()
        if step == 0:  # the accumulated gradients, before AdamW amplifies float noise on tiny ones
            mine = dict(model.named_parameters())
            for name, p in ref.named_parameters():
                if name in mine and mine[name].grad is not None:
                    err = float((mine[name].grad - p.grad).abs().max()) / float(p.grad.abs().max())
                    assert err < 1e-5, (name, err)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        assert float(norm) == pytest.approx(float(ref_norm), rel=1e-4)  # the server's norm covers every piece
        for o, s in ((opt, sched), (ref_opt, ref_sched)):
            o.step()
            s.step()
            o.zero_grad()
        # every micro-batch is a piece: a forward and a backward each, one apply
        assert model.remote.stats.calls - calls == 2 * M * accum
        assert step_apply(model.remote)["pieces"] == M * accum
    # AdamW divides by sqrt(v): a gradient component near 0 summed in another order (micro-batches,
    # pieces accumulated as they arrive) moves its weight by a few 1e-4 (lr = 1e-2); a lost or
    # mis-scaled piece moves weights by ~lr. The gradients themselves were compared above (1e-5).
    assert_weights_equal(model, ref, server, atol=1e-3)
    model.remote.close()


def test_the_forwards_of_a_step_are_in_flight_together(server):
    model = split_lm(server, micro_batches=M)
    remote, events = model.remote, []
    start, finish = remote.steps.start, remote.steps.finish

    def spy_start(kind, tensors, lane, piece=None):
        call = start(kind, tensors, lane, piece)
        events.append(("start", kind, call[1][1]))
        return call

    def spy_finish(call):
        events.append(("finish", call[0], call[1][1]))
        return finish(call)

    remote.steps.start, remote.steps.finish = spy_start, spy_finish
    ids, mask, labels = batches(1, seed=4, rows=6)[0]
    model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    first_answer = events.index(("finish", "f", 0))
    assert {e[2] for e in events[:first_answer] if e[:2] == ("start", "f")} == set(range(M)), events
    # the backwards go one at a time, in order (the server sums the pieces' gradients in one order)
    backs = [e for e in events if e[1] == "b"]
    assert backs == [x for i in range(M) for x in (("start", "b", i), ("finish", "b", i))], events
    model.zero_grad()
    model.remote.close()


def test_an_unsplittable_batch_goes_whole(server):
    """One row, or a micro-batch without targets: one piece, the same loss as unpipelined."""
    model = split_lm(server, micro_batches=M)
    ids = torch.randint(0, 256, (3, 8))
    labels = ids.clone()
    labels[1:] = -100  # the second and third micro-batches have no targets
    calls = model.remote.stats.calls
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    assert model.remote.stats.calls - calls == 2 and model.remote.pieces == 1
    model.zero_grad()
    model.remote.close()


@pytest.mark.parametrize("bad", [0, M * 100, True, "2", 1.5])
def test_bad_micro_batches_are_refused(server, bad):
    model = split_lm(server)
    with pytest.raises(ConfigError, match="micro_batches"):
        model.micro_batches = bad
    assert model.micro_batches == 1
    model.remote.close()


def test_only_the_lm_head_pipelines(server):
    if not server.u_shape:
        pytest.skip("a 2-way server serves the LM head only")
    with pytest.raises(ConfigError, match="SplitGPT2LMHeadModel"):
        SplitGPT2ForSequenceClassification.from_pretrained("tiny", server=server.url, token=TOKEN, num_labels=2,
                                                           micro_batches=2)
    assert SplitGPT2LMHeadModel.micro_batches.fget  # the property, documented on the class


class _Clock:
    """A step's time as the test says: each training forward reads it once."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


@pytest.mark.parametrize("faster", ["whole", "pipelined"])
def test_the_chooser_keeps_the_count_it_measured_faster(server, faster):
    """On a GPU, micro-batching can be slower than whole batches (one GPU shared by both sides):
    the first steps measure both and the faster stays. Here on the CPU (choose_micro_batches =
    True) with a clock the test drives: each step's server calls show which count it ran."""
    from splitlearn.hf import pipeline

    model = split_lm(server, micro_batches=M)
    model.choose_micro_batches = True
    clock = _Clock()
    model.__dict__["_micro_chooser"] = pipeline.Chooser(M, clock=clock)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    data = batches(12, seed=4, rows=4)
    ran = []
    for ids, mask, labels in data:
        calls = model.remote.stats.calls
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()
        pieces = (model.remote.stats.calls - calls) // 2  # a forward and a backward each
        ran.append(pieces)
        slow = (pieces > 1) == (faster == "whole")
        clock.now += 2.0 if slow else 1.0
    plan = pipeline.Chooser.WARMUP + pipeline.Chooser.TRIALS
    assert ran[:plan] == [M] * plan and ran[plan:2 * plan] == [1] * plan  # measured both
    assert set(ran[2 * plan:]) == {1 if faster == "whole" else M}  # then kept the faster
    model.choose_micro_batches = False  # the user's M, always
    ids, mask, labels = data[0]
    calls = model.remote.stats.calls
    model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    assert (model.remote.stats.calls - calls) // 2 == M
    model.remote.close()


def test_by_default_the_chooser_measures_on_a_gpu_only(server):
    """``choose_micro_batches = "auto"`` by default: a CPU model keeps its M from the first
    step (no trial steps with whole batches), and no chooser is made for it."""
    from splitlearn.hf import pipeline

    model = split_lm(server, micro_batches=M)
    assert model.choose_micro_batches == "auto"
    assert [pipeline.micro_count(model) for _ in range(12)] == [M] * 12
    assert "_micro_chooser" not in model.__dict__
    model.remote.close()


def test_micro_batches_with_a_server_on_this_machine_say_why_they_may_be_slower(server, caplog):
    """Issue 54: ``--micro-batches 4`` ran ~3x slower than whole batches on loopback with no hint.
    The first pipelined step with a server on this machine's CPU cores (here ``inproc://``) warns
    once, with the reason and the way to measure; a remote host's URL does not."""
    import logging

    from splitlearn.hf.pipeline import server_on_this_machine

    model = split_lm(server, micro_batches=M)
    ids = torch.randint(0, 256, (4, 8))
    with caplog.at_level(logging.WARNING, logger="splitlearn.hf.pipeline"):
        for _ in range(2):
            model(input_ids=ids, labels=ids).loss.backward()
    said = [r.getMessage() for r in caplog.records if r.name == "splitlearn.hf.pipeline"]
    assert len(said) == 1 and "this machine's CPU cores" in said[0] and "choose_micro_batches = True" in said[0]
    assert server_on_this_machine(model)
    model.remote.transport.cfg.url = "http://10.1.2.3:8000"  # what a remote server's client holds
    assert not server_on_this_machine(model)
    model.zero_grad()
    model.remote.close()
