"""The package's import graph has no circle and no module imports the package
root: every module can be read (and imported) from the bottom up.

Every import counts, at module level or inside a function: a function-level
import of a module that imports back is still a circle, only one that fails
later. ``from . import x`` counts as an import of submodule ``x`` when ``x`` is
one (and not of the package, which Python imports first for any submodule).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "ds_pipe_ckpt"


def module_names(package: Path) -> dict[str, Path]:
    """``{"ds_pipe_ckpt.planning.solver": path, ...}`` for every module of ``package``."""
    names = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def imports_of(name: str, path: Path, modules: set[str]) -> set[str]:
    """The package modules that module ``name`` (at ``path``) imports anywhere in its body."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            # ``from pkg import sub`` imports the submodule; the package itself is
            # imported first for any submodule import, so it is no edge of its own.
            targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source
                       for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # ``import a.b.c`` of a non-module name: its module
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph(package: Path) -> dict[str, set[str]]:
    modules = module_names(package)
    return {name: imports_of(name, path, set(modules)) for name, path in modules.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


# -- the walker itself ------------------------------------------------------------------

@pytest.fixture
def toy(tmp_path):
    def write(files: dict[str, str]) -> Path:
        root = tmp_path / "pkg"
        for relative, source in files.items():
            path = root / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(source)
        return root
    return write


def test_relative_function_level_and_submodule_imports_are_seen(toy):
    root = toy({"__init__.py": "from .a import x\n",
                "a.py": "def f():\n    from .sub import b\n",
                "sub/__init__.py": "from .. import a\n",
                "sub/b.py": "import pkg.a.x\nfrom ..sub import c\n",
                "sub/c.py": ""})
    assert import_graph(root) == {"pkg": {"pkg.a"}, "pkg.a": {"pkg.sub.b"}, "pkg.sub": {"pkg.a"},
                                  "pkg.sub.b": {"pkg.a", "pkg.sub.c"}, "pkg.sub.c": set()}


def test_a_circle_through_a_function_level_import_is_found(toy):
    root = toy({"__init__.py": "", "a.py": "from . import b\n", "b.py": "def f():\n    from .c import g\n",
                "c.py": "from .a import h\n", "d.py": "from . import a\n"})
    assert circles(import_graph(root)) == [["pkg.a", "pkg.b", "pkg.c"]]


# -- the package ------------------------------------------------------------------------

GRAPH = import_graph(PACKAGE)


def test_the_walk_sees_the_package():
    assert len(GRAPH) > 40 and "ds_pipe_ckpt.planning.solver" in GRAPH
    assert "ds_pipe_ckpt.checkpoint" in GRAPH["ds_pipe_ckpt"]


def test_the_package_has_no_import_circle():
    assert circles(GRAPH) == []


def test_no_module_imports_the_package_root():
    """``ds_pipe_ckpt/__init__.py`` assembles the public API from the modules;
    a module that imports it back would depend on everything."""
    assert [name for name, imported in GRAPH.items() if "ds_pipe_ckpt" in imported] == []
