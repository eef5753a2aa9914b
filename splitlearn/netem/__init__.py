"""Emulated network links for benchmarks and tests: :class:`DelayRelay` (a TCP relay adding a
fixed one-way delay per direction and an optional rate limit). See :mod:`.relay` for why a
relay and not ``tc netem``."""
from .relay import DelayRelay, TokenBucket, relay_process

__all__ = ["DelayRelay", "TokenBucket", "relay_process"]
