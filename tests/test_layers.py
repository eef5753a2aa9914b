"""The layers of docs/ARCHITECTURE.md, read from the source: nothing imports a layer above its own.

Every ``import`` counts, function-local ones too (they hide loops rather than remove them).
"""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "splitlearn"

#: a package (or top-level module) -> its layer; a module may import its own layer and those below
LAYERS = {
    "core": 0,        # top-level modules: errors, wire, protocol, partition, segments, loading, lora, ...
    "transport": 1,   # how a client reaches a server
    "privacy": 2,     # defenses and the leakage meter's attacks (the model classes apply defenses)
    "offload": 2,     # masked offload (its maths is also the server's)
    "hf": 3,          # the model classes: the one client engine
    "analysis": 4,    # the analyzer and link diagnostics
    "client": 5,      # SplitClient and the client CLI
    "server": 5,
    "localserver": 5,  # starts servers for the demo, the cluster and benchmarks
    "cluster": 6,
    "netem": 6,
    "demo": 6,
    "defensetrain": 6,  # defense-aware fine-tuning through the model classes and an in-process server
    "main": 7,        # every package's __main__.py: a command, imported by nothing
}


def unit_of(module: str) -> str:
    """'splitlearn.hf.remote' -> 'hf'; 'splitlearn.wire' -> 'core'; 'splitlearn' -> 'facade'."""
    parts = module.split(".")
    if len(parts) == 1:
        return "facade"  # splitlearn/__init__.py: lazy re-exports of every layer
    if parts[-1] == "__main__":
        return "main"  # python -m splitlearn.X: the top of the stack (it may start any layer)
    name = parts[1]
    if (ROOT / name).is_dir():
        return name
    return name if name in LAYERS else "core"


def imports(path: Path, pkg: list[str] = None) -> list[str]:
    """The splitlearn modules ``path`` (in package ``pkg``, by default where it lies) imports, as
    absolute names, at module level or inside functions."""
    pkg = pkg or list(path.relative_to(ROOT.parent).parts[:-1])
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg[:len(pkg) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
                names = [] if node.module else [a.name for a in node.names]
                out += [f"{target}.{n}" for n in names] or [target]
            elif node.module and node.module.startswith("splitlearn"):
                out.append(node.module)
        elif isinstance(node, ast.Import):
            out += [a.name for a in node.names if a.name.startswith("splitlearn")]
    return out


def edges() -> set[tuple[str, str, str]]:
    """(importing unit, imported unit, importing file) for every import across units."""
    found = set()
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        parts = list(rel.parts[:-1]) if rel.name == "__init__" else list(rel.parts)
        src = unit_of(".".join(parts))
        for target in imports(path):
            dst = unit_of(target)
            if src != dst and dst != "facade":
                found.add((src, dst, str(path.relative_to(ROOT.parent))))
    return found


def test_every_unit_has_a_layer():
    units = {unit_of("splitlearn." + p.name) for p in ROOT.iterdir()
             if p.is_dir() and (p / "__init__.py").exists()}
    assert units <= set(LAYERS), f"give these packages a layer: {units - set(LAYERS)}"


@pytest.mark.parametrize("src,dst,where", sorted(edges()))
def test_no_import_reaches_up(src, dst, where):
    if src == "facade":
        return
    assert LAYERS[dst] < LAYERS[src], f"{where}: layer {src} ({LAYERS[src]}) imports {dst} ({LAYERS[dst]})"


def test_no_two_packages_import_each_other():
    pairs = {(s, d) for s, d, _ in edges()}
    loops = sorted({tuple(sorted(p)) for p in pairs if (p[1], p[0]) in pairs})
    assert not loops, f"packages that import each other: {loops}"


def test_nothing_imports_a_command():
    """A ``__main__`` sits above every layer only because nothing imports it."""
    assert not [(s, w) for s, d, w in edges() if d == "main"]
    assert unit_of("splitlearn.privacy.__main__") == "main" and unit_of("splitlearn.defensetrain") == "defensetrain"


def test_the_checker_sees_a_lie(tmp_path):
    """The checker would catch hf importing client: an upward edge it must report."""
    f = tmp_path / "remote.py"
    f.write_text("import torch\n\ndef f():\n    from ..client.core import SplitClient\n    from . import cache\n")
    found = imports(f, ["splitlearn", "hf"])  # as if it lay in splitlearn/hf/
    assert found == ["splitlearn.client.core", "splitlearn.hf.cache"]
    assert [unit_of(t) for t in found] == ["client", "hf"] and LAYERS["client"] > LAYERS["hf"]
