"""The analyzer on other families (issue 52 items 3 and 4): per-segment params sum to the model's,
a segment's MACs are fvcore's on that segment alone and a hand count per layer (prefill, and
decode past a sliding window), the sweep covers every cut, and LLaMA-2-7B's shape is counted on
the meta device in seconds without allocating its weights."""
import json
import time

import pytest
import torch

import families
from splitlearn.analysis.cli import main
from splitlearn.analysis.core import AnalysisConfig, analyze, segment_inputs
from splitlearn.analysis.counting import fvcore_macs
from splitlearn.analysis.sweep import LinkConfig, sweep_cuts
from splitlearn.errors import ConfigError
from splitlearn.model.partition import partition

#: Llama with grouped KV heads, Gemma 2 (alternating sliding layers, softcaps, tied head), and
#: GPT-NeoX (fused QKV, partial rotary, parallel residual, a plain GELU MLP)
NAMES = ["llama-gqa", "gemma2", "gpt_neox"]
FAST = dict(repeats=1, warmup=0, roofline=False)
B, S = 2, 8


@pytest.fixture(scope="module", params=NAMES)
def fam(request):
    return request.param, families.model(request.param)


_REPORTS = {}  # (family, mode) -> analyze()'s report of cuts (1, 3), B x S, FAST: several tests read one


def report_of(name: str, mode: str = "prefill", model=None) -> dict:
    """The analyzer's report of family ``name`` (``model``, default a fresh tests/families.py one),
    cuts (1, 3), computed once per family and mode (the tests only read it)."""
    if (name, mode) not in _REPORTS:
        cfg = AnalysisConfig(cuts=(1, 3), batch_size=B, seq_len=S, mode=mode, **FAST)
        _REPORTS[name, mode] = analyze(cfg, model=model if model is not None else families.model(name))
    return _REPORTS[name, mode]


def hand_layer_macs(name: str, batch: int, new: int, keys: int) -> int:
    """One layer's multiply-adds, counted by hand from tests/families.py's sizes (d 32, f 64)."""
    d, f = 32, 64
    if name == "llama-gqa":  # q, o: d x 4·8; k, v: d x 2·8; SwiGLU: gate, up, down
        linear, heads, hd, mlp = d * 32 + 2 * d * 16 + 32 * d, 4, 8, 3 * d * f
    elif name == "gemma2":  # head_dim 8 given, 4 heads, 2 KV heads; GeGLU
        linear, heads, hd, mlp = d * 32 + 2 * d * 16 + 32 * d, 4, 8, 3 * d * f
    else:  # gpt_neox: fused QKV 3d², dense d², MLP d->f->d
        linear, heads, hd, mlp = 3 * d * d + d * d, 4, 8, 2 * d * f
    return batch * new * (linear + mlp) + batch * heads * new * keys * 2 * hd


def test_segment_params_sum_to_the_models_total(fam):
    name, model = fam
    report = report_of(name, model=model)
    segs = report["segments"]
    assert [s["blocks"] for s in segs] == [[0, 1], [1, 3], [3, 4]]
    total = sum(p.numel() for p in model.parameters())  # unique tensors
    copies = sum(t["params"] * (len(t["holders"]) - 1) for t in report["tied_parameters"])
    assert sum(s["params"] for s in segs) == total + copies == report["model"]["params"] + copies
    assert bool(copies) == (name == "gemma2")  # Gemma ties its head to the embedding: each side counts it
    for s in segs:  # the top-level rows partition the segment's parameters
        assert sum(x["params"] for x in s["submodules"] if not x["parent"]) == s["params"]
        assert s["latency_ms"]["median"] > 0 and s["mac_crosscheck"]["mismatches"] == []
    assert report["model"]["model_type"] == model.config.model_type


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_segment_macs_are_fvcore_alone_and_the_hand_count(fam, mode):
    name, model = fam
    cfg = AnalysisConfig(cuts=(1, 3), batch_size=B, seq_len=S, mode=mode, **FAST)
    report = report_of(name, mode, model)
    part = partition(model, (1, 3))
    new = S if mode == "prefill" else 1
    window = getattr(model.config, "sliding_window", None)
    types = getattr(model.config, "layer_types", None) or ["full_attention"] * 4
    for seg, args, row in zip(part.segments, segment_inputs(part, cfg, torch.device("cpu")), report["segments"]):
        fv = fvcore_macs(seg, args)  # the segment alone
        assert row["macs"] == fv[""] and row["mac_crosscheck"]["analytic"] == fv[""]
        for i in range(seg.start, seg.end):
            keys = S + new if mode == "decode" else S
            if types[i] == "sliding_attention" and mode == "decode":
                keys = min(S, window - 1) + 1  # the sliding cache holds window - 1 past tokens
            got = next(x["macs"] for x in row["submodules"] if x["name"] == f"{seg.arch.layers_name}.{i - seg.start}")
            assert got == hand_layer_macs(name, B, new, keys), (name, mode, i)
        if seg.has_head:
            assert fv["lm_head"] == B * new * 32 * families.V
    if name == "gemma2":
        assert "sliding_attention" in types and window < S  # decode ran past the window


def test_the_sweep_covers_every_cut_and_matches_the_segments(fam):
    name, model = fam
    cfg = AnalysisConfig(cuts=(), batch_size=B, seq_len=S, **FAST)
    sw = sweep_cuts(model, cfg, LinkConfig(link_mbps=100.0), torch.device("cpu"))
    n = 4
    assert [p["cut"] for p in sw["points"]] == list(range(n + 1))
    assert [tuple(p["cuts"]) for p in sw["u_points"]] == [(a, b) for a in range(n + 1) for b in range(a + 1, n + 1)]
    for c in (0, 2, 4):  # each side's MACs: fvcore on that segment alone
        bottom, top = partition(model, c).segments
        args = segment_inputs(partition(model, c), cfg, torch.device("cpu"))
        p = sw["points"][c]
        assert p["client_macs"] == fvcore_macs(bottom, args[0])[""]
        assert p["server_macs"] == fvcore_macs(top, args[1])[""]
        assert p["bytes"]["float32"] == B * S * 32 * 4 and p["step_ms"] > 0
    assert "recommendation" in sw


# -- LLaMA-2-7B's shape, on the meta device ---------------------------------------------------

D7, F7, V7 = 4096, 11008, 32000
LAYER_PARAMS_7B = 4 * D7 * D7 + 3 * D7 * F7 + 2 * D7  # q, k, v, o; gate, up, down; two RMSNorms


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_llama2_7b_shape_table_on_meta_in_seconds_without_weights(tmp_path):
    rss, t0 = _rss_bytes(), time.perf_counter()
    out = tmp_path / "r.json"
    assert main(["--model", "llama2-7b-shape", "--device", "meta", "--dtype", "float16", "--seq-len", "512",
                 "--cut", "2", "--cut", "30", "--quiet", "--json", str(out)]) == 0
    seconds, grown = time.perf_counter() - t0, _rss_bytes() - rss
    r = json.loads(out.read_text())
    assert r["model"]["params"] == 6_738_415_616  # LLaMA-2-7B's parameter count
    bottom, trunk, top = r["segments"]
    layer = next(x for x in trunk["submodules"] if x["name"] == "layers.0")
    assert layer["params"] == LAYER_PARAMS_7B == 202_383_360
    T = 512  # per layer: 2·T·(params of its products) / 2 + attention B·H·T·T·2·head_dim
    assert layer["macs"] == T * (4 * D7 * D7 + 3 * D7 * F7) + 32 * T * T * 2 * 128 == 105_763_569_664
    assert bottom["params"] == V7 * D7 + 2 * LAYER_PARAMS_7B and top["params"] == 2 * LAYER_PARAMS_7B + D7 + V7 * D7
    assert top["macs"] == 2 * layer["macs"] + T * D7 * V7
    assert r["cuts"][0]["activations_bytes"]["float16"] == T * D7 * 2 == 4 * 2 ** 20  # seed 000's 4 MB transfer
    assert trunk["kv_cache_bytes"] == 28 * 2 * T * D7 * 2
    assert all(s["latency_ms"] is None and s["mac_crosscheck"]["analytic"] == s["macs"] for s in r["segments"])
    assert r["device"]["type"] == "meta" and r["roofline"] is None
    # 13.5 GB of float16 weights were never allocated; the count took seconds (2 shared cores)
    assert grown < 1 << 30, f"RSS grew by {grown / 2 ** 20:.0f} MiB"
    assert seconds < 90, seconds


def test_a_shape_is_refused_off_the_meta_device():
    with pytest.raises(ConfigError, match="--device meta"):
        analyze(AnalysisConfig(model="llama2-7b-shape", cuts=(2,), **FAST))


def test_decode_inputs_rebuild_each_layers_cache_as_decoding_left_it():
    """The analyzer times and counts a decode step on a cache rebuilt inside the traced call from
    the KV tensors: its output equals the step on the cache a real prefill left. Gemma 2 past its
    window of 4, cut (2, 3): the trunk holds one sliding layer, whose cache keeps 3 tokens of 8;
    its positions (rotary) must count from the 8 tokens seen, not the 3 held."""
    from splitlearn.analysis.counting import runner

    model = families.model("gemma2")
    assert model.config.layer_types[2] == "sliding_attention"
    cfg = AnalysisConfig(cuts=(2, 3), batch_size=B, seq_len=S, mode="decode", **FAST)
    part = partition(model, (2, 3))
    inputs = segment_inputs(part, cfg, torch.device("cpu"))
    assert inputs[1][1].shape[2] == 3 and inputs[1].past == S
    caches = part.new_caches()
    gen = torch.Generator().manual_seed(cfg.seed)
    prompt = torch.randint(0, model.config.vocab_size, (B, S), generator=gen)  # segment_inputs' prefill
    x = inputs[0][0]  # (B, 1): the new token
    with torch.no_grad():
        part(prompt, caches=caches)
        for i, seg in enumerate(part.segments):
            expected = seg(x, cache=caches[i])
            got = runner(seg, inputs[i])(*inputs[i])
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
            if i + 1 < len(inputs):
                assert torch.equal(got, inputs[i + 1][0])
            x = expected


def test_train_mode_times_a_falcon_whose_layer_adds_into_a_parts_output_in_place():
    """Falcon's parallel residual adds the attention's output into the MLP's in place, which torch
    forbids on an output carrying a backward hook: the layers are timed whole, the parts' latency
    is None, and the counts are 3 x forward as for any family (before: a RuntimeError)."""
    model = families.model("falcon-alibi")
    cfg = dict(cuts=(1, 3), batch_size=B, seq_len=S, **FAST)
    train = analyze(AnalysisConfig(mode="train", **cfg), model=model)
    fwd = analyze(AnalysisConfig(**cfg), model=model)
    for t, f in zip(train["segments"], fwd["segments"]):
        assert t["macs"] == 3 * f["macs"] and t["mac_crosscheck"]["mismatches"] == []
        rows = {x["name"]: x for x in t["submodules"]}
        assert rows["h.0"]["latency_ms"]["median"] > 0 and rows["h.0.mlp"]["latency_ms"] is None
        assert [c["parent"] for c in t["latency_sum_checks"]] == [""]
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("name", ["gemma2", "gpt2"])
def test_the_meta_device_counts_what_the_cpu_counts(name):
    """Decode past Gemma 2's window and GPT-2's learned positions (whose range check reads values a
    meta tensor lacks): params, MACs, output and KV bytes on meta equal those of the real model."""
    cfg = dict(cuts=(1, 3), batch_size=B, seq_len=S, mode="decode", **FAST)
    meta = analyze(AnalysisConfig(model=families.config(name), device="meta", **cfg))
    cpu = report_of(name, "decode")  # (gemma2's: the hand-count test's own, where it ran first)
    keys = ("params", "macs", "output_bytes", "kv_cache_bytes")
    assert [[s[k] for k in keys] for s in meta["segments"]] == [[s[k] for k in keys] for s in cpu["segments"]]
    assert meta["cuts"] == cpu["cuts"] and meta["segments"][0]["latency_ms"] is None
