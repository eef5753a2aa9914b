"""splitlearn.server.engine.priority: decode steps run inside a training step's forward and backward,
and the training step is exactly what it would have been without them."""
import contextlib
import copy

import pytest
import torch

import splitlearn as sl
from splitlearn.server.engine.batching import DecodeBatcher, DecodeItem
from splitlearn.server.engine.compute import ComputeThread
from splitlearn.server.engine.priority import Preemptor, QueueWaits, heavy_modules

# no time measured here: the preemption points fire on the compute thread that runs the step, where
# the queued decode steps already are, whatever the machine's load (the parallel phase runs it)


@pytest.fixture
def model():
    return sl.load_model("tiny")  # its own: hooks are installed on its modules


def _train_once(seg, x, queue_at: str, batcher, caches, answers):
    """Forward + backward of ``seg`` on ``x``; a decode step is queued before the forward
    (``queue_at="forward"``) or before the backward; returns the input's and weights' grads
    and whether the decode step had finished by the end of that phase."""
    seg.train()
    seg.zero_grad(set_to_none=True)
    h = x.clone().requires_grad_()
    done = {}

    def queue():
        item = DecodeItem(caches[0], answers["h"], key="s")
        answers["future"] = batcher.enqueue(item)

    if queue_at == "forward":
        queue()
    out = seg(h)  # (B, T, d)
    done["forward"] = answers.get("future") is not None and answers["future"].done()
    if queue_at == "backward":
        queue()
    out.pow(2).mean().backward()
    done["backward"] = answers["future"].done()
    assert seg.training  # the decode step ran in eval mode; training mode is back
    grads = {n: p.grad.clone() for n, p in seg.named_parameters()}
    return h.grad.clone(), grads, done


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_decode_runs_inside_a_training_step_which_stays_exact(model, phase):
    seg = sl.partition(model, (1, 3)).trunk
    compute = ComputeThread(1)
    reference = copy.deepcopy(seg)  # no hooks: the step as it is without decode steps
    prompt = torch.randn(1, 5, 32, generator=torch.Generator().manual_seed(0))
    step = torch.randn(1, 1, 32, generator=torch.Generator().manual_seed(1))
    caches = [seg.new_cache()]
    with torch.no_grad():
        seg.eval()(prompt, None, caches[0])
        expected = seg(step, None, copy.deepcopy(caches[0]))  # (1, 1, d): the decode answer alone
    waits = QueueWaits()
    batcher = DecodeBatcher(seg, compute, on_wait=lambda s: waits.record("decode", s))
    pre = Preemptor(batcher.pending, batcher.run_now, compute.on_thread)
    x = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(2))
    answers = {"h": step}

    def hooked_step():
        with pre.active([seg]):  # as the runtime does around a training request
            out = seg.train()(x.clone().requires_grad_())
        assert not any(m._forward_pre_hooks for m in heavy_modules(seg))  # decode keeps the fast path
        del out
        return _train_once_hooked()

    def _train_once_hooked():
        with pre.active([seg]):
            return _train_once(seg, x, phase, batcher, caches, answers)

    gin, grads, done = compute.run(hooked_step)
    # the decode step did not wait for the end of the step: it ran at a preemption point
    assert done[phase] and pre.preemptions == 1 and waits.summary()["decode"]["count"] == 1
    torch.testing.assert_close(answers["future"].result(), expected, rtol=0, atol=1e-6)
    # and the training step is bit for bit the one without it
    plain = ComputeThread(1)
    gin_ref, grads_ref, _ = plain.run(_train_once, reference, x, phase,
                                      DecodeBatcher(reference, plain), [reference.new_cache()], {"h": step})
    assert torch.equal(gin, gin_ref)
    assert all(torch.equal(grads[n], grads_ref[n]) for n in grads)
    assert copy.deepcopy(seg) is not seg  # SplitFed copies a hooked segment; the copy keeps the points
    compute.close()
    plain.close()


def test_points_sit_on_the_linear_layers_and_the_head(model):
    parts = sl.partition(model, (1, 3))
    assert len(heavy_modules(parts.trunk)) == 4 * 2
    assert len(heavy_modules(parts.top)) == 4 * 1 + 1  # + lm_head
    assert heavy_modules(parts.bottom) == [m for b in parts.bottom.h for m in
                                          (b.attn.c_attn, b.attn.c_proj, b.mlp.c_fc, b.mlp.c_proj)]


def test_no_point_fires_off_the_compute_thread_or_without_queued_work():
    calls = []
    pre = Preemptor(lambda: True, lambda: calls.append(1), on_thread=lambda: False)
    pre.point()
    pre2 = Preemptor(lambda: False, lambda: calls.append(2), on_thread=lambda: True)
    pre2.point()
    assert calls == [] and pre.preemptions == pre2.preemptions == 0


def test_queue_waits_summarise_per_class():
    w = QueueWaits(keep=100)
    for ms in range(1, 101):
        w.record("training", ms / 1e3)
    s = w.summary()
    assert s["training"]["count"] == 100 and s["training"]["max_ms"] == pytest.approx(100)
    assert s["training"]["p50_ms"] == pytest.approx(51) and s["decode"]["count"] == 0


@pytest.mark.parametrize("phase", ["forward", "backward"])
@pytest.mark.parametrize("name", ["llama-gqa", "gemma2"])
def test_a_family_models_points_fire_and_its_training_step_stays_exact(name, phase):
    """A Llama (GQA) and a Gemma 2 trunk: the points sit on each layer's seven linear layers (the
    gated MLP's three), two sessions' decode steps queued during the training step's forward or
    backward run at a point (batched together: splitlearn/server/engine/batching.py) with the
    answers they get alone, and the step's gradients are bit for bit the step's without them."""
    import families as fam

    seg = sl.partition(fam.model(name), (1, 3)).trunk
    assert len(heavy_modules(seg)) == 7 * 2  # q, k, v, o, gate, up, down per layer
    reference = copy.deepcopy(seg)
    d = seg.config.hidden_size
    g = torch.Generator().manual_seed(0)
    caches = [seg.new_cache(), seg.new_cache()]
    steps = [torch.randn(1, 1, d, generator=g) for _ in caches]
    with torch.no_grad():
        seg.eval()
        for c in caches:
            seg(torch.randn(1, 5, d, generator=g), None, c)
        expected = [seg(x, None, copy.deepcopy(c)) for x, c in zip(steps, caches)]
    compute = ComputeThread(1)
    batcher = DecodeBatcher(seg, compute)
    pre = Preemptor(batcher.pending, batcher.run_now, compute.on_thread)
    x = torch.randn(2, 6, d, generator=g)
    futures = []

    def step(s, hooked):
        s.train()
        s.zero_grad(set_to_none=True)
        h = x.clone().requires_grad_()
        with pre.active([s]) if hooked else contextlib.nullcontext():
            if hooked and phase == "forward":
                futures.extend(batcher.enqueue(DecodeItem(c, y, key=i)) for i, (c, y) in enumerate(zip(caches, steps)))
            out = s(h)
        done_fwd = all(f.done() for f in futures) if futures else False
        if hooked and phase == "backward":
            futures.extend(batcher.enqueue(DecodeItem(c, y, key=i)) for i, (c, y) in enumerate(zip(caches, steps)))
        out.pow(2).mean().backward()
        done = done_fwd if phase == "forward" else all(f.done() for f in futures)
        assert s.training
        return h.grad.clone(), {n: p.grad.clone() for n, p in s.named_parameters()}, done

    gin, grads, done = compute.run(step, seg, True)
    assert done and pre.preemptions >= 1 and batcher.items == 2
    for f, e in zip(futures, expected):
        torch.testing.assert_close(f.result(), e, rtol=1e-5, atol=1e-5)
    gin_ref, grads_ref, _ = compute.run(step, reference, False)
    assert torch.equal(gin, gin_ref)
    assert all(torch.equal(grads[n], grads_ref[n]) for n in grads)
    compute.close()
