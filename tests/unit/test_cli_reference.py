"""docs/reference/cli.md is exactly what scripts/gen_cli_reference.py makes from the commands' parsers.

Regenerates the page in memory and compares it with the checked-in file, as test_proto_stubs does for the
stubs: a flag added, renamed or re-documented in coordinator/config.py, coordinator/cli.py or worker/cli.py
without regenerating fails here.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from gradwire.coordinator.config import TrainConfig

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "scripts" / "gen_cli_reference.py"
REFERENCE = REPO_ROOT / "docs" / "reference" / "cli.md"
REGENERATE = "run python scripts/gen_cli_reference.py and commit docs/reference/cli.md"


@pytest.fixture(scope="module")
def generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_cli_reference", SCRIPT)
    assert spec is not None and spec.loader is not None, f"cannot load {SCRIPT}"
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and typing look modules up by name
    try:
        spec.loader.exec_module(module)
    finally:
        sys.modules.pop(spec.name, None)
    return module


def test_checked_in_reference_matches_regeneration(generator: ModuleType) -> None:
    assert REFERENCE.is_file(), f"{REFERENCE.relative_to(REPO_ROOT)} missing: {REGENERATE}"
    fresh = generator.render()
    checked_in = REFERENCE.read_text(encoding="utf-8")
    if fresh != checked_in:
        changed = [
            f"  line {i + 1}: {new!r}"
            for i, (old, new) in enumerate(zip(checked_in.splitlines(), fresh.splitlines()))
            if old != new
        ][:5]
        pytest.fail(f"docs/reference/cli.md is stale: {REGENERATE}\nfirst differences:\n" + "\n".join(changed))


def test_every_setting_has_its_row(generator: ModuleType) -> None:
    page = generator.render()
    missing = [f.name for f in dataclasses.fields(TrainConfig) if f'id="train-{f.name.replace("_", "-")}"' not in page]
    assert not missing, f"TrainConfig fields without a row in the reference: {missing}"
    for flag in ("port", "nproc-per-node", "node-mode", "join", "tunnel", "tls-client-ca"):
        assert f'id="serve-{flag}"' in page, f"worker serve --{flag} has no row"


def test_render_ignores_the_terminal(generator: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "40")
    narrow = generator.render()
    monkeypatch.setenv("COLUMNS", "300")
    assert generator.render() == narrow
