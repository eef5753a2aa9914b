"""The splitlearn server: one segment of a GPT-2 behind a Flask app (``create_app``)."""
import importlib

from .._extras import require

require("server", "flask", "waitress", what="the splitlearn server")

# Each name is imported on first use (PEP 562), so ``python -m splitlearn.server --help``, which
# imports this package first, imports no torch (issue 54): name -> its module.
_LAZY = {"create_app": "http.app", "ServerConfig": "config", "SegmentRuntime": "engine.runtime"}

__all__ = ["ServerConfig", "SegmentRuntime", "create_app"]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    globals()[name] = value  # once: later reads do not come here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
