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


def test_long_spin_reads_the_spin_libgomp_read():
    import torch  # noqa: F401  (libgomp is loaded with it on Linux wheels)

    if not openmp._libgomp_loaded():
        import pytest
        pytest.skip("torch runs no libgomp here")
    assert openmp.long_spin({})  # libgomp's default: 300,000 iterations
    assert not openmp.long_spin({"GOMP_SPINCOUNT": openmp.SPINCOUNT})
    assert openmp.long_spin({"GOMP_SPINCOUNT": "300k"}) and openmp.long_spin({"GOMP_SPINCOUNT": "INFINITE"})
    assert not openmp.long_spin({"GOMP_SPINCOUNT": "0"}) and openmp.long_spin({"GOMP_SPINCOUNT": "junk"})
    assert not openmp.long_spin({"OMP_WAIT_POLICY": "passive"}) and openmp.long_spin({"OMP_WAIT_POLICY": "ACTIVE"})
    assert not openmp.long_spin({"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "1000"})  # the count decides


SPIN_PROBE = """
import statistics, sys, time, torch  # torch first: libgomp keeps its default (long) spin
from splitlearn.procs import openmp
torch.set_num_threads(2)
x = torch.randn(256, 256)
def burnt():  # CPU time this process spends in the 20 ms after a parallel operator (its workers' spin)
    out = []
    for _ in range(15):
        x @ x
        t0 = time.process_time(); time.sleep(0.02); out.append(time.process_time() - t0)
    return statistics.median(out) * 1e3
before = burnt()
with openmp.short_spin() as held:
    inside, threads = burnt(), torch.get_num_threads()
after = burnt()
print(held, threads, before, inside, after)
"""


def test_short_spin_shortens_libgomps_spin_at_run_time_whatever_the_import_order():
    """A script that imported torch first: the workers' spin after an operator burns milliseconds
    of CPU; inside short_spin (libgomp's throttle, held by a helper thread's idle team) a small
    fraction of it, with the same threads; after it, the long spin is back."""
    import torch  # noqa: F401

    if not openmp._libgomp_loaded():
        import pytest
        pytest.skip("torch runs no libgomp here")
    held, threads, before, inside, after = _python(SPIN_PROBE)
    assert held == "True" and threads == "2"
    before, inside, after = float(before), float(inside), float(after)
    assert inside < before / 5 and inside < after / 5, (before, inside, after)


def test_a_split_model_shortens_the_spin_while_generating_where_its_workers_would_spin_on_the_servers_cores(
        monkeypatch, varied_model):
    """An inproc server shares this process's cores: with a long spin, generate's steps run with
    libgomp's throttle held (the threads unchanged), the tokens unchanged, the throttle released after."""
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    from conftest import VARIED
    from serverproc import TOKEN, InprocServerProcess
    from splitlearn.hf import SplitGPT2LMHeadModel, generation

    if not openmp._libgomp_loaded():
        import pytest
        pytest.skip("torch runs no libgomp here")
    seen = []

    class Throttle(LogitsProcessor):
        def __call__(self, input_ids, scores):
            seen.append((openmp._THROTTLE._holders, torch.get_num_threads()))
            return scores

    ids = torch.randint(0, 250, (1, 6), generator=torch.Generator().manual_seed(0))
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False, pad_token_id=256,
              logits_processor=LogitsProcessorList([Throttle()]))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with InprocServerProcess((1, 3), model=VARIED) as srv:
            model = SplitGPT2LMHeadModel.from_pretrained(VARIED, server=srv.url, token=TOKEN)
            expected = varied_model.generate(ids, **kw)
            for spins, quiet, held in ((True, True, 1), (True, False, 0), (False, True, 0)):
                monkeypatch.setattr(generation, "long_spin", lambda spins=spins: spins)
                model.quiet_openmp = quiet
                seen.clear()
                assert torch.equal(model.generate(ids, **kw), expected)
                assert set(seen) == {(held, 2)}
                assert openmp._THROTTLE._holders == 0 and torch.get_num_threads() == 2
            model.remote.close()
    finally:
        torch.set_num_threads(threads)


def test_quiet_workers_falls_back_to_one_thread_where_the_throttle_is_out_of_reach(monkeypatch):
    import torch

    monkeypatch.setattr(openmp, "_libgomp_loaded", lambda: False)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with openmp.quiet_workers():
            assert torch.get_num_threads() == 1 and openmp._THROTTLE._holders == 0
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)


def test_quiet_workers_does_nothing_on_one_torch_thread():
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with openmp.quiet_workers():
            assert torch.get_num_threads() == 1 and openmp._THROTTLE._holders == 0
    finally:
        torch.set_num_threads(threads)
