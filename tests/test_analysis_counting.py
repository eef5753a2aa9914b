"""MACs: fvcore (with its SDPA handler) equals flop_counter and the analytic formulas."""
import pytest
import torch

from splitlearn import load_model, partition
from splitlearn.analysis.counting import (analytic_macs, count_segment, flop_counter_macs,
                                          fvcore_macs)
from splitlearn.analysis.core import AnalysisConfig, segment_inputs


def _args(part, mode, seq=8, batch=2):
    return segment_inputs(part, AnalysisConfig(cuts=part.cuts, batch_size=batch, seq_len=seq,
                                               mode=mode), torch.device("cpu"))


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_fvcore_equals_formulas_and_flop_counter(tiny_model, mode):
    part = partition(tiny_model, (1, 3))
    d, V, B = 32, 257, 2
    S, T = (8, 8) if mode == "prefill" else (1, 9)
    for seg, args in zip(part.segments, _args(part, mode)):
        fv = fvcore_macs(seg, args)
        block = 12 * B * S * d * d + 2 * B * S * T * d  # per block, the formula
        for i in range(len(seg.h)):
            assert fv[f"h.{i}"] == block
            assert fv[f"h.{i}.attn"] == 4 * B * S * d * d + 2 * B * S * T * d
            assert fv[f"h.{i}.mlp"] == 8 * B * S * d * d
        head = B * S * d * V if seg.has_head else 0
        if seg.has_head:
            assert fv["lm_head"] == head and fv["ln_f"] == 0
        if seg.has_embeddings:
            assert fv["wte"] == 0 and fv["wpe"] == 0
        assert fv[""] == len(seg.h) * block + head
        assert flop_counter_macs(seg, args)[""] == fv[""]
        assert analytic_macs(seg, B, S, T)[""] == fv[""]


def test_attention_is_counted(tiny_model):
    """fvcore alone skips scaled_dot_product_attention; the handler adds B·S·T·d twice."""
    seg = partition(tiny_model, 2).segments[1]
    x = torch.randn(1, 8, 32)
    fv = fvcore_macs(seg, (x,))
    assert fv["h.0.attn"] - fv["h.0.attn.c_attn"] - fv["h.0.attn.c_proj"] == 2 * 8 * 8 * 32


def test_train_counts_three_times_forward_and_real_backward_agrees(tiny_model):
    part = partition(tiny_model, 2)
    for seg, args in zip(part.segments, _args(part, "train")):
        fwd = count_segment(seg, args, 2, 8, 8)
        train = count_segment(seg, args, 2, 8, 8, train=True)
        assert train.fvcore[""] == 3 * fwd.fvcore[""]
        assert train.mismatches == []  # real backward within 1% of 3x forward
        assert all(p.grad is None for p in seg.parameters())  # counting leaves no gradients


def test_mismatch_is_reported_not_hidden(tiny_model, monkeypatch):
    import splitlearn.analysis.counting as counting
    seg = partition(tiny_model, 2).segments[1]
    real = counting.analytic_macs
    monkeypatch.setattr(counting, "analytic_macs",
                        lambda *a: {k: v + (v // 10 if k == "" else 0) for k, v in real(*a).items()})
    c = count_segment(seg, (torch.randn(1, 8, 32),), 1, 8, 8)
    assert [(m.module, m.reference) for m in c.mismatches] == [("", "analytic")]
    assert c.mismatches[0].relative == pytest.approx(0.1 / 1.1, rel=1e-3)


def test_published_table_counts():
    """GPT-2 small, cuts 2 and 10, batch 1, sequence 6: the seed's params and MACs."""
    model = load_model("random:gpt2")
    part = partition(model, (2, 10))
    args = _args(part, "prefill", seq=6, batch=1)
    bottom, _, top = part.segments
    params = lambda m: sum(p.numel() for p in m.parameters())
    assert round(params(bottom) / 1e6, 2) == 53.56
    assert round(params(top) / 1e6, 2) == 52.77  # lm_head counted: the top's copy of wte
    fb, ft = fvcore_macs(bottom, args[0]), fvcore_macs(top, args[2])
    assert ft["lm_head"] == 6 * 768 * 50257 and round(ft["lm_head"] / 1e9, 2) == 0.23
    assert 0.08 <= fb[""] / 1e9 < 0.09  # 0.085 G; the seed's table truncates to 0.08
    assert round(ft[""] / 1e9, 2) == 0.32
    assert fb["h.0"] == 12 * 6 * 768 ** 2 + 2 * 6 * 6 * 768  # 0.0425 G (docs/INTERNALS.md, "fvcore")
