"""The report: documented fields, tied weights, KV bytes, modes; memory peaks."""
import pytest
import torch

from splitlearn.analysis.core import AnalysisConfig, analyze
from splitlearn.analysis.memory import measure_peaks, resident_bytes
from splitlearn.errors import ConfigError

FAST = dict(repeats=2, warmup=1, peak_tflops=1.0, mem_bw_gbs=10.0)
FIELDS = {"name", "params", "macs", "flops", "latency_ms", "peak_memory_bytes", "output_bytes"}


@pytest.fixture(scope="module")
def prefill(tiny_model):
    return analyze(AnalysisConfig(cuts=(1, 3), batch_size=2, seq_len=8, **FAST), model=tiny_model)


def test_documented_fields(prefill):
    segs = prefill["segments"]
    assert [s["name"] for s in segs] == ["bottom", "trunk", "top"]
    assert [s["blocks"] for s in segs] == [[0, 1], [1, 3], [3, 4]]
    for s in segs:
        assert FIELDS | {"blocks", "submodules"} <= set(s)
        assert set(s["latency_ms"]) >= {"median", "p90"}
        assert s["flops"] == 2 * s["macs"]
        for sub in s["submodules"]:
            assert FIELDS <= set(sub) and sub["flops"] == 2 * sub["macs"]
    names = [x["name"] for x in segs[0]["submodules"]]
    assert names == ["wte", "wpe", "drop", "h.0", "h.0.ln_1", "h.0.attn", "h.0.ln_2", "h.0.mlp"]
    assert [x["name"] for x in segs[2]["submodules"]][-2:] == ["ln_f", "lm_head"]


def test_params_outputs_and_tied_weights(prefill, tiny_model):
    bottom, trunk, top = prefill["segments"]
    V, d = 257, 32
    assert bottom["params"] == V * d + 64 * d + sum(p.numel() for p in tiny_model.transformer.h[0].parameters())
    lm_head = next(s for s in top["submodules"] if s["name"] == "lm_head")
    assert lm_head["params"] == V * d  # the top counts its copy of the tied matrix
    assert bottom["output_bytes"] == 2 * 8 * d * 4 and top["output_bytes"] == 2 * 8 * V * 4
    (tied,) = prefill["tied_parameters"]
    assert {(h["segment"], h["parameter"]) for h in tied["holders"]} == {
        ("bottom", "wte.weight"), ("top", "lm_head.weight")}
    assert bottom["params"] + trunk["params"] + top["params"] == prefill["model"]["params"] + V * d


def test_bytes_crossing_and_kv(prefill):
    cut = prefill["cuts"][0]
    n = 2 * 8 * 32
    assert cut["activations_bytes"] == {"float32": 4 * n, "bfloat16": 2 * n, "float16": 2 * n,
                                        "int8": n + 4 * 2 * 8}
    assert "gradients_bytes" not in cut
    assert [s["kv_cache_bytes"] for s in prefill["segments"]] == [2 * k * 2 * 8 * 32 * 4 for k in (1, 2, 1)]


def test_roofline_uses_given_peaks(prefill):
    assert prefill["roofline"]["ridge_flops_per_byte"] == pytest.approx(100.0)
    ops = {o["op"]: o for o in prefill["segments"][2]["operators"]}
    assert ops["addmm"]["flops"] > 0 and ops["addmm"]["bound"] == "memory"  # tiny: I << 100
    assert all(o["intensity"] == pytest.approx(o["flops"] / o["bytes"]) for o in ops.values())


def test_decode_and_train(tiny_model):
    dec = analyze(AnalysisConfig(cuts=(2,), seq_len=8, mode="decode", roofline=False, **FAST),
                  model=tiny_model)
    bottom, top = dec["segments"]
    assert bottom["output_bytes"] == 32 * 4  # one token
    assert bottom["kv_cache_bytes"] == 2 * 2 * 9 * 32 * 4  # T past + the new token
    assert top["macs"] == 2 * (12 * 32 ** 2 + 2 * 9 * 32) + 32 * 257
    tr = analyze(AnalysisConfig(cuts=(2,), seq_len=8, mode="train", roofline=False, **FAST),
                 model=tiny_model)
    assert tr["cuts"][0]["gradients_bytes"]["float32"] == 8 * 32 * 4
    assert tr["segments"][1]["macs"] == 3 * (2 * (12 * 8 * 32 ** 2 + 2 * 64 * 32) + 8 * 32 * 257)
    assert all(p.grad is None for p in tiny_model.parameters())


def test_memory_tracker_sees_a_large_temporary():
    lin = torch.nn.Linear(256, 256)
    x = torch.randn(1024, 256)
    total, subs = measure_peaks(lambda: lin(x).relu().sum(), {"lin": lin}, torch.device("cpu"))
    assert subs["lin"] >= 1024 * 256 * 4
    assert total >= 2 * 1024 * 256 * 4  # lin's output and relu's are alive together
    assert resident_bytes(lin) == (256 * 256 + 256) * 4


@pytest.mark.parametrize("kw, words", [
    (dict(cuts=(5,)), "out of range"), (dict(seq_len=65), "n_positions"),
    (dict(seq_len=64, mode="decode"), "n_positions"), (dict(mode="sideways"), "mode")])
def test_bad_config(tiny_model, kw, words):
    with pytest.raises(ConfigError, match=words):
        analyze(AnalysisConfig(**{**FAST, **kw}), model=tiny_model)
