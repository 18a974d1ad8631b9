"""vSkipper benchmark command (plugged into ``python -m impl`` through ``impl.cli.COMMANDS``).

``vskipper-bench``: per-step timings of the arms (upstream, routed all-RUN, RandomSkip over the r x d
grid, FlexiDepth when a checkpoint is given, the mode-switch hybrids) on a model directory or on the
wider randomly initialised model (``--wide``), beside the FLOP accounting's prediction
(:mod:`impl.vskipper.bench`); writes the rows as JSONL and a summary JSON with the issue's targets as
PASS / FAIL fields and a coarse decode profile.

``vskipper-http-check``: the three engine arms (upstream, hybrid, always-route) of one model served
in-process over HTTP and checked against the load generator's OpenAI-style client (``ignore_eos``,
streaming, greedy ids equal to the arm run in process), lm-eval's ``local-completions`` on the offline
GSM8K task, and the health / model / malformed-request endpoints (:mod:`impl.vskipper.http_check`);
writes PASS / FAIL rows as CSV and a summary JSON.

Settings: command-line flags; a flag left unset falls back to the optional config section
``vskipper.bench`` (same names with underscores), then to the defaults below.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

from ..argtypes import fraction, nonneg_float, nonneg_int, output_file, positive_int

log = logging.getLogger(__name__)

#: defaults of the settings (flag name with underscores -> value)
BENCH_DEFAULTS = dict(
    prefill_tokens=[2048], prompt_len=256, decode_requests=[32, 128], decode_context=64, repeats=5, warmup=1,
    cell_budget_s=90.0, max_repeats=40, target_budget_s=60.0, target_max_repeats=40,
    r=[0.25, 0.5, 0.75], d=[0.25, 0.5, 0.75], hybrid=True, profile_repeats=2, profile_steps=3,
    profile_requests=[32, 128], wide_hidden=256, wide_intermediate=704, wide_layers=12, wide_heads=4,
)


def _settings(args, cfg: dict | None) -> dict:
    """Flag, else the config's ``vskipper.bench`` key (typed: :class:`impl.vskipper.schema.Bench`), else
    :data:`BENCH_DEFAULTS`, per setting."""
    from .schema import optional_vskipper_section

    v = optional_vskipper_section(cfg) if cfg is not None else None
    bench = v.bench if v is not None else None
    out = {}
    for k, v in BENCH_DEFAULTS.items():
        a = getattr(args, k, None)
        c = getattr(bench, k) if bench is not None else None
        out[k] = a if a is not None else (c if c is not None else v)
    return out


def cmd_vskipper_bench(args) -> None:
    """Run the step benchmark on one model and write rows + summary."""
    import torch

    from impl.runtime import config_from_args, load_for, pin_allocator, run_provenance, set_threads
    from impl.provenance import write_json, write_jsonl
    from impl.schema import core_config

    from .bench import (WIDE_ARCH, arch_of, check_targets, decode_profile, prefill_profile, step_benchmark,
                        wide_model)

    cfg = config_from_args(args)
    core = core_config(cfg)
    set_threads(cfg)
    allocator = pin_allocator()
    s = _settings(args, cfg)
    if bool(args.wide) == bool(args.model_dir):
        raise SystemExit("error: pass exactly one of --model-dir DIR or --wide")
    if args.wide:
        arch = dict(WIDE_ARCH, hidden_size=int(s["wide_hidden"]), intermediate_size=int(s["wide_intermediate"]),
                    num_layers=int(s["wide_layers"]), num_heads=int(s["wide_heads"]))
        model = wide_model(**arch, seed=core.seed, dtype=getattr(torch, core.dtype)).to(core.device)
        label = args.label or "wide"
        source = {"wide": arch, "note": "randomly initialised (seeded); timings only, outputs meaningless"}
    else:
        model = load_for(cfg, args.model_dir)
        label = args.label or str(args.model_dir).rstrip("/").split("/")[-1]
        source = {"model_dir": str(args.model_dir)}
    flexi = None
    routed_layers = None
    if args.flexidepth:
        from .flexidepth import load_flexidepth

        flexi = load_flexidepth(args.flexidepth, model)
        routed_layers = list(flexi.routed_layers)
    cells = [dict(phase="prefill", tokens=int(t), prompt_len=int(s["prompt_len"])) for t in s["prefill_tokens"]]
    cells += [dict(phase="decode", requests=int(n), context=int(s["decode_context"])) for n in s["decode_requests"]]
    grid = [(float(r), float(d)) for r in s["r"] for d in s["d"]]
    pt = sorted({max(int(s["prompt_len"]), 512), *[int(t) for t in s["prefill_tokens"]]})
    profile_kw = dict(prefill_tokens=pt, prefill_prompt_len=int(s["prompt_len"]),
                      decode_requests=[int(n) for n in s["decode_requests"]], decode_context=int(s["decode_context"]),
                      repeats=int(s["profile_repeats"]), warmup=0)
    rows = step_benchmark(model, cells, routed_layers=routed_layers, grid=grid, flexidepth=flexi,
                          hybrid=bool(s["hybrid"]), profile_kw=profile_kw, repeats=int(s["repeats"]),
                          warmup=int(s["warmup"]), cell_budget_s=float(s["cell_budget_s"]),
                          max_repeats=int(s["max_repeats"]), target_budget_s=float(s["target_budget_s"]),
                          target_max_repeats=int(s["target_max_repeats"]), seed=core.seed, label=label, log=log.info)
    prof = []
    for n in s["profile_requests"]:
        prof += decode_profile(model, requests=int(n), context=int(s["decode_context"]), routed_layers=routed_layers,
                               steps=int(s["profile_steps"]), seed=core.seed, label=label)
    # where the worst prefill gap's time goes: the torch-profiler split of the RandomSkip arm farthest
    # from its FLOP prediction in the largest prefill cell, beside upstream and the cohort all-RUN path
    pre = [r for r in rows if r["phase"] == "prefill" and r["kind"] == "routed" and r.get("r") is not None]
    pprof = []
    if pre:
        T = max(r["T"] for r in pre)
        worst = max((r for r in pre if r["T"] == T), key=lambda r: r["abs_gap"])
        log.info("prefill profile: %s (gap %.3f)", worst["arm"], worst["abs_gap"])
        pprof = prefill_profile(model, tokens=T, prompt_len=int(s["prompt_len"]), arms=[(worst["r"], worst["d"])],
                                routed_layers=routed_layers, steps=int(s["profile_steps"]), seed=core.seed, label=label)
        for p in pprof:
            p["bench_gap"] = worst["abs_gap"] if p["arm"] == worst["arm"] else None
    prov = run_provenance(cfg, allocator=allocator)
    write_jsonl(args.out, [dict(r, **prov) for r in rows])
    targets = check_targets(rows)
    table = [{k: r.get(k) for k in ("cell", "arm", "kind", "r", "d", "skip_share", "t_step_s", "measured_ratio",
                                    "ratio_ci95", "flop_pred_ratio", "abs_gap", "hybrid_routed")} for r in rows]
    summary = dict(label=label, source=source, arch=arch_of(model), settings=s, cells=cells, targets=targets,
                   ratios=table, decode_profile=prof, prefill_profile=pprof, threads=torch.get_num_threads(),
                   timing_note="CPU wall clock; each arm over the upstream steps timed next to it (median of paired ratios over rounds); shared cores: noisy, compare ratios",
                   **prov)
    write_json(args.summary, summary)
    log.info("%s: all_run %s, prefill_flop %s, hybrid_dense %s -> %s", label, targets["all_run"],
             targets["prefill_flop"], targets["hybrid_dense"], args.summary)
    if not args.quiet:
        for r in table:
            print(f"{label:10s} {r['cell']:14s} {r['arm']:28s} measured {r['measured_ratio']:.3f}  "
                  f"flop {r['flop_pred_ratio']:.3f}  share {_f(r['skip_share'])}")
        print({k: v for k, v in targets.items() if k != "targets"})


def _f(x) -> str:
    return "  -  " if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3f}"


def cmd_vskipper_prefill_profile(args) -> None:
    """Torch-profiler split of a packed prefill step, dense vs routed (impl.vskipper.bench.prefill_profile)."""
    import torch

    from impl.provenance import write_json
    from impl.runtime import config_from_args, load_for, pin_allocator, run_provenance, set_threads
    from impl.schema import core_config

    from .bench import WIDE_ARCH, prefill_profile, wide_model

    cfg = config_from_args(args)
    core = core_config(cfg)
    set_threads(cfg)
    allocator = pin_allocator()
    if bool(args.wide) == bool(args.model_dir):
        raise SystemExit("error: pass exactly one of --model-dir DIR or --wide")
    if len(args.r) != len(args.d):
        raise SystemExit(f"error: --r and --d need one value per arm, got {len(args.r)} and {len(args.d)}")
    if args.wide:
        s = _settings(args, cfg)
        arch = dict(WIDE_ARCH, hidden_size=int(s["wide_hidden"]), intermediate_size=int(s["wide_intermediate"]),
                    num_layers=int(s["wide_layers"]), num_heads=int(s["wide_heads"]))
        model = wide_model(**arch, seed=core.seed, dtype=getattr(torch, core.dtype)).to(core.device)
        label = args.label or "wide"
    else:
        model = load_for(cfg, args.model_dir)
        label = args.label or str(args.model_dir).rstrip("/").split("/")[-1]
    rows = prefill_profile(model, tokens=args.tokens, prompt_len=args.prompt_len, arms=list(zip(args.r, args.d)),
                           steps=args.steps, seed=core.seed, label=label)
    write_json(args.out, {"rows": rows, **run_provenance(cfg, allocator=allocator)})
    cats = sorted({k for r in rows for k in r["ops_ms"]})
    print(f"{'arm':18s} {'wall ms':>8s} {'ratio':>6s} {'pred':>6s} " + " ".join(f"{c:>14s}" for c in cats))
    for r in rows:
        print(f"{r['arm']:18s} {1e3 * r['wall_s']:8.1f} {r['measured_ratio']:6.3f} {r['flop_pred_ratio']:6.3f} "
              + " ".join(f"{r['ops_ms'].get(c, 0.0):14.1f}" for c in cats))
    for r in rows[1:]:
        print(f"{r['arm']:18s} sections (ms): " + ", ".join(f"{k} {v:.1f}" for k, v in r["sections_ms"].items()))


def cmd_vskipper_bench_tables(args) -> None:
    """Step-benchmark tables from the summaries (impl.vskipper.bench_report)."""
    from .bench_report import bench_tables

    bench_tables(args.summaries, args.out_dir)
    log.info("vskipper bench tables -> %s", args.out_dir)


def cmd_vskipper_http_check(args) -> None:
    """The three engine arms in process and behind HTTP on one model (impl.vskipper.http_check): rows as
    CSV with PASS / FAIL verdicts and a summary JSON."""
    import time

    from impl.runtime import config_from_args, run_provenance, set_threads
    from impl.schema import core_config

    from .http_check import ARMS, DEFAULT_CHECKS, HYBRID_SWITCH, check_arms, default_skipper_specs, write_outputs

    cfg = config_from_args(args)
    set_threads(cfg)
    for name in ("ContinuousBatchingLogger", "lm_eval", "lm-eval"):
        logging.getLogger(name).setLevel(logging.WARNING)
    from .schema import BenchServing, RandomSkipMap, optional_vskipper_section

    core = core_config(cfg)
    v = optional_vskipper_section(cfg)
    rs = v.randomskip if v is not None else RandomSkipMap()
    q = v.quality if v is not None else None
    engine = v.engine if v is not None else None
    bench = v.http.bench_serving if v is not None else BenchServing()
    if args.sglang_python:
        bench = bench.model_copy(update={"python": args.sglang_python})
    knee = None
    if args.knee:  # bench_serving at a load point of the knee: an open-loop Poisson stream at factor x Q*
        from .serving_commands import served_knee_fields

        try:
            knee = served_knee_fields(json.loads(Path(args.knee).read_text()), args.point)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise SystemExit(f"error: --knee {args.knee}: {type(e).__name__}: {e}")
        n_knee = bench.knee_num_prompts or (v.requests if v is not None else bench.num_prompts)
        bench = bench.model_copy(update={"request_rate": knee["rate"], "max_concurrency": None, "num_prompts": n_knee})
    switch = None
    if args.thresholds:  # the hybrid arm's mode switch from profile-mode's rule-derived thresholds
        from .mode import ModeSwitch

        try:
            switch = ModeSwitch.from_profile(args.thresholds)
        except ValueError as e:
            raise SystemExit(f"error: --thresholds: {e}")
    checks = list(args.checks or (DEFAULT_CHECKS + (("bench_serving",) if args.sglang_python else ())))
    if args.skipper:
        specs = list(args.skipper)
    else:
        rd = f"r={args.r},d={args.d},seed={rs.seed},layer_choice={rs.layer_choice}"
        specs = default_skipper_specs(args.flexidepth, rd)
        if args.flexidepth and not specs[0].startswith("flexidepth:"):
            raise SystemExit(f"error: --flexidepth {args.flexidepth} is not a FlexiDepth checkpoint "
                             "(no flexidepth.json)")
        if args.also_randomskip and specs[0].startswith("flexidepth:"):
            specs.append(f"randomskip:{rd}")
    num_fewshot = args.num_fewshot if args.num_fewshot is not None else (q.gsm8k_num_fewshot if q else None)
    max_gen = args.max_gen_toks or (q.max_gen_toks.gsm8k if q else None) or 32
    settings = dict(model_dir=str(args.model_dir), prompts=args.prompts and str(args.prompts), arms=list(args.arms or ARMS),
                    skippers=specs, n_prompts=args.n_prompts, max_tokens=args.max_tokens, limit=args.limit,
                    num_fewshot=num_fewshot, max_gen_toks=int(max_gen), checks=checks,
                    bench_serving=bench.model_dump() if "bench_serving" in checks else None,
                    hybrid_switch=(switch or HYBRID_SWITCH).to_dict(), engine=None if engine is None else engine.model_dump(),
                    data_dir=str(core.data_dir), bench_prompts=args.bench_prompts and str(args.bench_prompts),
                    knee=knee, thresholds=args.thresholds and str(args.thresholds))
    prov = run_provenance(cfg)  # before the run: the git sha of the code that runs, not of a later commit
    t0 = time.perf_counter()
    rows = check_arms(args.model_dir, settings["arms"], specs, args.prompts, n_prompts=args.n_prompts,
                      max_tokens=args.max_tokens, data_dir=core.data_dir, limit=args.limit, num_fewshot=num_fewshot,
                      max_gen_toks=int(max_gen), engine=engine, label=args.label, dtype=core.dtype,
                      device=core.device, seed=core.seed, checks=checks, bench=bench, switch=switch,
                      bench_prompts=args.bench_prompts)
    wall = time.perf_counter() - t0
    summary = write_outputs(rows, args.out, args.summary,
                            extra=dict(label=args.label or str(args.model_dir).rstrip("/").split("/")[-1],
                                       settings=settings, wall_s=round(wall, 1), **prov))
    fails = [r for r in rows if r["verdict"] != "PASS"]
    log.info("%s: %d PASS / %d FAIL in %.0f s -> %s", args.model_dir, summary["counts"]["PASS"], len(fails), wall,
             args.out)
    for r in fails:
        log.warning("FAIL %s %s [%s] %s: %s", r["model"], r["arm"], r["skipper"], r["check"], r["detail"])
    if not args.quiet:
        for r in rows:
            sk = (r["skipper"] or "-").split(",seed=")[0]
            print(f"{r['model']:10s} {r['arm']:13s} {sk:32s} {r['check']:14s} {r['verdict']}  {r['detail']}")
    if fails and args.strict:
        raise SystemExit(1)


def register(add) -> None:
    """Add this module's commands to the ``python -m impl`` parser (``add(name, fn, help)``)."""
    sp = add("vskipper-bench", cmd_vskipper_bench,
             "per-step timings of the vSkipper arms vs FLOP accounting (RandomSkip r x d grid, FlexiDepth, hybrid)")
    sp.add_argument("--model-dir", help="HF model directory (or --wide)")
    sp.add_argument("--wide", action="store_true", help="the wider randomly initialised model (timings only)")
    sp.add_argument("--flexidepth", help="FlexiDepth checkpoint directory (adds the flexidepth arms)")
    sp.add_argument("--label", help="label of the rows (default: model dir name, or 'wide')")
    sp.add_argument("--out", type=output_file, required=True, help="JSONL rows to write")
    sp.add_argument("--summary", type=output_file, required=True, help="summary JSON to write (targets as PASS/FAIL)")
    sp.add_argument("--prefill-tokens", type=positive_int, nargs="+", help="prefill cells: packed prompt tokens")
    sp.add_argument("--prompt-len", type=positive_int, help="tokens per packed prompt")
    sp.add_argument("--decode-requests", type=positive_int, nargs="+", help="decode cells: concurrent requests")
    sp.add_argument("--decode-context", type=positive_int, help="cached tokens per decode request")
    sp.add_argument("--repeats", type=positive_int, help="timed rounds per cell (median)")
    sp.add_argument("--warmup", type=nonneg_int, help="untimed rounds per cell")
    sp.add_argument("--cell-budget-s", type=nonneg_float,
                    help="seconds of timed steps per cell: rounds go on past --repeats until then (0: exactly --repeats)")
    sp.add_argument("--max-repeats", type=positive_int, help="at most this many timed rounds per cell")
    sp.add_argument("--target-budget-s", type=nonneg_float,
                    help="seconds of further paired rounds of the all-RUN arm and the A/A control alone per cell "
                         "(the 2%% target's precision; 0: none)")
    sp.add_argument("--target-max-repeats", type=positive_int, help="at most this many such rounds per cell")
    sp.add_argument("--r", type=fraction, nargs="+", help="RandomSkip row fractions")
    sp.add_argument("--d", type=fraction, nargs="+", help="RandomSkip layer fractions")
    sp.add_argument("--no-hybrid", dest="hybrid", action="store_const", const=False, help="skip the hybrid arms")
    sp.add_argument("--profile-repeats", type=positive_int, help="rounds of the routed-cost profile for the thresholds")
    sp.add_argument("--profile-steps", type=positive_int, help="steps of the decode time profile")
    sp.add_argument("--profile-requests", type=positive_int, nargs="*", help="decode loads of the time profile")
    sp.add_argument("--wide-hidden", type=positive_int)
    sp.add_argument("--wide-intermediate", type=positive_int)
    sp.add_argument("--wide-layers", type=positive_int)
    sp.add_argument("--wide-heads", type=positive_int)
    sp = add("vskipper-prefill-profile", cmd_vskipper_prefill_profile,
             "torch-profiler split of a packed prefill step: upstream, cohort all-RUN and RandomSkip arms")
    sp.add_argument("--model-dir", help="HF model directory (or --wide)")
    sp.add_argument("--wide", action="store_true", help="the wider randomly initialised model (timings only)")
    sp.add_argument("--label")
    sp.add_argument("--tokens", type=positive_int, default=2048, help="packed prompt tokens of the step")
    sp.add_argument("--prompt-len", type=positive_int, default=256, help="tokens per packed prompt")
    sp.add_argument("--r", type=fraction, nargs="+", default=[0.5], help="RandomSkip row fractions, one per arm")
    sp.add_argument("--d", type=fraction, nargs="+", default=[0.5], help="RandomSkip layer fractions, one per arm")
    sp.add_argument("--steps", type=positive_int, default=2, help="profiled steps per arm")
    sp.add_argument("--out", type=output_file, required=True, help="JSON to write (rows + provenance)")
    sp = add("vskipper-bench-tables", cmd_vskipper_bench_tables, "tables of the vSkipper step benchmark", config=False)
    sp.add_argument("--summaries", nargs="+", required=True, help="vskipper-bench summary JSON files")
    sp.add_argument("--out-dir", required=True, help="tables directory")
    sp = add("vskipper-http-check", cmd_vskipper_http_check,
             "engine arms (upstream, hybrid, always-route) in process and behind HTTP: OpenAI-style client with "
             "ignore_eos, the OpenAI SDK, lm-eval local-completions, endpoints; PASS/FAIL rows")
    sp.add_argument("--model-dir", required=True, help="HF model directory (with tokenizer)")
    sp.add_argument("--prompts", help="workload suite JSONL with input_ids (rule workload_tokens; needed by the "
                                      "client_stream, greedy_ids, openai_sdk and endpoints checks)")
    sp.add_argument("--flexidepth", help="FlexiDepth checkpoint directory: the routed arms' skipper "
                                         "(default: RandomSkip r=--r, d=--d)")
    sp.add_argument("--skipper", action="append", help="skipper spec(s) of the routed arms, overriding --flexidepth "
                                                       "(repeatable; e.g. randomskip:r=0.5,d=0.5)")
    sp.add_argument("--also-randomskip", action="store_true",
                    help="with a FlexiDepth checkpoint, run the routed arms with RandomSkip too")
    sp.add_argument("--r", type=fraction, default=0.5, help="RandomSkip row fraction (default 0.5)")
    sp.add_argument("--d", type=fraction, default=0.5, help="RandomSkip layer fraction (default 0.5)")
    sp.add_argument("--arms", nargs="+",
                    help="arms (default: upstream hybrid always-route; also prefill-only decode-only no-promotion never-route)")
    sp.add_argument("--checks", nargs="+",
                    help="checks (default: client_stream greedy_ids openai_sdk lm_eval endpoints, plus bench_serving when "
                         "--sglang-python is given; bench_serving alone takes its Python from "
                         "vskipper.http.bench_serving.python)")
    sp.add_argument("--sglang-python", help="a Python with SGLang installed (.venv-sglang/bin/python from "
                                            "scripts/setup_sglang.sh): adds the bench_serving check to the "
                                            "default checks (its settings: vskipper.http.bench_serving)")
    sp.add_argument("--bench-prompts", help="workload suite JSONL (rows with text) that bench_serving and the load "
                    "generator send instead of the ShareGPT subset, e.g. the knee workload's prompts")
    sp.add_argument("--knee", help="knee JSON (rule vskipper_knee): bench_serving runs open loop at --point x Q* "
                    "(overrides vskipper.http.bench_serving.request_rate / max_concurrency)")
    sp.add_argument("--point", default="knee", help="load point of --knee (a label of vskipper.load_points; default knee)")
    sp.add_argument("--thresholds", help="profile-mode JSON of the FlexiDepth policy: the hybrid arm's mode switch "
                    "(default: the check's fixed switch, HYBRID_SWITCH)")
    sp.add_argument("--n-prompts", type=positive_int, default=4, help="requests per client check (default 4)")
    sp.add_argument("--max-tokens", type=positive_int, default=16, help="tokens per ignore_eos request (default 16)")
    sp.add_argument("--limit", type=positive_int, default=4, help="GSM8K documents evaluated by lm-eval (default 4)")
    sp.add_argument("--num-fewshot", type=nonneg_int, help="GSM8K few-shot (default: vskipper.quality.gsm8k_num_fewshot, "
                                                    "else the task's 5)")
    sp.add_argument("--max-gen-toks", type=positive_int, help="lm-eval budget per document (default: "
                                                     "vskipper.quality.max_gen_toks.gsm8k, else 32)")
    sp.add_argument("--label", help="model column and served model name (default: the directory's name)")
    sp.add_argument("--out", type=output_file, required=True, help="CSV rows to write")
    sp.add_argument("--summary", type=output_file, help="summary JSON to write")
    sp.add_argument("--strict", action="store_true", help="exit 1 when any row FAILs (outputs are written first)")


__all__ = ["register", "cmd_vskipper_bench", "cmd_vskipper_bench_tables", "cmd_vskipper_http_check",
           "BENCH_DEFAULTS"]
