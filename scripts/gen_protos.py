"""Regenerate the Python stubs in gradwire/v1/ from proto/gradwire/v1/*.proto.

The .proto files are the only contract; the generated ``*_pb2.py``, ``*_pb2.pyi`` and ``*_pb2_grpc.py``
are checked in so that installing gradwire needs no code generator. This is the one way to regenerate
them, and tests/unit/test_proto_stubs.py runs it into a temporary directory to fail when the checked-in
stubs drift from the protos (or from the pinned grpcio-tools in pyproject.toml).

Usage, from anywhere:
    python scripts/gen_protos.py              # rewrite the stubs in place
    python scripts/gen_protos.py --out DIR    # write DIR/gradwire/v1/*, leave the repo alone
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO_ROOT / "proto"
# The proto package path doubles as the Python package path: gradwire/v1/x.proto -> gradwire/v1/x_pb2.py,
# and generated imports read `from gradwire.v1 import x_pb2`.
PROTO_PACKAGE = Path("gradwire") / "v1"


def proto_files() -> list[Path]:
    """Every .proto of the package, relative to PROTO_ROOT, sorted so runs are repeatable."""
    files = sorted(p.relative_to(PROTO_ROOT) for p in (PROTO_ROOT / PROTO_PACKAGE).glob("*.proto"))
    if not files:
        raise SystemExit(f"no .proto files under {PROTO_ROOT / PROTO_PACKAGE}")
    return files


def generate(out: Path) -> list[Path]:
    """Run protoc on every proto into ``out``; return the stub files written, relative to ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    files = proto_files()
    cmd = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        "-I",
        ".",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        # Paths relative to -I, so the generated files record "gradwire/v1/x.proto", not a machine path.
        *(str(f) for f in files),
    ]
    subprocess.run(cmd, cwd=PROTO_ROOT, check=True)
    return sorted(p.relative_to(out) for p in (out / PROTO_PACKAGE).glob("*_pb2*.py*"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=REPO_ROOT,
        help="root to write gradwire/v1/ under (default: the repo root, i.e. overwrite the checked-in stubs)",
    )
    args = parser.parse_args(argv)
    for path in generate(args.out.resolve()):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
