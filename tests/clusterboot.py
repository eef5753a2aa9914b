"""``python -m clusterboot ARGS``: ``python -m splitlearn.cluster ARGS`` for the cluster tests, its
replicas forked from the tests' fork server instead of exec'd (the tests' speed only).

The supervisor (splitlearn/cluster/supervisor.py) starts each replica, and again each one a test
kills, as ``subprocess.Popen([sys.executable, "-m", "splitlearn.server", ...])``: a fresh
interpreter, ~9 CPU-seconds of imports before it serves (3 first starts in test_cluster.py, 2 in
test_cluster_splitfed.py). :func:`command` runs the supervisor itself forked from the tests' fork
server (tests/forkserver.py, as benchmarks' bench_boot does), and here its module's
``subprocess.Popen`` forks a ``python -m`` child from that same fork server
(:func:`forkserver.launch`'s rule: where it can, else the real Popen; HAProxy is always real).
Only a replica's first start is forked; a restart (of a replica a test killed) is the real
``Popen``: see :class:`_Subprocess`. Everything else is the supervisor's own code: its spawn,
watch, restart and stop, the replicas' pids in replicas.json, SIGKILL and SIGTERM of real
processes. What a forked replica does not get: the supervisor's ``start_new_session`` and
``preexec_fn`` (PDEATHSIG, core pinning: off in these tests); the supervisor stops its replicas
itself at every exit the tests cause.

Without a fork server (``SPLITLEARN_FORK_SERVERS=0``) :func:`command` is the plain
``python -m splitlearn.cluster``.
"""
from __future__ import annotations

import contextlib
import os
import runpy
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def command(*args: str) -> list[str]:
    """The cluster's command line for a ChildServer started inside :func:`here`."""
    from forkserver import FORK_ENV

    module = "clusterboot" if os.environ.get(FORK_ENV, "1") == "1" else "splitlearn.cluster"
    return [sys.executable, "-m", module, *args]


@contextlib.contextmanager
def here():
    """The working directory where ``python -m clusterboot`` finds this module (a forked
    child's sys.path starts with its working directory, as ``python -m``'s)."""
    with contextlib.chdir(TESTS):
        yield


class _Subprocess:
    """``subprocess`` for the supervisor's module, but ``Popen`` forks a replica's first start.

    A replica started again (the supervisor's restart of a killed one: the same command) is the
    supervisor's real ``Popen``, a fresh interpreter, as slow to come back as a real one: a
    replica back within a second takes its owners back from the survivor before the tests'
    reads of their state (which is on the survivor until it is durable), a race the tests do
    not set out to measure."""

    def __init__(self):
        self.started: set = set()

    def __getattr__(self, name):
        return getattr(subprocess, name)

    def Popen(self, cmd, *, stdout=None, stderr=None, env=None, **kw):  # noqa: N802 - subprocess's name
        import forkserver

        first, key = tuple(cmd) not in self.started, tuple(cmd)
        self.started.add(key)
        if first and forkserver.can_fork(cmd, env, stdout):
            err = stdout if stderr == subprocess.STDOUT else stderr
            return forkserver.ForkedProcess(cmd, dict(os.environ if env is None else env), stdout=stdout, stderr=err)
        return subprocess.Popen(cmd, stdout=stdout, stderr=stderr, env=env, **kw)


def main() -> None:
    from multiprocessing import forkserver as mp_forkserver

    fs = mp_forkserver._forkserver  # set where this process was forked by a fork server: that one's
    if fs._forkserver_address is not None and fs._forkserver_alive_fd is not None:
        fs.ensure_running = lambda: None  # it is running (the tests' process holds it): fork from it
        import forkserver

        from splitlearn.cluster import supervisor

        forkserver.install()
        supervisor.subprocess = _Subprocess()
    runpy.run_module("splitlearn.cluster", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
