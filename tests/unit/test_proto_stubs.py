"""The checked-in stubs in gradwire/v1/ are exactly what scripts/gen_protos.py makes from proto/.

Regenerates into a temporary directory and compares byte for byte, so editing a .proto without
regenerating, hand-editing a stub, or generating with another grpcio-tools than the pinned one fails here.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
STUB_DIR = Path("gradwire") / "v1"
STUB_GLOBS = ("*_pb2.py", "*_pb2.pyi", "*_pb2_grpc.py")


def _stubs(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for pattern in STUB_GLOBS for p in (root / STUB_DIR).glob(pattern)}


def test_every_proto_has_checked_in_stubs() -> None:
    protos = sorted(p.stem for p in (REPO_ROOT / "proto" / STUB_DIR).glob("*.proto"))
    assert protos, "no .proto files found"
    stubs = _stubs(REPO_ROOT)
    for stem in protos:
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
            assert stem + suffix in stubs, f"{STUB_DIR / (stem + suffix)} missing: run scripts/gen_protos.py"


def test_checked_in_stubs_match_regeneration(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts" / "gen_protos.py"), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, f"gen_protos.py failed:\n{run.stdout}{run.stderr}"
    fresh = _stubs(tmp_path)
    checked_in = _stubs(REPO_ROOT)
    assert fresh, "gen_protos.py generated nothing"
    assert sorted(checked_in) == sorted(fresh), "stub files missing or extra: run scripts/gen_protos.py"
    drifted = [name for name in fresh if fresh[name] != checked_in[name]]
    assert not drifted, f"stale stubs {drifted}: run scripts/gen_protos.py and commit the result"
