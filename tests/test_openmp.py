"""splitlearn/procs/openmp.py: idle OpenMP threads of splitlearn's processes spin briefly, so a
client and a server on the same cores do not spin on the cores the other is computing on."""
import os
import subprocess
import sys

from splitlearn.procs import openmp

READ = "import os; print(os.environ.get('GOMP_SPINCOUNT'), os.environ.get('OMP_WAIT_POLICY'))"


def _python(code: str, **env) -> list[str]:
    """What ``python -c code`` prints, split, in this environment without a spin of its own plus ``env``."""
    clean = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    return subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True,
                          check=True, timeout=120).stdout.split()


def test_spin_env_sets_the_count_unless_the_user_chose_a_spin():
    assert openmp.spin_env({}) == {"GOMP_SPINCOUNT": openmp.SPINCOUNT}
    assert openmp.spin_env({"GOMP_SPINCOUNT": "300000"}) == {"GOMP_SPINCOUNT": "300000"}
    assert openmp.spin_env({"OMP_WAIT_POLICY": "ACTIVE"}) == {"OMP_WAIT_POLICY": "ACTIVE"}  # libgomp decides from it


def test_importing_splitlearn_before_torch_sets_the_spin_and_after_torch_does_not():
    # libgomp reads its environment when torch loads it: set after that, it would only lie
    assert _python("import splitlearn; " + READ) == [openmp.SPINCOUNT, "None"]
    assert _python("import torch, splitlearn; " + READ) == ["None", "None"]
    assert _python("import splitlearn; " + READ, GOMP_SPINCOUNT="5") == ["5", "None"]
    assert _python("import splitlearn; " + READ, OMP_WAIT_POLICY="PASSIVE") == ["None", "PASSIVE"]
    # `python -m splitlearn.server` imports the package, then torch: the first case above


def test_default_spin_does_nothing_once_torch_is_loaded(monkeypatch):
    import torch  # noqa: F401  (loaded in this process)

    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert openmp.default_spin() is False and "GOMP_SPINCOUNT" not in os.environ
