#!/usr/bin/env bash
# Download into .gpu-wheels/ the wheels scripts/gpu_check.sh installs on a device without a package
# registry (CPython 3.12, x86-64 Linux, with its own torch, transformers and numpy): pydantic and its
# dependencies, at the versions this project pins. About 2.5 MB.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
rm -rf .gpu-wheels
mkdir .gpu-wheels
"$PY" -m pip download -q --only-binary=:all: --no-deps --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 -d .gpu-wheels \
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-extensions==4.16.0 typing-inspection==0.4.5
ls .gpu-wheels
