# Tables and figures from raw rows, and results/REPORT.md linking them.
TABLES = f"{RESULTS}/tables"
REPORT = f"{RESULTS}/REPORT.md"
TABLE_NAMES = ["models", "training", "val_loss_by_depth", "ead_summary", "ead_hist", "s_x", "nested_chains",
               "selection", "selection_best", "ar_throughput"] + (
    ["ls_vs_std"] if CFG["ead"].get("compare") else []) + (
    ["ls_vs_std_shared", "ead_shared_summary"] if EAD_SHARED else [])
FIGURE_NAMES = ["ead_hist", "ead_means", "s_x_vs_k", "selection"] + (["loss_by_depth"] if TINY_MODELS else [])


rule tables:
    conda:
        "../env.yaml"
    input:
        ead=expand(f"{RESULTS}/ead/{{model}}/{{suite}}.jsonl", model=EAD_MODELS, suite=EAD_WORKLOADS),
        ar=expand(f"{RESULTS}/ar/{{model}}/{{suite}}.jsonl", model=EAD_MODELS, suite=EAD_WORKLOADS),
        train=expand(f"{RESULTS}/train/{{model}}.json", model=[m for m in EAD_MODELS if m in TINY_MODELS]),
        shared=expand(f"{RESULTS}/ead_shared/{{suite}}.jsonl", suite=EAD_WORKLOADS if EAD_SHARED else []),
        models=[str(model_dir(CFG, m)) for m in EAD_MODELS],
    output:
        expand(f"{TABLES}/{{name}}.{{ext}}", name=TABLE_NAMES, ext=["csv", "md"]),
        prov=f"{TABLES}/provenance.json",
    params:
        cfg=EFFECTIVE_CONFIG,
        tables=lambda w, output: os.path.dirname(output.prov),
        sig=sig("ead"),
    log:
        f"{LOGS}/tables.log",
    shell:
        "python -m impl tables --config-json @{params.cfg} --ead {input.ead} --ar {input.ar} --train {input.train} "
        "--shared {input.shared} --out-dir {params.tables} 2> {log}"


rule figures:
    conda:
        "../env.yaml"
    input:
        prov=rules.tables.output.prov,
    output:
        expand(f"{FIGURES}/{{name}}.png", name=FIGURE_NAMES),
    params:
        tables=lambda w, input: os.path.dirname(input.prov),
        figures=lambda w, output: os.path.dirname(output[0]),
    log:
        f"{LOGS}/figures.log",
    shell:
        "python -m impl figures --tables-dir {params.tables} --out-dir {params.figures} 2> {log}"


rule report:
    conda:
        "../env.yaml"
    input:
        rules.tables.output,
        prov=rules.tables.output.prov,
        figs=rules.figures.output,
        extra=[f for _, _, files in report_sections() for f in files],
    output:
        REPORT,
    params:
        tables=lambda w, input: os.path.dirname(input.prov),
        figures=lambda w, input: os.path.dirname(input.figs[0]),
        configs=" ".join(map(str, workflow.configfiles)) or "configs/default.yaml",
        sections=" ".join(f"--section {name}={tables}" for name, tables, _ in report_sections()),
    log:
        f"{LOGS}/report.log",
    shell:
        "python -m impl report --tables-dir {params.tables} --figures-dir {params.figures} --out {output} "
        "--config-name {params.configs:q} {params.sections} 2> {log}"
