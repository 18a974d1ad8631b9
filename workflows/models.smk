# Tiny models trained inside the DAG (cached under models_dir): tokenizer -> corpus -> one rule per model.


rule tokenizer:
    output:
        directory(f"{MODELS}/tokenizer"),
    params:
        sig=sig("data_dir", "corpus", "tokenizer"),
    log:
        f"{LOGS}/tokenizer.log",
    resources:
        mem_mb=4000,
        runtime=20,
    shell:
        "{PY} -m impl tokenizer {CONFIG_ARG} --out {output} 2> {log}"


rule corpus:
    input:
        tok=rules.tokenizer.output,
    output:
        directory(f"{MODELS}/corpus"),
    params:
        sig=sig("data_dir", "corpus"),
    log:
        f"{LOGS}/corpus.log",
    resources:
        mem_mb=8000,
        runtime=30,
    shell:
        "{PY} -m impl corpus {CONFIG_ARG} --tokenizer {input.tok} --out {output} 2> {log}"


rule train_model:
    input:
        tok=rules.tokenizer.output,
        corpus=rules.corpus.output,
    output:
        model=directory(f"{MODELS}/{{model}}"),
        summary=f"{RESULTS}/train/{{model}}.json",
    params:
        sig=lambda w: sig("tiny_arch", "training", "seed", model=CFG["models"][w.model]),
    threads: CFG["threads"]
    log:
        f"{LOGS}/train/{{model}}.log",
    resources:
        mem_mb=8000,
        runtime=240,
    shell:
        "{PY} -m impl train {CONFIG_ARG} --quiet --model {wildcards.model} --tokenizer {input.tok} "
        "--corpus {input.corpus} --out {output.model} --summary {output.summary} 2> {log}"
