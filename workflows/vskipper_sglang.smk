# The vSkipper protocol on upstream SGLang (vskipper.sglang_section; off when absent): both arm families on
# SGLang's own server, vSkipper as an out-of-tree SGLang model (impl/vskipper/sglang_model), beside the main
# run, for the report section "vSkipper on upstream SGLang" (issue "Upstream SGLang as a real engine arm").
#   knee on SGLang's upstream arm (per SGLang workload) -> cells at the section's load points -> mechanism
#   ablation at the knee -> (sglang_section.quality) the quality 2x2 with C and D on SGLang -> the ordinary
#   vSkipper tables in {VSK_TABLES}/sglang -> both engines side by side.
# The jobs re-run the main rules' commands (use rule ... with:) on their own effective config
# (impl.vskipper.schema.engine_config: vskipper.engines = sglang for both families), written beside
# EFFECTIVE_CONFIG when execution starts. The FlexiDepth checkpoint and the mode-switch thresholds are the
# main run's. Needs the SGLang environment (scripts/setup_sglang.sh; the config check names the key).
from impl.vskipper.engine_report import ENGINE_TABLE_NAMES
from impl.vskipper.schema import engine_config, sglang_section_settings
from impl.vskipper.serving_report import QUALITY_TABLE_NAMES as VSK_QUALITY_TABLE_NAMES
from impl.vskipper.serving_report import TABLE_NAMES as VSK_TABLE_NAMES

VSKS = sglang_section_settings(VSK) if VSK else None
VSKS_REPORT_INPUTS = []
if VSKS:
    VSKS_DIR = f"{VSK_DIR}/engines/sglang"
    VSKS_TABLES = f"{VSK_TABLES}/sglang"
    VSKS_CFG_PATH = f"{RESULTS}/.config/vskipper/engines/sglang.json"
    VSKS_CFG = engine_config(CFG, "sglang")
    EXTRA_CONFIGS[VSKS_CFG_PATH] = VSKS_CFG
    VSKS_W0 = VSKS["workloads"][0]
    VSKS_TOP = ("seed", "threads", "device", "dtype")
    # the main run's engine label (its arm families' engines)
    _e = VSK["engines"]
    VSKS_MAIN_ENGINE = _e["upstream"] if _e["upstream"] == _e["routed"] else f"{_e['upstream']}+{_e['routed']}"



    use rule vskipper_knee as vskipper_sglang_knee with:
        output:
            f"{VSKS_DIR}/knee/{{suite}}.json",
        params:
            cfg=VSKS_CFG_PATH,
            sig=vsks_sig("knee", "requests", "max_new_tokens", "load_points", "timeout_s"),
        log:
            f"{LOGS}/vskipper/sglang/knee_{{suite}}.log",

    use rule vskipper_cell as vskipper_sglang_cell with:
        input:
            **{**VSK_CELL_INPUTS, "knee": f"{VSKS_DIR}/knee/{{suite}}.json"},
        output:
            f"{VSKS_DIR}/cells/{{suite}}/{{vsk_point}}.jsonl",
        params:
            cfg=VSKS_CFG_PATH,
            args=lambda w: f"--point {w.vsk_point} --experiment main",
            sig=vsks_sig("requests", "max_new_tokens", "repetitions", "lanes", "timeout_s"),
        log:
            f"{LOGS}/vskipper/sglang/cells/{{suite}}/{{vsk_point}}.log",

    VSKS_CELLS = expand(f"{VSKS_DIR}/cells/{{suite}}/{{p}}.jsonl", suite=VSKS["workloads"], p=VSKS["points"])
    VSKS_ABLATION = [f"{VSKS_DIR}/ablation/{VSKS_W0}.jsonl"] if VSKS["ablation"] else []

    if VSKS_ABLATION:

        use rule vskipper_ablation as vskipper_sglang_ablation with:
            input:
                **{**VSK_CELL_INPUTS, "knee": f"{VSKS_DIR}/knee/{{suite}}.json"},
            output:
                f"{VSKS_DIR}/ablation/{{suite}}.jsonl",
            params:
                cfg=VSKS_CFG_PATH,
                args=("--point knee --experiment ablation --lanes matched --drop-ids "
                      f"--repetitions {VSK['ablation_repetitions']} --arms {' '.join(VSK['ablations'])}"),
                sig=vsks_sig("requests", "max_new_tokens", "ablations", "ablation_repetitions", "timeout_s"),
            log:
                f"{LOGS}/vskipper/sglang/ablation_{{suite}}.log",

    # the quality 2x2 with C and D on SGLang (quality-cell serves them on vskipper.engines.routed's engine)
    VSKS_QUALITY = (expand(f"{VSKS_DIR}/quality/{{qsuite}}.jsonl", qsuite=VSK_Q["tasks"])
                    if VSKS["quality"] and VSK_Q else [])

    if VSKS_QUALITY:

        use rule vskipper_quality as vskipper_sglang_quality with:
            output:
                rows=f"{VSKS_DIR}/quality/{{qsuite}}.jsonl",
                summary=f"{VSKS_DIR}/quality/{{qsuite}}.json",
                requests=f"{VSKS_DIR}/quality/{{qsuite}}_requests.jsonl",
                work=directory(f"{VSKS_DIR}/quality/{{qsuite}}_run"),
            params:
                cfg=VSKS_CFG_PATH,
                sig=vsks_sig("engine", "quality"),
            log:
                f"{LOGS}/vskipper/sglang/quality_{{qsuite}}.log",

    rule vskipper_sglang_tables:
        conda:
            "../env.yaml"
        input:
            knee=expand(f"{VSKS_DIR}/knee/{{suite}}.json", suite=VSKS["workloads"]),
            thresholds=f"{VSK_DIR}/thresholds/flexidepth.json",
            flexidepth=rules.vskipper_train_flexidepth.output.summary,
            cells=VSKS_CELLS,
            ablation=VSKS_ABLATION,
            quality=VSKS_QUALITY,
        output:
            expand(f"{VSKS_TABLES}/{{name}}.{{ext}}", name=list(VSK_TABLE_NAMES)
                   + (list(VSK_QUALITY_TABLE_NAMES) if VSKS_QUALITY else []), ext=["csv", "md"]),
        params:
            out=lambda w, output: os.path.dirname(output[0]),
            quality=lambda w, input: ("--quality " + " ".join(input.quality)) if VSKS_QUALITY else "",
        log:
            f"{LOGS}/vskipper/sglang/tables.log",
        shell:
            "python -m impl vskipper-tables --knee {input.knee} --thresholds {input.thresholds} "
            "--flexidepth {input.flexidepth} --cells {input.cells} --ablation {input.ablation} "
            "{params.quality} --out-dir {params.out} 2> {log}"

    rule vskipper_engine_tables:
        conda:
            "../env.yaml"
        input:
            main=rules.vskipper_tables.output,
            sglang=rules.vskipper_sglang_tables.output,
        output:
            expand(f"{VSKS_TABLES}/{{name}}.{{ext}}", name=ENGINE_TABLE_NAMES, ext=["csv", "md"]),
        params:
            main=lambda w, input: os.path.dirname(input.main[0]),
            sglang=lambda w, input: os.path.dirname(input.sglang[0]),
            out=lambda w, output: os.path.dirname(output[0]),
            label=VSKS_MAIN_ENGINE,
        log:
            f"{LOGS}/vskipper/sglang/engine_tables.log",
        shell:
            "python -m impl vskipper-engine-tables --engine {params.label}={params.main} --engine sglang={params.sglang} "
            "--out-dir {params.out} 2> {log}"

    VSKS_REPORT_INPUTS = rules.vskipper_sglang_tables.output + rules.vskipper_engine_tables.output
