"""``python -m impl`` commands of the TEV/ExitTrain experiments (registered by :mod:`impl.cli`).

- ``tev-train``: target rollouts on the prompt mixture (:mod:`impl.tev.prompts`; once, through the
  target's chat template when it has one), the base DFlash-style drafter (dense decayed token loss; its held-out learning curve when
  ``tev.drafter.curve_points`` is set), then each ExitTrain objective (token-only, prefix-weighted,
  exit-guided) and Draft-OPD fine-tuned from the base with matched initialisation, data and steps;
  drafters saved under one directory (``base/``, ``token/``, ``prefix/``, ``exit/``, ``opd/``) with a
  JSON summary.
- ``tev-cell``: every decoding arm on one (model, workload) (:mod:`impl.tev.cell`).
- ``tev-latency``: verifier-stage latency of predraw, sequential residual and TEV on the same
  realised trees (Table 3).
- ``tev-tables``: the five tables from raw rows (:mod:`impl.tev.report`).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from ..argtypes import output_file
from ..schema import core_config
from ..workloads.prompts import read_prompts
from .schema import tev_section

log = logging.getLogger("impl")



def cmd_tev_train(args) -> None:
    import torch

    from ..models.adapters import model_fingerprint
    from ..models.load import load_tokenizer
    from ..runtime import config_from_args, load_for
    from ..provenance import atomic_path, provenance, write_json
    from .drafter import DrafterTrainConfig, make_rollouts, train_drafter
    from .prompts import drafter_prompt_ids
    from .train import ExitTrainConfig, evaluate_trees, train_exittrain

    cfg = config_from_args(args)
    if args.dex_head:  # DEX Fig. 5's trained-head arm for a model TEV does not train: the base drafter only
        from ..dex.schema import dex_section

        dex = dex_section(cfg, why=" (the trained head's settings live in dex.speculative.dflash.drafter)")
        d = dex.speculative.dflash.drafter if dex.speculative.dflash is not None else None
        if d is None:
            raise SystemExit("config: dex.speculative.dflash.drafter is not set (the trained head's drafter settings)")
        stop_at_eos, objectives, curve_tree = dex.stop_at_eos, [], None
    else:
        t = tev_section(cfg)
        d, stop_at_eos, objectives = t.drafter, t.stop_at_eos, t.exittrain.objectives
        curve_tree = (t.budget, t.depth)  # the learning curve's tree: the main cells' B, greedy (T = 0)
    torch.set_num_threads(d.threads)
    target = load_for(cfg, args.model_dir)
    tok = load_tokenizer(args.model_dir)
    core = core_config(cfg)
    # workload-shaped sources render as their workloads (and the held-out ones leave the frozen sample out)
    prompts, sources = drafter_prompt_ids(tok, core.data_dir, d.prompts, d.prompt_mix,
                                          max_prompt_tokens=d.prompt_max_tokens, workloads=cfg.get("workloads"),
                                          seed=core.seed)
    tcfg = DrafterTrainConfig.from_section(d, seed=core.seed, progress=not args.quiet)
    eos = target.config.eos_token_id if stop_at_eos else None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(core.seed)
        from .drafter import BlockDrafter

        layers = BlockDrafter(target, tcfg.drafter).feature_layers
    data = make_rollouts(target, prompts, layers, new_tokens=d.rollout_new_tokens,
                         temperature=d.rollout_temperature, eos_token_id=eos, seed=core.seed,
                         batch_size=d.rollout_batch_size, heldout_fraction=d.heldout_fraction,
                         progress=tcfg.progress)

    def curve(drafter) -> dict:  # held-out tree tau of the main cells' tree (B, depth) at T = 0
        if curve_tree is None:
            return {}
        b, depth = curve_tree
        r = evaluate_trees(target, drafter, data, data.heldout_idx, budgets=(b,), depth=min(depth, drafter.block_size),
                           temperatures=(0.0,))
        return {"tree_tau": r[f"B{b}"]["T0"], "tree_budget": b, "n_contexts": r["n_contexts"]}

    with torch.enable_grad():
        base, base_summary = train_drafter(target, None, tcfg, data=data, curve=curve)
    summaries = {"base": base_summary}
    drafters = {"base": base}
    before = None  # every objective starts from the same base drafter: its evaluation runs once
    for obj in objectives:
        ecfg = ExitTrainConfig.from_section(t, seed=core.seed, eval_prompts=0, progress=not args.quiet,
                                            eval_before=before is None)
        with torch.enable_grad():
            drafters[obj], summaries[obj] = train_exittrain(target, base, data, ecfg, objective=obj)
        if before is None:
            before = summaries[obj].get("before")
        else:
            summaries[obj]["before"] = before
        log.info("tev-train %s: %.0f s", obj, summaries[obj]["seconds"]["total"])
    with atomic_path(args.out) as tmp:
        for k, dr in drafters.items():
            dr.save(Path(tmp) / k)
    # what each saved drafter is (its weights' content hash) and what it was trained for: cells record the
    # same fingerprints, so tev-tables can tell one training from a retrain (impl.tev.report.check_one_training)
    summary = {"fingerprints": {k: dr.fingerprint() for k, dr in drafters.items()},
               "target_fingerprint": model_fingerprint(target),
               "model_dir": str(args.model_dir), "n_prompts": len(prompts),
               "prompt_sources": {s: sources.count(s) for s in dict.fromkeys(sources)},
               "rollout_tokens": data.rollout_tokens,
               "rollout_seconds": data.seconds, "drafters": sorted(drafters), "summaries": summaries,
               **provenance(cfg, seed=core.seed)}
    write_json(args.summary, summary)


def cmd_tev_cell(args) -> None:

    from ..models.adapters import model_fingerprint
    from ..runtime import config_from_args, load_for, run_provenance, set_threads
    from ..provenance import write_jsonl
    from .cell import run_tev_cell, target_arms, tev_arms
    from .drafter import BlockDrafter

    cfg = config_from_args(args)
    t = tev_section(cfg)
    root = Path(args.drafters)
    wanted = ["base", *t.exittrain.objectives]  # what tev-train saved for this config: every arm needs its drafter
    missing = [k for k in wanted if not (root / k).is_dir()]
    if missing:
        raise FileNotFoundError(f"--drafters {root}: no {', '.join(missing)} drafter (tev.exittrain.objectives "
                                f"{list(t.exittrain.objectives)} plus base; built by the tev_train rule / python -m "
                                "impl tev-train with the same config)")
    prompts = [p for p in read_prompts(args.prompts) if p.get("input_ids")]
    if not prompts:
        raise ValueError(f"--prompts {args.prompts}: no prompt with input_ids (a token-id suite: rule workload_tokens)")
    set_threads(cfg)
    target = load_for(cfg, args.model_dir)
    drafters = {k: BlockDrafter.load(root / k, target) for k in wanted}
    if args.target:  # the tau-target cell: three arms at T = 0 on tev.target_prompts prompts
        if t.target_prompts is None:
            raise ValueError("tev-cell --target: the config's tev.target_prompts is null (the target cell is off)")
        n, arms, temperatures = t.target_prompts, target_arms(t.budget, tuple(drafters)), [0.0]
    else:
        n, arms, temperatures = t.n_prompts, tev_arms(t.budget, t.budgets, tuple(drafters)), t.temperatures
    prompts = prompts[:n]
    eos = target.config.eos_token_id if t.stop_at_eos else None
    rows = run_tev_cell(target, drafters, prompts, arms, temperatures=temperatures, depth=t.depth,
                        max_new_tokens=t.max_new_tokens, eos=eos, seed=core_config(cfg).seed,
                        progress=not args.quiet)
    prov = run_provenance(cfg)
    fps, target_fp = {k: dr.fingerprint() for k, dr in drafters.items()}, model_fingerprint(target)
    for r in rows:
        r.update(model=args.model, batch_size=1, cell="target" if args.target else "full", target_fingerprint=target_fp,
                 **({"drafter_fingerprint": fps[r["drafter"]]} if r.get("drafter") else {}), **prov)
    write_jsonl(args.out, rows)
    bad = sorted({r["arm"] for r in rows if r.get("ar_match") is False})
    log.info("%s: %d rows; T=0 arms differing from AR: %s", args.out, len(rows), bad or "none")


def cmd_tev_latency(args) -> None:

    from ..models.adapters import model_fingerprint
    from ..runtime import config_from_args, load_for, run_provenance, set_threads
    from ..provenance import write_jsonl
    from .drafter import BlockDrafter
    from .latency import verifier_latency

    cfg = config_from_args(args)
    t = tev_section(cfg)
    lat = t.latency
    set_threads(cfg)
    target = load_for(cfg, args.model_dir)
    drafter = BlockDrafter.load(Path(args.drafters) / "base", target)
    prompts = [p["input_ids"] for p in read_prompts(args.prompts) if p.get("input_ids")][: t.n_prompts]
    from functools import partial

    from .verify import predraw_follow, sequential_residual, tev

    # predraw twice: with the exact inverse-CDF sampler every verifier here uses, and as DDTree's code
    # draws (one torch.multinomial over all [N, V] rows; ~50x slower on CPU, with megabytes of
    # temporaries, so timed in its own passes on the same trees); TEV's ratio is reported against both
    verifiers = {"predraw_follow": predraw_follow,
                 "predraw_ddtree_multinomial": partial(predraw_follow, sampler="multinomial"),
                 "sequential_residual": sequential_residual, "tev": tev}
    rows = verifier_latency(target, drafter, prompts, budgets=tuple(lat.budgets), depth=t.depth,
                            temperature=lat.temperature, n_trees=lat.trees, repeats=lat.repeats,
                            seed=core_config(cfg).seed, verifiers=verifiers, isolated=("predraw_ddtree_multinomial",),
                            vocab_sizes=tuple(lat.vocab_sizes), law_draws=lat.law_draws)
    prov = {**run_provenance(cfg), "drafter_fingerprint": drafter.fingerprint(), "target_fingerprint": model_fingerprint(target)}
    write_jsonl(args.out, [{**r, "model": args.model, **prov} for r in rows])  # rows carry vocab_size


def cmd_tev_tables(args) -> None:
    from ..provenance import read_jsonl
    from ..report.tables import write_table
    from .report import check_one_training, check_rows, check_summaries, tev_tables

    out_dir = Path(args.out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"--out-dir {out_dir}: exists and is not a directory")
    if args.report_section and not (Path(args.report_section).parent.is_dir()
                                    or Path(args.report_section).parent.resolve() == out_dir.resolve()):
        raise ValueError(f"--report-section {args.report_section}: its folder does not exist")
    # every input read and checked before any table is written (a bad file leaves no partial output)
    given = {kind: [(f, read_jsonl(f)) for f in files]
             for kind, files in (("cells", args.cells), ("latency", args.latency), ("target", args.target_cells))}
    rows, latency, target = (check_rows(given[k], k) for k in ("cells", "latency", "target"))
    trained = [(f, _read_json(f, "--train")) for f in args.train]
    summaries = check_summaries(trained)
    # cells of one run may come from two sessions: one training of each drafter, or no tables
    drafters = check_one_training([(k, f, r) for k, files in given.items() for f, r in files], trained)
    for name, df in tev_tables(rows, latency, summaries, target, drafters).items():
        write_table(df, out_dir / name)
    if args.report_section:  # the report's TEV section from these tables, links relative to its folder
        from ..provenance import write_text
        from .report import report_section

        dest = Path(args.report_section)
        write_text(dest, "\n".join(report_section(out_dir, out_dir, dest.parent)) + "\n")


def _read_json(path: str, flag: str) -> object:
    """One JSON document; FileNotFoundError / ValueError naming ``flag`` and the file."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{flag} {p}: no such file")
    try:
        return json.loads(p.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{flag} {p}: not a JSON document ({e})") from None


def register(add) -> None:
    """Add the TEV commands to the ``python -m impl`` parser (``add(name, fn, help)``)."""
    sp = add("tev-train", cmd_tev_train, "TEV: rollouts, base drafter, ExitTrain objectives (token/prefix/exit) and Draft-OPD")
    sp.add_argument("--model-dir", required=True)
    sp.add_argument("--out", required=True, help="directory for the drafters (base/, token/, prefix/, exit/, opd/)")
    sp.add_argument("--summary", type=output_file, required=True, help="training summary JSON")
    sp.add_argument("--dex-head", action="store_true",
                    help="train only the base drafter, with dex.speculative.dflash.drafter's settings (DEX Fig. 5's "
                         "trained-head arm for a model not in tev.models)")

    def target_args(sp, drafters_help: str) -> None:  # the arguments tev-cell and tev-latency share
        sp.add_argument("--model", required=True, help="model name recorded in the rows")
        sp.add_argument("--model-dir", required=True, help="the target model's directory (a trained tiny model or a converted one, e.g. models/smollm2)")
        sp.add_argument("--drafters", required=True, help=drafters_help)
        sp.add_argument("--prompts", required=True, help="token-id prompt suite (first tev.n_prompts used)")

    sp = add("tev-cell", cmd_tev_cell, "TEV: every decoding arm on one (model, workload), checked against AR")
    target_args(sp, "directory written by tev-train")
    sp.add_argument("--out", type=output_file, required=True)
    sp.add_argument("--target", action="store_true",
                    help="the tau-target cell: AR, DDTree and ExitTrain + TEV at T = 0 on tev.target_prompts prompts")
    sp = add("tev-latency", cmd_tev_latency, "TEV: verifier-stage latency on the same realised trees (Table 3)")
    target_args(sp, "directory written by tev-train; its base/ drafter builds the trees")
    sp.add_argument("--out", type=output_file, required=True, help="output JSONL: one row per (budget, verifier)")
    sp = add("tev-tables", cmd_tev_tables,
             "TEV: every table (tev_arms, tev_main, tev_objective, tev_crossed, tev_budget, tev_claims, "
             "tev_calibration, tev_latency, tev_training, tev_curve, tev_target, tev_drafters) as .md and .csv; a table whose "
             "input is not given is written empty with its columns", config=False)
    sp.add_argument("--cells", nargs="*", default=[],
                    help="rows of tev-cell, one file per workload of one run (the full cells; none: their tables are empty)")
    sp.add_argument("--latency", nargs="*", default=[], help="rows of tev-latency (Table 3; none: tev_latency is empty)")
    sp.add_argument("--train", nargs="*", default=[],
                    help="tev-train summaries, one per model (tev_training, tev_curve; none: both empty)")
    sp.add_argument("--target-cells", nargs="*", default=[],
                    help="rows of tev-cell --target, one file per workload of one run (the tau-target cell)")
    sp.add_argument("--out-dir", required=True, help="directory for the tables (created; existing tables replaced)")
    sp.add_argument("--report-section", type=output_file, default=None,
                    help="also write the report's TEV section (Markdown) made from these tables to this file")
