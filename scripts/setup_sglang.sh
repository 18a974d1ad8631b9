#!/usr/bin/env bash
# Create ./.venv-sglang: upstream SGLang (pinned) in its own environment, for SGLang's server (the upstream and
# routed vSkipper arms on SGLang) and its serving benchmark client (`python -m sglang.bench_serving`, the client
# of the vSkipper paper). SGLang pins its own torch (2.14.1 with CUDA wheels, about 11 GB in all), so it cannot
# share ./.venv. Idempotent: re-installs only when the pin below changes. PYTHON=/path/to/python3.11 picks the
# interpreter the venv is made from (default python3). On a cluster, run it once on a node with internet, on a
# filesystem the compute nodes see, and give the absolute path in the config. Point the harness at it with
#   vskipper.sglang.python: .venv-sglang/bin/python                  (the SGLang arms: configs/sglang.yaml)
#   vskipper.http.bench_serving.python: .venv-sglang/bin/python      (SGLang's client: configs/bench_serving.yaml)
# or `python -m impl vskipper-http-check ... --sglang-python .venv-sglang/bin/python`.
set -euo pipefail
cd "$(dirname "$0")/.."
SGLANG_VERSION=0.5.23
PY=${PYTHON:-python3}
if [ ! -x .venv-sglang/bin/python ]; then
  "$PY" -m venv .venv-sglang
fi
stamp=.venv-sglang/.installed-sglang-$SGLANG_VERSION
if [ ! -f "$stamp" ]; then
  .venv-sglang/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
  .venv-sglang/bin/python -m pip install -q "sglang==$SGLANG_VERSION" 2>&1 | grep -v "^WARNING: Location" || true
  HF_HUB_OFFLINE=1 .venv-sglang/bin/python -m sglang.bench_serving --help >/dev/null
  rm -f .venv-sglang/.installed-*
  touch "$stamp"
fi
echo ".venv-sglang/bin/python (sglang $SGLANG_VERSION)"
