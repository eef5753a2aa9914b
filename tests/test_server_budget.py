"""splitlearn.server.engine.budget: the memory one request may cost, priced before allocating.

The cost model against what autograd really keeps and what a route really peaks at; every
route that allocates by request size answering 413 (naming the limit and the flag) and
changing nothing; and a real server under an address-space limit, where shapes that used to
answer 500 (the allocation failed) now answer 413, or simply succeed, and the server keeps
serving.
"""
import json
import os
import sys
from pathlib import Path

import pytest
import requests
import torch

from splitlearn.api import protocol as P
from splitlearn.errors import ConfigError, PayloadTooLarge
from splitlearn.model.loading import config_from_dict, load_model, read_spec
from splitlearn.procs.localserver import LocalServer
from splitlearn.model.partition import partition
from splitlearn.server.engine import budget as bm
from splitlearn.server.http.app import create_app
from splitlearn.server.http.cli import parse_args
from splitlearn.server.config import ServerConfig
from splitlearn.api.wire import decode, encode

from serverproc import (TENANTS, TOKEN, apply_step, assert_error, auth, post_tensors, same_weights, segment_of,
                        snapshot, tensors_of)

ROOT = Path(__file__).resolve().parent.parent
D, NPOS, VOCAB = 32, 64, 257  # models/tiny.json
MiB, GiB = 1 << 20, 1 << 30
# GPT-2's vocabulary and context on a narrow, shallow body: the logits dominate at once
GPT2_VOCAB_SMALL = dict(model_type="gpt2", vocab_size=50257, n_positions=1024, n_embd=32, n_layer=2,
                        n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


# -- the cost model --------------------------------------------------------------------------

def _saved_bytes(seg, B, T, padded):
    """Bytes autograd keeps for a training forward of ``seg`` (parameters and input excluded)."""
    params = {p.untyped_storage().data_ptr() for p in seg.parameters()}
    h = torch.randn(B, T, seg.config.n_embd, requires_grad=True)
    mask = None
    if padded:
        mask = torch.ones(B, T, dtype=torch.long)
        mask[0, : T // 2] = 0
    seen = {}

    def keep(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params and s.data_ptr() != h.untyped_storage().data_ptr():
            seen[s.data_ptr()] = s.nbytes()
        return t

    seg.train()
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        seg(h, mask)
    return sum(seen.values())


@pytest.mark.parametrize("dropout", [0.0, 0.1], ids=["no-dropout", "gpt2-dropout"])
@pytest.mark.parametrize("B,T,padded", [(2, 16, False), (3, 64, True), (8, 64, False)])
def test_kept_per_block_is_what_autograd_keeps(dropout, B, T, padded):
    """Exact for sdpa without dropout; with GPT-2's dropout (scores materialised) at most 10% over."""
    spec = {**read_spec("tiny"), "attn_pdrop": dropout, "resid_pdrop": dropout}
    seg = partition(load_model(config_from_dict(spec)), (1, 2)).trunk  # one block
    measured = _saved_bytes(seg, B, T, padded)
    predicted = bm.kept_per_block(bm.Dims.of(seg, torch.float32), B, T, T, padded)
    if dropout == 0.0:
        assert predicted == measured
    else:
        assert measured <= predicted <= 1.1 * measured


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="peak RSS reset is Linux-only")
def test_a_measured_peak_stays_under_the_prediction(tmp_path, monkeypatch):
    """benchmarks/request_memory.py's measurement of one route (a process of its own, peak RSS) is
    below the model's price, and not absurdly so."""
    # forked from the tests' preloaded interpreter where it can be (tests/forkserver.py: not ~9
    # CPU-seconds of imports); the peak is reset (clear_refs) and read in the child itself
    from splitlearn.procs import localserver

    case = ["gpt2-vocab-d64", "train_step", 4, 512, True]
    monkeypatch.chdir(ROOT)  # python -m benchmarks.request_memory
    with open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w") as err:
        proc = localserver.launch([sys.executable, "-m", "benchmarks.request_memory", "--child", json.dumps(case)],
                                  env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=out, stderr=err)
        try:
            code = proc.wait(300)
        finally:
            proc.kill()
    assert code == 0, (tmp_path / "err").read_text()[-3000:]
    r = json.loads((tmp_path / "out").read_text().strip().splitlines()[-1])
    assert r["measured"] > 50 * MiB  # the route really ran
    assert r["measured"] <= r["predicted"] <= 2 * r["measured"], r


def test_dims_come_from_the_segment_and_its_dtype():
    top = partition(load_model("tiny"), (1,)).top
    m = bm.Dims.of(top, torch.float32)
    assert (m.d, m.heads, m.inner, m.vocab, m.blocks, m.head, m.elem) == (32, 4, 128, 257, 3, True, 4)
    assert not m.eager and not m.scores  # sdpa, no dropout: the flash kernel keeps no scores
    assert bm.Dims.of(top, torch.bfloat16).elem == 2
    gpt2 = partition(load_model(config_from_dict(read_spec("gpt2")), device="meta"), (2, 10)).trunk
    g = bm.Dims.of(gpt2, torch.float32)
    assert (g.blocks, g.head, g.attn_dropout, g.dropout, g.scores) == (8, False, True, True, True)


def test_the_head_costs_one_chunk_not_the_logits():
    """64 x 1024 positions of a GPT-2-vocabulary top: training is priced far under the 13 GB of
    logits it used to make, and a forward without labels pays for the last position only."""
    top = partition(load_model(config_from_dict({**GPT2_VOCAB_SMALL, "n_embd": 64}), device="meta"), (1,)).top
    m = bm.Dims.of(top, torch.float32)
    logits = 64 * 1024 * 50257 * 4
    assert bm.train_cost(m, 64, 1024, False) < logits / 8
    with_labels, without = bm.forward_cost(m, 64, 1024, False, True), bm.forward_cost(m, 64, 1024, False, False)
    assert without < with_labels < without + 4 * 64 * MiB  # labels add one chunk of logits (and x)
    # 32 more rows cost their activations, not their 6.6 GB of logits
    assert bm.forward_cost(m, 64, 1024, False, True) - bm.forward_cost(m, 32, 1024, False, True) < logits / 2 / 20


def test_kv_cache_and_session_steps():
    top = partition(load_model("tiny"), (2,)).top
    m = bm.Dims.of(top, torch.float32)
    assert bm.kv_bytes(m, 100) == 2 * 2 * 100 * 32 * 4  # K and V, 2 blocks, d=32, float32
    assert bm.session_step_cost(m, 2, 60, 1) > bm.kv_bytes(m, 2 * 61)  # the cache it reads, and more


def test_check_names_the_limit_and_the_flag():
    top = partition(load_model("tiny"), (2,)).top
    budget = bm.Budget(GiB, bm.Dims.of(top, torch.float32), "--max-request-memory-gb")
    budget.check("a thing", GiB)  # at the limit: allowed
    with pytest.raises(PayloadTooLarge) as e:
        budget.check("a thing", 3 * GiB)
    assert e.value.status == 413
    assert "a thing needs about 3.00 GiB" in e.value.message
    assert "allows 1.00 GiB per request (--max-request-memory-gb)" in e.value.message


def test_derived_limit_is_half_of_what_the_training_state_leaves():
    assert bm.derived_limit(10 * GiB, 2 * GiB) == 4 * GiB
    assert bm.derived_limit(1 * GiB, 2 * GiB) == bm.MIN_DERIVED  # never zero: a warning says why
    seg = partition(load_model("tiny"), (2,)).top
    params = bm.trainable_bytes(seg)
    assert bm.state_bytes(seg, "adamw", packed=True) == 4 * params  # grad, two moments, packed copy
    assert bm.state_bytes(seg, "sgd", packed=False) == params
    for p in seg.parameters():
        p.requires_grad_(False)  # a LoRA server's frozen base makes no gradients, is still packed
    assert bm.trainable_bytes(seg) == 0 and bm.state_bytes(seg, "adamw", packed=True) == params


def test_available_memory_honours_an_address_space_limit(tmp_path, monkeypatch):
    # a process of its own (the limit is its own), forked from the tests' preloaded interpreter
    # where it can be (tests/forkserver.py: not ~9 CPU-seconds of imports)
    from splitlearn.procs import localserver

    (tmp_path / "as_limit_probe.py").write_text(
        "import resource, torch; from splitlearn.server.engine import budget as b\n"
        "size = b._status_kib('VmSize'); hard = resource.getrlimit(resource.RLIMIT_AS)[1]\n"
        "resource.setrlimit(resource.RLIMIT_AS, (size + (64 << 20), hard))\n"
        "print(*b.available_memory(torch.device('cpu')), sep='|')\n")
    monkeypatch.chdir(tmp_path)
    with open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w") as err:
        proc = localserver.launch([sys.executable, "-m", "as_limit_probe"], env=dict(os.environ), stdout=out, stderr=err)
    assert proc.wait(120) == 0, (tmp_path / "err").read_text()[-2000:]
    free, what = (tmp_path / "out").read_text().strip().split("|")
    assert what == "RLIMIT_AS" and 0 < int(free) <= 64 << 20


# -- on a CUDA device: the same model with sdpa's fused kernels (priced on the CPU) ------------

# What an 80 GB H100 has free once a server's segment is on it: the card's 81559 MiB, less the
# CUDA context (~0.5 GiB) and the segment's weights, which load before the budget is derived.
H100_MIB = 81559


def _xl(cuts):
    """GPT-2 XL's segment for ``cuts`` (the top for 2-way, the trunk for U), bfloat16, on meta."""
    model = load_model(config_from_dict(read_spec("gpt2-xl")), device="meta", dtype="bfloat16")
    parts = partition(model, cuts)
    return parts.top if len(cuts) == 1 else parts.trunk


def test_on_cuda_sdpa_keeps_no_scores_dropout_included():
    """GPT-2's attention dropout makes the CPU keep (B, a, T, T) scores (math path); CUDA's flash
    and memory-efficient kernels take the dropout: what differs is the scores term, less the
    log-sum-exp's float32, plus the RNG state; and CUDA's residual dropouts keep bool masks (the
    CPU's are in the compute dtype), its layer norms float32 statistics."""
    seg = partition(load_model(config_from_dict(read_spec("gpt2")), device="meta"), (2, 10)).trunk
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        cpu, cuda = bm.Dims.of(seg, dtype), bm.Dims.of(seg, dtype, torch.device("cuda"))
        assert cpu.scores and not cpu.cuda_kernels and not cpu.cuda
        assert cuda.cuda_kernels and cuda.cuda and not cuda.scores
        e, (B, T), a = cpu.elem, (8, 1024), cpu.heads
        N, d = B * T, cpu.d
        scores = B * a * T * T * (3 * e + 1)
        lse = N * a * (bm.LSE_BYTES - e)
        masks = N * d * (2 * e + 2) - N * d * (e + 2)  # CPU: masks (e) and the output; CUDA: bool, the output
        stats = 2 * 2 * N * (e - bm.LN_STATS_BYTES)  # two layer norms' mean and 1/std
        assert bm.kept_per_block(cpu, B, T, T, False) - bm.kept_per_block(cuda, B, T, T, False) \
            == scores - lse - bm.RNG_STATE_BYTES + masks + stats
    # float64 and head sizes the kernels refuse fall back to the math path: scores again
    assert bm.Dims.of(seg, torch.float64, "cuda").scores
    assert not bm.fused_sdpa(torch.bfloat16, 60) and bm.fused_sdpa(torch.bfloat16, 64)
    # without attention dropout the CPU's flash kernel keeps none either: in float32 the two agree
    # but for the residual dropouts' masks (float32 on the CPU, bool on CUDA) and the optimizer
    still = {**read_spec("gpt2"), "attn_pdrop": 0.0}
    seg = partition(load_model(config_from_dict(still), device="meta"), (2, 10)).trunk
    cpu, cuda = bm.Dims.of(seg, torch.float32), bm.Dims.of(seg, torch.float32, "cuda")
    assert bm.kept_per_block(cpu, 8, 1024, 1024, True) - bm.kept_per_block(cuda, 8, 1024, 1024, True) \
        == ((2 * 4 + 2) - (4 + 2)) * 8 * 1024 * cpu.d  # N·d·(2e + 2) on the CPU, N·d·(e + 2) on CUDA
    assert bm.update_bytes(cuda) == 2 * cuda.grads > bm.update_bytes(cpu)  # foreach: every temporary at once


@pytest.mark.parametrize("cuts", [(2,), (2, 46)], ids=["2-way", "U"])
def test_gpt2_xl_8x1024_bfloat16_fits_an_80gb_gpu(cuts):
    """Issue 42: ``--model random:gpt2-xl`` trained 8 x 1024 bfloat16 was refused on an H100
    ("needs about 134.83 GiB ... allows 28.71 GiB"). On CUDA the step is priced without the
    scores and falls under the limit derived on an idle 80 GB card; the CPU's price is as it was,
    and the CPU's halving of what is left would still refuse it."""
    seg = _xl(cuts)
    cpu, cuda = bm.Dims.of(seg, torch.bfloat16), bm.Dims.of(seg, torch.bfloat16, "cuda")
    before = {(2,): 134.83, (2, 46): 127.38}[cuts]  # GiB, as the server priced it
    assert round(bm.train_cost(cpu, 8, 1024, False) / GiB, 2) == before
    need = bm.train_cost(cuda, 8, 1024, False)
    assert need < 0.5 * before * GiB
    weights = sum(p.numel() * p.element_size() for p in seg.parameters())
    free = H100_MIB * MiB - GiB // 2 - weights
    state = bm.state_bytes(seg, "adamw", packed=False)  # no prepacked copy off the CPU
    assert need <= bm.derived_limit(free, state, halve=False)
    assert need > bm.derived_limit(free, state)  # halved, as on the CPU: refused


def test_a_u_shape_forward_is_not_charged_for_its_graph_twice():
    """The forward's price is the step's; the graph it leaves is reserved on its own
    (training.py), so the request charges the price less the graph."""
    from splitlearn.server.engine.memory import MemoryAccount, scope

    m = bm.Dims.of(partition(load_model("tiny"), (1, 3)).trunk, torch.float32)
    budget, account = bm.Budget(GiB, m), MemoryAccount(GiB, GiB)
    with scope(account, "alice") as req, req.on_this_thread():
        budget.train_forward(4, 64, None, loss=False)
        charged = account.to_dict()["reserved_bytes"]
    assert charged == bm.train_cost(m, 4, 64, False) - bm.graph_bytes(m, 4, 64, False) > 0
    assert account.to_dict()["reserved_bytes"] == 0
    with pytest.raises(PayloadTooLarge, match="a training step of 64 x 64"):  # 413 on the whole price
        bm.Budget(bm.train_cost(m, 64, 64, False) - 1, m).train_forward(64, 64, None, loss=False)


_XL_SHAPED = dict(model_type="gpt2", vocab_size=50257, n_positions=1024, n_embd=768, n_layer=4, n_head=12)


def _train_step(client, cuts, n: int, B: int, T: int, d: int, vocab: int, g: torch.Generator) -> None:
    """Step ``n`` of client c1 through the routes: 2-way ``/v1/train/step``, U-shape forward and
    backward; then its apply."""
    h = torch.randn(B, T, d, generator=g)  # (B, T, d)
    meta = P.StepMeta("c1", n).to_meta()
    if len(cuts) == 1:
        y = torch.randint(0, vocab, (B, T), generator=g)
        tensors_of(post_tensors(client, P.TRAIN_STEP, {P.HIDDEN: h, P.LABELS: y}, meta))
    else:
        tensors_of(post_tensors(client, P.TRAIN_FORWARD, {P.HIDDEN: h}, meta))
        tensors_of(post_tensors(client, P.TRAIN_BACKWARD, {P.GRAD: torch.randn(B, T, d, generator=g)}, meta))
    assert apply_step(client, "c1", n).status_code == 200


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("cuts", [(1,), (1, 3)], ids=["2-way", "U"])
def test_on_cuda_the_price_is_within_1_5x_of_the_measured_peak(cuts, tmp_path):
    """A real step through the routes on the GPU (GPT-2 small's width, GPT-2's dropout, 8 x 1024,
    bfloat16): ``torch.cuda.max_memory_allocated()`` over what was allocated before it (weights,
    AdamW's moments from a first step) is below the price, and the price within 1.5x of it.
    The limit is derived without halving and the account's total is that limit."""
    spec = tmp_path / "wide.json"
    spec.write_text(json.dumps(_XL_SHAPED))
    app = create_app(ServerConfig(model=str(spec), cuts=cuts, tokens=TENANTS, device="cuda", dtype="bfloat16"))
    rt, client = app.extensions["splitlearn"], app.test_client()
    assert rt.budget.source.startswith("derived at start: all of free memory of cuda")
    assert rt.memory.to_dict()["limit_bytes"] == rt.budget.limit  # the account's total: the same rest
    B, T, d = 8, 1024, _XL_SHAPED["n_embd"]
    g = torch.Generator().manual_seed(0)

    def step(n):
        _train_step(client, cuts, n, B, T, d, _XL_SHAPED["vocab_size"], g)

    step(1)  # AdamW's moments exist from here on
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step(2)
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated() - base
    predicted = bm.train_cost(rt.budget.dims, B, T, False)
    assert rt.budget.dims.cuda_kernels and not rt.budget.dims.scores
    assert measured <= predicted <= 1.5 * measured, (measured / GiB, predicted / GiB)


# What tests/test_server_budget.py::test_on_cuda_the_price_is_within_1_5x_of_the_measured_peak[2-way]
# measured on an NVIDIA H100 (torch.cuda.max_memory_allocated() over what step 1 left allocated)
H100_2WAY_PEAK = 1.43 * GiB


def test_on_cuda_the_2way_price_is_within_1_5x_of_the_h100_peak():
    """The GPU test's 2-way case on an H100 (``_XL_SHAPED``, cut 1, bfloat16, 8 x 1024, step 2)
    peaked at 1.43 GiB, the head's forward: three blocks' kept tensors, ln_f's output, the shifted
    copy, grad of x, grad of W in float32 and one chunk of the loss. The model priced it at
    2.25 GiB (1.57x: the backward's workspace, all the gradients and host-memory bodies added to
    that peak). Priced by phase, the price lies between that peak and 1.5x of it."""
    model = load_model(config_from_dict(_XL_SHAPED), device="meta", dtype="bfloat16")
    m = bm.Dims.of(partition(model, (1,)).top, torch.bfloat16, "cuda")
    price = bm.train_cost(m, 8, 1024, False)
    assert H100_2WAY_PEAK <= price <= 1.5 * H100_2WAY_PEAK
    assert round(price / GiB, 2) == 1.75  # 1.23x (docs/INTERNALS.md)


_PHASED = dict(model_type="gpt2", vocab_size=2048, n_positions=256, n_embd=64, n_layer=3, n_head=4,
               attn_pdrop=0.0)  # GPT-2's residual dropout; no attention dropout: the CPU's sdpa takes flash


@pytest.mark.parametrize("cuts", [(1,), (1, 3)], ids=["2-way", "U"])
def test_on_cuda_each_phase_is_priced_over_what_a_cpu_step_keeps(cuts, tmp_path, monkeypatch):
    """A real step 2 through the routes on the CPU, bfloat16, AdamW on its foreach path (CUDA's):
    the live bytes of the storages the operators make (tests/tensorpeak.py, not the RSS), by
    phase, against the CUDA model's phases without its slack. The CPU keeps more than CUDA in one
    place only, the residual dropouts' masks (the compute dtype, not bool), added to the price;
    CUDA's attention backward makes float32 accumulators the CPU kernel hides."""
    from tensorpeak import TensorPeak, label_phases

    spec = tmp_path / "phased.json"
    spec.write_text(json.dumps(_PHASED))
    app = create_app(ServerConfig(model=str(spec), cuts=cuts, tokens=TENANTS, dtype="bfloat16",
                                  max_request_memory_bytes=1 << 40))
    rt, client = app.extensions["splitlearn"], app.test_client()
    opt = rt.federation.base.optimizer
    for group in opt.param_groups:
        group["foreach"] = True
    tp = TensorPeak()
    label_phases(tp, rt.segment, opt, monkeypatch)
    B, T, d = 4, 128, _PHASED["n_embd"]
    g = torch.Generator().manual_seed(0)

    def step(n):
        _train_step(client, cuts, n, B, T, d, _PHASED["vocab_size"], g)

    tp.on(rt.compute)
    try:
        step(1)  # AdamW's moments exist from here on
        base = tp.live
        tp.reset()
        step(2)
    finally:
        tp.off(rt.compute)
    peak = {phase: v - base for phase, v in tp.phase_peaks.items()}
    m = bm.Dims.of(rt.segment, torch.bfloat16, "cuda")
    e, N = m.elem, B * T
    masks = m.blocks * 2 * (e - 1) * N * d  # the CPU's masks in bfloat16, CUDA's bool
    kept, io = m.blocks * bm.kept_per_block(m, B, T, T, False), bm.io_bytes(m, B, T)
    head = (3 * e * N * d + 4 * m.vocab * d + bm._chunk(m, N, grads=True)) if m.head else 0
    backward = bm.block_workspace(m, B, T, T, False, False) + m.grads + (e * N * d if m.head else 0)
    assert peak["forward"] <= kept + backward + io + masks  # its temporaries within the backward's
    assert peak["backward"] <= kept + backward + io + masks
    scalars = 2 * 4 * len(list(rt.segment.parameters()))  # the norm's per-tensor norms and their stack (slack's)
    assert peak["update"] <= bm.update_bytes(m) + io + scalars
    if m.head:
        assert peak["head"] <= kept + head + io + masks
    measured, priced = tp.peak - base, bm.train_cost(m, B, T, False) / bm.CUDA_SLACK
    assert measured > 4 * MiB  # the step really ran
    assert measured <= priced + masks <= 1.6 * measured, (measured / MiB, priced / MiB, peak)


# -- the routes (Flask's test client) ----------------------------------------------------------

def _app(cuts, limit):
    return create_app(ServerConfig(model="tiny", cuts=cuts, tokens=TENANTS, max_request_memory_bytes=limit))


def _hidden(B, T, seed=0):
    return torch.randn(B, T, D, generator=torch.Generator().manual_seed(seed))  # (B, T, d)


def _step(B, T, step=1, seed=0, **meta):
    y = torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed + 1))
    return {P.HIDDEN: _hidden(B, T, seed), P.LABELS: y}, P.StepMeta("c1", step, **meta).to_meta()


def _client_step(client):
    return client.get(P.CLIENT_STATE.format(client_id="c1"), headers=auth()).get_json()["step"]


def test_an_over_budget_training_step_is_413_and_changes_nothing():
    app = _app((2,), 4 * MiB)
    rt, client = app.extensions["splitlearn"], app.test_client()
    m = bm.Dims.of(rt.segment, rt.dtype)
    assert bm.train_cost(m, 64, 64, False) > 4 * MiB > bm.train_cost(m, 2, 6, False)
    before = snapshot(segment_of(app))
    r = post_tensors(client, P.TRAIN_STEP, *_step(64, 64))
    err = assert_error(r, 413, "this server allows 0.00 GiB per request (--max-request-memory-gb)")
    assert err["error"] == "payload_too_large" and "64 x 64 positions" in err["message"]
    assert same_weights(before, snapshot(segment_of(app)))
    assert _client_step(client) == 0  # the ledger never saw it: no record, nothing pending
    assert not rt.ledger.known("alice:c1") and rt.ledger.pending_since() == {}
    out = tensors_of(post_tensors(client, P.TRAIN_STEP, *_step(2, 6)))  # the same step number, smaller
    assert out[P.GRAD].shape == (2, 6, D)
    assert apply_step(client, "c1", 1).status_code == 200 and _client_step(client) == 1
    assert not same_weights(before, snapshot(segment_of(app)))


def test_an_over_budget_u_shape_forward_keeps_no_graph_and_no_lease():
    app = _app((1, 3), 4 * MiB)
    client = app.test_client()
    before = snapshot(segment_of(app))
    meta = P.StepMeta("c1", 1).to_meta()
    assert_error(post_tensors(client, P.TRAIN_FORWARD, {P.HIDDEN: _hidden(64, 64)}, meta), 413,
                 "--max-request-memory-gb")
    assert_error(post_tensors(client, P.TRAIN_BACKWARD, {P.GRAD: _hidden(64, 64)}, meta), 409, "forward")
    # nothing pending, nothing leased: another client steps at once, then c1 at its step 1
    other = P.StepMeta("c2", 1).to_meta()
    tensors_of(post_tensors(client, P.TRAIN_FORWARD, {P.HIDDEN: _hidden(2, 6)}, other))
    tensors_of(post_tensors(client, P.TRAIN_BACKWARD, {P.GRAD: _hidden(2, 6, 1)}, other))
    assert apply_step(client, "c2", 1).status_code == 200
    tensors_of(post_tensors(client, P.TRAIN_FORWARD, {P.HIDDEN: _hidden(2, 6)}, meta))
    assert not same_weights(before, snapshot(segment_of(app)))  # c2's step was applied
    assert _client_step(client) == 0


def test_a_u_shape_steps_waiting_graphs_are_priced_together():
    """The graphs of a step's pieces wait together for their backwards: each is reserved in the
    tenant's share (:mod:`splitlearn.server.engine.memory`), so a piece that fits the per-request
    budget alone is refused (429, nothing kept) once its step's waiting graphs would not fit."""
    probe = _app((1, 3), 1 << 40)
    rt = probe.extensions["splitlearn"]
    graph = bm.graph_bytes(bm.Dims.of(rt.segment, rt.dtype), 32, 64, False)
    app = create_app(ServerConfig(model="tiny", cuts=(1, 3), tokens=TENANTS, max_request_memory_bytes=1 << 40,
                                  max_tenant_memory_bytes=int(2.5 * graph)))
    client = app.test_client()
    piece = lambda i: P.StepMeta("c1", 1, micro=i).to_meta()  # noqa: E731
    for i in range(2):
        assert tensors_of(post_tensors(client, P.TRAIN_FORWARD, {P.HIDDEN: _hidden(32, 64, i)}, piece(i)))
    assert_error(post_tensors(client, P.TRAIN_FORWARD, {P.HIDDEN: _hidden(32, 64, 2)}, piece(2)), 429,
                 "--max-tenant-memory-gb")
    assert set(app.extensions["splitlearn"].ledger.pending("alice:c1").state.forwards) == {0, 1}


def test_an_over_budget_forward_is_413_and_a_smaller_one_answers():
    app = _app((2,), 4 * MiB)
    client = app.test_client()
    before = snapshot(segment_of(app))
    tensors, _ = _step(64, 64)
    assert_error(post_tensors(client, P.FORWARD, tensors, {}), 413, "a forward of 64 x 64 positions")
    tensors, _ = _step(2, 6)
    out = tensors_of(post_tensors(client, P.FORWARD, tensors, {}))
    assert out[P.LOGITS].shape == (2, VOCAB) and torch.isfinite(out[P.LOSS]).all()
    assert same_weights(before, snapshot(segment_of(app)))


def test_sessions_are_priced_at_open_and_at_every_step():
    app = _app((2,), 1 * MiB)
    rt, client = app.extensions["splitlearn"], app.test_client()
    m = bm.Dims.of(rt.segment, rt.dtype)
    assert bm.kv_bytes(m, 64 * NPOS) > MiB > bm.kv_bytes(m, 8 * NPOS)
    r = client.post(P.SESSIONS, json={"rows": 64}, headers=auth())
    assert_error(r, 413, "KV cache")
    assert len(rt.sessions) == 0  # nothing opened
    r = client.post(P.SESSIONS, json={"rows": 8}, headers=auth())
    assert r.status_code == 201, r.get_data(as_text=True)
    url = P.SESSION_STEP.format(session_id=r.get_json()["session_id"])
    assert bm.session_step_cost(m, 8, 0, NPOS, False) > 1.5 * MiB
    assert bm.session_step_cost(m, 8, 8, 1, False) < bm.session_step_cost(m, 8, 0, 8, False) < MiB / 2
    assert_error(post_tensors(client, url, {P.HIDDEN: _hidden(8, NPOS)}, P.SessionStepMeta(0).to_meta()),
                 413, "a generation step of 8 x 64 positions")
    # the session did not move: its prompt in pieces works from position 0
    out = tensors_of(post_tensors(client, url, {P.HIDDEN: _hidden(8, 8)}, P.SessionStepMeta(0).to_meta()))
    assert out[P.LOGITS].shape == (8, VOCAB)
    out = tensors_of(post_tensors(client, url, {P.HIDDEN: _hidden(8, 1)}, P.SessionStepMeta(8).to_meta()))
    assert out[P.LOGITS].shape == (8, VOCAB)


def test_info_reports_the_limit_and_where_it_comes_from():
    info = _app((2,), 3 * GiB).test_client().get(P.INFO, headers=auth()).get_json()["limits"]
    assert info["max_request_memory_bytes"] == 3 * GiB
    assert info["max_request_memory_source"] == "--max-request-memory-gb"
    derived = _app((2,), None).test_client().get(P.INFO, headers=auth()).get_json()["limits"]
    assert derived["max_request_memory_bytes"] >= bm.MIN_DERIVED
    assert derived["max_request_memory_source"].startswith("derived at start: half of ")
    assert derived["max_request_memory_source"].endswith("--max-request-memory-gb sets it")


def test_the_flag_and_the_config_field():
    assert parse_args(["--model", "tiny", "--cut", "1", "--max-request-memory-gb", "1.5"]) \
        .max_request_memory_bytes == int(1.5 * GiB)
    assert parse_args(["--model", "tiny", "--cut", "1"]).max_request_memory_bytes is None
    with pytest.raises(ConfigError, match="max-request-memory-gb"):
        ServerConfig(model="tiny", cuts=(1,), tokens=TENANTS, max_request_memory_bytes=1000)


# -- a real server under an address-space limit -------------------------------------------------

# python -m splitlearn.server, with RLIMIT_AS set first (an allocation past it fails: as out of memory).
# Two malloc arenas (MALLOC_ARENA_MAX=2, set by mallopt as the process may already be running:
# tests/forkserver.py forks it from the tests' preloaded interpreter, not ~9 CPU-seconds of imports)
# keep the idle virtual size near 1 GB.
LAUNCH = ("import ctypes, resource, runpy, sys\n"
          "limit = int(sys.argv.pop(1))\n"
          "assert ctypes.CDLL(None).mallopt(-8, 2) == 1  # M_ARENA_MAX\n"
          "resource.setrlimit(resource.RLIMIT_AS, (limit, limit))\n"
          "runpy.run_module('splitlearn.server', run_name='__main__', alter_sys=True)\n")


class LimitedServer(LocalServer):
    """A LocalServer whose process may map at most ``as_bytes`` of address space
    (``python -m as_limited_server``: ``launcher_dir``, where it writes :data:`LAUNCH`, must be the
    working directory when it starts)."""

    def __init__(self, args, as_bytes: int, launcher_dir: Path):
        super().__init__(args, token=TOKEN)
        (launcher_dir / "as_limited_server.py").write_text(LAUNCH)
        self.cmd = [sys.executable, "-m", "as_limited_server", str(as_bytes), *self.cmd[3:]]

    def post(self, path, tensors, meta=None):
        return requests.post(self.url + path, data=encode(tensors, meta), timeout=300,
                             headers={**auth(), "Content-Type": P.CONTENT_TYPE})


def _gpt2_vocab_step(B, T, step, labels=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = {P.HIDDEN: torch.randn(B, T, 32, generator=g)}
    if labels:
        t[P.LABELS] = torch.randint(0, 50257, (B, T), generator=g)
    return t, P.StepMeta("c1", step).to_meta()


@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_AS semantics are Linux's")
def test_a_real_server_under_an_address_space_limit_refuses_or_serves_and_keeps_serving(tmp_path, monkeypatch):
    """2.5 GiB of address space (the idle server maps ~1 GiB). Before the budget, this
    GPT-2-vocabulary top made all the logits: 13 GB for a forward of 64 x 1024 positions, 0.8 GB
    each for the logits, their shifted copy and log-softmax in a forward of 4 x 1024 with labels,
    and more with the gradients in a training step of 4 x 1024: each failed to allocate and
    answered 500 (measured with the code before; docs/INTERNALS.md).
    Now the forwards compute the last logits only and the loss in chunks, the training step
    fits, and a training step of 64 x 1024 is refused with 413 before anything is allocated."""
    spec = tmp_path / "gpt2-vocab-small.json"
    spec.write_text(json.dumps(GPT2_VOCAB_SMALL))
    args = ["--model", str(spec), "--cut", "1", "--threads", "2", "--max-request-memory-gb", "0.75"]
    monkeypatch.chdir(tmp_path)
    with LimitedServer(args, int(2.5 * GiB), tmp_path) as srv:
        limit = int(2.5 * GiB)  # the server's own process holds it (forked or not)
        assert f"Max address space         {limit}" in Path(f"/proc/{srv.proc.pid}/limits").read_text()
        r = srv.post(P.TRAIN_STEP, *_gpt2_vocab_step(64, 1024, 1))
        assert r.status_code == 413, r.text[:500]
        err = r.json()
        assert err["error"] == "payload_too_large"
        assert "a training step of 64 x 1024 positions needs about" in err["message"]
        assert "allows 0.75 GiB per request (--max-request-memory-gb)" in err["message"]

        r = srv.post(P.FORWARD, _gpt2_vocab_step(64, 1024, 1, labels=False)[0], {})
        assert r.status_code == 200, r.text[:500]
        assert decode(r.content)[0][P.LOGITS].shape == (64, 50257)

        r = srv.post(P.FORWARD, _gpt2_vocab_step(4, 1024, 1)[0], {})
        assert r.status_code == 200, r.text[:500]
        assert torch.isfinite(decode(r.content)[0][P.LOSS]).all()

        r = srv.post(P.TRAIN_STEP, *_gpt2_vocab_step(4, 1024, 1))  # step 1: the refused one changed nothing
        assert r.status_code == 200, r.text[:500]
        out = decode(r.content)[0]
        assert out[P.GRAD].shape == (4, 1024, 32) and torch.isfinite(out[P.LOSS]).all()
        r = apply_step(requests, "c1", 1, url=srv.url)  # the optimizer step (its state allocated) fits too
        assert r.status_code == 200, r.text[:500]

        assert requests.get(srv.url + P.HEALTH, timeout=10).status_code == 200
        state = requests.get(srv.url + P.CLIENT_STATE.format(client_id="c1"), headers=auth(), timeout=10)
        assert state.json()["step"] == 1
        assert srv.proc.poll() is None  # alive
