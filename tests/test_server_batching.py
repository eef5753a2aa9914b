"""Cross-session batching of decode steps: batched == one session at a time."""
import threading
import time

import pytest
import torch

import splitlearn as sl
from splitlearn.errors import Conflict
from splitlearn.server.engine.batching import DecodeBatcher, DecodeItem, batched_decode
from splitlearn.server.engine.compute import ComputeThread

# measures time or fairness: `make test` runs it after the parallel phase, alone (pytest.ini)
pytestmark = pytest.mark.serial


@pytest.fixture(scope="module")
def model():
    return sl.load_model("tiny")


def _server_segment(model, cuts):
    parts = sl.partition(model, cuts)
    return parts.trunk if parts.u_shape else parts.top


def _prefilled(seg, prompts):
    """Two independent copies of per-session caches, after the same prefill."""
    copies = []
    for _ in range(2):
        caches = []
        for h, mask in prompts:
            c = seg.new_cache()
            with torch.no_grad():
                seg(h, mask, c)
            caches.append(c)
        copies.append(caches)
    return copies


@pytest.mark.parametrize("cuts", [(1, 3), (2,), (0, 4), (4,)])
def test_batched_decode_equals_sequential(model, cuts):
    seg = _server_segment(model, cuts).eval()
    d = model.config.n_embd
    g = torch.Generator().manual_seed(0)
    padded = torch.ones(2, 7, dtype=torch.long)
    padded[0, :3] = 0
    prompts = [(torch.randn(1, 5, d, generator=g), None), (torch.randn(2, 7, d, generator=g), padded),
               (torch.randn(3, 2, d, generator=g), None)]
    ref, bat = _prefilled(seg, prompts)
    masks = [m for _, m in prompts]
    for _ in range(4):
        new = [torch.randn(h.shape[0], 1, d, generator=g) for h, _ in prompts]
        masks = [None if m is None else torch.cat([m, torch.ones(m.shape[0], 1, dtype=torch.long)], 1)
                 for m in masks]
        with torch.no_grad():
            expected = [seg(x, m, c) for x, m, c in zip(new, masks, ref)]
        got = _run_batched(seg, new, masks, bat)
        for e, o in zip(expected, got):
            assert o.shape == e.shape
            torch.testing.assert_close(o, e, atol=1e-6, rtol=1e-5)
    assert [c.length for c in bat] == [c.length for c in ref]


def _run_batched(seg, new, masks, caches):
    items = [DecodeItem(c, x, prepare=(lambda m=m: m)) for x, m, c in zip(new, masks, caches)]
    for it in items:
        it.mask = it.prepare()
    return batched_decode(seg, items)


def test_concurrent_submits_share_one_forward(model):
    seg = _server_segment(model, (1, 3)).eval()
    d = model.config.n_embd
    g = torch.Generator().manual_seed(1)
    prompts = [(torch.randn(1, 4, d, generator=g), None) for _ in range(3)]
    ref, bat = _prefilled(seg, prompts)
    new = [torch.randn(1, 1, d, generator=g) for _ in prompts]
    compute = ComputeThread()
    batcher = DecodeBatcher(seg, compute)
    results = [None] * 3

    def submit(i):
        results[i] = batcher.submit(DecodeItem(bat[i], new[i]))

    busy = threading.Event()
    compute.submit(busy.wait, 10)  # the model is busy: all three steps queue up behind it
    threads = [threading.Thread(target=submit, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while len(batcher._queue) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    busy.set()
    for t in threads:
        t.join(10)
    compute.close()
    assert batcher.batches == 1 and batcher.items == 3
    with torch.no_grad():
        for i in range(3):
            torch.testing.assert_close(results[i], seg(new[i], None, ref[i]), atol=1e-6, rtol=1e-5)


def test_refused_step_does_not_disturb_the_others(model):
    seg = _server_segment(model, (2,)).eval()
    d = model.config.n_embd
    g = torch.Generator().manual_seed(2)
    prompts = [(torch.randn(1, 3, d, generator=g), None) for _ in range(2)]
    ref, bat = _prefilled(seg, prompts)
    x = [torch.randn(1, 1, d, generator=g) for _ in prompts]

    def refuse():
        raise Conflict("position mismatch")

    batcher = DecodeBatcher(seg, ComputeThread())
    bad, good = DecodeItem(bat[0], x[0], prepare=refuse), DecodeItem(bat[1], x[1])
    batcher._queue = [bad]
    out = batcher.submit(good)
    assert isinstance(bad.future.exception(timeout=0), Conflict)
    assert batcher.batches == 1 and batcher.items == 1
    assert bat[0].length == 3  # the refused session's cache is untouched
    with torch.no_grad():
        torch.testing.assert_close(out, seg(x[1], None, ref[1]), atol=1e-6, rtol=1e-5)


def test_unbatched_mode_runs_each_step_alone(model):
    seg = _server_segment(model, (1, 3)).eval()
    d = model.config.n_embd
    g = torch.Generator().manual_seed(3)
    prompts = [(torch.randn(1, 4, d, generator=g), None) for _ in range(3)]
    ref, bat = _prefilled(seg, prompts)
    new = [torch.randn(1, 1, d, generator=g) for _ in prompts]
    compute = ComputeThread()
    batcher = DecodeBatcher(seg, compute, batching=False)
    busy = threading.Event()
    compute.submit(busy.wait, 10)
    futures = [batcher.enqueue(DecodeItem(c, x)) for c, x in zip(bat, new)]
    busy.set()
    outs = [f.result(10) for f in futures]
    compute.close()
    assert batcher.batches == 3 and batcher.items == 3
    with torch.no_grad():
        for i in range(3):
            torch.testing.assert_close(outs[i], seg(new[i], None, ref[i]), atol=1e-6, rtol=1e-5)


def _sessions(model, n, seed):
    seg = _server_segment(model, (1, 3)).eval()
    g = torch.Generator().manual_seed(seed)
    d = model.config.n_embd
    _, caches = _prefilled(seg, [(torch.randn(1, 4, d, generator=g), None) for _ in range(n)])
    return seg, caches, (lambda: torch.randn(1, 1, d, generator=g))


def _step_all_together(batcher, compute, caches, x, keys):
    """One batch of every session (the model kept busy until all queued)."""
    busy = threading.Event()
    compute.submit(busy.wait, 10)
    futures = [batcher.enqueue(DecodeItem(c, x(), key=k)) for c, k in zip(caches, keys)]
    busy.set()
    for f in futures:
        f.result(10)


@pytest.mark.parametrize("wait_ms, batches", [(1000, 1), (0, 2)])
def test_a_batch_waits_for_the_rest_of_the_previous_batch(model, wait_ms, batches):
    """Sessions answered together come back a little apart: with a wait, the early one
    waits for the others and they share the next forward; without, they split."""
    seg, caches, x = _sessions(model, 3, 4)
    compute = ComputeThread()
    batcher = DecodeBatcher(seg, compute, wait_s=wait_ms / 1e3)
    _step_all_together(batcher, compute, caches, x, "abc")
    assert batcher.batches == 1
    first = batcher.enqueue(DecodeItem(caches[0], x(), key="a"))  # a drain starts: b, c still away
    time.sleep(0.2)
    if not wait_ms:
        first.result(10)  # nobody waits for b and c: a's step is answered alone
    busy = threading.Event()  # b and c arrive together (a loaded machine must not split them)
    compute.submit(busy.wait, 10)
    rest = [batcher.enqueue(DecodeItem(c, x(), key=k)) for c, k in zip(caches[1:], "bc")]
    busy.set()
    for f in [first, *rest]:
        f.result(10)
    compute.close()
    assert batcher.batches - 1 == batches and batcher.items == 6
    assert [c.length for c in caches] == [6, 6, 6]


def test_no_wait_for_strangers_or_closed_sessions(model):
    """A step of a session that was not in the previous batch, or a batch whose missing
    sessions were closed, runs at once (a long wait would show as a timeout here)."""
    seg, caches, x = _sessions(model, 3, 5)
    compute = ComputeThread()
    batcher = DecodeBatcher(seg, compute, wait_s=30.0)
    _step_all_together(batcher, compute, caches[:2], x, "ab")
    batcher.enqueue(DecodeItem(caches[2], x(), key="c")).result(5)  # not in {a, b}: no wait
    assert batcher.batches == 2
    _step_all_together(batcher, compute, caches[:2], x, "ab")
    batcher.forget("b")  # b's session is closed
    batcher.enqueue(DecodeItem(caches[0], x(), key="a")).result(5)  # b will not come: no wait
    compute.close()
    assert batcher.batches == 4
