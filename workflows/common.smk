# Config validation (JSON schema in impl/config.py) and path/input helpers shared by every family.
# A bad key, value, data file or model directory fails here, before any job starts.
import json
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, workflow.basedir)

from impl.config import ConfigError, model_dir, split_variant, validate_config, variant_name  # noqa: E402
from impl.provenance import config_hash  # noqa: E402

try:
    CFG = validate_config(config)
except ConfigError as err:
    raise WorkflowError(str(err))

RESULTS = CFG["results_dir"]
FIGURES = CFG["figures_dir"]
MODELS = CFG["models_dir"]
LOGS = CFG["logs_dir"]
# Jobs run `python -m impl ...` with the interpreter that runs Snakemake (its bin dir first on PATH).
envvars:
    "PATH",


os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"

# The validated config (with --config overrides and defaults) is handed to every command as one file
# at a fixed path (so the shell command and params stay the same across config edits); rules re-run
# when the config sections they use change (their `sig` param), not on every edit. It is written when
# execution starts (onstart), so a dry run writes nothing.
EFFECTIVE_CONFIG = f"{RESULTS}/.config/effective.json"
# Further effective configs (path -> validated config) that families derive from CFG, e.g. one per extra
# vSkipper Table 6 / 7 target (workflows/vskipper.smk); written beside it, the same way.
EXTRA_CONFIGS = {}


onstart:
    for _path, _cfg in {EFFECTIVE_CONFIG: CFG, **EXTRA_CONFIGS}.items():
        _text = json.dumps(_cfg, indent=2, sort_keys=True)
        _eff = Path(_path)
        if not _eff.is_file() or _eff.read_text() != _text:
            _eff.parent.mkdir(parents=True, exist_ok=True)
            _tmp = _eff.with_suffix(f".{os.getpid()}.tmp")
            _tmp.write_text(_text)
            _tmp.replace(_eff)


def sig(*keys, **extra):
    """Hash of the config sections a rule depends on (a param, so edits elsewhere don't re-run it)."""
    return config_hash({**{k: CFG.get(k) for k in keys}, **extra})


def model_path(wildcards):
    """Directory of model {model}: trained by rule train_model (tiny) or given by path (pretrained)."""
    return str(model_dir(CFG, wildcards.model))


def dex_cell_inputs(w):
    """Inputs of a DEX cell; an adapted variant (impl.dex.cell.variant_name) adds the model's inducing
    adapters (rule train_adapters)."""
    base, adapted = split_variant(w.variant)
    d = {"prompts": f"{RESULTS}/workloads/{base}/{w.suite}.jsonl", "model": str(model_dir(CFG, base))}
    if adapted:
        d["adapters"] = f"{MODELS}/adapters/{base}"
    return d


# Method-family .smk files append the outputs the report needs and their report sections
# ("<module>:<tables dir>", where module has report_section(tables_dir, figures_dir, base)).
REPORT_EXTRA = []
REPORT_SECTIONS = []

EAD_MODELS = CFG["ead"]["models"]
EAD_WORKLOADS = CFG["ead"]["workloads"]
# shared-context EAD (rule ead_shared) when the compared models share a tokenizer (ead.compare.shared)
EAD_SHARED = bool(CFG["ead"].get("compare") and CFG["ead"]["compare"]["shared"])
TINY_MODELS = [m for m, v in CFG["models"].items() if v["kind"] == "tiny"]

wildcard_constraints:
    model="|".join(map(re.escape, CFG["models"])),
    suite="|".join(map(re.escape, CFG["workloads"])),
