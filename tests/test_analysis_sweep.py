"""Sweep: every cut's compute per side, bytes crossing, step estimate and advice."""
import pytest

from splitlearn.analysis.core import AnalysisConfig
from splitlearn.analysis.sweep import LinkConfig, recommend, sweep_cuts
from splitlearn.errors import ConfigError

CFG = AnalysisConfig(cuts=(), seq_len=8, repeats=2, warmup=1, roofline=False)


def test_sweep_points(tiny_model):
    out = sweep_cuts(tiny_model, CFG, LinkConfig(link_mbps=8.0, rtt_ms=5.0), tiny_model.device)
    pts = out["points"]
    assert [p["cut"] for p in pts] == [0, 1, 2, 3, 4]
    block = 12 * 8 * 32 ** 2 + 2 * 64 * 32
    head = 8 * 32 * 257
    for p in pts:
        assert p["client_macs"] == p["cut"] * block
        assert p["server_macs"] == (4 - p["cut"]) * block + head
        assert p["bytes"]["float32"] == 8 * 32 * 4
        # 8 Mbit/s = 1 byte per microsecond: 1024 bytes = 1.024 ms, plus the 5 ms round trip
        assert p["transfer_ms"] == pytest.approx(5 + 1.024)
        assert p["step_ms"] == pytest.approx(p["client_ms"] + p["server_ms"] + p["transfer_ms"])
    # client + server is the whole model at any cut and the bytes are the same: with a server as
    # fast as this machine, every cut ties (issue 41: 1231.54 ms each, "recommends" cut 1 as if timed)
    rec = out["recommendation"]
    assert rec["tie"] and rec["cut"] == 1  # the fewest client blocks min_client_blocks=1 allows
    assert "the allowed cuts tie" in rec["reason"] and "privacy and memory" in rec["reason"]
    assert rec["decided_by"].startswith("client memory")


def test_train_sends_gradients_and_labels(tiny_model):
    cfg = AnalysisConfig(cuts=(), seq_len=8, repeats=2, warmup=1, roofline=False, mode="train")
    out = sweep_cuts(tiny_model, cfg, LinkConfig(), tiny_model.device)
    assert out["points"][2]["bytes"]["float32"] == 2 * 8 * 32 * 4 + 8 * 8
    assert "recommendation" not in out


def _pts(client, server, transfer=1.0):
    return [{"cut": c, "client_ms": a, "server_ms": b, "transfer_ms": transfer,
             "step_ms": a + b + transfer, "bytes": {"float32": 100}}
            for c, (a, b) in enumerate(zip(client, server))]


def test_recommend_fast_server_keeps_the_client_small():
    link = LinkConfig(link_mbps=100, server_speedup=10.0, min_client_blocks=1)
    pts = _pts([1, 5, 9, 13], [30, 20, 10, 0])  # a block costs 4 ms here, 1 ms on the server
    for p in pts:
        p["step_ms"] = p["client_ms"] + p["server_ms"] / 10 + 1
    rec = recommend(pts, link, 3)
    assert rec["cut"] == 1 and "10x faster" in rec["reason"]


def test_recommend_says_when_link_dominates():
    pts = _pts([1, 5, 9], [30, 20, 10], transfer=20.0)
    for p in pts:
        p["step_ms"] = p["client_ms"] + p["server_ms"] / 10 + 20.0  # 24, 27, 30 ms
    rec = recommend(pts, LinkConfig(link_mbps=1, server_speedup=10.0, min_client_blocks=0), 2)
    assert rec["cut"] == 0 and not rec["tie"] and rec["decided_by"] == "step time"
    assert "link dominates" in rec["reason"] and "span 25.0%" in rec["reason"]


def test_cuts_that_tie_say_so_and_what_decides():
    """Issue 41: a sweep whose cuts all take the same time says they tie and why, and recommends
    by memory (the fewest client blocks allowed), not as if one cut were faster."""
    link = LinkConfig(link_mbps=100, rtt_ms=20, server_speedup=4.0, min_client_blocks=2)
    pts = _pts([1, 2, 3, 4, 5], [8, 6, 4, 2, 0], transfer=1200.0)  # within 0.5%: the link dominates
    for p in pts:
        p["step_ms"] = p["client_ms"] + p["server_ms"] / 4 + 1200.0
    rec = recommend(pts, link, 4)
    assert rec["tie"] and rec["cut"] == 2 and rec["decided_by"].startswith("client memory")
    assert "tie" in rec["reason"] and "link dominates" in rec["reason"] and "--min-client-blocks 2" in rec["reason"]
    same = recommend(_pts([1, 2, 3], [3, 2, 1], transfer=10.0), LinkConfig(link_mbps=100), 2)
    assert same["tie"] and same["cut"] == 1 and "same speed" in same["reason"]


def test_link_validation():
    with pytest.raises(ConfigError):
        LinkConfig(link_mbps=0)
    with pytest.raises(ConfigError):
        LinkConfig(wire_dtype="int4")
