# Oracle EAD measurement (DEX Def. 1) and the AR baseline, per (model, workload).


rule measure_ead:
    conda:
        "../env.yaml"
    input:
        prompts=rules.workload_tokens.output,
        model=model_path,
    output:
        f"{RESULTS}/ead/{{model}}/{{suite}}.jsonl",
    params:
        cfg=EFFECTIVE_CONFIG,
        sig=sig("ead", "device", "dtype"),
    threads: CFG["threads"]
    log:
        f"{LOGS}/ead/{{model}}/{{suite}}.log",
    shell:
        "python -m impl ead --config-json @{params.cfg} --quiet --model {wildcards.model} --model-dir {input.model} "
        "--prompts {input.prompts} --out {output} 2> {log}"


rule ar_bench:
    conda:
        "../env.yaml"
    input:
        prompts=rules.workload_tokens.output,
        model=model_path,
    output:
        f"{RESULTS}/ar/{{model}}/{{suite}}.jsonl",
    params:
        cfg=EFFECTIVE_CONFIG,
        sig=sig("ar_bench", "device", "dtype", stop=CFG["ead"]["stop_at_eos"]),
    threads: CFG["threads"]
    log:
        f"{LOGS}/ar/{{model}}/{{suite}}.log",
    shell:
        "python -m impl ar-bench --config-json @{params.cfg} --quiet --model {wildcards.model} --model-dir {input.model} "
        "--prompts {input.prompts} --out {output} 2> {log}"


if EAD_SHARED:
    COMPARED = [CFG["ead"]["compare"]["baseline"], CFG["ead"]["compare"]["treatment"]]

    rule ead_shared:
        conda:
            "../env.yaml"
        input:
            prompts=f"{RESULTS}/workloads/{COMPARED[0]}/{{suite}}.jsonl",
            ead=expand(f"{RESULTS}/ead/{{model}}/{{{{suite}}}}.jsonl", model=COMPARED),
            models=[str(model_dir(CFG, m)) for m in COMPARED],
        output:
            f"{RESULTS}/ead_shared/{{suite}}.jsonl",
        params:
            cfg=EFFECTIVE_CONFIG,
            names=" ".join(COMPARED),
            sig=sig("ead", "device", "dtype"),
        threads: CFG["threads"]
        log:
            f"{LOGS}/ead_shared/{{suite}}.log",
        shell:
            "python -m impl ead-shared --config-json @{params.cfg} --quiet --models {params.names} "
            "--model-dirs {input.models} --ead {input.ead} --prompts {input.prompts} --out {output} 2> {log}"
