#!/usr/bin/env bash
# Test command: set up the environment and run every test, including the slow ones (the smoke DAG end
# to end, an interrupted-and-resumed run, the SLURM-profile dry run and snakemake --lint).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
source scripts/data_dir.sh
# Two pytest-xdist workers with one torch thread each: the smoke DAG (tests using `smoke_run`, kept on
# one worker and started first) overlaps the unit tests; two multi-threaded torch processes on 2 cores
# would oversubscribe them. PYTEST_WORKERS=0 runs everything in one process, =auto one worker per core.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
.venv/bin/python -m pytest -n "${PYTEST_WORKERS:-2}" --dist loadgroup "$@"
