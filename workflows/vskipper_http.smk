# vSkipper engine arms over HTTP (vSkipper engine issue: "Three engine arms run in-process and behind HTTP on
# both tiny models; lm_eval --model local-completions and an OpenAI-style client with ignore_eos can both talk
# to every arm"). Per tiny model: upstream, hybrid and always-route each served in-process on 127.0.0.1:0
# and checked with the load generator's OpenAI-style client (ignore_eos, streaming, greedy ids equal to the
# arm run in process), lm-eval local-completions on the offline GSM8K task, and the health / model /
# malformed-request endpoints -> PASS/FAIL rows (CSV) + summary JSON, a "engine arms over HTTP" section in
# REPORT.md. Routed arms use the FlexiDepth checkpoint (and RandomSkip too) on vskipper.model, RandomSkip on
# the other tiny models. Command: python -m impl vskipper-http-check --help (impl/vskipper/commands.py).
# Include after vskipper.smk and before report.smk.
VSKH_BENCH_MODELS = []  # set below when vskipper.http.bench_serving.python is
if CFG.get("vskipper") and TINY_MODELS:
    VSKH = CFG["vskipper"]
    VSKH_DIR = f"{RESULTS}/vskipper/http"
    VSKH_SUITE = VSKH["workloads"][0]  # prompts: the first vSkipper workload's token ids per model
    VSKH_CKPT = f"{MODELS}/{VSKH['model']}-flexidepth"  # rule vskipper_train_flexidepth
    # vskipper.http: requests x tokens per client check, GSM8K documents for lm-eval, RandomSkip r and d
    # (seed / layer_choice from vskipper.randomskip); the engine sizes come from vskipper.engine and lm-eval's
    # few-shot / budget from vskipper.quality (gsm8k) when present.
    _vskh = VSKH["http"]
    VSKH_ARGS = (f"--n-prompts {_vskh['n_prompts']} --max-tokens {_vskh['max_tokens']} --limit {_vskh['limit']} "
                 f"--r {_vskh['r']} --d {_vskh['d']}")
    # vskipper.http.bench_serving.python set (a Python with SGLang, scripts/setup_sglang.sh; overlay
    # configs/bench_serving.yaml): rule vskipper_bench_serving runs SGLang's own bench_serving client against
    # every listed arm of every listed model (RandomSkip r/d above for the routed arms)
    VSKH_BENCH = _vskh["bench_serving"]
    VSKH_BENCH_MODELS = list(VSKH_BENCH.get("models") or CFG["models"]) if VSKH_BENCH.get("python") else []

    rule vskipper_http:
        conda:
            "../env.yaml"
        input:
            # the model, the first vSkipper workload's token ids for it, and the FlexiDepth checkpoint of vskipper.model
            unpack(lambda w: {"model": str(model_dir(CFG, w.model)),
                              "prompts": f"{RESULTS}/workloads/{w.model}/{VSKH_SUITE}.jsonl",
                              **({"ckpt": VSKH_CKPT} if w.model == VSKH["model"] else {})}),
        output:
            csv=f"{VSKH_DIR}/{{model}}.csv",
            summary=f"{VSKH_DIR}/{{model}}.json",
        params:
            cfg=EFFECTIVE_CONFIG,
            skipper=lambda w: f"--flexidepth {VSKH_CKPT} --also-randomskip" if w.model == VSKH["model"] else "",
            args=VSKH_ARGS,
            sig=sig("data_dir", "seed", "threads", "device", "dtype", args=VSKH_ARGS,
                    vsk={k: VSKH.get(k) for k in ("model", "workloads", "engine", "randomskip", "quality")}),
        threads: 1
        log:
            f"{LOGS}/vskipper/http_{{model}}.log",
        shell:
            "python -m impl vskipper-http-check --config-json @{params.cfg} --quiet --model-dir {input.model} "
            "--prompts {input.prompts} {params.skipper} {params.args} --label {wildcards.model} "
            "--out {output.csv} --summary {output.summary} 2> {log}"



if CFG.get("vskipper") and VSKH_BENCH_MODELS:

    rule vskipper_bench_serving:
        conda:
            "../env.yaml"
        input:
            model=model_path,
        output:
            csv=f"{VSKH_DIR}/{{model}}.bench_serving.csv",
            summary=f"{VSKH_DIR}/{{model}}.bench_serving.json",
        params:
            cfg=EFFECTIVE_CONFIG,
            arms=" ".join(VSKH_BENCH["arms"]),
            rd=f"--r {_vskh['r']} --d {_vskh['d']}",
            sig=sig("data_dir", "seed", "threads", "device", "dtype", bench=VSKH_BENCH, r=_vskh["r"], d=_vskh["d"],
                    vsk={k: VSKH.get(k) for k in ("engine", "randomskip")}),
        threads: 1
        log:
            f"{LOGS}/vskipper/bench_serving_{{model}}.log",
        shell:
            "python -m impl vskipper-http-check --config-json @{params.cfg} --quiet --model-dir {input.model} "
            "--checks bench_serving --arms {params.arms} {params.rd} --label {wildcards.model} "
            "--out {output.csv} --summary {output.summary} 2> {log}"


# SGLang's bench_serving at the knee (vskipper.http.bench_serving.python set, .knee true): upstream and the served
# hybrid of vskipper.model (its FlexiDepth checkpoint under the rule-derived thresholds, as in the cells), open
# loop at the knee point x Q* of the first vSkipper workload, on that workload's frozen prompts; after each
# bench_serving run the project's load generator replays the same prompts at the same rate against the same arm
# and the two clients' E2E / TTFT / TPOT are compared (report: "SGLang's client and the project's load generator").
# A timed job: it takes both cores, as the cells do.
_vskk = ((CFG.get("vskipper") or {}).get("http") or {}).get("bench_serving") or {}
VSKH_KNEE_BENCH = bool(CFG.get("vskipper") and _vskk.get("python") and _vskk.get("knee", True))
if VSKH_KNEE_BENCH:
    VSKH_KNEE_BENCH_OUT = f"{RESULTS}/vskipper/http/{VSK_MODEL}.knee.bench_serving.csv"

    rule vskipper_knee_bench_serving:
        conda:
            "../env.yaml"
        input:
            model=VSK_MODEL_DIR,
            ckpt=VSK_CKPT,
            thresholds=f"{VSK_DIR}/thresholds/flexidepth.json",
            knee=f"{VSK_DIR}/knee/{VSK_W0}.json",
            prompts=f"{RESULTS}/workloads/{VSK_MODEL}/{VSK_W0}.jsonl",
        output:
            csv=VSKH_KNEE_BENCH_OUT,
            summary=VSKH_KNEE_BENCH_OUT.replace(".csv", ".json"),
        params:
            cfg=EFFECTIVE_CONFIG,
            label=f"{VSK_MODEL}@knee",
            sig=vsk_sig("model", "requests", "max_new_tokens", "engine", "http", "load_points"),
        threads: TIMED_THREADS
        log:
            f"{LOGS}/vskipper/knee_bench_serving.log",
        shell:
            "python -m impl vskipper-http-check --config-json @{params.cfg} --quiet --model-dir {input.model} "
            "--checks bench_serving --arms upstream hybrid --flexidepth {input.ckpt} --thresholds {input.thresholds} "
            "--knee {input.knee} --point knee --bench-prompts {input.prompts} --label {params.label} "
            "--out {output.csv} --summary {output.summary} 2> {log}"
