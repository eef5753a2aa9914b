"""The shipped model specs (``models/NAME.json``): where they are, their names, their contents,
and whether a source names one (:func:`is_spec_source`). No torch, no transformers: a command
can tell a spec from a hub id before it imports them (``train``'s unreachable-hub check).
:mod:`.loading` builds models from them."""
from __future__ import annotations

import json
from pathlib import Path

from ..errors import ConfigError


def specs_dir() -> Path:
    """Where the shipped model specs live (``models/`` of the checkout, or the installed copy)."""
    here = Path(__file__).resolve().parents[1]  # splitlearn/
    for candidate in (here.parent / "models", here / "_models"):
        if candidate.is_dir():
            return candidate
    raise ConfigError("the model specs directory (models/) is missing from this installation")


def list_specs() -> list[str]:
    return sorted(p.stem for p in specs_dir().glob("*.json"))


def read_spec(name: str) -> dict:
    path = specs_dir() / f"{name}.json"
    if not path.is_file():
        raise ConfigError(f"no model spec named {name!r}; shipped specs: {', '.join(list_specs())}")
    return json.loads(path.read_text())


def is_spec_source(s: str) -> bool:
    p = Path(s)
    if p.suffix == ".json" and p.is_file():
        return True
    name = s.removeprefix("random:")
    return s.startswith("random:") or (name in list_specs() and "hub_id" not in read_spec(name))
