"""``IdlePoller``: keep a process's cores from sleeping between messages (``--poll-idle``).

A split decode step is a relay: the client computes while the server's cores wait for the
next request, then the server computes while the client's cores wait for the answer. A
core with nothing to run goes idle, and on a virtual machine an idle vCPU halts: the
hypervisor takes the core back, and giving it back when a packet arrives costs a fraction of
a millisecond, on every message. Measured on this project's 2-core VM (AMD EPYC, KVM,
``cpuidle-haltpoll``; ``POST /v1/echo`` of a decode step's body, client and server on cores
of their own)::

    echo round trip                                 median
    back to back                                    0.27 ms
    after the server sat idle 13 ms                 1.08 ms
      ... with a poller on the server's core        0.62 ms
      ... with pollers on both cores                0.54 ms

The kernel's own remedy is ``idle=poll`` (or a longer ``haltpoll`` window): root, and the
whole machine. This module does it for the cores of one process: one child process per core,
pinned to it, scheduled ``SCHED_IDLE`` (it runs only when nothing else wants the core, and is
preempted at once when something does), spinning. It costs energy and the core's idle
time, never the process's own time; use it where the cores are the split's own (two
devices, one side each), not on a laptop on battery or cores shared with other work.

The pollers exit with their parent, even one killed with SIGKILL: each checks its parent
every ~10 ms. Linux only (``os.sched_setaffinity``).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from contextlib import contextmanager
from typing import Iterable, Iterator, Optional

from .errors import ConfigError

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
    """Pollers on ``cores`` (default: every core this process may run on).

    ``start()`` / ``stop()`` (or a ``with`` block); ``pause()`` / ``resume()`` (or ``with
    poller.running():``) stop and continue them without a new process (SIGSTOP / SIGCONT),
    for a benchmark's baseline.
    """

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
