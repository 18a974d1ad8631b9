# Tables and figures from raw rows, and results/REPORT.md linking them.
TABLES = f"{RESULTS}/tables"
REPORT = f"{RESULTS}/REPORT.md"
TABLE_NAMES = ["training", "val_loss_by_depth", "ead_summary", "ead_hist", "s_x", "nested_chains",
               "selection", "selection_best", "ar_throughput"] + (["ls_vs_std"] if CFG["ead"].get("compare") else [])
FIGURE_NAMES = ["ead_hist", "s_x_vs_k", "selection"] + (["loss_by_depth"] if TINY_MODELS else [])


rule tables:
    input:
        ead=expand(f"{RESULTS}/ead/{{model}}/{{suite}}.jsonl", model=EAD_MODELS, suite=EAD_WORKLOADS),
        ar=expand(f"{RESULTS}/ar/{{model}}/{{suite}}.jsonl", model=EAD_MODELS, suite=EAD_WORKLOADS),
        train=expand(f"{RESULTS}/train/{{model}}.json", model=[m for m in EAD_MODELS if m in TINY_MODELS]),
    output:
        expand(f"{TABLES}/{{name}}.{{ext}}", name=TABLE_NAMES, ext=["csv", "md"]),
        prov=f"{TABLES}/provenance.json",
    params:
        sig=sig("ead"),
    log:
        f"{LOGS}/tables.log",
    shell:
        "{PY} -m impl tables {CONFIG_ARG} --ead {input.ead} --ar {input.ar} --train {input.train} "
        "--out-dir {TABLES} 2> {log}"


rule figures:
    input:
        rules.tables.output,
    output:
        expand(f"{FIGURES}/{{name}}.png", name=FIGURE_NAMES),
    log:
        f"{LOGS}/figures.log",
    shell:
        "{PY} -m impl figures --tables-dir {TABLES} --out-dir {FIGURES} 2> {log}"


rule report:
    input:
        rules.tables.output,
        rules.figures.output,
    output:
        REPORT,
    params:
        configs=" ".join(map(str, workflow.configfiles)) or "configs/default.yaml",
    log:
        f"{LOGS}/report.log",
    shell:
        "{PY} -m impl report --tables-dir {TABLES} --figures-dir {FIGURES} --out {output} "
        "--config-name {params.configs:q} 2> {log}"
