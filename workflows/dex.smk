# DEX depth-axis experiments (Fig. 3, Fig. 4, Table 1 shapes): inducing adapters for standard models,
# one benchmark cell per (model variant, workload), then DEX tables and figures for the report.
# A variant is a model name, or the adapted variant (impl.dex.cell.variant_name) of a model of
# dex.adapters.models with its inducing adapters.
DEX = CFG.get("dex")
if DEX:
    DEX_VARIANTS = DEX["models"] + [variant_name(m, True) for m in DEX["adapters"]["models"]]
    DEX_CELLS = expand(f"{RESULTS}/dex/{{variant}}/{{suite}}.jsonl", variant=DEX_VARIANTS, suite=DEX["workloads"])

    wildcard_constraints:
        variant="|".join(map(re.escape, DEX_VARIANTS)),

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
        shell:
            "python -m impl train-adapters --config-json @{params.cfg} --quiet --model-dir {input.model} "
            "--out {output.adapters} --summary {output.summary} 2> {log}"

    rule dex_cell:
        conda:
            "../env.yaml"
        input:
            unpack(dex_cell_inputs),
        output:
            f"{RESULTS}/dex/{{variant}}/{{suite}}.jsonl",
        params:
            cfg=EFFECTIVE_CONFIG,
            adapters=lambda w, input: f"--adapters {input.adapters}" if "adapters" in input.keys() else "",
            draft=lambda w, input: f"--draft {input.draft}" if "draft" in input.keys() else "",
            tev=lambda w, input: f"--tev-drafters {input.tev_drafters}" if "tev_drafters" in input.keys() else "",
            sig=lambda w: sig("seed", "threads", "device", "dtype",
                              dex={k: ({a: c for a, c in v.items() if a != "tensor_parallel"} if k == "speculative" and v else v)
                                   for k, v in DEX.items() if k not in ("models", "workloads", "adapters", "distributed", "draft")}),
        threads: CFG["threads"]
        log:
            f"{LOGS}/dex/{{variant}}/{{suite}}.log",
        shell:
            "python -m impl dex-cell --config-json @{params.cfg} --quiet --variant {wildcards.variant} "
            "--model-dir {input.model} {params.adapters} {params.draft} {params.tev} --prompts {input.prompts} --out {output} 2> {log}"

    DIST = DEX["distributed"]
    DIST_MODEL, DIST_SUITE = DEX["models"][0], DEX["workloads"][0]
    DIST_RUNS = expand(f"{RESULTS}/dex/distributed/{DIST_MODEL}/K{{k}}.jsonl", k=DIST["explorers"])

    rule dex_prompts_head:
        input:
            f"{RESULTS}/workloads/{DIST_MODEL}/{DIST_SUITE}.jsonl",
        output:
            f"{RESULTS}/dex/distributed/{DIST_MODEL}/prompts.jsonl",
        params:
            n=DIST["n_prompts"],  # the first is also decoded once, unrecorded, as warm-up
        log:
            f"{LOGS}/dex/distributed/prompts.log",
        conda:
            "../env.yaml"
        shell:
            "(head -n {params.n} {input} > {output}.tmp && mv {output}.tmp {output}) 2> {log}"

    rule dex_distributed:
        conda:
            "../env.yaml"
        input:
            prompts=rules.dex_prompts_head.output,
            model=str(model_dir(CFG, DIST_MODEL)),
        output:
            f"{RESULTS}/dex/distributed/{DIST_MODEL}/K{{k}}.jsonl",
        params:
            n=DIST["max_new_tokens"],
            seed=CFG["seed"],
            eos="" if DEX["stop_at_eos"] else "--ignore-eos",
            dedupe="--dedupe" if DEX["dedupe"] else "",
        threads: 2
        log:
            f"{LOGS}/dex/distributed/K{{k}}.log",
        resources:
            gres=lambda w: f"gpu:{w.k}",  # one GPU per explorer rank on a cluster (ignored locally)
        shell:
            "OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node {wildcards.k} "
            "-m impl.dex.distributed --model {input.model} --prompts {input.prompts} --out {output} "
            "--max-new-tokens {params.n} --seed {params.seed} {params.eos} {params.dedupe} --warmup-prompts 1 "
            "--device auto 2> {log}"

    # a small draft model per dex model for the speculative arms (Fig. 5), when dex.draft is set
    DRAFTS = expand(f"{RESULTS}/dex/draft/{{model}}.json", model=DEX["models"]) if DEX.get("draft") else []

    rule train_draft:
        conda:
            "../env.yaml"
        input:
            model=model_path,
        output:
            draft=directory(f"{MODELS}/{{model}}-draft"),
            summary=f"{RESULTS}/dex/draft/{{model}}.json",
        params:
            cfg=EFFECTIVE_CONFIG,
            sig=sig("data_dir", "seed", "device", "dtype", draft=DEX.get("draft")),
        threads: (DEX.get("draft") or {}).get("threads", 1)
        log:
            f"{LOGS}/dex/draft/{{model}}.log",
        shell:
            "python -m impl train-draft --config-json @{params.cfg} --quiet --model-dir {input.model} "
            "--out {output.draft} --summary {output.summary} 2> {log}"

    SPEC = Speculative(**(DEX.get("speculative") or {}))  # the typed section: its defaults filled in
    HEAD = SPEC.dflash.drafter if SPEC.dflash is not None else None

    # Fig. 5's trained-head arm for dex models TEV does not train: TEV's base drafter, trained with
    # dex.speculative.dflash.drafter's settings (same code as rule tev_train, no ExitTrain objectives)
    rule train_head:
        conda:
            "../env.yaml"
        input:
            model=model_path,
        output:
            drafters=directory(f"{MODELS}/dex-head/{{model}}"),
            summary=f"{RESULTS}/dex/head/{{model}}.json",
        params:
            cfg=EFFECTIVE_CONFIG,
            sig=sig("data_dir", "seed", "device", "dtype", "max_prompt_tokens",
                    head=HEAD.model_dump() if HEAD is not None else None, eos=DEX["stop_at_eos"],
                    gsm8k=(CFG.get("workloads") or {}).get("gsm8k") if HEAD is not None and "gsm8k" in HEAD.prompt_mix
                    else None, **held_out_sources(HEAD.prompt_mix if HEAD is not None else None)),
        threads: HEAD.threads if HEAD is not None else 1
        log:
            f"{LOGS}/dex/head/{{model}}.log",
        shell:
            "python -m impl tev-train --dex-head --config-json @{params.cfg} --quiet --model-dir {input.model} "
            "--out {output.drafters} --summary {output.summary} 2> {log}"

    # Fig. 5's multi-process arms for the first dex model on every dex workload (dex.speculative): PEARL with
    # the target and the draft on two ranks, and transformers' tensor-parallel plan over K ranks; one thread
    # per rank, rank 0 times AR on the same prompts in the same run and checks the ids
    MP_MODEL = DEX["models"][0]
    MP_DEVICE = "cpu" if CFG["device"] == "cpu" else "auto"  # device: cpu keeps the ranks on CPU (gloo) on a GPU host
    MP_ARMS = (["pearl"] if SPEC.pearl is not None and SPEC.pearl.distributed else []) + \
              ([f"tp{SPEC.tensor_parallel.ranks}"] if SPEC.tensor_parallel is not None else [])
    MP_RUNS = expand(f"{RESULTS}/dex/multiprocess/{MP_MODEL}/{{suite}}/{{arm}}.jsonl", suite=DEX["workloads"], arm=MP_ARMS)

    rule dex_pearl_ranks:
        conda:
            "../env.yaml"
        input:
            prompts=f"{RESULTS}/workloads/{MP_MODEL}/{{suite}}.jsonl",
            model=str(model_dir(CFG, MP_MODEL)),
            draft=f"{MODELS}/{MP_MODEL}-draft",
        output:
            f"{RESULTS}/dex/multiprocess/{MP_MODEL}/{{suite}}/pearl.jsonl",
        params:
            n=DEX["n_prompts"],
            new=DEX["max_new_tokens"],
            gamma=SPEC.pearl.gamma if SPEC.pearl is not None else None,
            variant=MP_MODEL,
            device=MP_DEVICE,
            eos="" if DEX["stop_at_eos"] else "--ignore-eos",
        threads: 2
        log:
            f"{LOGS}/dex/multiprocess/{{suite}}/pearl.log",
        resources:
            gres="gpu:2",  # the target and the draft on a GPU each on a cluster (ignored locally)
        shell:
            "OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node 2 "
            "-m impl.spec.pearl_distributed --model {input.model} --draft {input.draft} --prompts {input.prompts} "
            "--n-prompts {params.n} --variant {params.variant} --out {output} --max-new-tokens {params.new} --gamma {params.gamma} {params.eos} "
            "--warmup-prompts 1 --device {params.device} 2> {log}"

    rule dex_tensor_parallel:
        conda:
            "../env.yaml"
        input:
            prompts=f"{RESULTS}/workloads/{MP_MODEL}/{{suite}}.jsonl",
            model=str(model_dir(CFG, MP_MODEL)),
        output:
            f"{RESULTS}/dex/multiprocess/{MP_MODEL}/{{suite}}/tp{{k}}.jsonl",
        params:
            variant=MP_MODEL,
            device=MP_DEVICE,
            n=DEX["n_prompts"],
            new=DEX["max_new_tokens"],
            eos="" if DEX["stop_at_eos"] else "--ignore-eos",
        threads: 2
        log:
            f"{LOGS}/dex/multiprocess/{{suite}}/tp{{k}}.log",
        resources:
            gres=lambda w: f"gpu:{w.k}",
        shell:
            "OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node {wildcards.k} "
            "-m impl.spec.tensor_parallel --model {input.model} --prompts {input.prompts} --n-prompts {params.n} --variant {params.variant} "
            "--out {output} --max-new-tokens {params.new} {params.eos} --warmup-prompts 1 --device {params.device} 2> {log}"

    # the trained heads' summaries (dex models TEV does not train, when dex.speculative.dflash.drafter is set)
    HEADS = expand(f"{RESULTS}/dex/head/{{model}}.json",
                   model=[m for m in DEX["models"] if m not in ((CFG.get("tev") or {}).get("models") or [])]) if HEAD else []

    DEX_TABLE_NAMES = ["dex_arms", "dex_claims", "dex_fig5", "dex_overhead", "dex_walltime_model", "dex_tuning", "dex_adapters",
                       "dex_adapter_ead", "dex_distributed", "dex_draft", "dex_fig5_multiprocess", "dex_head"]
    DEX_FIGURE_NAMES = ["dex_fig3", "dex_fig4", "dex_fig5"]

    rule dex_tables:
        conda:
            "../env.yaml"
        input:
            cells=DEX_CELLS,
            adapters=expand(f"{RESULTS}/dex/adapters/{{model}}.json", model=DEX["adapters"]["models"]),
            distributed=DIST_RUNS,
            drafts=DRAFTS,
            multiprocess=MP_RUNS,
            heads=HEADS,
        output:
            expand(f"{RESULTS}/tables/dex/{{name}}.{{ext}}", name=DEX_TABLE_NAMES, ext=["csv", "md"]),
        params:
            out=lambda w, output: os.path.dirname(output[0]),
        log:
            f"{LOGS}/dex/tables.log",
        shell:
            "python -m impl dex-tables --cells {input.cells} --adapters {input.adapters} --distributed {input.distributed} "
            "--drafts {input.drafts} --multiprocess {input.multiprocess} --heads {input.heads} --out-dir {params.out} 2> {log}"

    rule dex_figures:
        conda:
            "../env.yaml"
        input:
            rules.dex_tables.output,
        output:
            expand(f"{FIGURES}/{{name}}.png", name=DEX_FIGURE_NAMES),
        params:
            tables=lambda w, input: os.path.dirname(input[0]),
            out=lambda w, output: os.path.dirname(output[0]),
        log:
            f"{LOGS}/dex/figures.log",
        shell:
            "python -m impl dex-figures --tables-dir {params.tables} --out-dir {params.out} 2> {log}"

