"""A regular install (``pip install .``, as deploy/Dockerfile does) ships exactly the packages pyproject names:
every source directory with an ``__init__.py`` must be among them, or the image lacks it."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _import_name(directory: Path, package_dir: dict[str, str]) -> str | None:
    """The import name ``directory`` installs as, through the longest ``package-dir`` mapping above it."""
    rel = directory.relative_to(ROOT).as_posix()
    best = None
    for name, src in package_dir.items():
        if (rel == src or rel.startswith(src + "/")) and (best is None or len(src) > len(package_dir[best])):
            best = name
    if best is None:
        return None
    rest = rel[len(package_dir[best]) :].strip("/")
    return ".".join([best, *rest.split("/")]) if rest else best


def test_every_source_package_is_installed() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11 on
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    package_dir, packages = setuptools["package-dir"], set(setuptools["packages"])
    found = set()
    for src in set(package_dir.values()):
        for init in (ROOT / src).rglob("__init__.py"):
            name = _import_name(init.parent, package_dir)
            if name is not None and "__pycache__" not in init.parts:
                found.add(name)
    assert found, "no packages found under package-dir"
    assert not found - packages, f"packages a regular install would leave out: {sorted(found - packages)}"
    assert not packages - found, f"packages named in pyproject without an __init__.py: {sorted(packages - found)}"
