"""The layers of docs/ARCHITECTURE.md, read from the source: nothing imports a layer above its own,
no modules import each other, and inside ``splitlearn/server`` every import points down a wing.

Every ``import`` counts, function-local ones and those under ``if __name__ == "__main__":`` too
(they hide loops rather than remove them: a module's command runs at the module's own layer). A
package's ``__main__.py`` sits at its package's layer, except the thin commands of ``COMMANDS``,
which sit at the floor named there (``python -m splitlearn.privacy`` runs the apps' driver).
"""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "splitlearn"

#: a package (or a module of the root) -> its layer; a module imports its own unit and the layers
#: below (two units of one layer never import each other)
LAYERS = {
    "core": 0,         # the root's modules: errors, and the private helpers _lazy, _extras
    "model": 1,        # the model's maths: partition, segments, loading, lora, headloss, packed, checkpoint, data...
    "api": 1,          # what client and server say: wire, protocol, openapi, trust, fingerprint
    "offloadmath": 1,  # masked offload's maths, the client's and the server's: field, layers
    "defense": 1,      # what the client does to the activations before they cross the cut (+ DP accounting)
    "transport": 2,    # how a client reaches a server
    "procs": 2,        # running processes: child servers on loopback, idle polling, --help
    "hf": 3,           # the model classes: the one client engine (with the client's federation, fedsync)
    "offload": 3,      # the client's side of masked offload
    "privacy": 4,      # the leakage meter and its attacks: measuring defenses
    "analysis": 5,     # the analyzer and link diagnostics
    "client": 6,       # SplitClient and the client CLI
    "server": 6,
    "apps": 7,         # the demo; defense-aware fine-tuning through the model classes and an in-process server
    "cluster": 7,
    "netem": 7,
    "main": 8,         # every package's __main__.py: a command, imported by nothing
}
#: a package's __main__.py that runs a command of a layer above its package's: the floor it sits at
#: (it must stay thin: one import, its command's ``main``)
COMMANDS = {"splitlearn.privacy.__main__": "apps"}


def floor_of(module: str) -> str:
    """The unit whose layer ``module``'s imports are checked at: its own, or for a package's
    ``__main__`` its package's (a command named in ``COMMANDS``: the floor named there)."""
    parts = module.split(".")
    if parts[-1] != "__main__":
        return unit_of(module)
    return COMMANDS.get(module) or unit_of(".".join(parts[:-1]))

def unit_of(module: str) -> str:
    """'splitlearn.hf.remote' -> 'hf'; 'splitlearn.errors' -> 'core'; 'splitlearn' -> 'facade'."""
    parts = module.split(".")
    if len(parts) == 1:
        return "facade"  # splitlearn/__init__.py: lazy re-exports of every layer
    if parts[-1] == "__main__":
        return "main"  # python -m splitlearn.X: the top of the stack (it may start any layer)
    name = parts[1]
    return name if (ROOT / name).is_dir() else "core"


def imports(path: Path, pkg: list[str] = None) -> list[str]:
    """What ``path`` (in package ``pkg``, by default where it lies) imports of splitlearn, as
    absolute names, at module level, inside functions or under a ``__main__`` guard: each
    name of a ``from`` import as ``module.name`` (a submodule, or a name in that module:
    :func:`graph` takes the deepest module)."""
    pkg = pkg or list(path.relative_to(ROOT.parent).parts[:-1])
    out = []

    def visit(node: ast.AST) -> None:
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
    """Every module of splitlearn by its dotted name (a package by its own name)."""
    found = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        found[".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)] = path
    return found


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


def module_edges() -> set[tuple[str, str]]:
    """(importing module, imported module): ``from pkg import name`` counts as importing
    ``pkg.name`` where that is a module, else ``pkg``."""
    mods = modules()
    found = set()
    for name, path in mods.items():
        for target in imports(path):
            while target not in mods and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in mods and target != name:
                found.add((name, target))
    return found


def edges() -> set[tuple[str, str, str]]:
    """(importing unit, imported unit, importing file) for every import across units."""
    found = set()
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        parts = list(rel.parts[:-1]) if rel.name == "__init__" else list(rel.parts)
        src = floor_of(".".join(parts))
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


def test_no_modules_import_each_other():
    """Within a package too, and round a loop of any length: a loop is one module in several
    files (or a layer missing)."""
    g = {}
    for src, dst in module_edges():
        g.setdefault(src, set()).add(dst)
    assert not loops(g), f"modules that import each other (directly or round a loop): {loops(g)}"


def test_the_root_holds_no_layer_of_its_own():
    """The root keeps only what every layer uses (errors) and private helpers; the rest sits in a
    package that names its layer."""
    root = sorted(p.stem for p in ROOT.glob("*.py"))
    assert root == ["__init__", "_extras", "_lazy", "errors"], root


def test_nothing_imports_a_command():
    """Nothing imports a ``__main__``; one sits at its package's layer (a command of ``COMMANDS``
    at the floor named there)."""
    assert not [(s, w) for s, d, w in edges() if d == "main"]
    assert unit_of("splitlearn.privacy.__main__") == "main" and floor_of("splitlearn.privacy.__main__") == "apps"
    assert floor_of("splitlearn.server.__main__") == "server" and floor_of("splitlearn.hf.remote") == "hf"


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_command_above_its_package_is_thin(command):
    """``python -m splitlearn.privacy`` may run the apps' driver only as a thin module: one import
    of splitlearn (its command's ``main``), a few lines, no code of its own."""
    path = modules()[command]
    assert len(imports(path)) == 1 and len(path.read_text().splitlines()) <= 8, path.read_text()


def test_a_command_guard_counts_as_an_import(tmp_path):
    """``if __name__ == "__main__": from ..http.fedapp import main`` in federation/ is an upward
    import and, with fedapp importing the module, a loop (issue 54: the fed server's command moved
    to http/fedapp.py)."""
    f = tmp_path / "fedserver.py"
    f.write_text("import sys\n\nif __name__ == '__main__':\n    from ..http.fedapp import main\n    sys.exit(main())\n")
    found = imports(f, ["splitlearn", "server", "federation"])
    assert found == ["splitlearn.server.http.fedapp.main"]
    g = {"splitlearn.server.federation.fedserver": {"splitlearn.server.http.fedapp"},
         "splitlearn.server.http.fedapp": {"splitlearn.server.federation.fedserver"}}
    assert upward(g) == ["splitlearn.server.federation.fedserver (federation) -> splitlearn.server.http.fedapp (http)"]
    assert loops(g) == [["splitlearn.server.federation.fedserver", "splitlearn.server.http.fedapp"]]


def test_the_checker_sees_a_lie(tmp_path):
    """The checker would catch hf importing client: an upward edge it must report."""
    f = tmp_path / "remote.py"
    f.write_text("import torch\n\ndef f():\n    from ..client.core import SplitClient\n    from . import cache\n")
    found = imports(f, ["splitlearn", "hf"])  # as if it lay in splitlearn/hf/
    assert found == ["splitlearn.client.core.SplitClient", "splitlearn.hf.cache"]
    assert [unit_of(t) for t in found] == ["client", "hf"] and LAYERS["client"] > LAYERS["hf"]


# -- the server's wings: inside splitlearn/server every import points down a wing --------------
#
#    5  __main__                    python -m splitlearn.server (imported by nothing)
#    4  splitlearn.server           the package's facade (create_app, ServerConfig, SegmentRuntime)
#    3  http/                       the apps, the doors, the routes, the CLI; the fed server's app
#    2  engine/                     the segment and everything that touches it
#    1  federation/                 the modes, the rounds, the strategies; the fed server's state
#    0  config, options, tenants    plain data the wings read, and pure code

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


def server_modules() -> dict[str, Path]:
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


@pytest.fixture(scope="module")
def server_graph():
    return graph(server_modules())


def test_every_module_has_a_wing():
    assert {wing_of(m) for m in server_modules()} <= set(WINGS), "give the new top-level module of splitlearn/server a wing"


def test_no_import_reaches_up_a_wing(server_graph):
    assert not upward(server_graph), "imports that reach up a wing:\n" + "\n".join(upward(server_graph))


def test_no_server_modules_import_each_other(server_graph):
    assert not loops(server_graph), f"modules that import each other (directly or round a loop): {loops(server_graph)}"


def test_config_is_plain_data_the_wings_read(server_graph):
    """The config imports no wing: the wings read it (and what is built of it is built in them)."""
    assert {wing_of(m) for m in server_graph["splitlearn.server.config"]} <= {"base"}


def test_the_wing_checker_sees_a_lie(tmp_path):
    """An upward edge (federation importing engine, in a function), a pair of modules importing
    each other, and a command's entry (counted as an import) as the checker reads them."""
    f = tmp_path / "modes.py"
    f.write_text("import torch\nfrom . import tickets\n\ndef f():\n    from ..engine.tenants import client_of\n\n"
                 "if __name__ == '__main__':\n    from ..http.fedapp import main\n")
    found = imports(f, ["splitlearn", "server", "federation"])  # as if it lay in splitlearn/server/federation/
    assert found == ["splitlearn.server.federation.tickets", "splitlearn.server.engine.tenants.client_of",
                     "splitlearn.server.http.fedapp.main"]
    g = {"splitlearn.server.federation.modes": {"splitlearn.server.engine.tenants", "splitlearn.server.config"},
         "splitlearn.server.engine.tenants": set(), "splitlearn.server.config": set()}
    assert upward(g) == ["splitlearn.server.federation.modes (federation) -> splitlearn.server.engine.tenants (engine)"]
    assert not loops(g)
    g["splitlearn.server.engine.tenants"] = {"splitlearn.server.federation.modes"}  # a pair: each imports the other
    assert loops(g) == [["splitlearn.server.engine.tenants", "splitlearn.server.federation.modes"]]
    assert wing_of("splitlearn.server") == "facade" and wing_of("splitlearn.server.__main__") == "main"
    assert wing_of("splitlearn.server.tenants") == "base" and wing_of("splitlearn.server.wings") == "unknown:wings"


# -- rooms of one concept ---------------------------------------------------------------------

def test_no_class_over_400_lines_and_no_file_over_600():
    """One concept per module: a class past 400 lines, or a file past 600, holds several."""
    big = []
    for path in sorted(ROOT.rglob("*.py")):
        text = path.read_text()
        if text.count("\n") > 600:
            big.append(f"{path.relative_to(ROOT.parent)}: {text.count(chr(10))} lines")
        big += [f"{path.relative_to(ROOT.parent)}: class {n.name}, {n.end_lineno - n.lineno + 1} lines"
                for n in ast.walk(ast.parse(text)) if isinstance(n, ast.ClassDef) and n.end_lineno - n.lineno >= 400]
    assert not big, big


def private_reads(path: Path) -> list[str]:
    """``x._name`` where ``x`` is not ``self`` or ``cls``: a read of another object's insides."""
    return [f"{path.name}:{n.lineno} {ast.unparse(n)}" for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__")
            and not (isinstance(n.value, ast.Name) and n.value.id in ("self", "cls"))]


def test_the_client_drives_the_engine_through_its_public_api(tmp_path):
    """``SplitClient`` uses the engine's rooms as a user's loop does: no private reads (it once
    read ``remote._snap_step`` and switched the engine into a second mode)."""
    assert not [r for p in (ROOT / "client").glob("*.py") for r in private_reads(p)]
    lie = tmp_path / "core.py"
    lie.write_text("def load(self, remote):\n    return self._model.remote._snap_step\n")
    assert private_reads(lie) == ["core.py:2 self._model.remote._snap_step"]
