"""``wait_while_busy``: call again while the server answers busy (503, 429), bounded, logged.

Used wherever a client waits on the server's word: the model classes' applies and recovery
(:mod:`splitlearn.hf.remote`), the federation's turns and rounds (:mod:`splitlearn.hf.fedsync`)."""
from __future__ import annotations

import logging
import time
from typing import Callable, TypeVar

from ..errors import ServiceUnavailable

log = logging.getLogger(__name__)
T = TypeVar("T")


BUSY_LOG_S = 5.0  # a wait this long is logged (WARNING, with the server's word on who holds it), and again each time


def wait_while_busy(fn: Callable[[], T], what: str, timeout_s: float, first_wait_s: float = 0.02) -> T:
    """Call ``fn`` until it does not raise 503/429 (retryable busy answers), for at most
    ``timeout_s`` seconds, waiting 20 ms, 40 ms, ... up to the server's Retry-After; every
    :data:`BUSY_LOG_S` seconds of waiting a warning says for how long and why (the server's answer:
    who holds the segment, for how long)."""
    start = time.monotonic()
    deadline, said = start + timeout_s, start
    wait = first_wait_s
    while True:
        try:
            return fn()
        except ServiceUnavailable as e:
            now = time.monotonic()
            if now + wait > deadline:
                raise ServiceUnavailable(f"waited {timeout_s:g}s for {what}; the server still says: "
                                         f"{e.message}") from None
            if now - said >= BUSY_LOG_S:
                said = now
                log.warning("waiting %.0fs for %s (at most %gs): %s", now - start, what, timeout_s, e.message)
            time.sleep(wait)
            wait = min(wait * 2, e.retry_after or 1.0, 1.0)
