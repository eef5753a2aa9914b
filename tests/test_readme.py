"""README.md runs as written (issue 41, item 3): its server command starts a real server, and its
Python snippet runs against it in a fresh interpreter, offline.

What the test fills in, and nothing else: the server's port (``8000`` in the README: a free port
here, so parallel test workers cannot collide) and its ``--checkpoint-dir`` (a temporary
directory). ``SPLITLEARN_TOKEN`` is exported as the README exports it. Then it checks what the
README promises: the script exits 0, prints a loss and a sample that starts with the prompt, warns
of nothing (no differing optimizers, no transformers warning), and the server applied exactly
the client's optimizer steps, the last one included although the script simply ends.
"""
from __future__ import annotations

import contextlib
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from splitlearn.api import protocol as P
from splitlearn.procs import localserver
from splitlearn.procs.localserver import LocalServer

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def blocks(path: Path) -> list[tuple[str, str]]:
    """The fenced code blocks of a markdown file, as (language, code)."""
    return re.findall(r"^```(\w*)\n(.*?)^```", path.read_text(encoding="utf-8"), flags=re.S | re.M)


def server_args(code: str) -> list[str]:
    """The arguments of the README's ``python -m splitlearn.server ... &`` line, without --port."""
    line = next(ln for ln in code.splitlines() if "python -m splitlearn.server" in ln)
    words = shlex.split(line.split("python -m splitlearn.server", 1)[1].rstrip("& "))
    i = words.index("--port")
    return words[:i] + words[i + 2:]


def test_readme_has_the_snippets_this_test_runs():
    langs = [lang for lang, _ in blocks(README)]
    assert sum("python -m splitlearn.server" in code for _, code in blocks(README)) == 1
    assert langs.count("python") == 1, "a new Python snippet in README.md: run it here too"


@pytest.mark.slow
def test_readme_quickstart_runs_as_written(tmp_path):
    (_, shell), = [(lang, code) for lang, code in blocks(README) if "python -m splitlearn.server" in code]
    (_, script), = [(lang, code) for lang, code in blocks(README) if lang == "python"]
    args = [str(tmp_path / "ckpt") if a == "ckpt/" else a for a in server_args(shell)]
    assert "--checkpoint-dir" in args and "--cut" in args
    steps = int(re.search(r"steps=(\d+)", script).group(1))
    with LocalServer(args, env={"OMP_NUM_THREADS": "1"}) as srv:
        (tmp_path / "quickstart.py").write_text(script.replace("http://127.0.0.1:8000", srv.url))
        # (huggingface_hub reads TRANSFORMERS_OFFLINE only as another name of HF_HUB_OFFLINE)
        env = {**os.environ, "SPLITLEARN_TOKEN": srv.token, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
        # `python -m quickstart` in its folder (the script as __main__, its folder first on sys.path, as
        # `python quickstart.py`), forked from the tests' preloaded interpreter as the servers are where
        # it can be (tests/forkserver.py: not ~9 CPU-seconds of importing torch again), else exec'd
        with open(tmp_path / "stdout", "w") as so, open(tmp_path / "stderr", "w") as se, contextlib.chdir(tmp_path):
            proc = localserver.launch([sys.executable, "-m", "quickstart"], env=env, stdout=so, stderr=se)
            try:
                code = proc.wait(240)
            finally:
                if proc.poll() is None:
                    proc.kill()
        run = subprocess.CompletedProcess(proc.args, code, (tmp_path / "stdout").read_text(),
                                          (tmp_path / "stderr").read_text())
        assert run.returncode == 0, run.stderr[-3000:]
        saved = requests.post(srv.url + P.CHECKPOINT, json={}, timeout=60,
                              headers={"Authorization": f"Bearer {srv.token}"})
        assert saved.status_code == 200, saved.text
    assert saved.json()["steps_applied"] == steps, "the server did not apply every optimizer step"
    out = run.stdout.splitlines()
    assert out[0].startswith("loss ") and float(out[0].split()[1]) > 0
    assert out[-1].startswith("Once upon a time") and len(out[-1]) > len("Once upon a time")
    assert "warn" not in run.stderr.lower() and "differ" not in run.stderr, run.stderr[-3000:]
