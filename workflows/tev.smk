# TEV / ExitTrain experiments (Tables 1-5 shapes): drafters trained on target rollouts (base, then the
# three ExitTrain objectives from the same base), one decoding cell per (model, workload), the
# verifier-latency benchmark, then the TEV tables for the report.
TEV = CFG.get("tev")
if TEV:
    TEV_CELLS = expand(f"{RESULTS}/tev/{{model}}/{{suite}}.jsonl", model=TEV["models"], suite=TEV["workloads"])
    TEV_TABLE_NAMES = ["tev_arms", "tev_main", "tev_objective", "tev_crossed", "tev_budget", "tev_claims",
                       "tev_calibration", "tev_latency", "tev_training", "tev_curve", "tev_target", "tev_drafters"]
    # the tau-target cell (tev.target_prompts): AR, DDTree and ExitTrain + TEV at T = 0 on more prompts
    TEV_TARGET_CELLS = expand(f"{RESULTS}/tev/target/{{model}}/{{suite}}.jsonl", model=TEV["models"],
                              suite=TEV["workloads"]) if TEV.get("target_prompts") else []

    rule tev_train:
        conda:
            "../env.yaml"
        input:
            model=model_path,
        output:
            drafters=directory(f"{MODELS}/tev/{{model}}"),
            summary=f"{RESULTS}/tev/train/{{model}}.json",
        params:
            cfg=EFFECTIVE_CONFIG,
            sig=sig("data_dir", "seed", "device", "dtype", "max_prompt_tokens",
                    tev={k: TEV[k] for k in ("drafter", "exittrain", "stop_at_eos")},
                    # the gsm8k prompt source renders its questions as the gsm8k workload does
                    gsm8k=(CFG.get("workloads") or {}).get("gsm8k") if "gsm8k" in TEV["drafter"].get("prompt_mix", {})
                    else None, **held_out_sources(TEV["drafter"].get("prompt_mix"))),
        threads: TEV["drafter"]["threads"]
        log:
            f"{LOGS}/tev/train/{{model}}.log",
        shell:
            "python -m impl tev-train --config-json @{params.cfg} --quiet --model-dir {input.model} "
            "--out {output.drafters} --summary {output.summary} 2> {log}"

    rule tev_cell:
        conda:
            "../env.yaml"
        input:
            prompts=f"{RESULTS}/workloads/{{model}}/{{suite}}.jsonl",
            model=model_path,
            drafters=f"{MODELS}/tev/{{model}}",
        output:
            f"{RESULTS}/tev/{{model}}/{{suite}}.jsonl",
        params:
            cfg=EFFECTIVE_CONFIG,
            sig=sig("seed", "threads", "device", "dtype",
                    tev={k: TEV[k] for k in ("n_prompts", "max_new_tokens", "stop_at_eos", "temperatures",
                                             "budget", "budgets", "depth")}),
        threads: CFG["threads"]
        log:
            f"{LOGS}/tev/{{model}}/{{suite}}.log",
        shell:
            "python -m impl tev-cell --config-json @{params.cfg} --quiet --model {wildcards.model} "
            "--model-dir {input.model} --drafters {input.drafters} --prompts {input.prompts} --out {output} 2> {log}"

    rule tev_target_cell:
        conda:
            "../env.yaml"
        input:
            prompts=f"{RESULTS}/workloads/{{model}}/{{suite}}.jsonl",
            model=model_path,
            drafters=f"{MODELS}/tev/{{model}}",
        output:
            f"{RESULTS}/tev/target/{{model}}/{{suite}}.jsonl",
        params:
            cfg=EFFECTIVE_CONFIG,
            sig=sig("seed", "threads", "device", "dtype",
                    tev={k: TEV.get(k) for k in ("target_prompts", "max_new_tokens", "stop_at_eos", "budget", "depth")}),
        threads: CFG["threads"]
        log:
            f"{LOGS}/tev/target/{{model}}/{{suite}}.log",
        shell:
            "python -m impl tev-cell --target --config-json @{params.cfg} --quiet --model {wildcards.model} "
            "--model-dir {input.model} --drafters {input.drafters} --prompts {input.prompts} --out {output} 2> {log}"

    rule tev_latency:
        conda:
            "../env.yaml"
        input:
            prompts=f"{RESULTS}/workloads/{{model}}/{TEV['workloads'][0]}.jsonl",
            model=model_path,
            drafters=f"{MODELS}/tev/{{model}}",
        output:
            f"{RESULTS}/tev/latency/{{model}}.jsonl",
        params:
            cfg=EFFECTIVE_CONFIG,
            sig=sig("seed", "threads", "device", "dtype", tev={k: TEV[k] for k in ("latency", "depth", "n_prompts")}),
        threads: TIMED_THREADS  # alone on the default: its microseconds are results
        log:
            f"{LOGS}/tev/latency/{{model}}.log",
        shell:
            "python -m impl tev-latency --config-json @{params.cfg} --quiet --model {wildcards.model} "
            "--model-dir {input.model} --drafters {input.drafters} --prompts {input.prompts} --out {output} 2> {log}"

    rule tev_tables:
        conda:
            "../env.yaml"
        input:
            cells=TEV_CELLS,
            latency=expand(f"{RESULTS}/tev/latency/{{model}}.jsonl", model=TEV["models"]),
            train=expand(f"{RESULTS}/tev/train/{{model}}.json", model=TEV["models"]),
            target=TEV_TARGET_CELLS,
        output:
            expand(f"{RESULTS}/tables/tev/{{name}}.{{ext}}", name=TEV_TABLE_NAMES, ext=["csv", "md"]),
        params:
            out=lambda w, output: os.path.dirname(output[0]),
        log:
            f"{LOGS}/tev/tables.log",
        shell:
            "python -m impl tev-tables --cells {input.cells} --latency {input.latency} --train {input.train} "
            "--target-cells {input.target} --out-dir {params.out} 2> {log}"

