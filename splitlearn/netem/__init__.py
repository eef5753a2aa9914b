"""Emulated network links for benchmarks and tests: :class:`DelayRelay`, a TCP relay adding a
fixed one-way delay per direction and an optional rate limit (docs/WAN.md, 'The emulated link')."""
from .relay import DelayRelay, TokenBucket, relay_process

__all__ = ["DelayRelay", "TokenBucket", "relay_process"]
