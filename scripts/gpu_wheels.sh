#!/usr/bin/env bash
# The wheels a bare GPU machine with CUDA torch but no network lacks for gradwire's GPU checks
# (scripts/gpu_check.sh): gRPC, its health service and protobuf at the versions the checked-in stubs need,
# for that machine's Python (3.12, x86-64 Linux). Run where pip reaches a package index; they land in .whl/
# (git-ignored), to travel with the tree. PYTHON_VERSION=3.11 etc. for another Python there.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

DEST=.whl
PY=${PYTHON_VERSION:-3.12}
PACKAGES=(grpcio==1.85.3 grpcio-health-checking==1.85.1 protobuf==7.36.2)
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64)

mkdir -p "$DEST"
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version "$PY" --implementation cp \
    "${PLATFORMS[@]/#/--platform=}" --dest "$DEST" "${PACKAGES[@]}"
ls -1 "$DEST"
