"""Command line: every job a workflow rule runs is one of these commands (``python -m impl CMD``).

Each command takes the run configuration either as ``--config FILE.yaml`` (what a user types) or
``--config-json JSON`` (what a rule passes: the validated config, including command-line overrides).
Run ``python -m impl CMD --help`` for each command's arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import logging
import signal
import sys
from pathlib import Path
from .provenance import process_git_state
from .registry import Registry
from .runtime import config_from_args, load_for, run_provenance, set_threads
from .schema import core_config, prompt_cap
from .argtypes import (ArgumentParser, json_object, nonneg_float, nonneg_int, output_file, positive_int, temperature,
                       usage_error)
from .workloads.prompts import read_prompts

log = logging.getLogger("impl")


# --------------------------------------------------------------------------- commands


def cmd_validate(args) -> None:
    cfg = config_from_args(args)
    print(f"config OK: {len(cfg['models'])} models, {len(cfg['workloads'])} workloads")


def cmd_tokenizer(args) -> None:
    from .models.corpus import collect_documents
    from .models.tokenizer import train_tokenizer
    from .provenance import atomic_path

    core = core_config(config_from_args(args))
    docs, meta = collect_documents(core.data_dir, core.corpus.sources, core.corpus.max_chars_per_source)
    with atomic_path(args.out) as tmp:
        train_tokenizer(docs, core.tokenizer.vocab_size, tmp)
    log.info("tokenizer (%d docs) -> %s", len(docs), args.out)


def cmd_corpus(args) -> None:
    import numpy as np

    from .models.corpus import collect_documents
    from .models.load import load_tokenizer
    from .models.train import unigram_baseline
    from .provenance import atomic_path, provenance

    cfg = config_from_args(args)
    core = core_config(cfg)
    tok = load_tokenizer(args.tokenizer, builder="tokenizer")
    docs, meta = collect_documents(core.data_dir, core.corpus.sources, core.corpus.max_chars_per_source)
    # hold out every k-th document for validation (deterministic, spread over all sources)
    k = max(2, round(1 / core.corpus.val_fraction))
    ids = tok(docs, add_special_tokens=False)["input_ids"]
    eos = tok.eos_token_id
    dtype = np.uint16 if len(tok) < 2**16 else np.int32
    join = lambda seqs: np.concatenate([np.asarray(s + [eos], dtype=dtype) for s in seqs])  # noqa: E731
    train = join([s for i, s in enumerate(ids) if i % k])
    val = join([s for i, s in enumerate(ids) if i % k == 0])
    meta.update(train_tokens=int(train.size), val_tokens=int(val.size), vocab_size=len(tok),
                unigram_baseline=unigram_baseline(train, val, len(tok)), **provenance(cfg, seed=core.seed))
    with atomic_path(args.out) as tmp:
        tmp.mkdir()
        np.save(tmp / "train.npy", train)
        np.save(tmp / "val.npy", val)
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
    log.info("corpus: %d train / %d val tokens, unigram %.3f nats", train.size, val.size, meta["unigram_baseline"])


def cmd_train(args) -> None:
    import numpy as np

    from .config import tiny_arch, train_config
    from .models.load import load_tokenizer
    from .models.train import train_tiny
    from .provenance import atomic_path, provenance, write_json

    cfg = config_from_args(args)
    core = core_config(cfg)
    if core.models[args.model].kind != "tiny":
        raise SystemExit(f"error: models.{args.model} is kind 'pretrained'; only tiny models are trained here")
    corpus = Path(args.corpus)
    tok = load_tokenizer(args.tokenizer, builder="tokenizer")
    meta = json.loads((corpus / "meta.json").read_text())
    train, val = np.load(corpus / "train.npy"), np.load(corpus / "val.npy")
    with atomic_path(args.out) as tmp:
        summary = train_tiny(tiny_arch(cfg), train_config(cfg, args.model), train, val, tok, tmp,
                             progress=not args.quiet)
    summary.update(model=args.model, unigram_baseline=meta["unigram_baseline"], corpus=meta["sources"],
                   **provenance(cfg, seed=core.seed))
    write_json(args.summary, summary)
    log.info("%s: val loss %.3f (unigram %.3f) in %.0f s", args.model, summary["val_loss"],
             meta["unigram_baseline"], summary["train_seconds"])


def cmd_convert_gguf(args) -> None:
    from .models.gguf import GGUFError, GGUFSource, convert_gguf
    from .provenance import atomic_path, provenance

    cfg = config_from_args(args)
    core = core_config(cfg)
    m = core.models.get(args.model)
    if m is None or m.gguf is None:
        raise SystemExit(f"error: models.{args.model} has no 'gguf' source in the config")
    try:
        with atomic_path(args.out) as tmp:
            record = convert_gguf(GGUFSource(**m.gguf.model_dump()), tmp, dtype=core.dtype,
                                  extra={"model": args.model, **provenance(cfg, seed=core.seed, dtype=core.dtype)})
    except GGUFError as e:
        raise SystemExit(f"error: models.{args.model}: {e}") from None
    log.info("%s: %s (%s %s) -> %s; logits check passed (max |diff| %g)", args.model, record["source"]["file"],
             record["source"]["package"], record["source"]["package_version"], args.out,
             record["check"]["max_abs_logit_diff"])


def cmd_train_adapters(args) -> None:
    import torch

    from .dex.cell import adapter_depths
    from .dex.schema import dex_section
    from .models.adapter_train import AdapterTrainConfig, sharegpt_tokens, train_adapters
    from .models.adapters import save_adapters
    from .models.depth import num_layers
    from .models.load import load_tokenizer
    from .provenance import atomic_path, provenance, write_json

    cfg = config_from_args(args)
    dex = dex_section(cfg, why=" (adapter settings live in dex.adapters)")
    a = dex.adapters
    model = load_for(cfg, args.model_dir)
    tok = load_tokenizer(args.model_dir)
    depths = adapter_depths(dex, num_layers(model))
    tcfg = AdapterTrainConfig(steps=a.steps, batch_size=a.batch_size, seq_len=a.seq_len, lr=a.lr,
                              position_fraction=a.position_fraction, seed=core_config(cfg).seed, threads=a.threads)
    train, val = sharegpt_tokens(core_config(cfg).data_dir, tok, a.max_chars)
    with torch.enable_grad():
        adapters, summary = train_adapters(model, depths, train, val, tcfg, progress=not args.quiet)
    summary.update(model_dir=str(args.model_dir), data="sharegpt", train_tokens_available=int(len(train)),
                   **provenance(cfg, seed=core_config(cfg).seed))
    with atomic_path(args.out) as tmp:
        save_adapters(adapters, tmp, {"model_dir": str(args.model_dir), "summary": summary}, model=model)
    write_json(args.summary, summary)
    log.info("adapters at depths %s: KL %.3f in %.0f s", depths, summary["final_kl"], summary["train_seconds"])


def cmd_train_draft(args) -> None:
    """A layer-truncated draft of the model, distilled to it (``dex.draft``; :mod:`impl.models.draft`)."""
    import torch

    from .dex.schema import dex_section
    from .models.adapter_train import sharegpt_tokens
    from .models.depth import num_layers
    from .models.draft import DraftTrainConfig, draft_depths, train_draft, truncated_draft
    from .models.load import load_tokenizer
    from .provenance import atomic_path, provenance, write_json

    cfg = config_from_args(args)
    dex = dex_section(cfg, why=" (draft settings live in dex.draft)")
    d = dex.draft
    if d is None:
        raise SystemExit("config: dex.draft is not set (the draft model's layers and budget)")
    model = load_for(cfg, args.model_dir)
    tok = load_tokenizer(args.model_dir)
    depths = draft_depths(num_layers(model), d.layers)
    draft = truncated_draft(model, depths)
    tcfg = DraftTrainConfig(steps=d.steps, batch_size=d.batch_size, seq_len=d.seq_len, lr=d.lr,
                            position_fraction=d.position_fraction, threads=d.threads, seed=core_config(cfg).seed)
    train, val = sharegpt_tokens(core_config(cfg).data_dir, tok, d.max_chars)
    with torch.enable_grad():
        summary = train_draft(model, draft, train, val, tcfg, progress=not args.quiet)
    summary.update(depths=depths, model_dir=str(args.model_dir), data="sharegpt",
                   train_tokens_available=int(len(train)), **provenance(cfg, seed=core_config(cfg).seed))
    with atomic_path(args.out) as tmp:
        draft.save_pretrained(tmp)
        tok.save_pretrained(tmp)
    write_json(args.summary, summary)
    log.info("draft of %s at depths %s: top-1 agreement %.3f -> %.3f in %.0f s", args.model_dir, depths,
             summary["before"]["top1_agreement"], summary["after"]["top1_agreement"], summary["train_seconds"])


def cmd_workload(args) -> None:
    from .provenance import write_jsonl
    from .workloads import DEFAULT_TEMPLATES, build_text_suite

    core = core_config(config_from_args(args))
    w = core.workloads.get(args.suite)
    if w is None:
        raise SystemExit(f"error: suite {args.suite!r} is not in the config's workloads ({', '.join(core.workloads)})")
    rows = build_text_suite(args.suite, core.data_dir, w.n_prompts, core.seed,
                            w.template or DEFAULT_TEMPLATES[args.suite], chat=w.chat)
    write_jsonl(args.out, rows)
    log.info("%s: %d prompts -> %s", args.suite, len(rows), args.out)


def cmd_tokenize(args) -> None:
    from .models.load import load_tokenizer
    from .provenance import write_jsonl
    from .workloads import tokenize_suite

    core = core_config(config_from_args(args))
    tok = load_tokenizer(args.model_dir)
    prompts = read_prompts(args.prompts)
    suites = {p.get("suite") for p in prompts}
    # one suite per frozen file (rule workload_text); its own cap (workloads.<suite>.max_prompt_tokens) if set
    cap = prompt_cap(core, suites.pop() if len(suites) == 1 else None)
    rows, summary = tokenize_suite(prompts, tok, cap, core.overlong_prompt)
    write_jsonl(args.out, rows)
    log.info("tokenized %s: %s", args.prompts, summary)


def cmd_ead(args) -> None:
    from .ead.measure import measure_suite
    from .provenance import write_jsonl

    from .config import ead_prompt_limit

    cfg = config_from_args(args)
    set_threads(cfg)
    prompts = read_prompts(args.prompts)[: ead_prompt_limit(cfg, args.model)]
    model = load_for(cfg, args.model_dir)
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise SystemExit(f"error: --max-new-tokens must be >= 1, got {args.max_new_tokens}")
    ead = core_config(cfg).ead
    n = args.max_new_tokens or ead.max_new_tokens
    eos = model.config.eos_token_id if ead.stop_at_eos else None
    rows, errors = measure_suite(model, prompts, n, eos_token_id=eos, progress=not args.quiet)
    prov = run_provenance(cfg)
    for r in rows + errors:
        r.update(model=args.model, max_new_tokens=n, rule="greedy", batch_size=1, **prov)
    for e in errors:
        log.warning("prompt %s skipped: %s", e["prompt_id"], e["error"])
    write_jsonl(args.out, rows + errors)
    bad = sum(1 for r in rows if not r["ar_match"])
    log.info("%s: %d tokens from %d prompts, %d errors, %d tokens on prompts that differ from AR",
             args.out, len(rows), len(prompts) - len(errors), len(errors), bad)


def cmd_ead_shared(args) -> None:
    from .ead.shared import shared_rows
    from .provenance import read_jsonl, write_jsonl

    cfg = config_from_args(args)
    set_threads(cfg)
    if len(args.models) != len(args.model_dirs) or len(args.models) != len(args.ead):
        raise SystemExit("error: --models, --model-dirs and --ead need one entry per model")
    models = {m: load_for(cfg, d) for m, d in zip(args.models, args.model_dirs)}
    if len({m.config.vocab_size for m in models.values()}) != 1:
        raise SystemExit("error: shared-context EAD needs models with one tokenizer; vocab sizes differ: "
                         + ", ".join(f"{n}={m.config.vocab_size}" for n, m in models.items()))
    gens: dict = {}
    for m, f in zip(args.models, args.ead):
        for r in sorted((r for r in read_jsonl(f) if "error" not in r), key=lambda r: r["t"]):
            gens.setdefault((m, r["prompt_id"]), []).append(r["token_id"])
    rows = shared_rows(models, read_prompts(args.prompts), gens)
    prov = run_provenance(cfg)
    for r in rows:
        r.update(**prov)
    write_jsonl(args.out, rows)
    log.info("%s: %d rows", args.out, len(rows))


def cmd_ar_bench(args) -> None:
    from .provenance import write_jsonl
    from .spec.ar import ar_decode

    cfg = config_from_args(args)
    set_threads(cfg)
    model = load_for(cfg, args.model_dir)
    core = core_config(cfg)
    b = core.ar_bench
    from .config import ead_prompt_limit

    prompts = [p for p in read_prompts(args.prompts)[: ead_prompt_limit(cfg, args.model)] if p.get("input_ids")]
    eos = model.config.eos_token_id if core.ead.stop_at_eos else None
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise SystemExit(f"error: --max-new-tokens must be >= 1, got {args.max_new_tokens}")
    n = args.max_new_tokens or b.max_new_tokens
    for p in prompts[: b.warmup_prompts]:  # warm-up, not recorded
        ar_decode(model, p["input_ids"], n, eos_token_id=eos)
    prov = run_provenance(cfg)
    rows = []
    for rep in range(b.repetitions):
        for p in prompts:
            try:
                res = ar_decode(model, p["input_ids"], n, eos_token_id=eos)
            except ValueError as e:
                rows.append({"prompt_id": p["id"], "suite": p.get("suite"), "repetition": rep, "error": str(e),
                             "model": args.model, **prov})
                continue
            rows.append({
                "prompt_id": p["id"], "suite": p.get("suite"), "model": args.model, "repetition": rep,
                "n_prompt_tokens": len(p["input_ids"]), "n_new_tokens": len(res.tokens),
                "token_ids": res.tokens, "prefill_seconds": res.prefill_seconds,
                "token_seconds": res.token_seconds, "stopped_at_eos": res.stopped_at_eos,
                "warmup_prompts_excluded": b.warmup_prompts, "batch_size": 1, **prov,
            })
    write_jsonl(args.out, rows)
    log.info("%s: %d rows", args.out, len(rows))


def cmd_decode(args) -> None:
    import torch

    from .methods import METHODS, decode_prompts, parse_exploration_set
    from .models.load import load_model, load_tokenizer, model_num_layers
    from .provenance import provenance, write_jsonl
    from .spec.sampling import DecodeRule

    if args.method != "dex" and (args.exploration_set or args.explorers or args.decs or args.single_exit
                                 or args.adapters):
        usage_error("--exploration-set/--explorers/--decs/--single-exit/--adapters apply to --method dex only")
    params: dict = {}
    if args.params is not None:  # a JSON object (argtypes.json_object)
        if args.method in ("ar", "dex"):
            usage_error("--params applies to the methods with parameters ("
                        + ", ".join(m for m in METHODS if m not in ("ar", "dex")) + "), not to " + args.method)
        params = args.params
    elif args.method not in ("ar", "dex", "dynamic_exit"):  # every other method has required parameters
        usage_error(f"--method {args.method} needs --params (see python -m impl decode --help)")
    prompts_path = Path(args.prompts)
    if not prompts_path.exists():
        usage_error(f"--prompts: file not found: {args.prompts}")
    if prompts_path.is_dir():
        usage_error(f"--prompts: {args.prompts} is a directory, not a JSONL prompt file")
    try:
        prompts = read_prompts(prompts_path)  # before any weights are read: a bad file fails fast
    except ValueError as e:
        usage_error(f"--prompts: {e}")
    if not prompts:
        usage_error(f"--prompts: {args.prompts} holds no prompt rows")
    if args.method == "dex":  # checked from config.json, before any weights are read
        try:
            params = {"exploration_set": parse_exploration_set(args.exploration_set, args.explorers,
                                                               model_num_layers(args.model_dir)),
                      "decs": args.decs, "single_exit": args.single_exit, "dedupe": args.dedupe}
        except FileNotFoundError as e:
            usage_error(f"--model-dir: {e}")
        except ValueError as e:
            usage_error(f"--exploration-set/--explorers: {e}")
    torch.set_num_threads(args.threads)
    model = load_model(args.model_dir, dtype=getattr(torch, args.dtype))
    tok = load_tokenizer(args.model_dir)
    rule = DecodeRule(temperature=args.temperature, seed=args.seed)
    eos = None if args.ignore_eos else model.config.eos_token_id
    adapters = None
    if args.adapters:
        from .models.adapters import load_adapters

        adapters = load_adapters(args.adapters, model)
    try:
        rows = decode_prompts(model, tok, prompts, args.method, params, rule, args.max_new_tokens,
                              eos, progress=not args.quiet, adapters=adapters)
    except (KeyError, TypeError) as e:
        raise SystemExit(f"error: bad --params for {args.method}: {e}") from None
    prov = provenance({"method": args.method, **{k: str(v) for k, v in params.items()}}, seed=args.seed,
                      dtype=args.dtype)
    for r in rows:
        r.update(model_dir=str(args.model_dir), batch_size=1, **prov)
    write_jsonl(args.out, rows)
    bad = [r["prompt_id"] for r in rows if r.get("ar_match") is False]
    errs = [r["prompt_id"] for r in rows if "error" in r]
    log.info("%s: %d rows, %d errors, %d differ from AR%s", args.out, len(rows), len(errs), len(bad),
             f" ({bad})" if bad else "")


def cmd_dex_cell(args) -> None:
    from .dex.cell import dex_arms, run_cell, speculative_arms, tune_baselines
    from .dex.schema import dex_section
    from .models.depth import num_layers
    from .provenance import write_jsonl

    cfg = config_from_args(args)
    d = dex_section(cfg)
    if (d.speculative.assisted is not None or d.speculative.pearl is not None) and not args.adapters \
            and not args.draft:
        raise SystemExit("error: dex.speculative.assisted / pearl is on: give the model's draft model with --draft DIR "
                         "(rule train_draft's output)")
    set_threads(cfg)
    model = load_for(cfg, args.model_dir)
    adapters = None
    if args.adapters:
        from .models.adapters import load_adapters

        adapters = load_adapters(args.adapters, model)
    L = num_layers(model)
    suite = [p for p in read_prompts(args.prompts) if p.get("input_ids")]
    n, nt = d.n_prompts, d.baselines.tune_prompts
    prompts, tune = suite[:n], suite[n:n + nt]
    if len(prompts) < n or (not adapters and len(tune) < nt):
        log.warning("%s has %d prompts: %d evaluated (dex.n_prompts=%d), %d for tuning (tune_prompts=%d)",
                    args.prompts, len(suite), len(prompts), n, len(tune), nt)
    eos = model.config.eos_token_id if d.stop_at_eos else None
    arms = dex_arms(d, L)
    tuning: list[dict] = []
    if not adapters and tune:  # baselines run on the plain model; the adapter variant adds DEX arms only
        extra, tuning = tune_baselines(model, tune, d, L, d.max_new_tokens, eos)
        arms += extra
    if not adapters:  # Fig. 5's speculative arms, on the plain model as the baselines
        arms += speculative_arms(d, args.draft, args.tev_drafters)
    rows = run_cell(model, prompts, arms, max_new_tokens=d.max_new_tokens, eos=eos, seed=core_config(cfg).seed,
                    adapters=adapters, progress=not args.quiet)
    prov = run_provenance(cfg)
    for r in rows:
        r.update(kind="decode", variant=args.variant, num_layers=L, batch_size=1, **prov)
    for r in tuning:
        r.update(variant=args.variant, suite=suite[0].get("suite") if suite else None, num_layers=L, **prov)
    write_jsonl(args.out, tuning + rows)
    bad = sorted({r["arm"] for r in rows if r.get("ar_match") is False})
    ident = [r for r in rows if "rounds_identity" in r]
    log.info("%s: %d rows; arms differing from AR: %s; rounds identity %d/%d", args.out, len(rows), bad or "none",
             sum(r["rounds_identity"] for r in ident), len(ident))


def cmd_dex_tables(args) -> None:
    from .provenance import read_jsonl
    from .report.dex import dex_tables
    from .report.tables import write_table

    rows = [r for f in args.cells for r in read_jsonl(f)]
    summaries = [json.loads(Path(f).read_text()) for f in args.adapters]
    dist = [r for f in args.distributed for r in read_jsonl(f)]
    drafts = [json.loads(Path(f).read_text()) for f in args.drafts]
    mp = [r for f in args.multiprocess for r in read_jsonl(f)]
    heads = [json.loads(Path(f).read_text()) for f in args.heads]
    for name, df in dex_tables(rows, summaries, dist, drafts, mp, heads).items():
        write_table(df, Path(args.out_dir) / name)
    log.info("DEX tables from %d cells -> %s", len(args.cells), args.out_dir)


def cmd_compare_tables(args) -> None:
    """Compare two runs' tables (:mod:`impl.report.compare`); exit 1 when a compared column differs."""
    from .report.compare import compare_dirs

    try:
        diffs = compare_dirs(args.a, args.b, rtol=args.rtol)
    except FileNotFoundError as e:
        raise SystemExit(f"error: {e}") from None
    bad = [d for d in diffs if d.problems]
    for d in diffs:
        state = "DIFFERS" if d.problems else "same"
        print(f"{state:8s}{d.path}  ({len(d.compared_columns)} columns compared, {len(d.timing_columns)} timing columns "
              "not compared)")
        for p in d.problems:
            print(f"        - {p}")
    print(f"{len(diffs)} tables: {len(diffs) - len(bad)} the same, {len(bad)} differ")
    if bad:
        raise SystemExit(1)


def cmd_dex_figures(args) -> None:
    import pandas as pd

    from .report import figures as F

    arms = pd.read_csv(Path(args.tables_dir) / "dex_arms.csv")
    F.dex_fig3(arms, Path(args.out_dir) / "dex_fig3.png")
    F.dex_fig4(arms, Path(args.out_dir) / "dex_fig4.png")
    f5 = Path(args.tables_dir) / "dex_fig5.csv"
    F.dex_fig5(pd.read_csv(f5) if f5.is_file() and f5.stat().st_size > 1 else pd.DataFrame(),
               Path(args.out_dir) / "dex_fig5.png")


def cmd_tables(args) -> None:
    from .provenance import write_json
    from .report.tables import (ar_table, best_selection, ead_tables, load_rows, models_table,
                                paired_model_comparison, training_table, write_table)

    cfg = config_from_args(args)
    out = Path(args.out_dir)
    ead_all = load_rows(args.ead)
    ead = [r for r in ead_all if "error" not in r]
    ar_all = load_rows(args.ar) if args.ar else []
    ar = [r for r in ar_all if "error" not in r]
    training, depth = training_table(args.train) if args.train else (None, None)
    if training is not None:
        write_table(training, out / "training")
        write_table(depth, out / "val_loss_by_depth")
    ead_cfg = core_config(cfg).ead
    tabs = ead_tables(ead, ead_cfg.num_speculations, ead_cfg.nested_chains)
    for name, df in tabs.items():
        write_table(df, out / name)
    write_table(best_selection(tabs["selection"]), out / "selection_best")
    write_table(models_table(cfg, ead), out / "models")
    comp = ead_cfg.compare
    if comp:
        write_table(paired_model_comparison(ead, comp.baseline, comp.treatment), out / "ls_vs_std")
    write_table(ar_table(ar, ead), out / "ar_throughput")
    if comp and args.shared:
        from .report.tables import shared_tables

        for name, df in shared_tables(load_rows(args.shared), comp.baseline, comp.treatment).items():
            write_table(df, out / name)
    keys = ("git_sha", "git_dirty", "config_hash", "device", "dtype", "torch_version", "transformers_version",
            "python_version")
    prov = {k: ead[0].get(k) for k in keys} if ead else {}
    prov["run_ids"] = sorted({r["run_id"] for r in ead_all + ar_all})
    prov["prompt_errors"] = sum(1 for r in ead_all if "error" in r)
    write_json(out / "provenance.json", prov)


def cmd_figures(args) -> None:
    import pandas as pd

    from .report import figures as F

    td, fd = Path(args.tables_dir), Path(args.out_dir)
    read = lambda n: pd.read_csv(td / f"{n}.csv")  # noqa: E731
    F.ead_histograms(read("ead_hist"), read("ead_summary"), fd / "ead_hist.png")
    F.s_x_vs_k(read("s_x"), fd / "s_x_vs_k.png")
    F.selection_curves(read("selection"), read("s_x"), fd / "selection.png")
    shared = read("ead_shared_summary") if (td / "ead_shared_summary.csv").is_file() else None
    F.ead_means(read("ead_summary"), shared, fd / "ead_means.png")
    if (td / "val_loss_by_depth.csv").is_file():
        F.loss_by_depth(read("val_loss_by_depth"), read("training"), fd / "loss_by_depth.png")


def cmd_report(args) -> None:
    from .report.markdown import build_report

    td, fd = Path(args.tables_dir), Path(args.figures_dir)
    prov = json.loads((td / "provenance.json").read_text())
    figs = {
        "Stable EAD distribution per model and workload (DEX Fig. 6 shape)": fd / "ead_hist.png",
        "Mean stable EAD per workload: own generations and shared contexts": fd / "ead_means.png",
        "S_X vs K with the S_EAD oracle (Prop. 7)": fd / "s_x_vs_k.png",
        "Single-exit selection vs exit depth (Eq. 4)": fd / "selection.png",
        "Validation loss of the intermediate readout per depth": fd / "loss_by_depth.png",
    }
    figs = {k: v for k, v in figs.items() if v.is_file()}
    names = []
    for c in args.config_name.split():
        try:
            names.append(os.path.relpath(c) if Path(c).resolve().is_relative_to(Path.cwd()) else c)
        except ValueError:
            names.append(c)
    from .report.markdown import REPORT_SECTIONS

    sections: list[str] = []
    for spec in args.section:
        name, _, tdir = spec.partition("=")
        if name not in REPORT_SECTIONS or not tdir:
            raise SystemExit(f"error: --section {spec!r} must be NAME=TABLES_DIR with NAME one of "
                             f"{', '.join(REPORT_SECTIONS)}")
        sections += REPORT_SECTIONS[name](tdir, fd, Path(args.out).parent)
    build_report(args.out, tables_dir=td, figures=figs, provenance=prov, config_name=" ".join(names),
                 prompt_errors=prov.get("prompt_errors", 0), sections=sections)
    print(f"report: {args.out}")


# --------------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    from .methods import METHODS
    from .workloads import SUITES

    p = ArgumentParser(prog="python -m impl", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="cmd", required=True)
    quietp = ArgumentParser(add_help=False)  # every command; those that read no config take only this
    quietp.add_argument("--quiet", action="store_true", help="no progress bars")
    cfgp = ArgumentParser(add_help=False, parents=[quietp])
    g = cfgp.add_mutually_exclusive_group()
    g.add_argument("--config", help="YAML config (e.g. configs/default.yaml)")
    g.add_argument("--config-json", help="validated config as JSON text, or @FILE holding it (used by workflow rules)")

    def add(name, fn, help_, *, config: bool = True):
        """A sub-command; ``config=False``: it reads no run config, so it takes no --config/--config-json
        (argparse then refuses them instead of the command silently ignoring them)."""
        sp = sub.add_parser(name, parents=[cfgp if config else quietp], help=help_, description=help_)
        sp.set_defaults(fn=fn)
        return sp

    add("validate-config", cmd_validate, "validate a config file (schema, references, data and model paths)")
    sp = add("tokenizer", cmd_tokenizer, "train the byte-level BPE tokenizer of the tiny models")
    sp.add_argument("--out", required=True, help="tokenizer directory to write")
    sp = add("corpus", cmd_corpus, "tokenize the training corpus into train.npy / val.npy / meta.json")
    sp.add_argument("--tokenizer", required=True)
    sp.add_argument("--out", required=True, help="corpus directory to write")
    sp = add("train", cmd_train, "train one tiny model (plain or early-exit loss) into a HF directory")
    sp.add_argument("--model", required=True, help="model name (a key of models: in the config)")
    sp.add_argument("--tokenizer", required=True)
    sp.add_argument("--corpus", required=True)
    sp.add_argument("--out", required=True, help="model directory to write")
    sp.add_argument("--summary", type=output_file, required=True, help="training summary JSON to write")
    sp = add("convert-gguf", cmd_convert_gguf,
             "convert a model's GGUF source (models.<name>.gguf) into a checked Hugging Face directory")
    sp.add_argument("--model", required=True, help="model name (a key of models: with a gguf source)")
    sp.add_argument("--out", required=True, help="model directory to write (conversion.json inside)")
    sp = add("train-adapters", cmd_train_adapters,
             "train DEX inducing adapters (App. C.2) for a frozen model by KL self-distillation on ShareGPT")
    sp.add_argument("--model-dir", required=True)
    sp.add_argument("--out", required=True, help="adapter directory to write")
    sp.add_argument("--summary", type=output_file, required=True, help="training summary JSON to write")
    sp = add("train-draft", cmd_train_draft,
             "a small draft model for the speculative arms: the model's layers at evenly spaced depths, distilled to it")
    sp.add_argument("--model-dir", required=True)
    sp.add_argument("--out", required=True, help="draft model directory to write (Hugging Face format)")
    sp.add_argument("--summary", type=output_file, required=True, help="training summary JSON to write")
    sp = add("workload", cmd_workload, "freeze a text prompt suite (seeded sample of N prompts)")
    sp.add_argument("--suite", required=True, choices=list(SUITES))
    sp.add_argument("--out", type=output_file, required=True)
    sp = add("tokenize", cmd_tokenize, "tokenize a text suite with a model's tokenizer (token-id JSONL)")
    sp.add_argument("--model-dir", required=True)
    sp.add_argument("--prompts", required=True, help="text suite JSONL (rows: id, text; suite and source_id kept if present)")
    sp.add_argument("--out", type=output_file, required=True)
    sp = add("ead", cmd_ead, "oracle EAD measurement: one row per generated token")
    sp.add_argument("--model", required=True, help="model name recorded in the rows")
    sp.add_argument("--model-dir", required=True)
    sp.add_argument("--prompts", required=True, help="token-id JSONL (rows: id, input_ids)")
    sp.add_argument("--out", type=output_file, required=True)
    sp.add_argument("--max-new-tokens", type=positive_int, help="override ead.max_new_tokens")
    sp = add("ead-shared", cmd_ead_shared,
             "stable EAD of several models teacher-forced on each other's generations (shared contexts)")
    sp.add_argument("--models", nargs="+", required=True, help="model names")
    sp.add_argument("--model-dirs", nargs="+", required=True, help="their directories (same order)")
    sp.add_argument("--ead", nargs="+", required=True, help="their EAD row files (same order)")
    sp.add_argument("--prompts", required=True, help="token-id prompt file (shared tokenizer)")
    sp.add_argument("--out", type=output_file, required=True)
    sp = add("ar-bench", cmd_ar_bench, "AR decoding throughput, one row per prompt and repetition")
    sp.add_argument("--model", required=True)
    sp.add_argument("--model-dir", required=True)
    sp.add_argument("--prompts", required=True)
    sp.add_argument("--out", type=output_file, required=True)
    sp.add_argument("--max-new-tokens", type=positive_int, help="override ar_bench.max_new_tokens")
    sp = add("decode", cmd_decode, f"decode a prompt file with one method ({', '.join(METHODS)}); "
             "each row checked against AR", config=False)
    sp.add_argument("--model-dir", required=True)
    sp.add_argument("--method", required=True, choices=list(METHODS))
    sp.add_argument("--params", type=json_object, help="the method's parameters as JSON (every method but ar and dex), e.g. self_spec "
                    "'{\"exit_layer\": 4, \"num_speculations\": 4}', lookahead "
                    "'{\"window\": 5, \"ngram\": 4, \"max_candidates\": 5}'")
    sp.add_argument("--prompts", required=True, help="JSONL rows with id and input_ids or text")
    sp.add_argument("--out", type=output_file, required=True)
    sp.add_argument("--max-new-tokens", type=positive_int, default=64)
    sp.add_argument("--temperature", type=temperature, default=0.0, help="0 = greedy")
    sp.add_argument("--seed", type=nonneg_int, default=0, help="seed of the per-position Gumbel noise")
    sp.add_argument("--exploration-set", help="DEX: comma-separated depths ending at L, e.g. 4,8,12")
    sp.add_argument("--explorers", type=positive_int, help="DEX: K for the uniform set DEX-1/K")
    sp.add_argument("--decs", action="store_true", help="DEX: depth-coupled sampling (Algorithm 2)")
    sp.add_argument("--single-exit", action="store_true", help="DEX ablation: branch only from d_0 and L")
    sp.add_argument("--dedupe", action="store_true", help="DEX: reuse children of repeated candidates")
    sp.add_argument("--adapters", help="DEX: inducing adapter directory (train-adapters)")
    sp.add_argument("--ignore-eos", action="store_true")
    sp.add_argument("--threads", type=positive_int, default=1)
    sp.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                    help="weight and activation dtype (README: tolerance policy for bfloat16)")
    sp = add("dex-cell", cmd_dex_cell,
             "one DEX benchmark cell: AR, DEX-1/K, ablations and tuned baselines on one (model, workload)")
    sp.add_argument("--variant", required=True, help="name recorded in the rows (model, or model+ad)")
    sp.add_argument("--model-dir", required=True)
    sp.add_argument("--adapters", help="inducing adapter directory (DEX arms only)")
    sp.add_argument("--draft", help="the model's draft model directory (train-draft), for dex.speculative.assisted")
    sp.add_argument("--tev-drafters", help="the model's TEV drafters directory (tev-train), for dex.speculative.dflash")
    sp.add_argument("--prompts", required=True, help="token-id suite: first dex.n_prompts evaluated, the next "
                    "dex.baselines.tune_prompts used for tuning")
    sp.add_argument("--out", type=output_file, required=True)
    sp = add("dex-tables", cmd_dex_tables, "DEX tables (Fig. 3/4, Table 1, claims, walltime model) from cell rows", config=False)
    sp.add_argument("--cells", nargs="+", required=True, help="dex-cell row files")
    sp.add_argument("--adapters", nargs="*", default=[], help="adapter training summaries")
    sp.add_argument("--distributed", nargs="*", default=[], help="rows of python -m impl.dex.distributed")
    sp.add_argument("--drafts", nargs="*", default=[], help="draft training summaries (train-draft)")
    sp.add_argument("--multiprocess", nargs="*", default=[],
                    help="rows of the multi-process Fig. 5 arms (impl.spec.pearl_distributed, impl.spec.tensor_parallel)")
    sp.add_argument("--heads", nargs="*", default=[], help="trained-head summaries (tev-train --dex-head)")
    sp.add_argument("--out-dir", required=True)
    sp = add("compare-tables", cmd_compare_tables, "compare two runs' tables (every column but the timings), "
             "e.g. the smoke run before and after a refactor; exit 1 when one differs", config=False)
    sp.add_argument("a", help="tables directory of run A (e.g. results/smoke/tables of the old commit)")
    sp.add_argument("b", help="tables directory of run B")
    sp.add_argument("--rtol", type=nonneg_float, default=1e-9, help="relative tolerance of compared floats")
    sp = add("dex-figures", cmd_dex_figures, "DEX Fig. 3 / Fig. 4 shapes from the DEX tables", config=False)
    sp.add_argument("--tables-dir", required=True)
    sp.add_argument("--out-dir", required=True)
    sp = add("tables", cmd_tables, "EAD / S_X / selection / AR / training tables from raw rows")
    sp.add_argument("--ead", nargs="+", required=True, help="EAD row files")
    sp.add_argument("--ar", nargs="*", default=[], help="AR benchmark row files")
    sp.add_argument("--train", nargs="*", default=[], help="training summary JSON files")
    sp.add_argument("--shared", nargs="*", default=[], help="shared-context EAD row files")
    sp.add_argument("--out-dir", required=True)
    sp = add("figures", cmd_figures, "PNG figures from the tables", config=False)
    sp.add_argument("--tables-dir", required=True)
    sp.add_argument("--out-dir", required=True)
    sp = add("report", cmd_report, "write results/REPORT.md", config=False)
    sp.add_argument("--tables-dir", required=True)
    sp.add_argument("--figures-dir", required=True)
    sp.add_argument("--out", type=output_file, required=True)
    sp.add_argument("--config-name", default="configs/default.yaml")
    sp.add_argument("--section", action="append", default=[],
                    help="NAME=TABLES_DIR of a method family's report section (repeatable; names in "
                         "impl.report.markdown.REPORT_SECTIONS), e.g. dex=results/tables/dex")
    # method families register their own commands (COMMANDS): register(add), where add(name, fn, help)
    # returns an argparse subparser that takes --config/--config-json (add(..., config=False): a command
    # that reads no run config and so refuses them)
    for family in COMMANDS:
        COMMANDS[family](add)
    return p


#: command families of ``python -m impl`` beyond the foundation's: lazy ``module:register`` entries
COMMANDS: Registry = Registry("command family")
COMMANDS.register("tev", "impl.tev.commands:register")
COMMANDS.register("vskipper-serving", "impl.vskipper.serving_commands:register")
COMMANDS.register("vskipper-bench", "impl.vskipper.commands:register")
COMMANDS.register("sglang", "impl.vskipper.sglang_check:register")


class Terminated(KeyboardInterrupt):
    """SIGTERM as an exception: raised in the main thread so that every ``finally`` / ``__exit__`` runs (child
    servers started in their own session, e.g. :class:`impl.serving.sglang_server.SGLangServer`, are stopped
    only there; Snakemake and ``timeout`` stop a job with SIGTERM)."""


def _raise_terminated(signum, frame) -> None:
    raise Terminated()


def main(argv: list[str] | None = None) -> None:
    """``python -m impl <command>``: parse the arguments, run the command.

    Exit status: 0 done; 2 a bad config, argument or input (one ``error:`` line); 130 / 143 after SIGINT /
    SIGTERM (one ``interrupted`` line; outputs are written whole or not at all, and the servers the command
    started are stopped).
    """
    from .config import ConfigError

    args = build_parser().parse_args(argv)
    process_git_state()  # the commit of the code this process runs, before the command (provenance)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        args.fn(args)
    except KeyboardInterrupt as e:
        name, code = ("SIGTERM", 143) if isinstance(e, Terminated) else ("SIGINT", 130)
        print(f"interrupted ({name}): {args.cmd} stopped (outputs are written whole or not at all)", file=sys.stderr)
        raise SystemExit(code) from None
    except (ConfigError, FileNotFoundError, IsADirectoryError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
