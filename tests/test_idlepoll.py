"""``IdlePoller``: pollers pinned to the cores, idle-scheduled, gone with their parent."""
import os
import signal
import subprocess
import sys
import time

import pytest

from splitlearn.procs.idlepoll import IdlePoller, available

pytestmark = pytest.mark.skipif(not available(), reason="needs os.sched_setaffinity (Linux)")


def _wait(pred, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _policy_and_cores(pid):
    try:
        return os.sched_getscheduler(pid), os.sched_getaffinity(pid)
    except (ProcessLookupError, PermissionError):
        return None, None


def test_one_idle_poller_per_core_pinned_to_it_and_stopped():
    cores = sorted(os.sched_getaffinity(0))
    with IdlePoller() as poller:
        assert poller.cores == cores and poller.alive == len(cores)
        for core, p in zip(cores, poller.procs):
            assert _wait(lambda: _policy_and_cores(p.pid) == (os.SCHED_IDLE, {core}))
        poller.pause()
        poller.resume()
        with poller.running():
            pass
        assert poller.alive == len(cores)
        procs = list(poller.procs)
    assert all(p.poll() is not None for p in procs)


def test_pollers_exit_when_their_parent_is_killed():
    """kill -9 of the process that started them leaves no spinning core behind."""
    code = ("import sys, time; from splitlearn.procs.idlepoll import IdlePoller; "
            "p = IdlePoller([min(__import__('os').sched_getaffinity(0))]).start(); "
            "print(p.procs[0].pid, flush=True); time.sleep(60)")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(parent.stdout.readline())
        assert _policy_and_cores(pid)[0] is not None
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        assert _wait(lambda: _gone(pid)), "the poller outlived its parent"
    finally:
        parent.kill()
        parent.stdout.close()


def _gone(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] == "Z"  # a zombie: exited, waiting for init to reap it
    except FileNotFoundError:
        return True


def test_a_server_and_a_client_with_poll_idle_serve_and_clean_up(tmp_path):
    import torch

    from splitlearn.client import SplitClient
    from splitlearn.procs.localserver import LocalServer

    with LocalServer(["--model", "tiny", "--cut", "1", "--cut", "3", "--poll-idle"]) as srv:
        with SplitClient(srv.url, "tiny", token=srv.token, poll_idle=True) as client:
            assert client.poller is not None and client.poller.alive >= 1
            ids = torch.randint(0, 100, (1, 4), generator=torch.Generator().manual_seed(0))
            assert client.generate(ids, max_new_tokens=3).shape == (1, 7)
            procs = list(client.poller.procs)
        assert all(p.poll() is not None for p in procs)
