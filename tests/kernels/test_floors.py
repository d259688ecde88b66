"""The kernels' floor holds: nothing in moebench/kernels/ imports a layer
above it (tuning, backends, bench, integration, reports, cli, ...).

What the kernels may import, from the data flow (docs/design.md, "The routed-expert
path"): themselves; the package root (`__version__`); and the core the layer
call is built from: `models` (shapes, MX block), `formats` (the canonical
MXFP4 / MXFP8 weights the kernels lay out), `routing` (the router constants
the fused top-k matches bit for bit), `record` (the route record the kernels
build and read) and `moe_output` (the contract their output fills). Those
core modules import only one another. Every import is counted: module-level
and deferred (inside functions), absolute and relative."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "moebench"
#: The core below the kernels.
CORE = {"moebench.models", "moebench.formats", "moebench.routing", "moebench.record", "moebench.moe_output"}


def moebench_imports(path: Path, package: str) -> set[str]:
    """The moebench modules `path` (a module of `package`) imports anywhere in
    its body; `from moebench import x` counts as moebench.x unless x is a dunder."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module == "moebench" or (node.level and not node.module):
                out.update(module if a.name.startswith("__") else f"{module}.{a.name}" for a in node.names)
            else:
                out.add(module)
    return {m for m in out if m == "moebench" or m.startswith("moebench.")}


def _above(imported: set[str], allowed) -> list[str]:
    return sorted(m for m in imported if not any(m == a or m.startswith(a + ".") for a in allowed))


@pytest.mark.parametrize("path", sorted((PACKAGE / "kernels").glob("*.py")), ids=lambda p: p.name)
def test_kernels_import_nothing_above_them(path):
    imported = moebench_imports(path, "moebench.kernels")
    above = _above(imported - {"moebench"}, {"moebench.kernels", *CORE})
    assert not above, f"moebench/kernels/{path.name} imports {above}, above the kernels' floor"


@pytest.mark.parametrize("name", sorted(CORE))
def test_the_core_below_the_kernels_imports_only_the_core(name):
    path = PACKAGE / (name.split(".")[1] + ".py")
    above = _above(moebench_imports(path, "moebench") - {"moebench"}, CORE)
    assert not above, f"{name} imports {above}: it would lift the kernels' floor"


def test_the_import_walk_sees_every_form(tmp_path):
    """The walker itself: deferred, relative and package-root imports count."""
    src = tmp_path / "mod.py"
    src.write_text(
        "import moebench.bench.sweep\nfrom moebench import __version__, tuning\n"
        "def f():\n    from ..backends import registry\n    from .tactic import GemmTactic\n"
        "    from . import gemm\n    import torch\n"
    )
    found = moebench_imports(src, "moebench.kernels")
    assert found == {
        "moebench.bench.sweep",
        "moebench",
        "moebench.tuning",
        "moebench.backends",
        "moebench.kernels.tactic",
        "moebench.kernels.gemm",
    }
    assert _above(found - {"moebench"}, {"moebench.kernels", *CORE}) == [
        "moebench.backends",
        "moebench.bench.sweep",
        "moebench.tuning",
    ]
