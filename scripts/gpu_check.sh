#!/usr/bin/env bash
# gradwire's GPU checks in one run, on a machine with CUDA torch and no network: the carried wheels
# (scripts/gpu_wheels.sh, in .whl/) into a private site folder, then, each under its share of the time left,
# the CUDA tests, `benchmarks.utilisation --device cuda` at gpt-80m (the busy-GPU targets), `benchmarks.gpu`'s
# checks, and llama-1b's local-SGD rounds against its bare loop. Each step's stdout (a benchmark's JSON) goes
# to $OUT/STEP.out and its stderr to $OUT/STEP.log ($OUT: a fresh temporary folder if unset; eight files); a
# step that runs out of time is killed and the next one starts.
#
#   bash scripts/gpu_check.sh [SECONDS]      # default 540: the whole run, install included
#
# GW_DEVICE=cpu GW_QUICK=1 runs the same plumbing at gpt-tiny on a machine without a GPU; GW_PYTHON names the
# interpreter (default python3).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

BUDGET=${1:-540}
DEVICE=${GW_DEVICE:-cuda}
OUT=${OUT:-$(mktemp -d)}
SITE=${GW_SITE:-/tmp/gradwire-site}
PY=${GW_PYTHON:-python3}
DEADLINE=$((SECONDS + BUDGET))
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1

left() { echo $((DEADLINE - SECONDS)); }
# step NAME SHARE CMD...: CMD under SHARE percent of the time left (at least 30 s); its stdout (the JSON of a
# benchmark) to $OUT/NAME.out, its stderr to $OUT/NAME.log.
step() {
    local name=$1 share=$2 t0=$SECONDS
    shift 2
    local limit=$(($(left) * share / 100))
    ((limit < 30)) && limit=30
    echo "== $name: up to ${limit}s: $*"
    timeout -k 10 "$limit" "$@" >"$OUT/$name.out" 2>"$OUT/$name.log"
    echo "== $name: exit $? after $((SECONDS - t0))s"
    tail -n 5 "$OUT/$name.log"
}

mkdir -p "$OUT"
{
    $PY --version
    $PY -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available(),
        torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")'
    command -v nvidia-smi >/dev/null && nvidia-smi -L
    git log -1 --format='%H %s' 2>/dev/null
    date -u
} 2>&1

# The carried wheels first on the path (they override the image's older gRPC and protobuf). gradwire itself is
# not installed: its subpackages, which live beside gradwire/ in the tree (pyproject's package-dir), are linked
# into it where they do not import (this copy of the tree only).
if compgen -G ".whl/*.whl" >/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
    export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
fi
if ! $PY -c 'import gradwire.compression' 2>/dev/null; then
    for package in compression models worker coordinator; do ln -sfn "../$package" "gradwire/$package"; done
fi
$PY -c 'import gradwire.coordinator.cli, gradwire.worker.cli, benchmarks.utilisation, benchmarks.gpu' || exit 1
echo "ready in ${SECONDS}s"

# The steps' sizes: the measurements at their real sizes, or with GW_QUICK the same commands at gpt-tiny.
if [ -n "${GW_QUICK:-}" ]; then
    SIZE=(--quick) RUNS=bare,grad-1,local-1 CHECKS=(--model gpt-tiny --updates 2 --checks fingerprint) LLAMA=(--quick)
else
    SIZE=() RUNS=bare,grad-1,grad-overlap-1,local-1,local-overlap-1 LLAMA=(--model llama-1b)
    CHECKS=(--model gpt-80m --checks refine,fingerprint,drift_float32)
fi
step tests 15 $PY -m pytest -q -p no:cacheprovider -m cuda tests/integration/test_cuda.py
step utilisation 60 $PY -m benchmarks.utilisation --device "$DEVICE" "${SIZE[@]}" --runs "$RUNS" --json
step gpu 50 $PY -m benchmarks.gpu --device "$DEVICE" "${CHECKS[@]}" --json
step llama 100 $PY -m benchmarks.utilisation --device "$DEVICE" "${LLAMA[@]}" --runs bare,local-1 --json
echo "done in $((BUDGET - $(left)))s; in $OUT: $(ls "$OUT" | tr '\n' ' ')"
