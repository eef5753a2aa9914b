"""CUDA graphs for the batched decode (splitlearn/server/engine/graphs.py).

Off a GPU the captures are a stand-in (``capture_eager``: the same static buffers, recomputed at
each replay), so the plumbing is tested here: the staged step equals the eager one bit for bit,
the bounds hold (row counts kept, captures a second, the memory account), and the graphs are
left out wherever their outputs could differ. On a GPU: real captures, and greedy tokens equal
the unsplit model's.
"""
import copy

import pytest
import torch

import splitlearn as sl
from splitlearn.errors import ServiceUnavailable
from splitlearn.server.engine.batching import DecodeItem, batched_decode
from splitlearn.server.engine.graphs import DecodeGraphs, capture_eager
from splitlearn.server.engine.memory import MemoryAccount

VARIED = "tiny-varied"  # its outputs vary from row to row and token to token (tests/conftest.py)


@pytest.fixture(scope="module")
def model():
    return sl.load_model(VARIED)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _segment(model, cuts):
    parts = sl.partition(model, cuts)
    return (parts.trunk if parts.u_shape else parts.top).eval()


def _sessions(seg, rows, seed=0, past=5):
    """Caches after a prefill of ``past`` positions, one per entry of ``rows``."""
    g = torch.Generator().manual_seed(seed)
    caches = []
    for n in rows:
        c = seg.new_cache()
        with torch.no_grad():
            seg(torch.randn(n, past, seg.config.n_embd, generator=g), None, c)
        caches.append(c)
    return caches


def _rows_of(cache, seg):
    return cache.layers[seg.start].keys.shape[0]


def _decode(seg, caches, graphs, seeds):
    outs = []
    for s in seeds:
        g = torch.Generator().manual_seed(s)
        items = [DecodeItem(c, torch.randn(_rows_of(c, seg), 1, seg.config.n_embd, generator=g)) for c in caches]
        outs.append(batched_decode(seg, items, graphs))
    return outs


@pytest.mark.parametrize("cuts", [(1, 3), (2,)], ids=["trunk", "top"])
def test_the_staged_step_is_the_eager_step_bit_for_bit(model, cuts):
    seg = _segment(model, cuts)
    caches = _sessions(seg, [1, 2])
    twin = copy.deepcopy(caches)
    graphs = DecodeGraphs(seg, max_graphs=2, repeats=2, capture_every_s=0.0, capture=capture_eager)
    staged = _decode(seg, caches, graphs, range(6))
    eager = _decode(seg, twin, None, range(6))
    assert graphs.captures == 1 and graphs.replays == 5  # captured on its 2nd batch of 3 rows, then replayed
    for a, b in zip(staged, eager):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert [c.length for c in caches] == [c.length for c in twin] == [11, 11]
    assert staged[-1][0].shape[-1] == (seg.config.vocab_size if seg.has_head else seg.config.n_embd)
    assert not torch.equal(staged[-1][0], staged[-2][0])  # outputs vary: a stale buffer would show


def test_an_output_is_a_copy_not_a_buffer_the_next_step_overwrites(model):
    seg = _segment(model, (1, 3))
    caches = _sessions(seg, [1])
    graphs = DecodeGraphs(seg, repeats=1, capture_every_s=0.0, capture=capture_eager)
    first = _decode(seg, caches, graphs, [1])[0][0]
    kept = first.clone()
    _decode(seg, caches, graphs, [2])
    assert torch.equal(first, kept)  # a session keeps its answer for a replay (sessions.py)


def test_row_counts_are_bounded_and_captures_paced(model):
    seg = _segment(model, (1, 3))
    clock = Clock()
    account = MemoryAccount(1 << 30, 1 << 30)
    graphs = DecodeGraphs(seg, max_graphs=2, account=account, repeats=2, capture_every_s=1.0,
                          capture=capture_eager, clock=clock)
    for rows in ([1], [2], [3]):
        caches = _sessions(seg, rows)
        _decode(seg, caches, graphs, [0])
        _decode(seg, caches, graphs, [1])  # its second batch: due, and a second has passed
        clock.now += 1.0
    assert list(graphs.graphs) == [2, 3] and graphs.captures == 3  # the least recently used (1 row) dropped
    held = account.to_dict()["reserved_bytes"]
    assert held > 0
    # two row counts due at once: one capture a second
    for rows in ([4], [5]):
        caches = _sessions(seg, rows)
        _decode(seg, caches, graphs, [0, 1])
    assert graphs.captures == 4 and 4 in graphs.graphs and 5 not in graphs.graphs
    graphs.close()
    assert account.to_dict()["reserved_bytes"] == 0  # every reservation released


def test_a_capture_the_account_cannot_hold_is_not_made(model):
    seg = _segment(model, (1, 3))
    account = MemoryAccount(1024, 1024)  # far below a capture's buffers
    graphs = DecodeGraphs(seg, account=account, repeats=1, capture_every_s=0.0, capture=capture_eager)
    caches = _sessions(seg, [2])
    twin = copy.deepcopy(caches)
    staged = _decode(seg, caches, graphs, [0, 1])
    assert graphs.graphs == {} and graphs.replays == 0
    assert all(torch.equal(a[0], b[0]) for a, b in zip(staged, _decode(seg, twin, None, [0, 1])))
    with pytest.raises(ServiceUnavailable):  # what the capture met
        account.reserve("", 4096, "x", shared=False)


def test_a_replaced_parameter_drops_the_graphs(model):
    seg = _segment(copy.deepcopy(model), (1, 3))
    graphs = DecodeGraphs(seg, repeats=1, capture_every_s=0.0, capture=capture_eager)
    caches = _sessions(seg, [1])
    _decode(seg, caches, graphs, [0])
    assert graphs.captures == 1
    w = seg.h[0].mlp.c_fc.weight
    w.data = w.data * 2  # a new tensor: the captured pointers are stale
    twin = copy.deepcopy(caches)
    staged = _decode(seg, caches, graphs, [1])
    assert graphs.captures == 2  # dropped, captured again over the new weight
    assert torch.equal(staged[0][0], _decode(seg, twin, None, [1])[0][0])


def test_graphs_are_left_out_where_outputs_could_differ(model):
    seg = _segment(model, (1, 3))
    graphs = DecodeGraphs(seg, repeats=1, capture_every_s=0.0, capture=capture_eager)
    x = torch.zeros(1, 1, seg.config.n_embd)
    filled, empty = _sessions(seg, [1])[0], seg.new_cache()
    assert graphs.usable([DecodeItem(filled, x)], x)
    assert not graphs.usable([DecodeItem(empty, x)], x)  # a first update keeps the keys it is given
    assert not graphs.usable([DecodeItem(filled, x, adapter=object())], x)  # a LoRA adapter
    seg.train()
    assert not graphs.usable([DecodeItem(filled, x)], x)  # dropout
    seg.eval()
    real = DecodeGraphs(seg)  # real captures: CUDA only
    assert not real.usable([DecodeItem(filled, x)], x)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_on_a_gpu_the_graphs_give_the_eager_tokens(dtype):
    """Issue 42 item 3: with ``--decode-graphs`` the server's decode replays CUDA graphs, and the
    split's greedy tokens are those of the same server without them (batch 1 and 3); in float32
    also the unsplit model's."""
    from serverproc import TOKEN, InprocServerProcess
    from splitlearn.api import protocol as P
    from splitlearn.hf import SplitGPT2LMHeadModel

    torch_dtype = getattr(torch, dtype)
    ref = sl.load_model(VARIED).to("cuda", torch_dtype)
    prompts = [torch.randint(0, ref.config.vocab_size, (rows, 6), generator=torch.Generator().manual_seed(rows)).cuda()
               for rows in (1, 3)]
    tokens = {}
    for graphs in ("0", "4"):
        with InprocServerProcess((1, 3), model=VARIED, extra=["--device", "cuda", "--dtype", dtype,
                                                             "--decode-graphs", graphs]) as srv:
            split = SplitGPT2LMHeadModel.from_pretrained(VARIED, server=srv.url, token=TOKEN).to("cuda", torch_dtype)
            tokens[graphs] = [split.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=0) for ids in prompts]
            info = split.remote.transport.get_json(P.INFO)["generation"]["decode_graphs"]
            split.remote.close()
        assert (info["replays"] > 0 and info["captured"]) == (graphs == "4"), info
    assert all(torch.equal(a, b) for a, b in zip(tokens["0"], tokens["4"]))
    if dtype == "float32":
        want = [ref.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=0) for ids in prompts]
        assert all(torch.equal(a, b) for a, b in zip(tokens["4"], want))
