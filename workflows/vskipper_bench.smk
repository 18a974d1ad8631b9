# vSkipper per-step timing benchmark (vSkipper engine issue, performance section): engine-shaped packed
# steps of the arms (upstream, routed all-RUN, RandomSkip r x d grid, FlexiDepth, mode-switch hybrids) on
# the vSkipper model (with its FlexiDepth checkpoint) and on a wider randomly initialised model of the same
# architecture (timings only), beside the FLOP accounting's prediction; targets as PASS/FAIL in the report.
# Commands: python -m impl vskipper-bench --help, python -m impl vskipper-bench-tables --help
# (impl/vskipper/commands.py). Include after vskipper.smk and before report.smk.
if CFG.get("vskipper"):
    VSKB = CFG["vskipper"]
    VSKB_MODEL = VSKB["model"]
    VSKB_DIR = f"{RESULTS}/vskipper/bench"
    VSKB_TABLES = f"{RESULTS}/tables/vskipper_bench"
    VSKB_EXTRA = list((VSKB.get("bench") or {}).get("models") or [])  # timed without FlexiDepth / hybrid arms
    VSKB_LABELS = [VSKB_MODEL, *VSKB_EXTRA, "wide"]
    _vskb_rd = VSKB.get("randomskip") or {}
    _vskb_grid = [str(x) for x in (_vskb_rd.get("r") or [0.25, 0.5, 0.75])], \
        [str(x) for x in (_vskb_rd.get("d") or [0.25, 0.5, 0.75])]
    # settings: the optional vskipper.bench config keys when present (read by the command); otherwise the
    # command's defaults (the r x d grid {0.25, 0.5, 0.75}^2, prefill 2048 tokens, decode 32 / 128 requests),
    # scaled down when the config's RandomSkip grid is smaller than 3 x 3 (the smoke config)
    if any(k != "models" for k in (VSKB.get("bench") or {})):
        VSKB_ARGS = ""
    elif len(_vskb_grid[0]) * len(_vskb_grid[1]) < 9:
        VSKB_ARGS = ("--r " + " ".join(_vskb_grid[0]) + " --d " + " ".join(_vskb_grid[1]) +
                     " --prefill-tokens 512 --prompt-len 128 --decode-requests 8 32 --decode-context 32 --repeats 1"
                     " --warmup 0 --cell-budget-s 0 --target-budget-s 0 --profile-repeats 1 --profile-steps 1 --profile-requests 32"
                     " --wide-hidden 192 --wide-intermediate 528 --wide-heads 3")
    else:
        VSKB_ARGS = ""

    wildcard_constraints:
        vskb_label="|".join(map(re.escape, VSKB_LABELS)),

    rule vskipper_bench:
        conda:
            "../env.yaml"
        input:
            unpack(lambda w: ({} if w.vskb_label == "wide" else
                              {"model": str(model_dir(CFG, w.vskb_label))} if w.vskb_label in VSKB_EXTRA else
                              {"model": str(model_dir(CFG, VSKB_MODEL)), "ckpt": f"{MODELS}/{VSKB_MODEL}-flexidepth"})),
        output:
            rows=f"{VSKB_DIR}/{{vskb_label}}.jsonl",
            summary=f"{VSKB_DIR}/{{vskb_label}}.json",
        params:
            cfg=EFFECTIVE_CONFIG,
            src=lambda w, input: ("--wide" if w.vskb_label == "wide" else
                                  f"--model-dir {input.model} --no-hybrid"
                                  if w.vskb_label in VSKB_EXTRA else
                                  f"--model-dir {input.model} --flexidepth {input.ckpt}"),
            args=VSKB_ARGS,
            sig=sig("seed", "threads", "device", "dtype", vsk={k: VSKB.get(k) for k in ("bench", "randomskip")}),
        threads: TIMED_THREADS
        log:
            f"{LOGS}/vskipper/bench_{{vskb_label}}.log",
        shell:
            "python -m impl vskipper-bench --config-json @{params.cfg} --quiet {params.src} --label {wildcards.vskb_label} "
            "{params.args} --out {output.rows} --summary {output.summary} 2> {log}"

    rule vskipper_bench_tables:
        conda:
            "../env.yaml"
        input:
            expand(f"{VSKB_DIR}/{{l}}.json", l=VSKB_LABELS),
        output:
            expand(f"{VSKB_TABLES}/{{name}}.{{ext}}",
                   name=["vskipper_bench", "vskipper_bench_targets", "vskipper_bench_profile",
                         "vskipper_bench_prefill_profile"], ext=["csv", "md"]),
        params:
            out=lambda w, output: os.path.dirname(output[0]),
        log:
            f"{LOGS}/vskipper/bench_tables.log",
        shell:
            "python -m impl vskipper-bench-tables --summaries {input} --out-dir {params.out} 2> {log}"

