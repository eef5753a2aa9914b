"""``ComputeThread``: the one thread that runs every tensor operation of a server.

PyTorch's CPU build parallelises an operator with OpenMP, and OpenMP gives *each calling
thread its own team* of worker threads, kept until that thread exits. A WSGI server hands
requests to a pool of threads, so a segment run from whichever worker thread got the request
builds one team per worker: with 16 workers and 2 cores that is 32 OpenMP threads. Once a
process holds more OpenMP threads than cores, libgomp stops spinning between parallel
regions and sleeps instead, and every operator pays a wake-up. Measured on a 2-core machine
(GPT-2 small, 8 blocks, one decode step): 14 ms run from one thread, 27-29 ms run from WSGI
worker threads after the model was loaded on the main thread.

So the server loads its model on, and runs all of its tensor work through, one long-lived
thread; the WSGI threads only read and write bytes::

    WSGI thread 1 --read body--+                          +--> bytes --> response 1
    WSGI thread 2 --read body--+--> queue --> compute ----+--> bytes --> response 2
    ...                                       thread: decode, validate, run the segment, encode

Work runs in arrival order. Decode steps of concurrent sessions that queue while the thread
is busy are run together by :class:`~.batching.DecodeBatcher` on this thread.
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional, TypeVar

import torch

from ...errors import ConfigError

T = TypeVar("T")


class ComputeThread:
    """A single worker thread; :meth:`run` executes a callable on it and returns its result."""

    def __init__(self, torch_threads: Optional[int] = None, name: str = "splitlearn-compute"):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._thread = self._pool.submit(threading.current_thread).result()  # the pool's one thread
        self._ident = self._thread.ident
        self._queued = 0  # submitted, not started yet (:meth:`waiting`)
        self._count = threading.Lock()
        if torch_threads is not None:
            if torch_threads < 1:
                raise ConfigError(f"torch_threads must be >= 1, got {torch_threads}")
            self.run(torch.set_num_threads, torch_threads)

    def on_thread(self) -> bool:
        """True when called from the compute thread itself."""
        return threading.get_ident() == self._ident

    def run(self, fn: Callable[..., T], *args, **kwargs) -> T:
        """Run ``fn(*args, **kwargs)`` on the compute thread and return its result.

        Re-raises what ``fn`` raises. Called from the compute thread, it just calls ``fn``.
        """
        if self.on_thread():
            return fn(*args, **kwargs)
        return self.submit(fn, *args, **kwargs).result()

    def submit(self, fn: Callable[..., T], *args, **kwargs):
        """Queue ``fn`` without waiting; returns a ``concurrent.futures.Future``."""
        with self._count:
            self._queued += 1
        return self._pool.submit(self._started, fn, *args, **kwargs)

    def _started(self, fn: Callable[..., T], *args, **kwargs) -> T:
        with self._count:
            self._queued -= 1
        return fn(*args, **kwargs)

    def alive(self) -> bool:
        """Whether the thread still runs (readiness, :mod:`splitlearn.server.http.probes`); False after :meth:`close`."""
        return self._thread.is_alive()

    def waiting(self) -> int:
        """Work queued behind what runs now (a hint: decode drains yield to it, :mod:`.priority`)."""
        return self._queued

    def close(self) -> None:
        self._pool.shutdown(wait=True)

