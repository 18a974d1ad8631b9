#!/usr/bin/env bash
# Test command: set up the environment and run every test, including the slow ones (the smoke DAG end
# to end, an interrupted-and-resumed run, the SLURM-profile dry run and snakemake --lint).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
source scripts/data_dir.sh
.venv/bin/python -m pytest "$@"
