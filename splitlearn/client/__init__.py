"""The splitlearn client: ``SplitClient`` for training and generation over HTTP.

The names are imported on first use, so ``python -m splitlearn.client --help`` imports no torch."""
import importlib

_LAZY = {"ClientConfig": ".config", "SplitClient": ".core", "TransportConfig": "..transport",
         "WireStats": "..transport"}

__all__ = ["ClientConfig", "SplitClient", "TransportConfig", "WireStats"]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
