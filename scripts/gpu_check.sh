#!/usr/bin/env bash
# The GPU check (impl/gpu_check.py): every method measured on a CUDA machine in one run of < 8 min,
# with that machine's own torch and transformers. Usage:
#   scripts/gpu_check.sh OUT_DIR [impl.gpu_check args]     e.g. scripts/gpu_check.sh "$OUT/gpu"
# What the device lacks (pydantic and its dependencies) is installed from .gpu-wheels/ (made here by
# scripts/gpu_wheels.sh) into a private folder on PYTHONPATH, never into the device's Python.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: scripts/gpu_check.sh OUT_DIR [args]}
shift
PY=${PYTHON:-python3}
site=$(mktemp -d)
trap 'rm -rf "$site"' EXIT
if ! "$PY" -c "import pydantic" 2>/dev/null; then
  if ! ls .gpu-wheels/*.whl >/dev/null 2>&1; then
    echo "error: this Python has no pydantic and there is no .gpu-wheels/ (run scripts/gpu_wheels.sh where pip works)" >&2
    exit 2
  fi
  "$PY" -m pip install -q --no-index --no-deps --target "$site" .gpu-wheels/*.whl
fi
PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m impl.gpu_check --out "$out" "$@"
