"""The benchmark harness end to end on the tiny model: every workload produces real rows.

Timing values are not asserted (CI machines are noisy); what is asserted is what the rows
must hold whatever the speed: split generation gives the unsplit model's tokens, float32
codec round trips are exact and carry raw bytes plus a small header, the report files exist.
"""
import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import report
from benchmarks.run import parse_args

import forkserver
from forkserver import FORK_ENV

ROOT = Path(__file__).resolve().parent.parent


# benchmarks/run.py ARGS forked from the tests' fork server (``python -m bench_boot ROOT TESTS ARGS``):
# its servers and client processes are forked by that same fork server, not by a second one that
# imports torch again, and it does not import torch itself (tests/forkserver.py). Run as a
# fresh interpreter (SPLITLEARN_FORK_SERVERS=0) it is `make bench`'s plain process.
BENCH_BOOT = """import os, runpy, sys
from multiprocessing import forkserver as mp_forkserver
root, tests = sys.argv.pop(1), sys.argv.pop(1)
os.chdir(root)
fs = mp_forkserver._forkserver  # set where this process was forked by a fork server: that one's
if fs._forkserver_address is not None and fs._forkserver_alive_fd is not None:
    fs.ensure_running = lambda: None  # it is running (the tests' process holds it): fork from it
    sys.path.insert(0, tests)
    import forkserver
    forkserver.install()
    del sys.path[0]
script = os.path.join(root, "benchmarks", "run.py")
sys.argv = [script, *sys.argv[1:]]
sys.path.insert(0, os.path.dirname(script))
runpy.run_path(script, run_name="__main__")
"""


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory):
    # A process of its own, as `make bench` runs it; its servers forked as the tests' own are
    # (tests/forkserver.py). Without the torch.distributed.rpc baseline: a child process per
    # measurement (~56 s of this run's ~100 s on 2 cores, spinning both cores while it runs);
    # tests/test_benchmarks_baselines.py checks that baseline itself. Its client processes (the
    # concurrency clients, the pinned client) fork from that fork server too (--mp-context).
    out, here = tmp_path_factory.mktemp("bench"), tmp_path_factory.mktemp("bench_boot")
    (here / "bench_boot.py").write_text(BENCH_BOOT)
    forked = ["--mp-context", "forkserver"] if os.environ.get(FORK_ENV, "1") == "1" else []
    code = forkserver.run_module(here, "bench_boot", [str(ROOT), str(Path(__file__).parent), "--quick",
                                                      "--wire-dtypes", "float32,int8", "--baselines", "naive",
                                                      *forked, "--out", str(out)])
    printed = (here / "stdout").read_text()
    assert code == 0, printed[-3000:] + (here / "stderr").read_text()[-3000:]
    assert "wrote " in printed
    return out


@pytest.fixture(scope="module")
def result(out_dir):
    return json.loads((out_dir / "results.json").read_text())


def _rows(result, workload):
    rows = [r for r in result["rows"] if r["workload"] == workload]
    assert rows, f"no {workload} rows"
    for r in rows:
        assert math.isfinite(r["value"]) and r["value"] >= 0, r
    return rows


def test_generation_compares_every_system_and_split_tokens_equal_unsplit(result):
    rows = _rows(result, "generation")
    systems = {r["system"] for r in rows}
    assert {"unsplit", "splitlearn u float32", "splitlearn 2-way float32", "splitlearn u int8",
            "naive JSON"} <= systems and "torch.distributed.rpc" not in systems  # --baselines naive
    for r in rows:
        if r["system"] in ("splitlearn u float32", "splitlearn 2-way float32", "naive JSON"):
            assert r["same_tokens"] is True, r["system"]
        assert r["ratio"] > 0
    unsplit = [r for r in rows if r["system"] == "unsplit"]
    assert [r["ratio"] for r in unsplit] == [1.0, 1.0]
    split = next(r for r in rows if r["system"] == "splitlearn u float32" and r["batch"] == 1)
    assert 0 < split["overhead_ms_per_call"] and split["bytes_per_call"] > 0


def test_training_rows_have_ratios_against_unsplit(result):
    rows = _rows(result, "training")
    assert rows[0]["system"] == "unsplit" and rows[0]["ratio"] == 1.0
    assert {"splitlearn u float32", "splitlearn 2-way int8", "naive JSON"} <= {r["system"] for r in rows}
    u32 = next(r for r in rows if r["system"] == "splitlearn u float32")
    u8 = next(r for r in rows if r["system"] == "splitlearn u int8")
    assert u8["bytes_per_step"] < u32["bytes_per_step"] / 2  # int8 halves bytes (and then some)


def test_codec_is_exact_for_float32_and_adds_only_a_header(result):
    rows = {r["system"]: r for r in _rows(result, "codec")}
    f32 = rows["splitlearn float32"]
    assert f32["max_abs_error"] == 0.0
    assert f32["payload_bytes"] == f32["raw_float32_bytes"] and f32["header_bytes"] <= 1024
    assert 0 < rows["splitlearn int8"]["max_abs_error"] < 0.05
    assert rows["JSON lists (naive)"]["bytes"] > 2 * f32["bytes"]


def test_overhead_drift_and_concurrency_rows(result):
    systems = {r["system"] for r in _rows(result, "overhead")}
    assert {"splitlearn health", "splitlearn decode step", "naive JSON ping"} == systems
    drift = _rows(result, "int8_drift")
    assert [r["wire_dtype"] for r in drift] == ["int8"]
    assert drift[0]["value"] < 0.5  # same data, same init: int8 only nudges the loss
    conc = _rows(result, "concurrency")
    assert {(r["system"], r["clients"]) for r in conc} == {
        (f"splitlearn {s} {b}", n) for s in ("2-way", "u") for b in ("batched", "unbatched") for n in (1, 2)}
    assert all(r["ratio"] == 1.0 for r in conc if r["clients"] == 1)


def test_report_files(result, out_dir):
    assert result["rows"] and result["config"]["model"] == "tiny" and result["command"]
    md = (out_dir / "results.md").read_text()
    assert "## Targets" in md and "## Generation (greedy)" in md and "| splitlearn u float32 |" in md
    assert (out_dir / "summary.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report.markdown(result) == md
    names = [t["target"] for t in report.targets(result)]
    assert any("codec" in n for n in names) and any("naive JSON" in n for n in names)


def test_cli_refuses_bad_arguments(capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["--workloads", "nonsense"])
    assert e.value.code == 2 and "unknown workloads" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--wire-dtypes", "float64"])
    with pytest.raises(SystemExit):
        parse_args(["--baselines", "naive,grpc"])
    assert "unknown baselines ['grpc']" in capsys.readouterr().err
    cfg, out = parse_args(["--quick", "--device", "cpu", "--workloads", "codec"])
    assert cfg.workloads == ("codec",) and out.name == "cpu" and cfg.baselines == ("naive", "rpc")
    assert cfg.mp_context == "spawn" and parse_args(["--mp-context", "forkserver"])[0].mp_context == "forkserver"
    with pytest.raises(SystemExit):
        parse_args(["--mp-context", "fork"])
    assert parse_args(["--baselines", ""])[0].baselines == ()


def test_server_batching_replays_sessions_without_client_compute(result):
    rows = _rows(result, "server_batching")
    assert {(r["system"], r["clients"]) for r in rows} == {
        (f"splitlearn {s} {b}", n) for s in ("2-way", "u") for b in ("batched", "unbatched") for n in (1, 2)}
    assert all(r["ratio"] == 1.0 for r in rows if r["clients"] == 1)
    assert all(r["unit"] == "server decode tokens/s" and r["ms_per_round"] > 0 for r in rows)
    assert any("replayed sessions" in t["target"] for t in report.targets(result))


def test_pinned_two_device_mode(result):
    if not {0, 1} <= set(os.sched_getaffinity(0)):
        pytest.skip("the pinned mode needs cores 0 and 1")
    rows = _rows(result, "pinned")
    gen = [r for r in rows if r["unit"] == "tokens/s"]
    from splitlearn.procs.idlepoll import available
    from splitlearn.model.packed import usable

    systems = ["unsplit (1 core)", "splitlearn u float32"]
    systems += ["unsplit (1 core, packed)"] if usable(torch.nn.Linear(1, 1)) else []
    systems += ["splitlearn u float32 poll-idle"] if available() else []
    assert {(r["system"], r["batch"]) for r in gen} == {(s, b) for s in systems for b in (1, 2)} | {
        ("splitlearn u float32 serial", 2)}
    assert all(r["same_tokens"] is True and r["cores"] == {"client": 0, "server": 1} for r in gen)
    assert [r["pipelined"] for r in gen if r["system"] == "splitlearn u float32"] == [False, True]
    steps = [r for r in rows if r["unit"] == "ms/call"]
    assert {r["system"] for r in steps} == {"splitlearn decode step"} | (
        {"splitlearn decode step poll-idle"} if available() else set())
    assert all(0 < r["server_ms"] < r["round_trip_ms"] for r in steps)
    names = [t["target"] for t in report.targets(result)]
    assert sum("pinned two devices" in n for n in names) == 3 * (1 + available())


@pytest.mark.slow
def test_load_quick_mixes_generation_and_training_with_zero_errors(tmp_path):
    """benchmarks/load.py --quick against one real server (Locust headless, two owners of two
    tenants): every operation of a generation and of a training step ran without a failure,
    its percentiles are ordered, and the server's RSS was sampled before and during the load."""
    from benchmarks import load

    out = tmp_path / "load.json"
    assert load.main(["--quick", "--setups", "one", "--seconds", "3", "--json", str(out)]) == 0
    rep = json.loads(out.read_text())
    (one,) = rep["setups"]
    assert one["name"] == "one server" and rep["config"]["owners"] == 2
    ops = {o["op"]: o for o in one["ops"]}
    assert set(load._OPS) <= set(ops)
    assert all(o["failures"] == 0 and 0 <= o["p50_ms"] <= o["p99_ms"] for o in ops.values())
    assert ops["decode"]["requests"] >= 2 * ops["prefill"]["requests"] > 0  # 8 decode steps a session
    assert ops["train forward"]["requests"] >= ops["train backward"]["requests"] > 0
    assert one["errors_total"] == 0 and one["errors"] == [] and one["exceptions"] == []
    rss = one["rss_mib"]["server"]
    assert 0 < rss["before"] <= rss["peak"] and rss["warm"] <= rss["peak"] and rss["end"] <= rss["peak"]
    assert rss["samples"] == len(rss["trace"]) >= 3 and rep["command"].startswith("python benchmarks/load.py")
    assert "| decode |" in load.markdown(rep) and "| errors | 0 |" in load.markdown(rep)
