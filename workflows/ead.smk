# Oracle EAD measurement (DEX Def. 1) and the AR baseline, per (model, workload).


rule measure_ead:
    input:
        prompts=rules.workload_tokens.output,
        model=model_path,
    output:
        f"{RESULTS}/ead/{{model}}/{{suite}}.jsonl",
    params:
        sig=sig("ead", "device", "dtype"),
    threads: CFG["threads"]
    log:
        f"{LOGS}/ead/{{model}}/{{suite}}.log",
    resources:
        mem_mb=8000,
        runtime=120,
    shell:
        "{PY} -m impl ead {CONFIG_ARG} --quiet --model {wildcards.model} --model-dir {input.model} "
        "--prompts {input.prompts} --out {output} 2> {log}"


rule ar_bench:
    input:
        prompts=rules.workload_tokens.output,
        model=model_path,
    output:
        f"{RESULTS}/ar/{{model}}/{{suite}}.jsonl",
    params:
        sig=sig("ar_bench", "device", "dtype", stop=CFG["ead"]["stop_at_eos"]),
    threads: CFG["threads"]
    log:
        f"{LOGS}/ar/{{model}}/{{suite}}.log",
    resources:
        mem_mb=8000,
        runtime=120,
    shell:
        "{PY} -m impl ar-bench {CONFIG_ARG} --quiet --model {wildcards.model} --model-dir {input.model} "
        "--prompts {input.prompts} --out {output} 2> {log}"
