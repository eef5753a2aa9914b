"""``IdlePoller``: keep a process's cores from sleeping between messages (``--poll-idle``).

One child process per core, pinned to it, ``SCHED_IDLE``, spinning; each exits with its parent
(even after SIGKILL: it checks every ~10 ms). Linux only. Why, what it buys and what it costs:
docs/INTERNALS.md, 'What a decode step pays for being a relay'."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from contextlib import contextmanager
from typing import Iterable, Iterator, Optional

from ..errors import ConfigError

_POLLER = r"""
import os, sys
core, parent = int(sys.argv[1]), int(sys.argv[2])
os.sched_setaffinity(0, {core})
try:
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
except (AttributeError, OSError):
    os.nice(19)
n = 0
while True:
    n += 1
    if n % 200000 == 0 and os.getppid() != parent:
        break
"""


def available() -> bool:
    return hasattr(os, "sched_setaffinity") and hasattr(os, "sched_getaffinity")


class IdlePoller:
    """Pollers on ``cores`` (default: every core this process may run on). ``start()``/``stop()``
    (or ``with``); ``pause()``/``resume()`` (or ``with poller.running():``) via SIGSTOP/SIGCONT."""

    def __init__(self, cores: Optional[Iterable[int]] = None):
        if not available():
            raise ConfigError("--poll-idle needs Linux (os.sched_setaffinity)")
        self.cores = sorted(os.sched_getaffinity(0) if cores is None else set(cores))
        if not self.cores:
            raise ConfigError("IdlePoller needs at least one core")
        self.procs: list[subprocess.Popen] = []

    def start(self) -> "IdlePoller":
        if not self.procs:
            self.procs = [subprocess.Popen([sys.executable, "-S", "-c", _POLLER, str(c), str(os.getpid())],
                                           stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
                          for c in self.cores]
        return self

    def _signal(self, sig: int) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(sig)

    def pause(self) -> None:
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal(signal.SIGCONT)

    @contextmanager
    def running(self) -> Iterator["IdlePoller"]:
        """Resumed within the block, paused after it."""
        self.resume()
        try:
            yield self
        finally:
            self.pause()

    def stop(self) -> None:
        self.resume()  # a stopped process would not see SIGTERM until continued
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs = []

    @property
    def alive(self) -> int:
        """How many pollers are alive (stopped or not)."""
        return sum(p.poll() is None for p in self.procs)

    def __enter__(self) -> "IdlePoller":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
