# vSkipper serving experiments (vSkipper Sec. 4: Tables 2-5, Table 3 ablation, Fig. 3; thresholds of
# Sec. 3.3) on the model of vskipper.model, driven through transformers' continuous-batching engine:
#   FlexiDepth-style skipper (stage-1 training) -> share + routed-cost profile -> rule-derived thresholds
#   knee sweep on upstream (per workload) -> cells at vskipper.load_points x Q* (matched / natural lanes)
#   -> mechanism ablation at the knee -> RandomSkip r x d map at randomskip.point -> tables, figures, report.
# Each command is documented in impl/vskipper/serving_commands.py (python -m impl CMD --help).
#
# Timing rules (profile, knee, cells, ablation, map) take TIMED_THREADS (common.smk): alone on the
# embedded default.
VSK = CFG.get("vskipper")
if VSK:
    VSK_MODEL = VSK["model"]
    VSK_MODEL_DIR = str(model_dir(CFG, VSK_MODEL))
    VSK_CKPT = f"{MODELS}/{VSK_MODEL}-flexidepth"  # the skipper's checkpoint, beside the model
    VSK_DIR = f"{RESULTS}/vskipper"
    VSK_TABLES = f"{RESULTS}/tables/vskipper"
    VSK_W0 = VSK["workloads"][0]  # share measurement, ablation and RandomSkip map run on the first workload
    VSK_POINTS = list(VSK["load_points"])


    wildcard_constraints:
        vsk_point="|".join(map(re.escape, VSK_POINTS)),
        vsk_policy="flexidepth|random",

    rule vskipper_train_flexidepth:
        conda:
            "../env.yaml"
        input:
            model=VSK_MODEL_DIR,
        output:
            ckpt=directory(VSK_CKPT),
            summary=f"{VSK_DIR}/flexidepth/{VSK_MODEL}.json",
        params:
            cfg=EFFECTIVE_CONFIG,
            sig=sig("data_dir", "seed", "device", "dtype", model=VSK_MODEL, flexidepth=VSK["flexidepth"]),
        threads: VSK["flexidepth"]["threads"]
        log:
            f"{LOGS}/vskipper/train_flexidepth.log",
        shell:
            "python -m impl train-flexidepth --config-json @{params.cfg} --quiet --model-dir {input.model} "
            "--out {output.ckpt} --summary {output.summary} 2> {log}"

    rule vskipper_profile:
        conda:
            "../env.yaml"
        input:
            model=VSK_MODEL_DIR,
            ckpt=VSK_CKPT,
            prompts=f"{RESULTS}/workloads/{VSK_MODEL}/{VSK_W0}.jsonl",
        output:
            f"{VSK_DIR}/thresholds/{{vsk_policy}}.json",
        params:
            cfg=EFFECTIVE_CONFIG,
            sig=vsk_sig("profile", "engine", "max_new_tokens", "randomskip"),
        threads: TIMED_THREADS
        log:
            f"{LOGS}/vskipper/profile_{{vsk_policy}}.log",
        shell:
            "python -m impl profile-mode --config-json @{params.cfg} --quiet --model-dir {input.model} "
            "--flexidepth {input.ckpt} --policy {wildcards.vsk_policy} --prompts {input.prompts} --out {output} 2> {log}"

    rule vskipper_knee:
        conda:
            "../env.yaml"
        input:
            model=VSK_MODEL_DIR,
            prompts=vsk_prompts,
        output:
            f"{VSK_DIR}/knee/{{suite}}.json",
        params:
            cfg=EFFECTIVE_CONFIG,
            sig=vsk_sig("knee", "engine", "requests", "max_new_tokens", "load_points", "timeout_s"),
        threads: TIMED_THREADS
        log:
            f"{LOGS}/vskipper/knee_{{suite}}.log",
        shell:
            "python -m impl knee --config-json @{params.cfg} --quiet --model-dir {input.model} --prompts {input.prompts} "
            "--workload {wildcards.suite} --out {output} 2> {log}"

    VSK_CELL_INPUTS = dict(model=VSK_MODEL_DIR, ckpt=VSK_CKPT, thresholds=f"{VSK_DIR}/thresholds/flexidepth.json",
                           knee=f"{VSK_DIR}/knee/{{suite}}.json", prompts=vsk_prompts)
    VSK_CELL_SHELL = ("python -m impl serve-cell --config-json @{params.cfg} --quiet --model-dir {input.model} "
                      "--flexidepth {input.ckpt} --thresholds {input.thresholds} --knee {input.knee} "
                      "--prompts {input.prompts} --workload {wildcards.suite} {params.args} --out {output} 2> {log}")

    rule vskipper_cell:
        conda:
            "../env.yaml"
        input:
            **VSK_CELL_INPUTS,
        output:
            f"{VSK_DIR}/cells/{{suite}}/{{vsk_point}}.jsonl",
        params:
            cfg=EFFECTIVE_CONFIG,
            args=lambda w: f"--point {w.vsk_point} --experiment main",
            sig=vsk_sig("engine", "requests", "max_new_tokens", "repetitions", "lanes", "timeout_s"),
        threads: TIMED_THREADS
        log:
            f"{LOGS}/vskipper/cells/{{suite}}/{{vsk_point}}.log",
        shell:
            VSK_CELL_SHELL

    VSK_CELLS = expand(f"{VSK_DIR}/cells/{{suite}}/{{p}}.jsonl", suite=VSK["workloads"], p=VSK_POINTS)
    VSK_ABLATION = [f"{VSK_DIR}/ablation/{VSK_W0}.jsonl"] if VSK["ablations"] else []
    VSK_MAP = [f"{VSK_DIR}/randomskip/{VSK_W0}.jsonl"] if VSK["randomskip"]["r"] else []

    if VSK_ABLATION:

        rule vskipper_ablation:
            conda:
                "../env.yaml"
            input:
                **VSK_CELL_INPUTS,
            output:
                f"{VSK_DIR}/ablation/{{suite}}.jsonl",
            params:
                cfg=EFFECTIVE_CONFIG,
                args=("--point knee --experiment ablation --lanes matched --drop-ids "
                      f"--repetitions {VSK['ablation_repetitions']} --arms {' '.join(VSK['ablations'])}"),
                sig=vsk_sig("engine", "requests", "max_new_tokens", "ablations", "ablation_repetitions", "timeout_s"),
            threads: TIMED_THREADS
            log:
                f"{LOGS}/vskipper/ablation_{{suite}}.log",
            shell:
                VSK_CELL_SHELL

    if VSK_MAP:

        rule vskipper_randomskip:
            conda:
                "../env.yaml"
            input:
                model=VSK_MODEL_DIR,
                knee=f"{VSK_DIR}/knee/{{suite}}.json",
                shared=f"{VSK_DIR}/thresholds/flexidepth.json",
                random=f"{VSK_DIR}/thresholds/random.json",
                prompts=vsk_prompts,
            output:
                f"{VSK_DIR}/randomskip/{{suite}}.jsonl",
            params:
                cfg=EFFECTIVE_CONFIG,
                sig=vsk_sig("engine", "requests", "max_new_tokens", "randomskip", "timeout_s"),
            threads: TIMED_THREADS
            log:
                f"{LOGS}/vskipper/randomskip_{{suite}}.log",
            shell:
                "python -m impl randomskip-map --config-json @{params.cfg} --quiet --model-dir {input.model} "
                "--knee {input.knee} --shared-thresholds {input.shared} --random-thresholds {input.random} "
                "--prompts {input.prompts} --workload {wildcards.suite} --out {output} 2> {log}"

    # ---- quality (Sec. 4.3, Table 5: the lm-eval 2x2 DiD, left; the served hybrid at the knee, right) ----
    # vskipper_quality, one job per suite of vskipper.quality.tasks: A base (lm-eval HF backend), B checkpoint
    # (plain PyTorch), C base served by the upstream arm, D checkpoint served always-route (C/D: the vSkipper
    # HTTP server started inside the job on 127.0.0.1:0, lm-eval's local-completions client sending token ids),
    # same documents and token ids; it also writes each document's request (prompt ids, stop strings, budget).
    # vskipper_quality_served (when vskipper.quality.served is not null): those requests, padded with the knee
    # workload's prompts, as one seeded Poisson stream at served.point x Q* (the knee JSON) to the hybrid server
    # (FlexiDepth thresholds) and to the always-route server; a timed job like the cells.
    VSK_Q = VSK.get("quality")
    VSK_QUALITY = expand(f"{VSK_DIR}/quality/{{qsuite}}.jsonl", qsuite=VSK_Q["tasks"]) if VSK_Q else []
    VSK_QS = VSK_Q.get("served") if VSK_Q else None
    VSK_QUALITY_SERVED = (expand(f"{VSK_DIR}/quality_served/{{qsuite}}.jsonl", qsuite=VSK_Q["tasks"])
                          if VSK_QUALITY and VSK_QS else [])
    if VSK_QUALITY:

        wildcard_constraints:
            qsuite="|".join(map(re.escape, VSK_Q["tasks"])),

        rule vskipper_quality:
            conda:
                "../env.yaml"
            input:
                model=VSK_MODEL_DIR,
                ckpt=VSK_CKPT,
            output:
                rows=f"{VSK_DIR}/quality/{{qsuite}}.jsonl",
                summary=f"{VSK_DIR}/quality/{{qsuite}}.json",
                requests=f"{VSK_DIR}/quality/{{qsuite}}_requests.jsonl",
                work=directory(f"{VSK_DIR}/quality/{{qsuite}}_run"),
            params:
                cfg=EFFECTIVE_CONFIG,
                sig=sig("data_dir", "seed", "threads", "device", "dtype",
                        vsk={"model": VSK_MODEL, "engine": VSK["engine"],
                             "quality": {k: x for k, x in VSK_Q.items() if k != "served"}}),
            threads: CFG["threads"]
            log:
                f"{LOGS}/vskipper/quality_{{qsuite}}.log",
            shell:
                "python -m impl quality-cell --config-json @{params.cfg} --quiet --model-dir {input.model} "
                "--flexidepth {input.ckpt} --suite {wildcards.qsuite} --work-dir {output.work} "
                "--out {output.rows} --summary {output.summary} --requests {output.requests} 2> {log}"

    if VSK_QUALITY_SERVED:
        from impl.vskipper.schema import served_knee_workload


        rule vskipper_quality_served:
            conda:
                "../env.yaml"
            input:
                model=VSK_MODEL_DIR,
                ckpt=VSK_CKPT,
                requests=f"{VSK_DIR}/quality/{{qsuite}}_requests.jsonl",
                thresholds=f"{VSK_DIR}/thresholds/flexidepth.json",
                knee=lambda w: f"{VSK_DIR}/knee/{vsk_qknee(w)}.json",
                prompts=lambda w: f"{RESULTS}/workloads/{VSK_MODEL}/{vsk_qknee(w)}.jsonl",
            output:
                rows=f"{VSK_DIR}/quality_served/{{qsuite}}.jsonl",
                summary=f"{VSK_DIR}/quality_served/{{qsuite}}.json",
                work=directory(f"{VSK_DIR}/quality_served/{{qsuite}}_run"),
            params:
                cfg=EFFECTIVE_CONFIG,
                sig=sig("data_dir", "seed", "threads", "device", "dtype", vsk={k: VSK[k] for k in (
                    "model", "engine", "requests", "max_new_tokens", "timeout_s", "load_points", "quality")}),
            threads: TIMED_THREADS
            log:
                f"{LOGS}/vskipper/quality_served_{{qsuite}}.log",
            shell:
                "python -m impl quality-served --config-json @{params.cfg} --quiet --model-dir {input.model} "
                "--flexidepth {input.ckpt} --thresholds {input.thresholds} --knee {input.knee} "
                "--requests {input.requests} --prompts {input.prompts} --suite {wildcards.qsuite} "
                "--work-dir {output.work} --out {output.rows} --summary {output.summary} 2> {log}"

    # ---- end of HOOK ----

    rule vskipper_tables:
        conda:
            "../env.yaml"
        input:
            knee=expand(f"{VSK_DIR}/knee/{{suite}}.json", suite=VSK["workloads"]),
            thresholds=expand(f"{VSK_DIR}/thresholds/{{p}}.json", p=["flexidepth"] + (["random"] if VSK_MAP else [])),
            flexidepth=rules.vskipper_train_flexidepth.output.summary,
            cells=VSK_CELLS,
            ablation=VSK_ABLATION,
            randomskip=VSK_MAP,
            quality=VSK_QUALITY,
            quality_served=VSK_QUALITY_SERVED,
        output:
            expand(f"{VSK_TABLES}/{{name}}.{{ext}}", name=[
                "vskipper_flexidepth", "vskipper_thresholds", "vskipper_knee", "vskipper_knee_summary",
                "vskipper_cells", "vskipper_table2", "vskipper_table4", "vskipper_ablation", "vskipper_randomskip",
                "vskipper_modes", "vskipper_gate"] + (["vskipper_table5", "vskipper_first_token"] if VSK_QUALITY else [])
                + (["vskipper_table5_served"] if VSK_QUALITY_SERVED else []),
                ext=["csv", "md"]),
        params:
            out=lambda w, output: os.path.dirname(output[0]),
            quality=lambda w, input: ("--quality " + " ".join(input.quality)) if VSK_QUALITY else "",
            quality_served=lambda w, input: (("--quality-served " + " ".join(input.quality_served))
                                             if VSK_QUALITY_SERVED else ""),
        log:
            f"{LOGS}/vskipper/tables.log",
        shell:
            "python -m impl vskipper-tables --knee {input.knee} --thresholds {input.thresholds} "
            "--flexidepth {input.flexidepth} --cells {input.cells} --ablation {input.ablation} "
            "--randomskip {input.randomskip} {params.quality} {params.quality_served} --out-dir {params.out} 2> {log}"

    rule vskipper_figures:
        conda:
            "../env.yaml"
        input:
            rules.vskipper_tables.output,
        output:
            expand(f"{FIGURES}/{{name}}.png", name=["vskipper_fig3", "vskipper_knee"]),
        params:
            tables=lambda w, input: os.path.dirname(input[0]),
            out=lambda w, output: os.path.dirname(output[0]),
        log:
            f"{LOGS}/vskipper/figures.log",
        shell:
            "python -m impl vskipper-figures --tables-dir {params.tables} --out-dir {params.out} 2> {log}"

    # ---- Table 6 (cross-model) and Table 7 (hardware transfer), Sec. 4.4 ----
    # Extra targets re-run the main rules' commands (use rule ... with:) on their own effective config
    # (impl.vskipper.schema.target_config: vskipper.model = the extra model, or device/threads = the device
    # entry's; written beside EFFECTIVE_CONFIG when execution starts). Outputs go to
    # {VSK_DIR}/models/{model}/... and {VSK_DIR}/devices/{name}/...; nothing of the main run moves or re-runs.
    # Per extra model: FlexiDepth skipper ({MODELS}/{model}-flexidepth), thresholds, knee on
    # cross_model.workload, a matched-lane cell at cross_model.point and (with vskipper.quality on that
    # workload) the quality 2x2 of that suite for the served accuracy. Per device: thresholds, knee and the
    # matched-lane cell of vskipper.model, its jobs carrying the entry's `resources` (SLURM partition, gres).
    from impl.vskipper.schema import target_config, transfer_settings
    from impl.vskipper.targets import device_resources, target_args, target_files, target_sig, transfer_targets

    VSK_X = transfer_settings(VSK)
    VSK_XW, VSK_XP = VSK_X["workload"], VSK_X["point"]
    VSK_XMODELS = list(VSK_X["models"])
    VSK_DEVICES = {d["name"]: d for d in VSK_X["devices"]}
    VSK_TCFG = {**{("models", m): target_config(CFG, model=m) for m in VSK_XMODELS},
                **{("devices", d): target_config(CFG, device=d) for d in VSK_DEVICES}}
    EXTRA_CONFIGS.update({vsk_tcfg_path(k, n): c for (k, n), c in VSK_TCFG.items()})
    VSK_XQUALITY = bool(VSK_QUALITY) and VSK_XW in VSK_Q["tasks"]
    VSK_TIMED_TOP = ("seed", "threads", "device", "dtype")

    if VSK_XMODELS:
        VSK_XM = f"{VSK_DIR}/models/{{vsk_xmodel}}"

        wildcard_constraints:
            vsk_xmodel="|".join(map(re.escape, VSK_XMODELS)),

        VSK_XM_CKPT = f"{MODELS}/{{vsk_xmodel}}-flexidepth"
        VSK_XM_PROMPTS = f"{RESULTS}/workloads/{{vsk_xmodel}}/{{suite}}.jsonl"

        use rule vskipper_train_flexidepth as vskipper_model_train_flexidepth with:
            input:
                model=vsk_xm_dir,
            output:
                ckpt=directory(VSK_XM_CKPT),
                summary=f"{VSK_XM}/flexidepth.json",
            params:
                cfg=vsk_xm_cfg,
                sig=vsk_tsig("models", ("data_dir", "seed", "device", "dtype"), ("model", "flexidepth")),
            log:
                f"{LOGS}/vskipper/models/{{vsk_xmodel}}/train_flexidepth.log",

        use rule vskipper_profile as vskipper_model_profile with:
            input:
                model=vsk_xm_dir,
                ckpt=VSK_XM_CKPT,
                prompts=f"{RESULTS}/workloads/{{vsk_xmodel}}/{VSK_W0}.jsonl",
            output:
                f"{VSK_XM}/thresholds/{{vsk_policy}}.json",
            params:
                cfg=vsk_xm_cfg,
                sig=vsk_tsig("models", VSK_TIMED_TOP, ("model", "profile", "engine", "max_new_tokens", "randomskip")),
            log:
                f"{LOGS}/vskipper/models/{{vsk_xmodel}}/profile_{{vsk_policy}}.log",

        use rule vskipper_knee as vskipper_model_knee with:
            input:
                model=vsk_xm_dir,
                prompts=VSK_XM_PROMPTS,
            output:
                f"{VSK_XM}/knee/{{suite}}.json",
            params:
                cfg=vsk_xm_cfg,
                sig=vsk_tsig("models", VSK_TIMED_TOP, ("model", "knee", "engine", "requests", "max_new_tokens",
                                                       "load_points", "timeout_s")),
            log:
                f"{LOGS}/vskipper/models/{{vsk_xmodel}}/knee_{{suite}}.log",

        use rule vskipper_cell as vskipper_model_cell with:
            input:
                model=vsk_xm_dir,
                ckpt=VSK_XM_CKPT,
                thresholds=f"{VSK_XM}/thresholds/flexidepth.json",
                knee=f"{VSK_XM}/knee/{{suite}}.json",
                prompts=VSK_XM_PROMPTS,
            output:
                f"{VSK_XM}/cells/{{suite}}/{{vsk_point}}.jsonl",
            params:
                cfg=vsk_xm_cfg,
                args=lambda w: f"--point {w.vsk_point} --lanes matched --experiment cross-model",
                sig=vsk_tsig("models", VSK_TIMED_TOP, ("model", "engine", "requests", "max_new_tokens", "repetitions",
                                                       "timeout_s")),
            log:
                f"{LOGS}/vskipper/models/{{vsk_xmodel}}/cells/{{suite}}/{{vsk_point}}.log",

        if VSK_XQUALITY:

            use rule vskipper_quality as vskipper_model_quality with:
                input:
                    model=vsk_xm_dir,
                    ckpt=VSK_XM_CKPT,
                output:
                    rows=f"{VSK_XM}/quality/{{qsuite}}.jsonl",
                    summary=f"{VSK_XM}/quality/{{qsuite}}.json",
                    requests=f"{VSK_XM}/quality/{{qsuite}}_requests.jsonl",
                    work=directory(f"{VSK_XM}/quality/{{qsuite}}_run"),
                params:
                    cfg=vsk_xm_cfg,
                    sig=vsk_tsig("models", ("data_dir", "seed", "threads", "device", "dtype"),
                                 ("model", "engine", "quality")),
                log:
                    f"{LOGS}/vskipper/models/{{vsk_xmodel}}/quality_{{qsuite}}.log",

    if VSK_DEVICES:
        VSK_XD = f"{VSK_DIR}/devices/{{vsk_device}}"

        wildcard_constraints:
            vsk_device="|".join(map(re.escape, VSK_DEVICES)),


        use rule vskipper_profile as vskipper_device_profile with:
            output:
                f"{VSK_XD}/thresholds/{{vsk_policy}}.json",
            params:
                cfg=vsk_xd_cfg,
                sig=vsk_tsig("devices", VSK_TIMED_TOP, ("model", "profile", "engine", "max_new_tokens", "randomskip")),
            threads: vsk_xd_threads
            log:
                f"{LOGS}/vskipper/devices/{{vsk_device}}/profile_{{vsk_policy}}.log",
            resources:
                **vsk_xd_resources(mem_mb=8000, runtime=60),

        use rule vskipper_knee as vskipper_device_knee with:
            output:
                f"{VSK_XD}/knee/{{suite}}.json",
            params:
                cfg=vsk_xd_cfg,
                sig=vsk_tsig("devices", VSK_TIMED_TOP, ("model", "knee", "engine", "requests", "max_new_tokens",
                                                        "load_points", "timeout_s")),
            threads: vsk_xd_threads
            log:
                f"{LOGS}/vskipper/devices/{{vsk_device}}/knee_{{suite}}.log",
            resources:
                **vsk_xd_resources(mem_mb=8000, runtime=120),

        use rule vskipper_cell as vskipper_device_cell with:
            input:
                **{**VSK_CELL_INPUTS, "thresholds": f"{VSK_XD}/thresholds/flexidepth.json",
                   "knee": f"{VSK_XD}/knee/{{suite}}.json"},
            output:
                f"{VSK_XD}/cells/{{suite}}/{{vsk_point}}.jsonl",
            params:
                cfg=vsk_xd_cfg,
                args=lambda w: f"--point {w.vsk_point} --lanes matched --experiment transfer",
                sig=vsk_tsig("devices", VSK_TIMED_TOP, ("model", "engine", "requests", "max_new_tokens", "repetitions",
                                                        "timeout_s")),
            threads: vsk_xd_threads
            log:
                f"{LOGS}/vskipper/devices/{{vsk_device}}/cells/{{suite}}/{{vsk_point}}.log",
            resources:
                **vsk_xd_resources(mem_mb=8000, runtime=240),


    VSK_T6, VSK_T7 = transfer_targets(VSK_DIR, VSK_MODEL, VSK_XMODELS, VSK_DEVICES, VSK_XW, VSK_XP, VSK_XQUALITY)
    VSK_TRANSFER = expand(f"{VSK_TABLES}/{{name}}.{{ext}}", ext=["csv", "md"],
                          name=(["vskipper_table6"] if VSK_T6 else []) + (["vskipper_table7"] if VSK_T7 else []))

    if VSK_TRANSFER:

        rule vskipper_transfer_tables:
            conda:
                "../env.yaml"
            input:
                table6=target_files(VSK_T6),
                table7=target_files(VSK_T7),
            output:
                VSK_TRANSFER,
            params:
                args=target_args(VSK_T6, VSK_T7),
                out=lambda w, output: os.path.dirname(output[0]),
            log:
                f"{LOGS}/vskipper/transfer_tables.log",
            shell:
                "python -m impl vskipper-transfer-tables {params.args} --out-dir {params.out} 2> {log}"

    VSK_REPORT_INPUTS = (rules.vskipper_tables.output + rules.vskipper_figures.output + VSK_QUALITY
                         + VSK_QUALITY_SERVED + VSK_TRANSFER)
