"""Where modules live: the runtime package never imports the developer tools, and no
module imports itself round a circle.

``provisioner/devtools/`` (demo, test harness, simulator) may import the runtime; no
module elsewhere under ``provisioner/`` may import ``devtools`` (docs/developers.md).
Imports inside functions count: a lazy import hides a circle, it does not break it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "provisioner"
RUNTIME = sorted(p for p in PACKAGE.rglob("*.py") if "devtools" not in p.relative_to(PACKAGE).parts)


def imported_modules(path: Path) -> list[str]:
    """Every module name an ``import`` or ``from … import`` in ``path`` names (dots kept)."""
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            names += [base] + [f"{base}.{alias.name}" for alias in node.names]
    return names


def test_the_runtime_is_found() -> None:
    assert PACKAGE / "broker" / "app.py" in RUNTIME
    assert not any("devtools" in p.parts for p in RUNTIME)


@pytest.mark.parametrize("path", RUNTIME, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_runtime_never_imports_devtools(path: Path) -> None:
    bad = [n for n in imported_modules(path) if "devtools" in n.split(".")]
    assert not bad, f"{path.relative_to(PACKAGE)} imports {bad}: the runtime must not need a tool"


def _module_name(path: Path) -> str:
    """``provisioner/broker/handlers.py`` -> ``provisioner.broker.handlers``."""
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def our_imports(module: str) -> set[str]:
    """The modules of ours that ``module`` imports anywhere in its text: at its top, inside
    functions (a lazy import hides a cycle, it does not break it), under TYPE_CHECKING.

    ``from . import x`` and ``from .a import b`` count ``x`` and ``a.b`` when those are
    modules, else the module ``a``.
    """
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                prefix = ".".join(base)
                base_name = f"{prefix}.{node.module}" if node.module else prefix
            else:
                base_name = node.module or ""
            for alias in node.names:
                sub = f"{base_name}.{alias.name}"
                targets.append(sub if sub in MODULES else base_name)
        for target in targets:
            while target and target not in MODULES:  # provisioner.x.y where y is a name
                target = target.rpartition(".")[0]
            if target and target != module:
                found.add(target)
    return found


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of ``graph`` with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
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
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_the_import_graph_is_read() -> None:
    # the edges this test relies on, a function-level import among them
    assert "provisioner.broker.openapi" in our_imports("provisioner.broker.routes")
    assert "provisioner.wire" in our_imports("provisioner.model")
    assert "provisioner.errors" in our_imports("provisioner.wire")
    assert "provisioner.doctor" in our_imports("provisioner.cli")  # inside a function


def test_the_cycle_finder_finds_a_hidden_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_cycles(graph) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles() -> None:
    """No module of ``provisioner`` reaches itself through imports (function-level ones
    included): the floors of docs/developers.md stay a ladder, not a circle."""
    graph = {m: our_imports(m) for m in MODULES}
    cycles = import_cycles(graph)
    assert not cycles, "import cycles among provisioner modules: " + "; ".join(
        " <-> ".join(c) for c in cycles
    )
