# Frozen prompt suites: a seeded text sample per suite, then token ids per model's tokenizer.


rule workload_text:
    conda:
        "../env.yaml"
    output:
        f"{RESULTS}/workloads/text/{{suite}}.jsonl",
    params:
        cfg=EFFECTIVE_CONFIG,
        # the text sample; the suite's prompt cap applies when tokenizing (rule workload_tokens)
        sig=lambda w: sig("data_dir", "seed", suite={k: v for k, v in CFG["workloads"][w.suite].items()
                                                     if k != "max_prompt_tokens"}),
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
        # a suite's own cap (workloads.<suite>.max_prompt_tokens) joins the hash only where it is set
        sig=lambda w: sig("max_prompt_tokens", "overlong_prompt", **({"suite_cap": CFG["workloads"][w.suite]["max_prompt_tokens"]}
                          if CFG["workloads"][w.suite].get("max_prompt_tokens") is not None else {})),
    log:
        f"{LOGS}/workloads/{{model}}/{{suite}}.log",
    shell:
        "python -m impl tokenize --config-json @{params.cfg} --model-dir {input.model} --prompts {input.prompts} "
        "--out {output} 2> {log}"
