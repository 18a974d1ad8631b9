# Tiny models trained inside the DAG (cached under models_dir): tokenizer -> corpus -> one rule per model.


rule tokenizer:
    conda:
        "../env.yaml"
    output:
        directory(f"{MODELS}/tokenizer"),
    params:
        cfg=EFFECTIVE_CONFIG,
        sig=sig("data_dir", "corpus", "tokenizer"),
    log:
        f"{LOGS}/tokenizer.log",
    resources:
        mem_mb=4000,
        runtime=20,
    shell:
        "python -m impl tokenizer --config-json @{params.cfg} --out {output} 2> {log}"


rule corpus:
    conda:
        "../env.yaml"
    input:
        tok=rules.tokenizer.output,
    output:
        directory(f"{MODELS}/corpus"),
    params:
        cfg=EFFECTIVE_CONFIG,
        sig=sig("data_dir", "corpus"),
    log:
        f"{LOGS}/corpus.log",
    resources:
        mem_mb=8000,
        runtime=30,
    shell:
        "python -m impl corpus --config-json @{params.cfg} --tokenizer {input.tok} --out {output} 2> {log}"


rule train_model:
    conda:
        "../env.yaml"
    input:
        tok=rules.tokenizer.output,
        corpus=rules.corpus.output,
    output:
        model=directory(f"{MODELS}/{{model}}"),
        summary=f"{RESULTS}/train/{{model}}.json",
    params:
        cfg=EFFECTIVE_CONFIG,
        sig=lambda w: sig("tiny_arch", "training", "seed", model=CFG["models"][w.model]),
    threads: CFG["training"]["threads"]
    log:
        f"{LOGS}/train/{{model}}.log",
    resources:
        mem_mb=8000,
        runtime=240,
    shell:
        "python -m impl train --config-json @{params.cfg} --quiet --model {wildcards.model} --tokenizer {input.tok} "
        "--corpus {input.corpus} --out {output.model} --summary {output.summary} 2> {log}"
