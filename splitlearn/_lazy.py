"""Names a package imports on first use (PEP 562), so that a ``--help`` imports no torch.

    __getattr__, __dir__ = lazy_names(__name__, {"SplitClient": ".core"})

binds each name to the module (relative to the package) it comes from; the first read imports
that module and keeps the value in the package's globals, so later reads do not come here.
"""
from __future__ import annotations

import importlib
import sys
from typing import Callable


def lazy_names(package: str, table: dict[str, str]) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """The package's ``__getattr__`` and ``__dir__`` for the names of ``table`` (name -> module)."""

    def __getattr__(name: str):
        if name not in table:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(table[name], package), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(table))

    return __getattr__, __dir__
