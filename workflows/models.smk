# Tiny models trained inside the DAG (cached under models_dir): tokenizer -> corpus -> one rule per model;
# pretrained models with a GGUF source (models.<name>.gguf) converted into their path by rule convert_<name>.


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
    shell:
        "python -m impl corpus --config-json @{params.cfg} --tokenizer {input.tok} --out {output} 2> {log}"


rule train_model:
    conda:
        "../env.yaml"
    wildcard_constraints:
        model="|".join(map(re.escape, TINY_MODELS)) or "(?!)",
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
    shell:
        "python -m impl train --config-json @{params.cfg} --quiet --model {wildcards.model} --tokenizer {input.tok} "
        "--corpus {input.corpus} --out {output.model} --summary {output.summary} 2> {log}"


for _name, _m in CFG["models"].items():
    if _m["kind"] != "pretrained" or "gguf" not in _m:
        continue

    rule:
        name:
            f"convert_{_name}"
        conda:
            "../env.yaml"
        output:
            directory(_m["path"]),
        params:
            cfg=EFFECTIVE_CONFIG,
            name=_name,
            sig=sig("dtype", gguf=_m["gguf"]),
        log:
            f"{LOGS}/convert/{_name}.log",
        shell:
            "python -m impl convert-gguf --config-json @{params.cfg} --model {params.name} --out {output} 2> {log}"
