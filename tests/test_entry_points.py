"""Commands run as ``python -m`` without runpy's warnings and where their layer is (issue 54):
``splitlearn.netem.relay`` (its package imported it eagerly: runpy's RuntimeWarning), the fed
server's command in its wing (``splitlearn.server.http.fedapp``; the old module names it)."""
import subprocess
import sys

import pytest


def run(*args):
    return subprocess.run([sys.executable, "-X", "importtime", "-W", "error::RuntimeWarning", "-m", *args],
                          capture_output=True, text=True, timeout=120,
                          env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "COLUMNS": "100"})


def heavy(r) -> set[str]:
    """torch and transformers, where ``-X importtime`` saw them imported (~8 s on 2 cores)."""
    names = {ln.rsplit("|", 1)[1].strip().split(".")[0] for ln in r.stderr.splitlines() if ln.startswith("import time:")}
    return names & {"torch", "transformers"}


@pytest.mark.parametrize("module", ["splitlearn.netem.relay", "splitlearn.server.http.fedapp"])
def test_a_command_runs_without_runpys_warning(module, monkeypatch):
    """... and its ``--help`` imports no torch (the fed server's options: .fedcli, .fedoptions)."""
    r = run(module, "--help")
    assert r.returncode == 0 and "RuntimeWarning" not in r.stderr, r.stderr
    assert f"python -m {module}" in r.stdout
    assert not heavy(r), heavy(r)
    if module.endswith("fedapp"):
        from splitlearn.server.http.fedcli import parser

        monkeypatch.setenv("COLUMNS", "100")  # argparse's width, as the command's
        assert r.stdout == parser().format_help() and "--fed-secret-file" in r.stdout


def test_the_fed_servers_old_module_names_its_command():
    r = run("splitlearn.server.federation.fedserver", "--help")
    assert r.returncode == 1 and "python -m splitlearn.server.http.fedapp" in r.stderr, r.stderr
    assert not heavy(r), heavy(r)


def test_netem_names_load_on_first_use():
    import splitlearn.netem as netem
    from splitlearn.netem.relay import DelayRelay

    assert netem.DelayRelay is DelayRelay and "DelayRelay" in dir(netem)
