"""Where modules live: the runtime package never imports the developer tools.

``provisioner/devtools/`` (demo, test harness, simulator) may import the runtime; no
module elsewhere under ``provisioner/`` may import ``devtools`` (docs/developers.md).
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
