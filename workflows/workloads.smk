# Frozen prompt suites: a seeded text sample per suite, then token ids per model's tokenizer.


rule workload_text:
    conda:
        "../env.yaml"
    output:
        f"{RESULTS}/workloads/text/{{suite}}.jsonl",
    params:
        cfg=EFFECTIVE_CONFIG,
        sig=lambda w: sig("data_dir", "seed", suite=CFG["workloads"][w.suite]),
    log:
        f"{LOGS}/workloads/{{suite}}.log",
    shell:
        "python -m impl workload --config-json @{params.cfg} --suite {wildcards.suite} --out {output} 2> {log}"


rule workload_tokens:
    conda:
        "../env.yaml"
    input:
        prompts=rules.workload_text.output,
        model=model_path,
    output:
        f"{RESULTS}/workloads/{{model}}/{{suite}}.jsonl",
    params:
        cfg=EFFECTIVE_CONFIG,
        sig=sig("max_prompt_tokens", "overlong_prompt"),
    log:
        f"{LOGS}/workloads/{{model}}/{{suite}}.log",
    shell:
        "python -m impl tokenize --config-json @{params.cfg} --model-dir {input.model} --prompts {input.prompts} "
        "--out {output} 2> {log}"
