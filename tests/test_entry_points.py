"""Commands run as ``python -m`` without runpy's warnings and where their layer is (issue 54):
``splitlearn.netem.relay`` (its package imported it eagerly: runpy's RuntimeWarning), the fed
server's command in its wing (``splitlearn.server.http.fedapp``; the old module names it)."""
import subprocess
import sys

import pytest


def run(*args):
    return subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-m", *args], capture_output=True,
                          text=True, timeout=120, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})


@pytest.mark.parametrize("module", ["splitlearn.netem.relay", "splitlearn.server.http.fedapp"])
def test_a_command_runs_without_runpys_warning(module):
    r = run(module, "--help")
    assert r.returncode == 0 and "RuntimeWarning" not in r.stderr, r.stderr
    assert f"python -m {module}" in r.stdout


def test_the_fed_servers_old_module_names_its_command():
    r = run("splitlearn.server.federation.fedserver", "--help")
    assert r.returncode == 1 and "python -m splitlearn.server.http.fedapp" in r.stderr, r.stderr


def test_netem_names_load_on_first_use():
    import splitlearn.netem as netem
    from splitlearn.netem.relay import DelayRelay

    assert netem.DelayRelay is DelayRelay and "DelayRelay" in dir(netem)
