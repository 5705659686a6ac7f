"""Data flows one way: the two sides meet only in shared modules, and the pure layers import neither side.

The coordinator imports nothing of ``worker/`` (what both sides need - the server factory, the worker
link and its errors - lives in ``gradwire/``), the worker nothing of ``coordinator/``, and ``compression/``,
``models/`` and ``gradwire/`` neither of them.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# folder -> the packages its modules must not import
FORBIDDEN = {
    "coordinator": ("gradwire.worker",),
    "worker": ("gradwire.coordinator",),
    "compression": ("gradwire.worker", "gradwire.coordinator"),
    "models": ("gradwire.worker", "gradwire.coordinator"),
    "gradwire": ("gradwire.worker", "gradwire.coordinator"),
}


def imported(path: Path) -> set[str]:
    """Every module ``path`` imports, at the top or inside a function."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_no_module_reaches_across_the_boundary(folder: str) -> None:
    files = [p for p in (ROOT / folder).rglob("*.py") if "v1" not in p.parts]  # generated stubs aside
    assert files
    crossings = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in files
        for name in sorted(imported(path))
        if name.startswith(FORBIDDEN[folder])
    ]
    assert not crossings, "\n".join(crossings)


def test_the_check_sees_an_import_inside_a_function(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from gradwire.worker.engine import WorkerEngine\n")
    assert "gradwire.worker.engine" in imported(module)
