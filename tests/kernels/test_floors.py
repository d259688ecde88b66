"""The kernels' floor holds: nothing in moebench/kernels/ imports a layer
above it (tuning, backends, bench, integration, reports, cli, ...).

What the kernels may import, from the data flow (DESIGN.md, "The routed-expert
path"): themselves; the package root (`__version__`); and the core the layer
call is built from: `models` (shapes, MX block), `formats` (the canonical
MXFP4 / MXFP8 weights the kernels lay out), `routing` (the router constants
the fused top-k matches bit for bit), `record` (the route record the kernels
build and read) and `moe_output` (the contract their output fills). Those
core modules import only one another. Every import is counted: module-level
and deferred (inside functions), absolute and relative."""

from pathlib import Path

import pytest
from import_graph import PACKAGE, imports_of, modules  # tests/import_graph.py (tests/: conftest.py's folder)

#: The core below the kernels.
CORE = {"moebench.models", "moebench.formats", "moebench.routing", "moebench.record", "moebench.moe_output"}


def moebench_imports(path: Path) -> set[str]:
    """The moebench modules `path` imports anywhere in its body (tests/import_graph.py, whose own test is
    tests/test_imports.py's); the package root (`__version__`) counts as 'moebench'."""
    return set(imports_of(path, set(modules())))


def _above(imported: set[str], allowed) -> list[str]:
    return sorted(m for m in imported if not any(m == a or m.startswith(a + ".") for a in allowed))


@pytest.mark.parametrize("path", sorted((PACKAGE / "kernels").glob("*.py")), ids=lambda p: p.name)
def test_kernels_import_nothing_above_them(path):
    imported = moebench_imports(path)
    above = _above(imported - {"moebench"}, {"moebench.kernels", *CORE})
    assert not above, f"moebench/kernels/{path.name} imports {above}, above the kernels' floor"


@pytest.mark.parametrize("name", sorted(CORE))
def test_the_core_below_the_kernels_imports_only_the_core(name):
    path = PACKAGE / (name.split(".")[1] + ".py")
    above = _above(moebench_imports(path) - {"moebench"}, CORE)
    assert not above, f"{name} imports {above}: it would lift the kernels' floor"
