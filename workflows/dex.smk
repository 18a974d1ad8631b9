# DEX depth-axis experiments (Fig. 3, Fig. 4, Table 1 shapes): inducing adapters for standard models,
# one benchmark cell per (model variant, workload), then DEX tables and figures for the report.
# A variant is a model name, or "<model>+ad" for a model of dex.adapters.models with its adapters.
DEX = CFG.get("dex")
if DEX:
    DEX_VARIANTS = DEX["models"] + [f"{m}+ad" for m in DEX["adapters"]["models"]]
    DEX_CELLS = expand(f"{RESULTS}/dex/{{variant}}/{{suite}}.jsonl", variant=DEX_VARIANTS, suite=DEX["workloads"])

    wildcard_constraints:
        variant="|".join(map(re.escape, DEX_VARIANTS)),

    def _base_model(variant):
        return variant[:-3] if variant.endswith("+ad") else variant

    rule train_adapters:
        conda:
            "../env.yaml"
        input:
            model=model_path,
        output:
            adapters=directory(f"{MODELS}/adapters/{{model}}"),
            summary=f"{RESULTS}/dex/adapters/{{model}}.json",
        params:
            cfg=EFFECTIVE_CONFIG,
            sig=sig("data_dir", "seed", "device", "dtype", adapters=DEX["adapters"], sets=[DEX["explorers"],
                    DEX["exploration_sets"], DEX["decs"]["explorers"]]),
        threads: DEX["adapters"]["threads"]
        log:
            f"{LOGS}/dex/adapters/{{model}}.log",
        resources:
            mem_mb=8000,
            runtime=120,
        shell:
            "python -m impl train-adapters --config-json @{params.cfg} --quiet --model-dir {input.model} "
            "--out {output.adapters} --summary {output.summary} 2> {log}"

    def _cell_inputs(w):
        base = _base_model(w.variant)
        d = {"prompts": f"{RESULTS}/workloads/{base}/{w.suite}.jsonl", "model": str(model_dir(CFG, base))}
        if w.variant.endswith("+ad"):
            d["adapters"] = f"{MODELS}/adapters/{base}"
        return d

    rule dex_cell:
        conda:
            "../env.yaml"
        input:
            unpack(_cell_inputs),
        output:
            f"{RESULTS}/dex/{{variant}}/{{suite}}.jsonl",
        params:
            cfg=EFFECTIVE_CONFIG,
            adapters=lambda w, input: f"--adapters {input.adapters}" if "adapters" in input.keys() else "",
            sig=lambda w: sig("seed", "threads", "device", "dtype",
                              dex={k: v for k, v in DEX.items() if k not in ("models", "workloads", "adapters")}),
        threads: CFG["threads"]
        log:
            f"{LOGS}/dex/{{variant}}/{{suite}}.log",
        resources:
            mem_mb=8000,
            runtime=240,
        shell:
            "python -m impl dex-cell --config-json @{params.cfg} --quiet --variant {wildcards.variant} "
            "--model-dir {input.model} {params.adapters} --prompts {input.prompts} --out {output} 2> {log}"

    DEX_TABLE_NAMES = ["dex_arms", "dex_claims", "dex_overhead", "dex_walltime_model", "dex_tuning", "dex_adapters"]
    DEX_FIGURE_NAMES = ["dex_fig3", "dex_fig4"]

    rule dex_tables:
        conda:
            "../env.yaml"
        input:
            cells=DEX_CELLS,
            adapters=expand(f"{RESULTS}/dex/adapters/{{model}}.json", model=DEX["adapters"]["models"]),
        output:
            expand(f"{RESULTS}/tables/dex/{{name}}.{{ext}}", name=DEX_TABLE_NAMES, ext=["csv", "md"]),
        params:
            out=f"{RESULTS}/tables/dex",
        log:
            f"{LOGS}/dex/tables.log",
        shell:
            "python -m impl dex-tables --cells {input.cells} --adapters {input.adapters} --out-dir {params.out} 2> {log}"

    rule dex_figures:
        conda:
            "../env.yaml"
        input:
            rules.dex_tables.output,
        output:
            expand(f"{FIGURES}/{{name}}.png", name=DEX_FIGURE_NAMES),
        params:
            tables=f"{RESULTS}/tables/dex",
            out=FIGURES,
        log:
            f"{LOGS}/dex/figures.log",
        shell:
            "python -m impl dex-figures --tables-dir {params.tables} --out-dir {params.out} 2> {log}"
