"""The splitlearn client: ``SplitClient`` for training and generation over HTTP.

The names are imported on first use, so ``python -m splitlearn.client --help`` imports no torch."""
from .._lazy import lazy_names

_LAZY = {"ClientConfig": ".config", "SplitClient": ".core", "TransportConfig": "..transport",
         "WireStats": "..transport"}

__all__ = ["ClientConfig", "SplitClient", "TransportConfig", "WireStats"]


__getattr__, __dir__ = lazy_names(__name__, _LAZY)
