"""``python -m splitlearn.client diagnose`` and ``POST /v1/echo`` against a real server process."""
import json

import pytest

from splitlearn.api import protocol as P
from splitlearn.client.cli import main
from splitlearn.analysis.diagnose import (BANDWIDTH_ADVICE, LATENCY_ADVICE, DiagnoseConfig, estimate, fit_link,
                                        step_traffic)
from splitlearn.transport import Transport, TransportConfig
from splitlearn.errors import ConfigError, Unauthorized
from splitlearn.procs.localserver import free_port

from serverproc import TOKEN, ServerProcess

pytestmark = pytest.mark.slow

D = 32  # models/tiny.json


@pytest.fixture(scope="module")
def server():
    with ServerProcess((1, 3)) as srv:
        yield srv


@pytest.fixture
def transport(server):
    t = Transport(TransportConfig(server.url, TOKEN, retries=0))
    yield t
    t.close()


@pytest.mark.parametrize("size", [0, 1, 1024, 3 << 20])
def test_echo_returns_the_body_unchanged(transport, size):
    body = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
    assert transport.post_bytes(P.ECHO, body) == body
    assert transport.stats.bytes_sent == transport.stats.bytes_received == size


def test_echo_needs_the_token(server):
    t = Transport(TransportConfig(server.url, "wrong", retries=0))
    with pytest.raises(Unauthorized):
        t.post_bytes(P.ECHO, b"abc")
    t.close()


def test_diagnose_json_report(server, monkeypatch, capsys):
    monkeypatch.setenv("SPLITLEARN_TOKEN", TOKEN)
    assert main(["diagnose", "--server", server.url, "--json", "--sizes-kib", "1,64,1024",
                 "--repeats", "2", "--batch-size", "2", "--seq-len", "8"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert [t["bytes"] for t in r["round_trips"]] == [1024, 64 << 10, 1 << 20]
    for t in r["round_trips"]:
        assert 0 < t["min_ms"] <= t["median_ms"] <= t["p90_ms"] and t["effective_MBps"] > 0
    assert 0 <= r["per_call_overhead_ms"] <= r["round_trips"][0]["median_ms"]
    assert r["bandwidth_MBps"] > 0 and r["skipped_sizes"] == []
    assert r["model"] == {"shape": "u", "cuts": [1, 3], "hidden_size": D, "vocab_size": 257}
    codec = {c["wire_dtype"]: c for c in r["codec"]}
    assert set(codec) == {"float32", "bfloat16", "float16", "int8"}
    assert 2 * 8 * D * 4 < codec["float32"]["training_step_bytes"] < 2 * 8 * D * 4 + 1024
    assert all(c[k] >= 0 for c in r["codec"] for k in c if k.endswith("_ms"))
    train = r["steps"]["training"]
    assert train["calls"] == 2 and train["batch"] == 2 and train["seq_len"] == 8
    f32, bf16 = train["per_wire_dtype"]["float32"], train["per_wire_dtype"]["bfloat16"]
    assert f32["bytes_sent"] == f32["bytes_received"] == 2 * 2 * 8 * D * 4  # activations + gradients
    assert bf16["bytes_sent"] * 2 == f32["bytes_sent"]
    assert f32["estimated_ms"] >= f32["calls_ms"] == pytest.approx(2 * r["per_call_overhead_ms"])
    decode = r["steps"]["decode"]
    assert decode["calls"] == 1 and decode["per_wire_dtype"]["float32"]["bytes_received"] == D * 4
    assert train["advice"].startswith((LATENCY_ADVICE, BANDWIDTH_ADVICE))
    assert decode["advice"].startswith(LATENCY_ADVICE)  # 128 bytes cannot outweigh a call
    for step in (train, decode):  # the advice names the dtype the table makes fastest (float32 within 5%)
        per = step["per_wire_dtype"]
        best = min(per, key=lambda n: per[n]["estimated_ms"])
        if per[best]["estimated_ms"] > 0.95 * per["float32"]["estimated_ms"]:
            best = "float32"
        assert step["fastest_wire_dtype"] == best or per[best]["estimated_ms"] == pytest.approx(
            per[step["fastest_wire_dtype"]]["estimated_ms"], abs=1e-3)
        assert f"--wire-dtype {step['fastest_wire_dtype']}" in step["advice"]


def test_diagnose_text_report(server, monkeypatch, capsys):
    monkeypatch.setenv("SPLITLEARN_TOKEN", TOKEN)
    assert main(["diagnose", "--server", server.url, "--sizes-kib", "1,16", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "per-call overhead" in out and "16 KiB" in out and "latency-bound" in out
    assert "training step" in out and "decode step" in out


def test_diagnose_bad_url_exits_2_with_a_clear_message(capsys):
    assert main(["diagnose", "--server", "ftp://example.org"]) == 2
    assert "must start with http:// or https://" in capsys.readouterr().err
    assert main(["diagnose", "--server", f"http://127.0.0.1:{free_port()}", "--repeats", "1"]) == 2
    assert "cannot reach" in capsys.readouterr().err


def test_fit_recovers_a_known_link():
    overhead, mbps = 0.5, 1000.0  # ms, MB/s
    rows = [{"bytes": b, "median_ms": overhead + 2 * b / (mbps * 1e3)} for b in (1024, 1 << 20, 16 << 20)]
    got_overhead, got_mbps = fit_link(rows)
    assert got_overhead == pytest.approx(overhead, rel=1e-6) and got_mbps == pytest.approx(mbps, rel=1e-6)


def test_two_way_decode_answers_logits_and_config_is_checked():
    info = {"cuts": [2], "model_config": {"n_embd": 8, "vocab_size": 100}}
    dec = step_traffic(info, 3, 1, "decode")
    assert dec["calls"] == 1 and dec["bytes"]["float32"]["bytes_received"] == 3 * 100 * 4
    train = step_traffic(info, 3, 5, "train")
    assert train["calls"] == 1 and train["bytes"]["float32"]["bytes_sent"] == 3 * 5 * 8 * 4 + 3 * 5 * 8
    with pytest.raises(ConfigError):
        DiagnoseConfig(sizes=(1024,))
    with pytest.raises(ConfigError):
        DiagnoseConfig(repeats=0)


def test_a_wan_link_is_measured_advised_on_and_feeds_the_analyzer(server, monkeypatch, capsys, tmp_path):
    """diagnose through a 20 ms relay: the link entry carries the measured round trip, the
    advice names speculative decoding and micro-batches, and analyze_model_performance
    --link-from takes that link for its cut and wire-dtype recommendation."""
    from splitlearn.analysis.cli import main as analyze
    from splitlearn.analysis.diagnose import wan_advice
    from splitlearn.netem import relay_process

    monkeypatch.setenv("SPLITLEARN_TOKEN", TOKEN)
    with relay_process(server.url, rtt_ms=20) as relay:
        assert main(["diagnose", "--server", relay.url, "--json", "--sizes-kib", "1,64,256",
                     "--repeats", "2", "--batch-size", "2", "--seq-len", "8"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["link"]["rtt_ms"] == r["per_call_overhead_ms"] >= 20 and r["link"]["link_mbps"] > 0
    wan = r["advice"][2:]
    assert len(wan) == 2 and "speculative decoding" in wan[0] and "micro_batches" in wan[1]
    assert wan_advice(0.3, 1.0) == []  # loopback: no WAN advice
    report = tmp_path / "link.json"
    report.write_text(json.dumps(r))
    out = tmp_path / "sweep.json"
    assert analyze(["--model", "tiny", "--sweep", "--mode", "train", "--seq-len", "8", "--repeats", "2",
                    "--warmup", "1", "--no-roofline", "--quiet", "--link-from", str(report),
                    "--json", str(out)]) == 0
    sweep = json.loads(out.read_text())["sweep"]
    assert sweep["link"]["rtt_ms"] == r["link"]["rtt_ms"] and sweep["link"]["measured_from"] == relay.url
    rec = sweep["recommendation"]
    assert set(rec["wire_dtype_step_ms"]) == {"float32", "bfloat16", "float16", "int8"}
    assert rec["wire_dtype_step_ms"]["int8"] <= rec["wire_dtype_step_ms"]["float32"]
    assert all(p["transfer_ms"] >= r["link"]["rtt_ms"] for p in sweep["points"])
    # bad input: exit 2 with one line
    assert analyze(["--model", "tiny", "--sweep", "--link-from", str(tmp_path / "none.json")]) == 2
    assert analyze(["--model", "tiny", "--cut", "1", "--link-from", str(report)]) == 2
    assert analyze(["--model", "tiny", "--sweep", "--link-from", str(out)]) == 2  # not a diagnose report
    err = capsys.readouterr().err
    assert "cannot read" in err and "needs --sweep" in err and "not a diagnose report" in err


def _codec(ms: dict) -> dict:
    """A codec table: each wire dtype's encode and decode ms (the same for both step kinds)."""
    return {n: {f"{k}_{w}_ms": v / 2 for k in ("training_step", "decode_step") for w in ("serialize", "deserialize")}
            for n, v in ms.items()}


def test_the_advice_follows_the_measured_table():
    """Issue 41: a bandwidth-bound step whose lossy dtypes cost more to cast than their bytes save
    (this 2-core machine's figures) is advised float32, not 'bfloat16 halves the bytes'; where
    the bytes dominate, the cheapest dtype is advised."""
    info = {"cuts": [1, 3], "model_config": {"n_embd": 768, "vocab_size": 50257}}
    step = step_traffic(info, 8, 128, "train")  # 4 tensors of 3 MiB (float32) over 2 calls
    slow_casts = _codec({"float32": 0.5, "bfloat16": 16.0, "float16": 15.0, "int8": 90.0})
    fast_link = estimate(step, 0.5, 2000.0, slow_casts, "training_step")  # 2 GB/s: 6.3 ms of bytes
    assert fast_link["bound"] == "bandwidth" and fast_link["fastest_wire_dtype"] == "float32"
    assert "keep --wire-dtype float32" in fast_link["advice"] and "halves" not in fast_link["advice"]
    slow_link = estimate(step, 0.5, 10.0, slow_casts, "training_step")  # 10 MB/s: 1.26 s of bytes
    per = slow_link["per_wire_dtype"]
    assert slow_link["fastest_wire_dtype"] == "int8" and per["int8"]["estimated_ms"] < per["bfloat16"]["estimated_ms"]
    assert "--wire-dtype int8 is the fastest here" in slow_link["advice"]
    free = _codec({"float32": 0.0, "bfloat16": 0.0, "float16": 0.0, "int8": 0.0})
    latency = estimate(step_traffic(info, 1, 1, "decode"), 20.0, 1000.0, free, "decode_step")
    assert latency["bound"] == "latency" and latency["advice"].startswith(LATENCY_ADVICE)
    # a decode step's few bytes: bfloat16 a hair faster is no reason to leave the exact float32
    assert latency["fastest_wire_dtype"] == "float32" and "no smaller dtype saves 5%" in latency["advice"]
