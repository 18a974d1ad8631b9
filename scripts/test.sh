#!/usr/bin/env bash
# Test command: set up the environment and run every test, including the slow ones (the smoke DAG end
# to end, an interrupted-and-resumed run, the SLURM-profile dry run and snakemake --lint).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
# Upstream SGLang in ./.venv-sglang (its own torch, about 11 GB; 3-10 min the first time, nothing after):
# the tests of SGLang as an engine arm and of vSkipper inside SGLang start real servers with it.
# IMPL_SGLANG=0 skips the install; those tests then skip.
if [ "${IMPL_SGLANG:-1}" != "0" ]; then
  bash scripts/setup_sglang.sh
fi
source scripts/data_dir.sh
# Two pytest-xdist workers with one torch thread each: the smoke DAG (tests using `smoke_run`, kept on
# one worker and started first) overlaps the unit tests; two multi-threaded torch processes on 2 cores
# would oversubscribe them. PYTEST_WORKERS=0 runs everything in one process, =auto one worker per core.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
.venv/bin/python -m pytest -n "${PYTEST_WORKERS:-2}" --dist loadgroup "$@"
