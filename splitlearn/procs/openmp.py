"""How long an idle OpenMP thread of this process spins before it sleeps (``GOMP_SPINCOUNT``).

PyTorch's CPU wheels run their intra-op threads on GNU OpenMP (libgomp). After each parallel
operator libgomp's workers spin, waiting for the next one, for ``GOMP_SPINCOUNT`` iterations
(300,000 by default: milliseconds) before they sleep. A split decode step hands the cores from
one process to the other several times a token: the client's bottom, the server's trunk, the
client's top. Where client and server share cores, the process that has just handed over keeps
spinning on the cores the other now needs, and every operator of the other waits at its barrier
for a thread that is not running. Measured (docs/PERFORMANCE.md, 'Client and server on the same
cores'): GPT-2 small U (2, 10), greedy batch 1, both processes on the same two cores, two torch
threads each, transformers' ``generate()`` over HTTP: 0.80x the unsplit model with libgomp's
default, 1.04x with :data:`SPINCOUNT` in both processes.

:data:`SPINCOUNT` iterations are a fraction of a millisecond: longer than the gaps between one
step's operators (so a step's own hand-offs stay spins), shorter than a network round trip (so a
process waiting for the other's answer sleeps). libgomp reads the variable once, when torch
loads it, so :func:`default_spin` only acts before ``import torch``. ``import splitlearn`` calls
it, so every process splitlearn starts (``python -m splitlearn.server``, ``python -m
splitlearn.client``, the demo) and every script that imports splitlearn before torch spins
briefly; a script that imports torch first keeps libgomp's default unless it sets the variable
(docs/PERFORMANCE.md). A value the user set (``GOMP_SPINCOUNT``, or ``OMP_WAIT_POLICY``, which libgomp
lets decide the spin when no count is given) is kept.

A process whose libgomp spins long (:func:`long_spin`: torch imported first) cannot change the
count libgomp read, but libgomp has a second, short count of its own, used while the process
manages more OpenMP threads than it has CPUs: :func:`short_spin` holds that state for a block (a
helper thread keeps one idle team; its exit gives the long spin back), so the workers keep their
number and sleep after 1,000 iterations. The split models' ``generate`` holds it where the server
shares the cores (:func:`quiet_workers`; docs/PERFORMANCE.md, 'Import order'). Where it is out of
reach (no libgomp's entry point), :func:`one_thread` runs the block on one torch thread, so no
worker is woken and none spins afterwards."""
from __future__ import annotations

import contextlib
import functools
import os
import re
import sys
from typing import Iterator, MutableMapping, Optional

SPINCOUNT = "20000"  # iterations of libgomp's wait loop before a worker sleeps
_USER_SET = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")


def spin_env(env: Optional[MutableMapping[str, str]] = None) -> MutableMapping[str, str]:
    """``env`` (default: this process's ``os.environ``) with ``GOMP_SPINCOUNT`` set to
    :data:`SPINCOUNT` unless the user chose a spin there; returned."""
    env = os.environ if env is None else env
    if not any(k in env for k in _USER_SET):
        env["GOMP_SPINCOUNT"] = SPINCOUNT
    return env


def default_spin() -> bool:
    """Set the spin for this process's OpenMP threads, if torch is not loaded yet (whether it
    could: after ``import torch`` libgomp has read its environment)."""
    if "torch" in sys.modules:
        return False
    spin_env()
    return True


LONG = 100_000  # spin iterations from which a wait is "long" (libgomp's default: 300,000, ~2 ms here)
_COUNT = re.compile(r"\s*(\d+)\s*([kKmMgGtT]?)\s*$")  # libgomp's GOMP_SPINCOUNT: a number, a k/M/G/T suffix


def long_spin(env: Optional[MutableMapping[str, str]] = None) -> bool:
    """Whether this process's idle OpenMP workers spin long: libgomp is loaded (torch's CPU
    wheels on Linux) and ``env`` (default: ``os.environ``) gives it more than :data:`LONG`
    iterations: no ``GOMP_SPINCOUNT`` (so libgomp's default: torch loaded before
    :func:`default_spin` could set one), a larger one, ``INFINITE``, or only
    ``OMP_WAIT_POLICY=ACTIVE``. A variable set after torch loaded is read as if libgomp had."""
    env = os.environ if env is None else env
    if not _libgomp_loaded():
        return False
    count = env.get("GOMP_SPINCOUNT")
    if count is not None:
        if count.strip().upper() in ("INFINITE", "INFINITY"):
            return True
        m = _COUNT.match(count)
        if m:  # (unparsable: libgomp ignores it and keeps its default)
            return int(m.group(1)) * 1000 ** " kmgt".index(m.group(2).lower() or " ") > LONG
    return env.get("OMP_WAIT_POLICY", "").strip().upper() != "PASSIVE"


@functools.lru_cache(maxsize=None)
def _libgomp_maps() -> bool:
    try:
        with open("/proc/self/maps") as f:
            return "libgomp" in f.read()
    except OSError:  # no /proc (macOS, Windows): not libgomp's wheels
        return False


def _libgomp_loaded() -> bool:
    """libgomp is in this process (read once torch is loaded; False before)."""
    return "torch" in sys.modules and _libgomp_maps()


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Run the block on one torch thread (process-wide, restored after): no OpenMP worker is
    woken inside it, so none spins on cores another process computes on."""
    import torch

    n = torch.get_num_threads()
    if n > 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if n > 1:
            torch.set_num_threads(n)


# -- A short spin at run time: libgomp's own throttle -------------------------------------------
#
# libgomp has a second, short count, used instead of GOMP_SPINCOUNT while the process manages more
# OpenMP threads than it has CPUs (libgomp's ``do_spin``: ``gomp_managed_threads >
# gomp_available_cpus`` -> ``gomp_throttled_spin_count_var``, 1,000 iterations by default; the GCC
# manual's GOMP_SPINCOUNT entry). Each thread that starts a parallel region gets a team of its
# own, and its idle workers count as managed until the thread exits. So a helper thread that
# starts one team of the right size and then waits makes every wait of the process's other teams
# short, and its exit gives the long spin back: a spin chosen at run time, whatever the import order.


def _libgomp():
    """ctypes handle of the libgomp torch loaded (its vendored copy), or None."""
    import ctypes

    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libgomp" in line and "/" in line}
    except OSError:
        return None
    for path in sorted(paths, key=lambda p: "torch" not in p):  # torch's own copy first
        try:
            lib = ctypes.CDLL(path)
            lib.GOMP_parallel  # noqa: B018  the entry a parallel region compiles to (GCC >= 4.9)
            return lib
        except (OSError, AttributeError):
            continue
    return None


def _available_cpus() -> int:
    """The CPUs libgomp counts (its affinity mask at load, as ``os.sched_getaffinity``)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class _Throttle:
    """The helper thread holding one idle OpenMP team (see above): :meth:`acquire` starts it (or
    counts one more holder), :meth:`release` lets it exit with the last holder."""

    def __init__(self):
        import threading

        self._lock = threading.Lock()
        self._holders = 0
        self._stop = None
        self._thread = None

    def acquire(self) -> bool:
        import ctypes
        import threading

        with self._lock:
            if self._holders:
                self._holders += 1
                return True
            lib = _libgomp()
            if lib is None:
                return False
            import torch

            # this thread's team of n adds n - 1 managed threads to the callers' (torch's
            # threads, less the caller itself): together one more than the CPUs
            n = max(2, _available_cpus() - torch.get_num_threads() + 2)
            libc = ctypes.CDLL(None)
            noop = ctypes.cast(libc.getpid, ctypes.c_void_p)  # a C function each worker calls once
            started, stop = threading.Event(), threading.Event()

            def hold():
                lib.GOMP_parallel(noop, None, ctypes.c_uint(n), ctypes.c_uint(0))
                started.set()
                stop.wait()  # the team's n - 1 workers stay docked (asleep) until this thread exits

            self._thread = threading.Thread(target=hold, name="splitlearn-omp-throttle", daemon=True)
            self._stop = stop
            self._thread.start()
            started.wait(5)
            self._holders = 1
            return True

    def release(self) -> None:
        with self._lock:
            self._holders -= 1
            if self._holders == 0:
                self._stop.set()
                self._thread.join(5)
                self._thread = self._stop = None


_THROTTLE = _Throttle()


@contextlib.contextmanager
def short_spin() -> Iterator[bool]:
    """Inside the block this process's idle OpenMP workers spin libgomp's throttled count
    (1,000 iterations) instead of a long ``GOMP_SPINCOUNT``, whatever the import order; the
    threads keep their number. Yields whether it could (False where torch runs no libgomp)."""
    held = _libgomp_loaded() and _THROTTLE.acquire()
    try:
        yield held
    finally:
        if held:
            _THROTTLE.release()


@contextlib.contextmanager
def quiet_workers() -> Iterator[None]:
    """No idle OpenMP worker of this process spins long inside the block: :func:`short_spin`
    (the threads keep their number), or :func:`one_thread` where libgomp's throttle is out of reach;
    nothing on one torch thread (no worker to spin, and the throttle's team would be one per CPU)."""
    import torch

    if torch.get_num_threads() <= 1:
        yield
        return
    with short_spin() as held:
        if held:
            yield
            return
    with one_thread():
        yield
