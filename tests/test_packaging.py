"""Packaging (issue 20, item 6): ``pip install splitlearn`` is the client and partitioning; the
server, the analyzer, training helpers, LoRA and privacy accounting are extras.

The client-side checks run in a subprocess where the extras' packages are *not installed* as far
as Python can tell: ``sys.modules[name] = None`` for each, so ``import flask`` raises
ModuleNotFoundError and ``importlib.util.find_spec("flask")`` answers None (what transformers'
``is_*_available`` checks see when a package is missing).
"""
import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXTRA_MODULES = ("flask", "waitress", "werkzeug", "fvcore", "matplotlib", "datasets", "accelerate", "peft",
                 "dp_accounting")
EXTRA_DISTS = {"flask", "waitress", "fvcore", "matplotlib", "datasets", "accelerate", "peft", "dp-accounting"}
BLOCK = f"import sys\nfor _n in {EXTRA_MODULES!r}:\n    sys.modules[_n] = None\n"


def run_blocked(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``python -c`` of ``code`` with the extras' packages missing."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", BLOCK + textwrap.dedent(code)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def setup_kwargs() -> dict:
    """What setup.py passes to setup(), without running setuptools."""
    captured = {}
    import setuptools

    real = setuptools.setup
    setuptools.setup = lambda **kw: captured.update(kw)
    try:
        cwd = os.getcwd()
        os.chdir(ROOT)
        try:
            exec(compile((ROOT / "setup.py").read_text(), "setup.py", "exec"), {"__name__": "__main__"})
        finally:
            os.chdir(cwd)
    finally:
        setuptools.setup = real
    return captured


def names(reqs) -> set:
    import re

    return {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower() for r in reqs}


def test_setup_base_has_no_extra_and_test_has_them_all():
    kw = setup_kwargs()
    base, extras = names(kw["install_requires"]), kw["extras_require"]
    assert {"torch", "transformers", "requests", "safetensors"} <= base
    assert not base & EXTRA_DISTS, base & EXTRA_DISTS
    assert names(extras["server"]) >= {"flask", "waitress"}
    assert names(extras["analysis"]) >= {"fvcore", "matplotlib"}
    assert names(extras["train"]) >= {"accelerate", "datasets"}
    assert names(extras["test"]) >= EXTRA_DISTS | {"pytest"}
    assert {p for p in kw["packages"] if p != "splitlearn._models"} >= {
        p.parent.relative_to(ROOT).as_posix().replace("/", ".") for p in (ROOT / "splitlearn").rglob("__init__.py")}
    makefile = (ROOT / "Makefile").read_text()
    assert "'.[test]'" in makefile  # make installs every extra
    if " -n " in makefile:  # make test runs on pytest-xdist workers
        assert "pytest-xdist" in names(extras["test"])


CLIENT_SCRIPT = """
import io, json, runpy, contextlib
import torch

def check(name, fn):
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            fn()
        result = "ok"
    except SystemExit as e:
        result = f"exit {e.code}"
    except BaseException as e:
        result = f"{type(e).__name__}: {e}"
    print(json.dumps({"check": name, "result": result, "output": out.getvalue()[-4000:]}), flush=True)

def imports():
    import splitlearn, splitlearn.hf
    from splitlearn import (SplitClient, SplitGPT2LMHeadModel, SplitGPT2ForSequenceClassification, RemoteCache,
                            OffloadGPT2LMHeadModel, split_model, partition, export_segments, load_model)
    import splitlearn.client.cli, splitlearn.analysis.diagnose, splitlearn.privacy, splitlearn.procs.localserver
    from splitlearn.privacy import GaussianNoise, NoPeek
    import transformers
    assert not transformers.utils.is_accelerate_available()

def run_module(name, *args):
    sys.argv = ["python -m " + name, *args]
    runpy.run_module(name, run_name="__main__", alter_sys=True)

def extras():
    from splitlearn.defense.accounting import gaussian_epsilon
    from splitlearn.analysis.plots import _pyplot
    for fn in (lambda: gaussian_epsilon(1.0, 1, 1e-5), _pyplot):
        try:
            fn()
        except ImportError as e:
            print(e)

def split_model_end_to_end():
    from splitlearn import SplitGPT2LMHeadModel
    model = SplitGPT2LMHeadModel.from_pretrained("tiny", server=URL, token=TOKEN).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    assert model.remote.applies == 1
    out = model.eval().generate(input_ids=ids, max_new_tokens=3, do_sample=False, pad_token_id=256)
    assert out.shape == (2, 11)
    model.remote.close()

check("imports", imports)
check("client --help", lambda: run_module("splitlearn.client", "--help"))
check("server", lambda: run_module("splitlearn.server", "--model", "tiny", "--cut", "2"))
check("extras", extras)
check("end to end", split_model_end_to_end)
"""


@pytest.fixture(scope="module")
def client_checks():
    """One process without the extras runs every client-side check (imports of torch and
    transformers cost seconds each time), against a real server from this environment."""
    import json

    from serverproc import TOKEN, ServerProcess

    with ServerProcess((1, 3)) as srv:
        r = run_blocked(f"URL, TOKEN = {srv.url!r}, {TOKEN!r}\n" + CLIENT_SCRIPT, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    return {c["check"]: c for c in map(json.loads, r.stdout.splitlines())}


def test_the_client_imports_without_the_extras(client_checks):
    c = client_checks["imports"]
    assert c["result"] == "ok", c


def test_client_cli_help_without_the_extras(client_checks):
    c = client_checks["client --help"]
    assert c["result"] == "exit 0", c
    assert "usage" in c["output"].lower() and "generate" in c["output"]


def test_server_without_flask_names_the_extra(client_checks):
    c = client_checks["server"]
    assert c["result"].startswith("ImportError") and "pip install 'splitlearn[server]'" in c["result"], c


def test_extras_name_themselves_when_missing(client_checks):
    c = client_checks["extras"]
    assert c["result"] == "ok", c
    assert "pip install 'splitlearn[privacy]'" in c["output"] and "pip install 'splitlearn[analysis]'" in c["output"]


@pytest.mark.slow
def test_the_split_model_trains_and_generates_without_the_extras(client_checks):
    """A real server (this environment, with flask), and a client process without any extra:
    from_pretrained, a training step with autograd over the wire, and generate()."""
    c = client_checks["end to end"]
    assert c["result"] == "ok", c


def test_no_client_module_imports_the_server_at_import_time():
    """A static guard: the client-side packages never import splitlearn.server or the analyzer at
    module level (a lazy import inside a function is fine)."""
    client_side = [*(ROOT / "splitlearn" / "client").glob("*.py"), *(ROOT / "splitlearn" / "hf").glob("*.py"),
                   *(ROOT / "splitlearn").glob("*.py")]
    for path in client_side:
        if path.name in ("demo.py",):  # runs a server in-process by design
            continue
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, ast.ImportFrom):
                mod = ("." * node.level) + (node.module or "")
                assert "server" not in mod.split(".") and "analysis" not in mod.split("."), (path, mod)
            elif isinstance(node, ast.Import):
                for a in node.names:
                    assert a.name.split(".")[0] not in EXTRA_MODULES, (path, a.name)
