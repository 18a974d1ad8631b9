# Config validation (JSON schema in impl/config.py) and path/input helpers shared by every family.
# A bad key, value, data file or model directory fails here, before any job starts.
import json
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, workflow.basedir)

from impl.config import ConfigError, model_dir, read_yaml, split_variant, validate_config, variant_name  # noqa: E402
from impl.provenance import config_hash  # noqa: E402
from impl.dex.schema import Speculative  # noqa: E402

try:
    for _configfile in workflow.configfiles or [os.path.join(workflow.basedir, "configs", "default.yaml")]:
        read_yaml(_configfile)  # Snakemake's own YAML loader keeps the last of a duplicated key silently
    CFG = validate_config(config)
except ConfigError as err:
    raise WorkflowError(str(err))

RESULTS = CFG["results_dir"]
FIGURES = CFG["figures_dir"]
MODELS = CFG["models_dir"]
LOGS = CFG["logs_dir"]
# Timed jobs (the seconds they write are results: vSkipper's profile, knee, cells, ablation, map and step
# benchmark, TEV's verifier latency) take 2 threads, so on the embedded default (snakemake --cores 2) no
# other job runs beside them. Their commands still run torch with the config's `threads`.
TIMED_THREADS = 2
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


def held_out_sources(mix):
    """``sig`` keywords for a drafter's held-out prompt sources (impl.tev.prompts.HELD_OUT_SOURCES: a workload's
    records outside its frozen sample): those workloads' settings, which fix the rows they leave out; no
    keyword when the mix has none, so a ShareGPT / GSM8K drafter keeps its signature."""
    held = {s: (CFG.get("workloads") or {}).get(s) for s in (mix or {}) if s not in ("sharegpt", "gsm8k")}
    return {"held_out": held} if held else {}


def model_path(wildcards):
    """Directory of model {model}: trained by rule train_model (tiny) or given by path (pretrained)."""
    return str(model_dir(CFG, wildcards.model))


def dex_cell_inputs(w):
    """Inputs of a DEX cell; an adapted variant (impl.dex.cell.variant_name) adds the model's inducing
    adapters (rule train_adapters), a plain one its draft model when dex.speculative.assisted or pearl is on
    and, when dex.speculative.dflash is on, its TEV drafters (TEV trains the model) or the base drafter
    trained for DEX (dex.speculative.dflash.drafter, rule train_head)."""
    base, adapted = split_variant(w.variant)
    d = {"prompts": f"{RESULTS}/workloads/{base}/{w.suite}.jsonl", "model": str(model_dir(CFG, base))}
    if adapted:
        d["adapters"] = f"{MODELS}/adapters/{base}"
    else:
        spec = DEX.get("speculative") or {}
        if spec.get("assisted") is not None or spec.get("pearl") is not None:
            d["draft"] = f"{MODELS}/{base}-draft"  # Fig. 5's assisted and PEARL arms draft with it (rule train_draft)
        if spec.get("dflash") is not None and base in ((CFG.get("tev") or {}).get("models") or []):
            d["tev_drafters"] = f"{MODELS}/tev/{base}"  # the trained-head arm's drafters (rule tev_train)
        elif spec.get("dflash") is not None and spec["dflash"].get("drafter") is not None:
            d["tev_drafters"] = f"{MODELS}/dex-head/{base}"  # a base drafter trained for DEX (rule train_head)
    return d



def get_final_output():
    """The default target (the input of the all rule): the report, which depends on every enabled family's tables
    (report_sections())."""
    return [REPORT]


def report_sections():
    """(section name in impl.report.markdown.REPORT_SECTIONS, its tables dir, the files it reads) of every
    method family the config enables, in report order."""
    out = []
    if DEX:
        out.append(("dex", f"{RESULTS}/tables/dex", rules.dex_tables.output + rules.dex_figures.output))
    if TEV:
        out.append(("tev", f"{RESULTS}/tables/tev", rules.tev_tables.output))
    if VSK:
        out.append(("vskipper-serving", VSK_TABLES, VSK_REPORT_INPUTS))
        out.append(("vskipper-bench", VSKB_TABLES, rules.vskipper_bench_tables.output))
        if TINY_MODELS or VSKH_KNEE_BENCH:
            out.append(("vskipper-http", f"{RESULTS}/vskipper/http",
                        expand(f"{RESULTS}/vskipper/http/{{model}}.csv", model=TINY_MODELS)
                        + expand(f"{RESULTS}/vskipper/http/{{model}}.bench_serving.csv", model=VSKH_BENCH_MODELS)
                        + ([VSKH_KNEE_BENCH_OUT] if VSKH_KNEE_BENCH else [])))
        if VSKS:
            out.append(("vskipper-sglang", VSKS_TABLES, VSKS_REPORT_INPUTS))
    return out



# --- vSkipper input functions (workflows/vskipper.smk; they read its VSK_* globals when called) ---------

def vsk_prompts(w):
    """Input function: token-id prompts of workload {suite} for the vSkipper model (rule workload_tokens)."""
    return f"{RESULTS}/workloads/{VSK_MODEL}/{w.suite}.jsonl"


def vsk_sig(*keys):
    """sig() of the given keys of the vskipper section, plus the run-wide keys every timing job uses."""
    return sig("seed", "threads", "device", "dtype", vsk={k: VSK[k] for k in keys})


def vsk_qknee(w):
    """The load workload whose knee gives the served-at-knee rate of quality suite {qsuite}."""
    from impl.vskipper.schema import served_knee_workload

    return served_knee_workload(VSK, w.qsuite)


def vsk_tcfg_path(kind, name):
    """Where the effective config of one extra Table 6 / 7 target is written."""
    return f"{RESULTS}/.config/vskipper/{kind}/{name}.json"


def vsk_tsig(kind, top, keys):
    """Params function: sig() of an extra target's effective config (impl.vskipper.targets.target_sig)
    over its top-level keys and vskipper keys."""
    from impl.vskipper.targets import target_sig

    def params(w):
        return target_sig(VSK_TCFG[(kind, w.vsk_xmodel if kind == "models" else w.vsk_device)], top, keys)
    return params


def vsks_sig(*keys):
    """sig() of the SGLang section's effective config (workflows/vskipper_sglang.smk's VSKS_CFG) over its
    timed top-level keys, the model, engines and sglang keys and ``keys`` of the vskipper section."""
    from impl.vskipper.targets import target_sig

    return target_sig(VSKS_CFG, VSKS_TOP, ("model", "engines", "sglang") + keys)


def vsk_xm_cfg(w):
    """Input function: the effective config of extra model {vsk_xmodel}."""
    return vsk_tcfg_path("models", w.vsk_xmodel)


def vsk_xm_dir(w):
    """Input function: the model directory of extra model {vsk_xmodel}."""
    return str(model_dir(CFG, w.vsk_xmodel))


def vsk_xd_cfg(w):
    """Input function: the effective config of device target {vsk_device}."""
    return vsk_tcfg_path("devices", w.vsk_device)


def vsk_xd_threads(w):
    """Threads of a device job: the cores its torch threads use (never fewer than the main timed jobs)."""
    return max(TIMED_THREADS, VSK_DEVICES[w.vsk_device]["threads"])


def vsk_xd_resources(**defaults):
    """Snakemake resources of a device job, one function per resource: its entry's `resources` (None =
    unset: the profile's default), mem_mb / runtime defaulting to the main rule's."""
    from impl.vskipper.targets import device_resources

    def per_device(values):
        def resource(w):
            return values[w.vsk_device]
        return resource
    return {k: per_device(values) for k, values in device_resources(VSK_DEVICES, **defaults).items()}


EAD_MODELS = CFG["ead"]["models"]
EAD_WORKLOADS = CFG["ead"]["workloads"]
# shared-context EAD (rule ead_shared) when the compared models share a tokenizer (ead.compare.shared)
EAD_SHARED = bool(CFG["ead"].get("compare") and CFG["ead"]["compare"]["shared"])
TINY_MODELS = [m for m, v in CFG["models"].items() if v["kind"] == "tiny"]

wildcard_constraints:
    model="|".join(map(re.escape, CFG["models"])),
    suite="|".join(map(re.escape, CFG["workloads"])),
