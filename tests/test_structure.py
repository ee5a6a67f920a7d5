"""The package's structure: no import cycles inside dayzero/, and DAYZERO_* settings read in one module.

The import graph is built from the source (ast), not by importing: an edge A -> B for every `import`
or `from ... import` statement in module A that names module B of the package, at module level or
inside a function (a function-level import is still a dependency; it only defers it). `from P import
name` is an edge to P.name where that is a module of the package, else to P. Importing a submodule
runs its parent packages' __init__ too, but that is not an edge: a package may import its own
submodules (to register them) without making every submodule depend on its siblings.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "dayzero"


def module_name(path: Path, root: Path = PACKAGE) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_modules(root: Path = PACKAGE) -> dict[str, Path]:
    return {module_name(p, root): p for p in sorted(root.rglob("*.py"))}


def _resolve(node: ast.ImportFrom, current: str, is_package: bool) -> str:
    """The absolute module a `from ... import` names (relative imports resolved against `current`)."""
    if not node.level:
        return node.module or ""
    base = current.split(".")
    base = base if is_package else base[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """{module: the package's modules it imports}, every import statement of the file counted."""
    modules = package_modules(root)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(node, name, path.name == "__init__.py")
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            for target in targets:
                while target and target not in modules:  # `import a.b.c` of a package a.b, or a name in it
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles_in_the_package():
    found = cycles(import_graph())
    assert not found, "import cycles in dayzero/ (module-level and function-level imports):\n" + "\n".join(
        "  " + " <-> ".join(c) for c in found)


def test_the_cycle_finder_finds_a_cycle(tmp_path):
    pkg = tmp_path / "dayzero"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from dayzero.sub import a  # a package importing its own module\n")
    (pkg / "sub" / "a.py").write_text("from dayzero.sub.b import f\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from . import c\n")
    (pkg / "sub" / "c.py").write_text("import dayzero.sub.a\n")
    (pkg / "d.py").write_text("from dayzero.sub import a\nimport torch\n")
    graph = import_graph(pkg)
    assert graph["dayzero.sub.b"] == {"dayzero.sub.c"}  # the relative, function-level import
    assert graph["dayzero.d"] == {"dayzero.sub.a"}
    assert cycles(graph) == [["dayzero.sub.a", "dayzero.sub.b", "dayzero.sub.c"]]


SETTINGS_MODULE = PACKAGE / "settings.py"


def test_dayzero_environment_variables_are_read_in_settings_only():
    """Every DAYZERO_* variable is declared (and read) in dayzero/settings.py; elsewhere in the package
    the prefix may appear in docstrings and messages, but no code reads the environment."""
    readers = re.compile(r"os\.environ|os\.getenv|getenv\(|environ\.get|environ\[")
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == SETTINGS_MODULE:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if readers.search(line):
                offenders.append(f"{path.relative_to(PACKAGE.parent)}:{number}: {line.strip()}")
    assert not offenders, "the environment is read outside dayzero/settings.py:\n" + "\n".join(offenders)
