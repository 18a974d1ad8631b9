#!/usr/bin/env bash
# Main job: set up the environment, run the whole DAG on the embedded default (CPU, tiny models
# trained from the real datasets), and print where the report is. Extra arguments go to snakemake,
# e.g.  scripts/run.sh --configfile configs/smoke.yaml
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
source scripts/data_dir.sh
extra=()
if [ -n "${IMPL_DATA_DIR:-}" ]; then extra+=(--config "data_dir=$IMPL_DATA_DIR"); fi
.venv/bin/snakemake --cores "${CORES:-2}" "${extra[@]}" "$@"
.venv/bin/python - "$@" <<'PY'
import sys, yaml
args = sys.argv[1:]
cfg = args[args.index("--configfile") + 1] if "--configfile" in args else "configs/default.yaml"
print(f"report: {yaml.safe_load(open(cfg))['results_dir']}/REPORT.md")
PY
