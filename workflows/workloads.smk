# Frozen prompt suites: a seeded text sample per suite, then token ids per model's tokenizer.


rule workload_text:
    output:
        f"{RESULTS}/workloads/text/{{suite}}.jsonl",
    params:
        sig=lambda w: sig("data_dir", "seed", suite=CFG["workloads"][w.suite]),
    log:
        f"{LOGS}/workloads/{{suite}}.log",
    shell:
        "{PY} -m impl workload {CONFIG_ARG} --suite {wildcards.suite} --out {output} 2> {log}"


rule workload_tokens:
    input:
        prompts=rules.workload_text.output,
        model=model_path,
    output:
        f"{RESULTS}/workloads/{{model}}/{{suite}}.jsonl",
    params:
        sig=sig("max_prompt_tokens", "overlong_prompt"),
    log:
        f"{LOGS}/workloads/{{model}}/{{suite}}.log",
    shell:
        "{PY} -m impl tokenize {CONFIG_ARG} --model-dir {input.model} --prompts {input.prompts} "
        "--out {output} 2> {log}"
