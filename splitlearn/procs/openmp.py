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

A process whose libgomp spins long (:func:`long_spin`: torch imported first) cannot shorten it
any more; what it can do is have no idle workers: :func:`one_thread` runs a block on one torch
thread, so no worker is woken and none spins afterwards (the split models' ``generate`` does so
where the server shares the cores: docs/PERFORMANCE.md, 'Import order')."""
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
