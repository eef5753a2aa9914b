"""Emulated network links for benchmarks and tests: :class:`DelayRelay`, a TCP relay adding a
fixed one-way delay per direction and an optional rate limit (docs/WAN.md, 'The emulated link').

The names load on first use (PEP 562): ``python -m splitlearn.netem.relay`` then runs the module
once, as ``__main__``, without runpy's warning that the package had imported it already."""
from .._lazy import lazy_names

__all__ = ["DelayRelay", "TokenBucket", "relay_process"]
__getattr__, __dir__ = lazy_names(__name__, {name: ".relay" for name in __all__})
