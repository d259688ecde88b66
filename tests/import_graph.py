"""The import graph of moebench/, read from the source with `ast`: every
import counts, module-level and deferred (inside functions), absolute and
relative; `from moebench.pkg import mod` is an import of the module
`moebench.pkg.mod`. Used by tests/test_imports.py (circles, layers) and
tests/kernels/test_floors.py (the kernels' floor); tests/ is on sys.path
as conftest.py's folder."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "moebench"


def module_name(path: Path, package: Path = PACKAGE) -> str:
    """moebench/bench/launch.py -> 'moebench.bench.launch' (`package`: the
    moebench/ folder it lies in); a package's __init__.py -> the package."""
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    """Every module of moebench/ by name."""
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(path: Path, known: set[str], package_dir: Path = PACKAGE) -> dict[str, int]:
    """The moebench modules (of `known`) the module at `path` imports anywhere
    in its body, each with the line of its first import. `from P import x`
    counts as P.x when that is a module, else as P; an import of a name
    that is no module counts as its nearest enclosing module."""
    name = module_name(path, package_dir)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: dict[str, int] = {}

    def add(target: str, line: int) -> None:
        while target not in known and "." in target:
            target = target.rpartition(".")[0]
        if target in known and target != name:
            found.setdefault(target, line)

    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                add(sub if sub in known else source, node.lineno)
    return found


def import_graph() -> dict[str, dict[str, int]]:
    """{module: {imported module: line}} over moebench/."""
    mods = modules()
    return {name: imports_of(path, set(mods)) for name, path in mods.items()}


def circles(graph: dict[str, dict[str, int]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(graph[nxt])))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                members = set()
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    members.add(top)
                    if top == node:
                        break
                if len(members) > 1:
                    found.append(frozenset(members))
    return found
