"""DEX experiment tables, figures and report section (Fig. 3, Fig. 4, Table 1 shapes) from the raw
rows of :func:`impl.dex.cell.run_cell`.

Four speedups are kept apart and labelled for what they are:

- ``depth_speedup``: AR's critical-path layer work over the method's (DEX Prop. 7 accounting:
  L * tokens / sum of critical-path layers); no machine noise touches it.
- ``projected_speedup``: AR's measured wall time over DEX's projected K-device wall time, the
  critical path of measured per-explorer batch times (per round, the slowest explorer) plus the
  measured communication per round (0 where none was measured; the column says which).
- ``wall_speedup``: AR's measured single-machine wall time over the method's, same run, same prompts
  (DEX's explorers run one after another here, so this is the cost of exploration on one device).
- the oracle lines: ``ead_oracle`` (sum of EADs, Def. 1) and ``stable_ead_oracle`` (sum of stable
  EADs, the paper's S_EAD).

Claims are paired per prompt with a t-based 95% interval (:mod:`impl.stats`).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import numpy as np
import pandas as pd
from scipy.optimize import lsq_linear

from ..config import split_variant
from ..stats import one_sample, paired_difference

log = logging.getLogger("impl.report.dex")

BASELINES = ("self_spec", "adadecode", "dynamic_exit")


def _decode_rows(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r.get("kind") == "decode" and "error" not in r]


def _frame(rows: list[dict]) -> pd.DataFrame:
    df = pd.DataFrame([{
        "variant": r["variant"], "suite": r.get("suite"), "arm": r["arm"], "method": r["method"],
        "figure": r.get("figure"), "temperature": r.get("temperature", 0.0), "prompt_id": r["prompt_id"],
        "L": r["num_layers"], "tokens": r["n_new_tokens"], "critical_layers": r["critical_layers_total"],
        "seconds": r.get("seconds", np.nan), "critical_path_seconds": r.get("critical_path_seconds", np.nan),
        "prefill_seconds": r.get("prefill_seconds", 0.0),
        "comm_seconds": r.get("comm_seconds", np.nan), "rounds_total": sum(r.get("rounds") or []) or np.nan,
        "K": len(r["params"]["exploration_set"]) if r["method"] == "dex" else np.nan,
        "ar_match": r.get("ar_match"), "rounds_identity": r.get("rounds_identity"),
        "max_lattice": max(r["max_lattice"]) if r.get("max_lattice") else np.nan,
        "expansion_s": (r.get("profile") or {}).get("expansion", np.nan),
        "collapse_s": (r.get("profile") or {}).get("collapse", np.nan),
        "bookkeeping_s": (r.get("profile") or {}).get("bookkeeping", np.nan),
        "params": json.dumps(r.get("params", {}), sort_keys=True),
    } for r in rows])
    df["depth_speedup"] = df["L"] * df["tokens"] / df["critical_layers"]
    return df


def _ratio(num: float, den: float) -> float:
    """``num / den``, NaN when the denominator is 0 or NaN (no 0/0 warning: e.g. rows without timings)."""
    return float(num) / float(den) if den and not np.isnan(den) else np.nan


def arms_table(df: pd.DataFrame) -> pd.DataFrame:
    """One row per (variant, suite, arm): pooled speedups, verdicts, lattice size."""
    out = []
    for (v, s), cell in df.groupby(["variant", "suite"], sort=False):
        ar_sec = {T: g["seconds"].sum() for T, g in cell[cell.method == "ar"].groupby("temperature")}
        for arm, g in cell.groupby("arm", sort=False):
            T = g["temperature"].iloc[0]
            # K-device wall time: the prefill (sequential through the stages, and inside AR's time too)
            # plus the slowest explorer of every round
            crit = ((g["critical_path_seconds"] + g["prefill_seconds"]).sum()
                    if g["critical_path_seconds"].notna().any() else np.nan)
            comm = g["comm_seconds"].sum() if g["comm_seconds"].notna().any() else 0.0
            is_oracle = g["method"].iloc[0].endswith("oracle")
            out.append({
                "variant": v, "suite": s, "arm": arm, "figure": g["figure"].iloc[0], "temperature": T,
                "K": g["K"].iloc[0], "n_prompts": len(g), "tokens": int(g["tokens"].sum()),
                "depth_speedup": _ratio(g["L"].iloc[0] * g["tokens"].sum(), g["critical_layers"].sum()),
                "wall_speedup": np.nan if is_oracle else _ratio(ar_sec.get(T, np.nan), g["seconds"].sum()),
                "projected_speedup": _ratio(ar_sec.get(T, np.nan), crit + comm),
                "comm_measured": bool(g["comm_seconds"].notna().any()),
                "ms_per_token": np.nan if is_oracle else _ratio(1000 * g["seconds"].sum(), g["tokens"].sum()),
                "ar_match_all": bool(g["ar_match"].fillna(False).astype(bool).all()),
                "rounds_identity": (bool(g["rounds_identity"].astype(bool).all())
                                    if g["rounds_identity"].notna().any() else None),
                "max_lattice": g["max_lattice"].max(),
                "params": g["params"].iloc[0],
            })
    return pd.DataFrame(out)


def _paired(cell: pd.DataFrame, a: str, b: str) -> dict | None:
    """Per-prompt depth speedup of arm b minus arm a (paired on prompt id)."""
    x = cell[cell.arm == a].set_index("prompt_id")["depth_speedup"]
    y = cell[cell.arm == b].set_index("prompt_id")["depth_speedup"]
    common = x.index.intersection(y.index)
    if len(common) == 0:
        return None
    r = paired_difference(x[common].to_numpy(), y[common].to_numpy())
    return {"arm_a": a, "arm_b": b, "n": r.n, "mean_a": float(x[common].mean()), "mean_b": float(y[common].mean()),
            "diff": r.mean, "ci_low": r.ci_low, "ci_high": r.ci_high, "resolved": r.resolved,
            "holds": bool(r.resolved and r.mean > 0)}


def claims_table(df: pd.DataFrame, arms: pd.DataFrame) -> pd.DataFrame:
    """The paper's claims as paired per-prompt comparisons of depth speedup (b - a):
    DEX-1/K above the best tuned baseline; full exploration above single exit; DECS above vanilla."""
    out = []
    for (v, s), cell in df.groupby(["variant", "suite"], sort=False):
        a = arms[(arms.variant == v) & (arms.suite == s)]
        base = a[a.arm.isin(BASELINES)].sort_values("depth_speedup", ascending=False)
        ref_cell = cell
        if base.empty and split_variant(v)[1]:
            # an adapted variant runs DEX arms only: its baselines are the base model's (same prompts;
            # adapters change only DEX's intermediate readouts), paired on prompt id
            bv = split_variant(v)[0]
            a_base = arms[(arms.variant == bv) & (arms.suite == s)]
            base = a_base[a_base.arm.isin(BASELINES)].sort_values("depth_speedup", ascending=False)
            ref_cell = df[(df.variant == bv) & (df.suite == s)]
        best = base["arm"].iloc[0] if len(base) else None
        dex = a[(a.figure == "fig3") & a.arm.str.startswith("dex")]["arm"].tolist()
        for d in dex:
            if best:
                r = _paired(pd.concat([ref_cell[ref_cell.arm == best], cell[cell.arm == d]]), best, d)
                if r:
                    if ref_cell is not cell:
                        r["arm_a"] = f"{split_variant(v)[0]}:{best}"
                    out.append({"variant": v, "suite": s, "claim": "DEX above best selection baseline", **r})
        for d in a[a.figure == "fig4_single"]["arm"]:
            r = _paired(cell, d, d[: -len("-single")])
            if r:
                out.append({"variant": v, "suite": s, "claim": "full exploration above single exit", **r})
        for d in a[(a.figure == "fig4_decs") & a.arm.str.contains("-decs")]["arm"]:
            r = _paired(cell, d.replace("-decs", ""), d)
            if r:
                out.append({"variant": v, "suite": s, "claim": "DECS above vanilla", **r})
    # inducing adapters (App. C.2): the adapted variant against its base model, same prompts and arms
    for (v, s), cell in df.groupby(["variant", "suite"], sort=False):
        base, adapted = split_variant(v)
        if not adapted:
            continue
        plain = df[(df.variant == base) & (df.suite == s)]
        for arm in cell[(cell.method == "dex") & (cell.figure == "fig3")]["arm"].unique():
            x = plain[plain.arm == arm].set_index("prompt_id")["depth_speedup"]
            y = cell[cell.arm == arm].set_index("prompt_id")["depth_speedup"]
            common = x.index.intersection(y.index)
            if len(common):
                r = paired_difference(x[common].to_numpy(), y[common].to_numpy())
                out.append({"variant": v, "suite": s, "claim": "inducing adapters raise DEX's depth speedup",
                            "arm_a": f"{base}:{arm}", "arm_b": f"{v}:{arm}", "n": r.n, "mean_a": float(x[common].mean()),
                            "mean_b": float(y[common].mean()), "diff": r.mean, "ci_low": r.ci_low, "ci_high": r.ci_high,
                            "resolved": r.resolved, "holds": bool(r.resolved and r.mean > 0)})
    return pd.DataFrame(out)


#: the speculative arms of Fig. 5 (``dex.speculative``) and the library early-exit reference
FIG5_KINDS = {"prompt_lookup": "speculative (no draft model)", "lookahead": "speculative (no draft model)",
              "assisted": "speculative (draft model)", "pearl": "parallel draft-and-verify (draft model, 2 devices)",
              "dflash_chain": "speculative (trained draft head)",
              "hf_early_exit": "library early exit"}


def fig5_table(df: pd.DataFrame, arms: pd.DataFrame) -> pd.DataFrame:
    """Fig. 5 shape: end-to-end greedy throughput per (variant, workload) of AR, the best DEX arm (by
    wall speedup), the tuned depth-selection baselines, transformers' early-exit reference and the
    speculative arms of ``dex.speculative``, all from the same cell (same run, same prompts).

    Columns: ``tokens_per_s`` (tokens over wall seconds, pooled), ``wall_speedup`` (AR's pooled
    seconds over the arm's), ``projected_speedup`` (DEX: K devices; PEARL: two devices; from the
    measured parts, :func:`arms_table`), ``speedup_mean`` / ``ci_low`` / ``ci_high`` (per-prompt AR seconds over
    the arm's seconds: mean and t-based 95% interval), ``above_ar`` (the interval of speedup - 1 lies
    above zero), ``depth_speedup`` and ``ar_match_all``. Cells without a speculative arm are left out.
    """

    out = []
    greedy = df[df.temperature == 0]
    for (v, s), cell in greedy.groupby(["variant", "suite"], sort=False):
        if not cell.figure.eq("fig5").any():
            continue
        a = arms[(arms.variant == v) & (arms.suite == s) & (arms.temperature == 0)]
        dex = a[(a.figure == "fig3") & a.arm.str.startswith("dex")].sort_values("wall_speedup", ascending=False)
        picks = [("ar", "AR")] + ([(dex.arm.iloc[0], "DEX (best K by wall)")] if len(dex) else [])
        picks += [(b, "depth-selection baseline") for b in BASELINES if (a.arm == b).any()]
        picks += [(n, k) for n, k in FIG5_KINDS.items() if (a.arm == n).any()]
        ar = cell[cell.arm == "ar"].set_index("prompt_id")["seconds"]
        for arm, kind in picks:
            g = cell[cell.arm == arm]
            if g.empty:  # every prompt of this arm errored (error rows are not decode rows)
                continue
            sec = g.set_index("prompt_id")["seconds"]
            common = sec.index.intersection(ar.index)
            sp = (ar[common] / sec[common]).to_numpy(dtype=float)
            sp = sp[np.isfinite(sp)]
            r = one_sample(sp) if len(sp) else None
            above = one_sample(sp - 1.0) if len(sp) else None
            out.append({
                "variant": v, "suite": s, "arm": arm, "kind": kind, "n_prompts": len(g), "tokens": int(g["tokens"].sum()),
                "tokens_per_s": _ratio(g["tokens"].sum(), g["seconds"].sum()),
                "wall_speedup": _ratio(ar.sum(), g["seconds"].sum()),
                "projected_speedup": (a.loc[a.arm == arm, "projected_speedup"].iloc[0]
                                      if (a.arm == arm).any() else np.nan),
                "speedup_mean": r.mean if r else np.nan, "ci_low": r.ci_low if r else np.nan,
                "ci_high": r.ci_high if r else np.nan,
                "above_ar": bool(above.resolved and above.mean > 0) if above else False,
                "depth_speedup": _ratio(g["L"].iloc[0] * g["tokens"].sum(), g["critical_layers"].sum()),
                "ar_match_all": bool(g["ar_match"].fillna(False).astype(bool).all()),
                "params": g["params"].iloc[0],
            })
    return pd.DataFrame(out)


def _mp_arm(r: dict) -> str:
    """The Fig. 5 arm name of a multi-process row: ``pearl-2ranks`` or ``tensor_parallel-K``."""
    return f"pearl-{r['world_size']}ranks" if r["method"] == "pearl" else f"{r['method']}-{r['world_size']}"


#: kinds of the multi-process arms in the Fig. 5 table
MP_KINDS = {"pearl": "parallel draft-and-verify, 2 processes (measured)",
            "tensor_parallel": "tensor parallel, K processes on the shared cores (measured)"}


def fig5_multiprocess_rows(mp_rows: list[dict]) -> list[dict]:
    """``dex_fig5`` rows of the multi-process arms (PEARL on two ranks, tensor parallelism over K ranks;
    :mod:`impl.spec.pearl_distributed`, :mod:`impl.spec.tensor_parallel`), one per (arm, workload): the
    arm's wall time against AR's on the same prompts timed by rank 0 in the same run (``ar_seconds``),
    per-prompt speedup mean and t-based 95% interval, AR equality of every row. Error rows are left out."""
    ok = [r for r in mp_rows if "error" not in r and r.get("ar_seconds")]
    skipped = sum("error" not in r and not r.get("ar_seconds") for r in mp_rows)
    if skipped:
        log.warning("dex_fig5: %d multi-process rows without ar_seconds (run with --no-check?) left out", skipped)
    if not ok:
        return []
    d = _mp_frame(ok)
    out = []
    for (variant, arm, suite), g in d.groupby(["variant", "arm", "suite"], sort=False, dropna=False):
        sp = (g["ar_seconds"] / g["seconds"]).to_numpy(dtype=float)
        sp = sp[np.isfinite(sp)]
        r = one_sample(sp) if len(sp) else None
        above = one_sample(sp - 1.0) if len(sp) else None
        match = g["ar_match"].fillna(False).astype(bool)
        tokens = int(g["n_new_tokens"].sum())
        out.append({
            "variant": variant, "suite": suite, "arm": arm,
            "kind": MP_KINDS[g["method"].iloc[0]], "n_prompts": len(g), "tokens": tokens,
            "tokens_per_s": _ratio(tokens, g["seconds"].sum()), "wall_speedup": _ratio(g["ar_seconds"].sum(), g["seconds"].sum()),
            "projected_speedup": np.nan, "speedup_mean": r.mean if r else np.nan, "ci_low": r.ci_low if r else np.nan,
            "ci_high": r.ci_high if r else np.nan, "above_ar": bool(above.resolved and above.mean > 0) if above else False,
            "depth_speedup": np.nan, "ar_match_all": bool(match.all()),
            "params": json.dumps({"world_size": int(g["world_size"].iloc[0]),
                                  **({"gamma": int(g["gamma"].iloc[0])} if "gamma" in g and g["gamma"].notna().all() else {})}),
        })
    return out


def _mp_frame(rows: list[dict]) -> pd.DataFrame:
    """Multi-process rows as a frame with the columns the tables read (absent ones NaN), ``arm`` and
    ``variant`` (the row's, else the model directory's name) added."""
    d = pd.DataFrame([{**r, "arm": _mp_arm(r), "variant": r.get("variant") or Path(str(r.get("model_dir"))).name}
                      for r in rows])
    for c in ("suite", "rounds", "comm_seconds", "ar_seconds", "ar_match", "rounds_match"):
        if c not in d:
            d[c] = np.nan
    return d


def multiprocess_table(mp_rows: list[dict]) -> pd.DataFrame:
    """The multi-process arms' detail per (variant, arm, workload): prompts, tokens, rounds and
    communication ms per round (PEARL: rank 0's round wall minus the slower rank's compute), tokens per
    round (PEARL), the measured seconds of the arm and of AR, the AR verdict and (PEARL) whether every
    prompt ran the single-process executor's rounds (``rounds_match_all``; empty where not checked)."""
    ok = [r for r in mp_rows if "error" not in r]
    cols = ["variant", "arm", "suite", "prompts", "tokens", "rounds", "tokens_per_round", "comm_ms_per_round",
            "seconds", "ar_seconds", "ar_match_all", "rounds_match_all"]
    if not ok:
        return pd.DataFrame(columns=cols)
    d = _mp_frame(ok)
    out = []
    for (variant, arm, suite), g in d.groupby(["variant", "arm", "suite"], sort=False, dropna=False):
        R = g["rounds"].sum(min_count=1)
        rm = g["rounds_match"].dropna()
        out.append({"variant": variant, "arm": arm, "suite": suite, "prompts": len(g), "tokens": int(g["n_new_tokens"].sum()),
                    "rounds": R, "tokens_per_round": _ratio(g["n_new_tokens"].sum(), R) if R == R else np.nan,
                    "comm_ms_per_round": 1000 * g["comm_seconds"].sum(min_count=1) / R if R == R and R else np.nan,
                    "seconds": g["seconds"].sum(), "ar_seconds": g["ar_seconds"].sum(min_count=1),
                    "ar_match_all": bool(g["ar_match"].fillna(False).astype(bool).all()),
                    "rounds_match_all": bool(rm.astype(bool).all()) if len(rm) else None})
    t = pd.DataFrame(out, columns=cols)
    t["rounds"] = t["rounds"].astype("Int64")  # empty where the arm has no rounds (TP)
    t["rounds_match_all"] = t["rounds_match_all"].astype("boolean")
    return t


def overhead_table(df: pd.DataFrame) -> pd.DataFrame:
    """Table 1 shape: per (variant, K), average ms per round of expansion (explorer batches),
    collapse (commit + collapse), decode/commit bookkeeping, and communication where measured,
    with shares of the profiled total. Greedy full DEX arms, pooled over workloads."""
    g = df[(df.method == "dex") & (df.figure == "fig3") & (df.temperature == 0)]
    out = []
    for (v, K), x in g.groupby(["variant", "K"]):
        rounds = x["rounds_total"].sum()
        comps = {"expansion": x["expansion_s"].sum(), "communication": x["comm_seconds"].sum(min_count=1),
                 "collapse": x["collapse_s"].sum(), "decode_commit": x["bookkeeping_s"].sum()}
        total = sum(val for val in comps.values() if not np.isnan(val))
        row = {"variant": v, "K": int(K), "rounds": int(rounds)}
        for k, val in comps.items():
            row[f"{k}_ms_per_round"] = 1000 * val / rounds if not np.isnan(val) else np.nan
            row[f"{k}_share"] = val / total if not np.isnan(val) else np.nan
        out.append(row)
    return pd.DataFrame(out)


def _batches(r: dict) -> list[tuple[int, float]]:
    """(stage width in layers, seconds) of every explorer batch that ran in a DEX row."""
    X = r["params"]["exploration_set"]
    widths = [X[0]] + [X[k] - X[k - 1] for k in range(1, len(X))]
    return [(widths[k], sec) for rnd in r.get("round_seconds") or [] for k, sec in enumerate(rnd) if sec > 0]


def walltime_model_table(df: pd.DataFrame, rows: list[dict]) -> pd.DataFrame:
    """App. B walltime model, calibrated per (variant, suite):

    S_wall = T (L + delta_AR) / sum_t (ceil(EAD(t))_X + delta_X(t)), everything in layer units.
    The per-layer cost c (s/layer) is the least-squares slope of explorer batch time on stage width
    (layers) over every batch of the cell's greedy DEX arms (the intercept is the fixed per-batch
    cost: readout, decode, launch), both constrained non-negative (``scipy.optimize.lsq_linear``); a
    cell without a positive slope is left out; delta_AR = AR s/token / c - L (AR's per-token overhead beyond
    layers); delta_X = projected s/token / c - critical layers/token (DEX's per-token overhead:
    batched branches, masks, readouts, communication). By construction the calibrated model
    reproduces the measured projected speedup; the table's value is the decomposition: how much of
    the gap between depth-side and walltime speedup each overhead explains.
    """
    by_key = {}
    for r in rows:
        if r.get("method") == "dex" and r.get("figure") == "fig3" and r.get("temperature", 0) == 0:
            by_key.setdefault((r["variant"], r.get("suite")), []).extend(_batches(r))
    out = []
    for (v, s), cell in df.groupby(["variant", "suite"], sort=False):
        ar = cell[(cell.method == "ar") & (cell.temperature == 0)]
        dex = cell[(cell.method == "dex") & (cell.figure == "fig3") & (cell.temperature == 0)]
        b = by_key.get((v, s), [])
        if ar.empty or dex.empty or len({w for w, _ in b}) < 2:
            continue
        w, sec = np.array(b, dtype=float).T
        # non-negative least squares: a layer cannot cost negative time, nor a batch's fixed part;
        # without a positive per-layer slope (degenerate timings) the decomposition has no meaning
        fit = lsq_linear(np.column_stack([w, np.ones_like(w)]), sec, bounds=(0.0, np.inf))
        c, icpt = (float(x) for x in fit.x)
        if not c > 0:
            continue
        L = int(cell["L"].iloc[0])
        ar_tok = ar["seconds"].sum() / ar["tokens"].sum()
        d_ar = ar_tok / c - L
        for K, g in dex.groupby("K"):
            n = g["tokens"].sum()
            crit = g["critical_layers"].sum()
            p = (g["critical_path_seconds"] + g["prefill_seconds"] + g["comm_seconds"].fillna(0.0)).sum()
            out.append({"variant": v, "suite": s, "K": int(K), "c_ms_per_layer": 1000 * c,
                        "batch_fixed_ms": 1000 * icpt, "delta_ar_layers": d_ar, "delta_x_layers": p / c / n - crit / n,
                        "critical_layers_per_token": crit / n, "depth_speedup": L * n / crit,
                        "calibrated_wall_speedup": n * (L + d_ar) / (p / c),
                        "comm_measured": bool(g["comm_seconds"].notna().any())})
    return pd.DataFrame(out)


def tuning_table(rows: list[dict]) -> pd.DataFrame:
    """Every tuning grid point with its depth speedup; ``chosen`` marks the tuned value per cell."""
    t = pd.DataFrame([{"variant": r["variant"], "suite": r.get("suite"), "method": r["method"],
                       "params": json.dumps(r["params"], sort_keys=True), "depth_speedup": r["depth_speedup"]}
                      for r in rows if r.get("kind") == "tuning"])
    if t.empty:
        return pd.DataFrame(columns=["variant", "suite", "method", "params", "depth_speedup", "chosen"])
    best = t.groupby(["variant", "suite", "method"])["depth_speedup"].transform("max")
    first = t[t.depth_speedup == best].groupby(["variant", "suite", "method"]).head(1).index
    t["chosen"] = t.index.isin(first)
    return t


def adapters_table(summaries: list[dict]) -> pd.DataFrame:
    """Per adapted model and depth: parameters, top-1 agreement with the final depth and KL before
    and after adapter training (held-out ShareGPT windows)."""
    out = []
    for s in summaries:
        for d in s["depths"]:
            b, a = s["before"][str(d)], s["after"][str(d)]
            out.append({"model": Path(s["model_dir"]).name, "depth": d, "parameters": s["parameters_per_adapter"],
                        "top1_before": b["top1_agreement"], "top1_after": a["top1_agreement"],
                        "kl_before": b["kl"], "kl_after": a["kl"], "train_seconds": s["train_seconds"]})
    return pd.DataFrame(out)


def draft_table(summaries: list[dict]) -> pd.DataFrame:
    """Per draft model (:mod:`impl.models.draft`): the target's depths it keeps, its parameters, the
    distillation budget and time, and the held-out top-1 agreement / KL with the target before and
    after (teacher-forced ShareGPT windows; top-1 agreement is a one-token draft's greedy acceptance)."""
    out = []
    for s in summaries:
        out.append({"model": Path(s["model_dir"]).name, "depths": " ".join(map(str, s["depths"])),
                    "draft_parameters": s["parameters_total"], "target_parameters": s["target_parameters"],
                    "steps": s["steps"], "tokens_seen": s["tokens_seen"], "train_seconds": s["train_seconds"],
                    "top1_before": s["before"]["top1_agreement"], "top1_after": s["after"]["top1_agreement"],
                    "kl_before": s["before"]["kl"], "kl_after": s["after"]["kl"]})
    return pd.DataFrame(out, columns=["model", "depths", "draft_parameters", "target_parameters", "steps", "tokens_seen",
                                      "train_seconds", "top1_before", "top1_after", "kl_before", "kl_after"])


def head_table(summaries: list[dict]) -> pd.DataFrame:
    """Per trained head of Fig. 5 (``tev-train --dex-head``: TEV's base block drafter for a model TEV does
    not train): block size, rollouts, steps and time, and the held-out greedy chain tau (1 + leading
    block positions whose argmax is the target's token) and first-position accuracy before and after."""
    cols = ["model", "block_size", "n_prompts", "rollout_tokens", "rollout_seconds", "steps", "train_seconds", "chain_tau_before",
            "chain_tau_after", "acc1_before", "acc1_after"]
    out = []
    for s in summaries:
        b = s["summaries"]["base"]
        out.append({"model": Path(s["model_dir"]).name, "block_size": len(b["heldout_after"]["accuracy"]),
                    "n_prompts": s["n_prompts"], "rollout_tokens": s["rollout_tokens"],
                    "rollout_seconds": (s.get("rollout_seconds") or {}).get("rollouts"),
                    "steps": (b.get("config") or {}).get("steps"), "train_seconds": b["seconds"]["total"],
                    "chain_tau_before": b["heldout_before"]["chain_tau"], "chain_tau_after": b["heldout_after"]["chain_tau"],
                    "acc1_before": b["heldout_before"]["accuracy"][0], "acc1_after": b["heldout_after"]["accuracy"][0]})
    return pd.DataFrame(out, columns=cols)


def adapter_ead_table(rows: list[dict]) -> pd.DataFrame:
    """Per adapted model and workload: mean stable EAD (DEX Def. 1) of the base model and of the model
    with its inducing adapters, and their paired per-prompt difference (adapted - base, t-based 95%
    interval). The cells measure EAD on the same prompts with the same final-depth generation (adapters
    change only the intermediate readouts), so the pairing is exact. DEX App. A.1 / Fig. 6: standard
    LLMs' stable EAD sits late in the stack and adapters move it earlier (``earlier``: resolved below 0).
    """
    per: dict[tuple[str, str, bool], dict[str, float]] = {}
    depth: dict[str, int] = {}
    for r in rows:
        if r.get("arm") != "stable_ead_oracle" or "error" in r or not r.get("stable_ead"):
            continue
        base, adapted = split_variant(r["variant"])
        per.setdefault((base, r.get("suite"), adapted), {})[r["prompt_id"]] = float(np.mean(r["stable_ead"]))
        if r.get("num_layers"):
            depth[base] = int(r["num_layers"])
    out = []
    for (base, suite, adapted), ad in per.items():
        if not adapted or (base, suite, False) not in per:
            continue
        pl = per[(base, suite, False)]
        common = sorted(set(pl) & set(ad))
        if not common:
            continue
        res = paired_difference([pl[k] for k in common], [ad[k] for k in common])
        out.append({"model": base, "suite": suite, "L": depth.get(base), "n": res.n,
                    "base_mean_stable_ead": float(np.mean([pl[k] for k in common])),
                    "adapted_mean_stable_ead": float(np.mean([ad[k] for k in common])),
                    "diff": res.mean, "ci_low": res.ci_low, "ci_high": res.ci_high, "resolved": res.resolved,
                    "earlier": bool(res.resolved and res.mean < 0)})
    cols = ["model", "suite", "L", "n", "base_mean_stable_ead", "adapted_mean_stable_ead", "diff", "ci_low",
            "ci_high", "resolved", "earlier"]
    return pd.DataFrame(out, columns=cols)


def comm_per_round(distributed_rows: list[dict]) -> dict[int, float]:
    """Mean measured communication seconds per explorer round, by K, from the rows of the
    torch.distributed executor (``python -m impl.dex.distributed``)."""
    acc: dict[int, list[float]] = {}
    for r in distributed_rows:
        if "error" in r or not r.get("round_comm_seconds"):
            continue
        acc.setdefault(len(r["exploration_set"]), []).extend(r["round_comm_seconds"])
    return {k: float(np.mean(v)) for k, v in acc.items() if v}


def distributed_table(distributed_rows: list[dict]) -> pd.DataFrame:
    """Per K: rounds, mean slowest-explorer and communication ms per round, and the AR verdict of the
    multi-process runs."""
    out = []
    for r in distributed_rows:
        if "error" in r:
            continue
        R = len(r.get("round_comm_seconds") or [])
        out.append({"K": len(r["exploration_set"]), "prompt_id": r.get("prompt_id", r.get("id")), "rounds": R,
                    "tokens": len(r["token_ids"]), "critical_path_ms_per_round": 1000 * r["critical_path_seconds"] / max(R, 1),
                    "comm_ms_per_round": 1000 * r["comm_seconds"] / max(R, 1), "ar_match": r.get("ar_match")})
    if not out:
        return pd.DataFrame(columns=["K", "prompts", "rounds", "critical_path_ms_per_round", "comm_ms_per_round",
                                     "ar_match_all"])
    d = pd.DataFrame(out)
    return d.groupby("K").agg(prompts=("prompt_id", "count"), rounds=("rounds", "sum"),
                              critical_path_ms_per_round=("critical_path_ms_per_round", "mean"),
                              comm_ms_per_round=("comm_ms_per_round", "mean"),
                              ar_match_all=("ar_match", "all")).reset_index()


def dex_tables(rows: list[dict], adapter_summaries: list[dict],
               distributed_rows: list[dict] | None = None, draft_summaries: list[dict] | None = None,
               multiprocess_rows: list[dict] | None = None, head_summaries: list[dict] | None = None
               ) -> dict[str, pd.DataFrame]:
    """All DEX tables from raw cell rows, adapter training summaries, the multi-process DEX runs (whose
    measured communication per round is added to the projected K-device time for the K measured), the
    draft models' training summaries and the multi-process Fig. 5 arms (PEARL on two ranks, tensor
    parallelism), whose rows join ``dex_fig5``."""
    df = _frame(_decode_rows(rows))
    comm = comm_per_round(distributed_rows or [])
    df["comm_seconds"] = [r * comm[int(k)] if not np.isnan(k) and int(k) in comm and not np.isnan(r) else np.nan
                          for k, r in zip(df["K"], df["rounds_total"])]
    arms = arms_table(df)
    fig5 = fig5_table(df, arms)
    mp = multiprocess_rows or []
    if mp:
        extra = pd.DataFrame(fig5_multiprocess_rows(mp))
        fig5 = pd.concat([fig5, extra], ignore_index=True) if len(fig5) else extra
        if len(fig5):  # each cell's rows together, AR first
            order = {k: i for i, k in enumerate(dict.fromkeys(zip(fig5["variant"], fig5["suite"])))}
            fig5 = fig5.iloc[sorted(range(len(fig5)), key=lambda i: order[(fig5["variant"].iloc[i], fig5["suite"].iloc[i])])]
            fig5 = fig5.reset_index(drop=True)
    return {"dex_arms": arms, "dex_claims": claims_table(df, arms), "dex_fig5": fig5,
            "dex_overhead": overhead_table(df),
            "dex_walltime_model": walltime_model_table(df, _decode_rows(rows)), "dex_tuning": tuning_table(rows),
            "dex_adapters": adapters_table(adapter_summaries), "dex_adapter_ead": adapter_ead_table(rows),
            "dex_distributed": distributed_table(distributed_rows or []),
            "dex_draft": draft_table(draft_summaries or []), "dex_fig5_multiprocess": multiprocess_table(mp),
            "dex_head": head_table(head_summaries or [])}


__all__ = ["dex_tables", "arms_table", "claims_table", "fig5_table", "FIG5_KINDS", "MP_KINDS", "fig5_multiprocess_rows",
           "multiprocess_table", "head_table", "overhead_table", "walltime_model_table", "tuning_table",
           "adapters_table", "adapter_ead_table", "draft_table", "BASELINES"]


def _md(df: pd.DataFrame) -> str:
    return df.to_markdown(index=False, floatfmt=".3f")


def _fig5_standing(fig5: pd.DataFrame, ranks: list[tuple[int, int]], n_cells: int) -> list[str]:
    """The report's summary of where DEX stands among the Fig. 5 arms on this machine: its rank per
    cell, the arms resolved above AR, and DEX's K-device projection beside the measured arms."""
    if not n_cells:
        return []
    out = []
    if ranks:
        top = sum(r == 1 for r, _ in ranks)
        out.append(f"- **Where DEX stands on this CPU**: its fastest arm ranks {', '.join(f'{r}/{n}' for r, n in ranks)} "
                   f"by measured wall speedup (first in {top}/{len(ranks)} cells).")
    g = fig5[fig5.arm != "ar"]
    above = g[g["above_ar"].astype(str).str.lower().eq("true")]
    out.append("- Arms resolved above AR (per-prompt 95% interval of speedup - 1 above zero): "
               + (", ".join(f"`{a}` ({int(c)} cells)" for a, c in above.groupby("arm", sort=False).size().items())
                  if len(above) else "none") + ".")
    dex = g[g.arm.astype(str).str.startswith("dex")]
    proj = pd.to_numeric(dex.get("projected_speedup"), errors="coerce").dropna() if len(dex) else pd.Series(dtype=float)
    pearl = pd.to_numeric(g.loc[g.arm == "pearl", "projected_speedup"], errors="coerce").dropna()
    if len(proj):
        line = (f"- Projected onto K devices (explorers on devices of their own, measured communication added), "
                f"DEX's best arm gives {proj.min():.2f}-{proj.max():.2f}x AR")
        if len(pearl):
            line += f"; PEARL projected onto two devices {pearl.min():.2f}-{pearl.max():.2f}x"
        out.append(line + ".")
    return out + [""]


def report_section(tables_dir: str | Path, figures_dir: str | Path, base: str | Path) -> list[str]:
    """Markdown lines of the DEX section of REPORT.md: checks (AR equality, rounds identity), the
    speedups per (variant, workload) labelled by kind, the claims with paired statistics, the
    overhead profile and the walltime-model decomposition. Claims that do not reproduce are stated
    as such."""

    td, fd, base = Path(tables_dir), Path(figures_dir), Path(base)
    rel = lambda p: os.path.relpath(p, base).replace(os.sep, "/")  # noqa: E731
    read = lambda n: pd.read_csv(td / f"{n}.csv") if (td / f"{n}.csv").stat().st_size > 1 else pd.DataFrame()  # noqa: E731
    arms, claims = read("dex_arms"), read("dex_claims")
    over, wall, adapters = read("dex_overhead"), read("dex_walltime_model"), read("dex_adapters")
    dist = read("dex_distributed") if (td / "dex_distributed.csv").is_file() else pd.DataFrame()
    lines = ["## DEX: depth exploration decoding (Fig. 3, Fig. 4, Table 1 shapes)", ""]
    dec = arms[~arms.arm.str.endswith("oracle")]
    ok = bool(dec["ar_match_all"].all())
    lines.append(f"- every DEX arm and baseline equals AR token for token on every prompt (greedy and sampling, "
                 f"same Gumbel noise): **{'PASS' if ok else 'FAIL'}** ({len(dec)} arm-cells)")
    ident = arms["rounds_identity"].dropna()
    ok = bool(ident.astype(str).str.lower().eq("true").all()) and len(ident) > 0
    lines.append(f"- rounds identity rounds(t+1) = 1 + k_t with k_t predicted by the EAD measurement, token by "
                 f"token (greedy DEX, no DECS): **{'PASS' if ok else 'FAIL'}** ({len(ident)} arm-cells)")
    lines.append("")
    lines += ["Speedups over AR per (variant, workload), labelled by kind: **depth** = AR's critical-path "
              "layer work over DEX's (Prop. 7 accounting, noise-free); **projected** = AR's measured wall "
              "time over the projected K-device wall time (the measured prefill, which AR's time also holds, plus per "
              "round the slowest explorer's measured batch time and measured communication where `comm_measured`); **wall** = measured single-machine "
              "wall time, explorers run one after another (same run, same prompts). Oracles: `ead_oracle` = "
              "sum of EADs (the bound for any lossless reuse of matching readouts), `stable_ead_oracle` = "
              "sum of stable EADs (the paper's S_EAD). Greedy unless `temperature` > 0.", ""]
    cols = ["variant", "suite", "arm", "temperature", "n_prompts", "tokens", "depth_speedup", "projected_speedup",
            "wall_speedup", "comm_measured", "max_lattice"]
    main = arms[arms.figure.isin(["fig3", "ar"])]
    lines += [_md(main[[c for c in cols if c in main]]), ""]
    if len(claims):
        lines += ["### Claims (paired per prompt, difference of depth-side speedups b - a, t-based 95% interval)", ""]
        for claim, g in claims.groupby("claim", sort=False):
            held = int(g["holds"].astype(bool).sum())
            pos = int((g["diff"] > 0).sum())
            verdict = ("reproduces" if held == len(g) else
                       "does not reproduce everywhere" if held else "does not reproduce")
            lines.append(f"- **{claim}**: {verdict}: resolved above zero in {held}/{len(g)} comparisons, "
                         f"mean difference positive in {pos}/{len(g)}.")
        lines += ["", _md(claims), ""]
    fig5 = read("dex_fig5") if (td / "dex_fig5.csv").is_file() else pd.DataFrame()
    if len(fig5):
        ok = bool(fig5["ar_match_all"].astype(str).str.lower().eq("true").all())
        lines += ["### End-to-end throughput against speculative decoding (Fig. 5 shape)", "",
                  f"- every arm below equals AR token for token on every prompt: **{'PASS' if ok else 'FAIL'}**", "",
                  "Greedy, one process, the same prompts and run as AR: `tokens_per_s` and `wall_speedup` pool the "
                  "prompts; `speedup_mean` [`ci_low`, `ci_high`] is the per-prompt AR time over the arm's with a "
                  "t-based 95% interval, `above_ar` whether speedup - 1 is resolved above zero. DEX's explorers run "
                  "one after another here (its K-device projection is in the table above); `prompt_lookup` and "
                  "`assisted` are transformers' own `generate` (prompt lookup; assisted decoding with the draft "
                  "model below), `lookahead` the harness's Lookahead decoding, `pearl` PEARL (draft and target "
                  "overlapped on two devices: `projected_speedup` from its measured parts; `wall_speedup` runs them "
                  "in turn), `dflash_chain` TEV's trained block drafter verified as a chain. The DEX row is the fastest DEX arm "
                  "of the cell, picked on these same timings, so its speedup leans high. Rows of kind *measured* "
                  "ran as several processes (one thread each) with AR timed by rank 0 on the same prompts in the "
                  "same run: `pearl-2ranks` has the target and the draft model in two processes on the two cores "
                  "(the overlap is real, communication included), `tensor_parallel-K` K processes sharing the "
                  "two cores (for K > 2 the ranks time-slice, so it is a lower bound on what K devices give).",
                  "", _md(fig5), ""]
        ranks, n_cells = [], 0
        for (v, s), g in fig5.groupby(["variant", "suite"], sort=False):
            best = g[g.arm != "ar"].sort_values("wall_speedup", ascending=False)
            if len(best):
                n_cells += 1
                dex_rank = next((i + 1 for i, a in enumerate(best.arm.astype(str)) if a.startswith("dex")), None)
                if dex_rank:
                    ranks.append((dex_rank, len(best)))
                lines.append(f"- {v} / {s}: fastest `{best.arm.iloc[0]}` ({best.wall_speedup.iloc[0]:.2f}x AR)"
                             + (f"; DEX ranks {dex_rank} of {len(best)}" if dex_rank else ""))
        lines.append("")
        lines += _fig5_standing(fig5, ranks, n_cells)
        mp = read("dex_fig5_multiprocess") if (td / "dex_fig5_multiprocess.csv").is_file() else pd.DataFrame()
        if len(mp):
            rm = mp["rounds_match_all"].dropna().astype(str).str.lower() if "rounds_match_all" in mp else pd.Series(dtype=str)
            if len(rm):
                lines += [f"- two-rank PEARL ran the single-process executor's rounds (kinds, tokens committed) on "
                          f"every prompt: **{'PASS' if rm.eq('true').all() else 'FAIL'}**", ""]
            lines += ["Multi-process arms in detail (rank 0's measurements; `comm_ms_per_round`: PEARL's round wall "
                      "time beyond the slower rank's compute, i.e. the exchange and the waiting):", "", _md(mp), ""]
        p = fd / "dex_fig5.png"
        if p.is_file():
            lines += [f"![Fig. 5 shape]({rel(p)})", ""]
    if len(over):
        lines += ["### Overhead profile (Table 1 shape)", "",
                  "Average ms per explorer round on this machine (reference executor: expansion is every "
                  "explorer batch of the round run in turn; communication only where measured).", "",
                  _md(over), ""]
    if len(dist):
        ok = bool(dist["ar_match_all"].astype(str).str.lower().eq("true").all())
        lines += ["### Multi-process explorers (torch.distributed, one rank per explorer)", "",
                  f"- token ids equal AR on every prompt: **{'PASS' if ok else 'FAIL'}**", "",
                  "Measured on this machine (gloo; ranks share the CPU cores, so communication includes "
                  "scheduling); this communication per round is what `projected_speedup` adds for these K.", "",
                  _md(dist), ""]
        if {"comm_ms_per_round", "critical_path_ms_per_round"} <= set(dist.columns):
            share = dist["comm_ms_per_round"] / (dist["critical_path_ms_per_round"] + dist["comm_ms_per_round"])
            parts = ", ".join(f"{s:.0%} at K = {int(k)}" for k, s in zip(dist["K"], share))
            lines += [f"- communication is {parts} of a projected round. "
                      + ("It is not what holds the projection back: the projected speedup is bounded by the depth-side "
                         "speedup and what DEX adds per round (lattice bookkeeping, intermediate readouts; walltime "
                         "model below)." if share.max() < 0.25 else
                         "It takes a large part of each round: on this model the explorers' batches are too small "
                         "for the transfer to hide."), ""]
    if len(wall):
        lines += ["### Walltime model (App. B), calibrated", "",
                  "c = per-layer cost fitted on explorer batch times; delta_AR and delta_X are AR's and DEX's "
                  "per-token overheads in layer units; the calibrated model reproduces the projected speedup "
                  "by construction and shows how much of the depth-side speedup the overheads take.", "",
                  _md(wall), ""]
    if len(adapters):
        lines += ["### Inducing adapters (App. C.2)", "",
                  "Top-1 agreement of the depth's readout with the final depth and KL(final || depth) on "
                  "held-out ShareGPT windows, before and after KL self-distillation; parameters per adapter "
                  "= 4h^2 + 4h + 1.", "", _md(adapters), ""]
    drafts = read("dex_draft") if (td / "dex_draft.csv").is_file() else pd.DataFrame()
    if len(drafts):
        lines += ["### Draft models for the speculative arms (Fig. 5)", "",
                  "Each draft is the model's embeddings, the decoder layers at the listed depths, its final norm "
                  "and LM head, with the kept layers and the norm distilled to the model (full-vocabulary KL on "
                  "ShareGPT). Top-1 agreement with the model on held-out windows (teacher-forced) is the greedy "
                  "acceptance rate of a one-token draft.", "", _md(drafts), ""]
    heads = read("dex_head") if (td / "dex_head.csv").is_file() else pd.DataFrame()
    if len(heads):
        lines += ["### Trained draft heads (Fig. 5's `dflash_chain` arm)", "",
                  "TEV's DFlash-style block drafter trained for models TEV does not train (`tev-train --dex-head`, "
                  "base objective only) on the target's own greedy rollouts of ShareGPT prompts; held-out chain tau "
                  "(1 + leading block positions equal to the target's token) and first-position accuracy.", "",
                  _md(heads), ""]
    aead = read("dex_adapter_ead") if (td / "dex_adapter_ead.csv").is_file() else pd.DataFrame()
    if len(aead):
        held = int(aead["earlier"].astype(str).str.lower().eq("true").sum())
        verdict = "holds" if held == len(aead) else "holds in part" if held else "does not hold"
        lines += ["### Stable EAD with and without inducing adapters (App. A.1, Fig. 6)", "",
                  f"- adapters move the stable EAD earlier (paired per prompt, resolved below zero): **{verdict}** "
                  f"({held}/{len(aead)} workloads)", "",
                  "Mean stable EAD (1-based depth of L) of each cell's EAD measurement, base model vs the same model "
                  "with its inducing adapters, on the same prompts and the same final-depth generation.", "",
                  _md(aead), ""]
    for name, cap in (("dex_fig3", "Depth-axis comparison (Fig. 3 shape)"),
                      ("dex_fig4", "Resolution scaling, single exit vs full, vanilla vs DECS (Fig. 4 shape)")):
        p = fd / f"{name}.png"
        if p.is_file():
            lines += [f"### {cap}", "", f"![{cap}]({rel(p)})", ""]
    lines += ["Tables: " + ", ".join(f"[{p.stem}]({rel(p)})" for p in sorted(td.glob("dex_*.csv"))), ""]
    return lines
