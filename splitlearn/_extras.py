"""Optional dependencies: ``pip install splitlearn`` is the client; the rest are extras (setup.py)."""
from __future__ import annotations

import importlib


def require(extra: str, *modules: str, what: str = "this") -> None:
    """Import ``modules`` or raise an ImportError that names the extra to install."""
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as e:
            raise ImportError(f"{what} needs {name!r}, which is not installed: pip install "
                              f"'splitlearn[{extra}]'") from e
