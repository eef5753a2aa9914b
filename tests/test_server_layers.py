"""The server's wings, read from the source: inside ``splitlearn/server`` every import points down
a wing, and no modules import each other (docs/ARCHITECTURE.md, 'The server')::

    5  __main__                    python -m splitlearn.server (imported by nothing)
    4  splitlearn.server           the package's facade (create_app, ServerConfig, SegmentRuntime)
    3  http/                       the apps, the doors, the routes, the CLI; the fed server's app
    2  engine/                     the segment and everything that touches it
    1  federation/                 the modes, the rounds, the strategies; the fed server's state
    0  config, options, tenants    plain data the wings read, and pure code

A module may import its own wing and those below. Every ``import`` counts, function-local ones
too (they hide loops rather than remove them); only a command's entry, the body of ``if __name__
== "__main__":``, may start any wing (as a ``__main__`` module may: tests/test_layers.py).
Self-contained (its own ast reader, as tests/test_layers.py's).
"""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "splitlearn"
SERVER = ROOT / "server"

#: a wing of splitlearn.server -> its layer; a module may import its own layer and those below
WINGS = {"base": 0, "federation": 1, "engine": 2, "http": 3, "facade": 4, "main": 5}
BASE = {"config", "options", "tenants"}  # splitlearn/server/<name>.py: plain data and pure code


def wing_of(module: str) -> str:
    """'splitlearn.server.http.app' -> 'http'; 'splitlearn.server.config' -> 'base';
    'splitlearn.server' -> 'facade'; 'splitlearn.server.__main__' -> 'main'."""
    parts = module.split(".")
    assert parts[:2] == ["splitlearn", "server"], module
    if len(parts) == 2:
        return "facade"
    if parts[2] == "__main__":
        return "main"
    if (SERVER / parts[2]).is_dir():
        return parts[2]
    return "base" if parts[2] in BASE else f"unknown:{parts[2]}"


def _is_main_guard(node: ast.AST) -> bool:
    """``if __name__ == "__main__":``"""
    t = getattr(node, "test", None)
    return (isinstance(node, ast.If) and isinstance(t, ast.Compare) and isinstance(t.left, ast.Name)
            and t.left.id == "__name__" and len(t.comparators) == 1
            and isinstance(t.comparators[0], ast.Constant) and t.comparators[0].value == "__main__")


def imports(path: Path, pkg: list[str] = None) -> list[str]:
    """What ``path`` (in package ``pkg``, by default where it lies) imports of splitlearn, as
    absolute names, at module level or inside functions (not under a ``__main__`` guard): each
    name of a ``from`` import as ``module.name`` (a submodule, or a name in that module:
    :func:`graph` takes the deepest module)."""
    pkg = pkg or list(path.relative_to(ROOT.parent).parts[:-1])
    out = []

    def visit(node: ast.AST) -> None:
        if _is_main_guard(node):
            return
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg[:len(pkg) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.startswith("splitlearn"):
                target = node.module
            else:
                target = None
            if target is not None:
                out.extend([f"{target}.{a.name}" for a in node.names if a.name != "*"] or [target])
        elif isinstance(node, ast.Import):
            out.extend(a.name for a in node.names if a.name.startswith("splitlearn"))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return out


def modules() -> dict[str, Path]:
    """Every module of splitlearn/server by its dotted name (a package by its own)."""
    found = {}
    for path in SERVER.rglob("*.py"):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        parts = list(rel.parts[:-1]) if rel.name == "__init__" else list(rel.parts)
        found[".".join(parts)] = path
    return found


def graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the modules of splitlearn/server it imports (``from .x import name``: module x)."""
    def resolve(target: str) -> str:
        while target not in mods and "." in target:
            target = target.rpartition(".")[0]
        return target

    out = {}
    for name, path in mods.items():
        targets = {resolve(t) for t in imports(path) if t == "splitlearn.server" or t.startswith("splitlearn.server.")}
        out[name] = targets - {name}
    return out


def upward(g: dict[str, set[str]]) -> list[str]:
    """Every import that reaches up a wing, as 'importer (wing) -> imported (wing)'."""
    return sorted(f"{src} ({wing_of(src)}) -> {dst} ({wing_of(dst)})" for src, dsts in g.items() for dst in dsts
                  if WINGS.get(wing_of(dst), 99) > WINGS.get(wing_of(src), -1))


def loops(g: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles (strongly connected components of more than one module; Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(g.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            connect(v)
    return sorted(found)


@pytest.fixture(scope="module")
def server_graph():
    return graph(modules())


def test_every_module_has_a_wing():
    assert {wing_of(m) for m in modules()} <= set(WINGS), "give the new top-level module of splitlearn/server a wing"


def test_no_import_reaches_up_a_wing(server_graph):
    assert not upward(server_graph), "imports that reach up a wing:\n" + "\n".join(upward(server_graph))


def test_no_modules_import_each_other(server_graph):
    assert not loops(server_graph), f"modules that import each other (directly or round a loop): {loops(server_graph)}"


def test_config_is_plain_data_the_wings_read(server_graph):
    """The config imports no wing: the wings read it (and what is built of it is built in them)."""
    assert {wing_of(m) for m in server_graph["splitlearn.server.config"]} <= {"base"}


def test_the_checker_sees_a_lie(tmp_path):
    """An upward edge (federation importing engine, in a function), a pair of modules importing
    each other, and a command's entry (which may start any wing) as the checker reads them."""
    f = tmp_path / "modes.py"
    f.write_text("import torch\nfrom . import tickets\n\ndef f():\n    from ..engine.tenants import client_of\n\n"
                 "if __name__ == '__main__':\n    from ..http.fedapp import main\n")
    found = imports(f, ["splitlearn", "server", "federation"])  # as if it lay in splitlearn/server/federation/
    assert found == ["splitlearn.server.federation.tickets", "splitlearn.server.engine.tenants.client_of"]
    g = {"splitlearn.server.federation.modes": {"splitlearn.server.engine.tenants", "splitlearn.server.config"},
         "splitlearn.server.engine.tenants": set(), "splitlearn.server.config": set()}
    assert upward(g) == ["splitlearn.server.federation.modes (federation) -> splitlearn.server.engine.tenants (engine)"]
    assert not loops(g)
    g["splitlearn.server.engine.tenants"] = {"splitlearn.server.federation.modes"}  # a pair: each imports the other
    assert loops(g) == [["splitlearn.server.engine.tenants", "splitlearn.server.federation.modes"]]
    assert wing_of("splitlearn.server") == "facade" and wing_of("splitlearn.server.__main__") == "main"
    assert wing_of("splitlearn.server.tenants") == "base" and wing_of("splitlearn.server.wings") == "unknown:wings"
