"""The command: outputs (table, JSON, CSV, Markdown, PNG) and bad input -> exit 2."""
import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from splitlearn.analysis.cli import main

ROOT = Path(__file__).resolve().parent.parent
FAST = ["--model", "tiny", "--seq-len", "8", "--repeats", "2", "--warmup", "1",
        "--peak-tflops", "1", "--mem-bw-gbs", "10"]


def test_all_outputs(tmp_path, capsys):
    out = {k: tmp_path / f"r.{k}" for k in ("json", "csv", "md", "png")}
    rc = main(FAST + ["--cut", "1", "--cut", "3", "--sweep", "--link-mbps", "10", "--json",
                      str(out["json"]), "--csv", str(out["csv"]), "--markdown", str(out["md"]),
                      "--plot", str(out["png"])])
    assert rc == 0
    text = capsys.readouterr().out
    assert "bottom" in text and "lm_head" in text and "Recommended: cut" in text
    data = json.loads(out["json"].read_text())
    assert [s["name"] for s in data["segments"]] == ["bottom", "trunk", "top"]
    assert len(data["sweep"]["points"]) == 5
    rows = list(csv.DictReader(out["csv"].open()))
    assert {r["segment"] for r in rows} == {"bottom", "trunk", "top"}
    assert int(rows[0]["flops"]) == 2 * int(rows[0]["macs"])
    assert out["md"].read_text().startswith("# ") and "| bottom |" in out["md"].read_text()
    for png in (out["png"], tmp_path / "r_sweep.png"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _bad(args, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("analyze_model_performance: error:")
    return err[0]


def test_cut_out_of_range(capsys):
    assert "out of range" in _bad(FAST + ["--cut", "9"], capsys)


def test_sequence_too_long(capsys):
    assert "n_positions=64" in _bad(["--model", "tiny", "--cut", "2", "--seq-len", "65"], capsys)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_gpu(capsys):
    assert "CUDA" in _bad(FAST + ["--cut", "2", "--device", "cuda"], capsys)


def test_nothing_to_do(capsys):
    assert "--cut" in _bad(["--model", "tiny"], capsys)


def test_script_is_the_same_command(monkeypatch, capsys):
    """The script run as ``python analysis/analyze_model_performance.py`` runs it (runpy, as the
    interpreter does: its directory first on sys.path, ``__main__``), in this process: a fresh
    interpreter would spend ~6 CPU-seconds importing torch to say the same."""
    import runpy

    script = ROOT / "analysis" / "analyze_model_performance.py"
    monkeypatch.setattr(sys, "argv", [str(script), "--model", "tiny", "--cut", "99"])
    monkeypatch.setattr(sys, "path", [str(script.parent), *sys.path])
    with pytest.raises(SystemExit) as r:
        runpy.run_path(str(script), run_name="__main__")
    assert r.value.code == 2 and "out of range" in capsys.readouterr().err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_run(tmp_path):
    assert main(FAST + ["--cut", "2", "--device", "cuda", "--json", str(tmp_path / "r.json")]) == 0
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["device"]["type"] == "cuda"
    assert all(s["peak_memory_bytes"] > 0 for s in data["segments"])


def test_help_imports_no_torch_and_shows_defaults():
    """``analyze_model_performance --help`` answers without importing torch or transformers."""
    code = ("import sys\n"
            "from splitlearn.analysis.cli import parser\n"
            "text = parser().format_help()\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
            "print(text)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    first, _, text = proc.stdout.partition("\n")
    assert first == "[]"
    text = " ".join(text.split())
    assert "timed runs (default 20)" in text and "compute dtype (default: float32)" in text


def test_the_cli_offers_the_wire_dtypes():
    from splitlearn.analysis.cli import WIRE_DTYPES
    from splitlearn.api.wire import WIRE_DTYPE_NAMES

    assert tuple(WIRE_DTYPES) == tuple(WIRE_DTYPE_NAMES)
