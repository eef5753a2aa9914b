"""splitlearn.server.engine.priority.step_in_parts: an optimizer step cut into parts with a
preemption point between two parts is exactly the one step, and a decode step run at a point
never sees a half-stepped model (the attack: read the weights while the step is under way)."""
import copy

import pytest
import torch

import splitlearn as sl
from splitlearn.server.engine.priority import step_in_parts


def _model_and_grads(seed: int):
    m = sl.load_model("tiny")
    g = torch.Generator().manual_seed(seed)
    for p in m.parameters():
        p.grad = torch.randn(p.shape, generator=g)
    return m


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01),
], ids=["adamw", "sgd-momentum"])
def test_the_step_in_parts_is_the_one_step_bit_for_bit(make):
    one, parts = _model_and_grads(0), _model_and_grads(0)
    opt_one, opt_parts = make(one.parameters()), make(parts.parameters())
    counted = []
    for step in range(3):  # the optimizer state (moments, momentum) carries over between steps
        for a, b in zip(one.parameters(), parts.parameters()):
            a.grad = b.grad = torch.randn(a.shape, generator=torch.Generator().manual_seed(step))
        opt_one.step()
        counted.append(step_in_parts(opt_parts, lambda: None, part_bytes=4096))
    assert min(counted) > 5  # it was cut into parts
    for a, b in zip(one.parameters(), parts.parameters()):
        assert torch.equal(a, b)
        assert b.grad is not None  # the gradients are given back
    for sa, sb in zip(opt_one.state.values(), opt_parts.state.values()):
        assert sa.keys() == sb.keys() and all(torch.equal(torch.as_tensor(sa[k]), torch.as_tensor(sb[k])) for k in sa)


def test_a_point_reads_the_weights_before_the_step_and_after_it_they_are_all_stepped():
    m = _model_and_grads(1)
    before = copy.deepcopy(m.state_dict())
    want = _model_and_grads(1)
    torch.optim.AdamW(want.parameters(), lr=1e-2).step()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    x = torch.randint(0, m.config.vocab_size, (1, 6))
    with torch.no_grad():
        logits_before = m(x).logits
    seen = []

    def point():  # what a decode step at this point computes with
        seen.append(all(torch.equal(v, before[k]) for k, v in m.state_dict().items()))
        with torch.no_grad():
            seen.append(torch.equal(m(x).logits, logits_before))

    n = step_in_parts(opt, point, part_bytes=4096)
    assert len(seen) == 2 * n and all(seen)
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), want.parameters()))
    assert not all(torch.equal(v, before[k]) for k, v in m.state_dict().items())  # it did step


def test_an_optimizer_that_is_not_per_parameter_steps_at_once():
    class Global(torch.optim.SGD):  # a subclass might read every gradient in its step
        pass

    m = _model_and_grads(2)
    calls = []
    assert step_in_parts(Global(m.parameters(), lr=0.1), lambda: calls.append(1), part_bytes=4096) == 1
    assert not calls


def test_a_servers_prepacked_copies_are_not_repacked_by_decode_around_the_step():
    # the prepacked copies (a server's decode products, splitlearn/model/packed.py) must neither be
    # packed again by the decode steps at the points (the old values are back) nor after the step
    # (the new values' copies are made ahead, at points): repacking GPT-2 small's trunk held a
    # decode step ~0.3 s
    from splitlearn.model.packed import PackedLinears

    m = _model_and_grads(3).eval()
    x = torch.randint(0, m.config.vocab_size, (1, 5))
    packer = PackedLinears(m, adaptive=False)
    with torch.no_grad(), packer.active():
        before = m(x).logits
    copies = {id(p): p.packed for p in packer._weights}
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    seen = []

    def point():
        with torch.no_grad(), packer.active():
            seen.append(torch.equal(m(x).logits, before))
        seen.append(all(p.packed is copies[id(p)] for p in packer._weights))  # nothing repacked

    n = step_in_parts(opt, point, part_bytes=4096)
    assert n > 5 and all(seen)
    assert all(p.key == (p.weight._version, p.weight.data_ptr()) for p in packer._weights)  # valid now
    assert all(p.packed is not copies[id(p)] for p in packer._weights)  # the new values' copies
    with torch.no_grad(), packer.active():
        after = m(x).logits
    want = _model_and_grads(3).eval()
    torch.optim.AdamW(want.parameters(), lr=1e-2).step()
    with torch.no_grad():
        torch.testing.assert_close(after, want(x).logits, atol=1e-4, rtol=1e-4)  # packed products of the new weights
    assert all(p.key == (p.weight._version, p.weight.data_ptr()) for p in packer._weights)
