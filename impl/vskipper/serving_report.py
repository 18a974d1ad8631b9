"""vSkipper serving tables, figures and report section (Sec. 4 shapes: Tables 2-5, Table 3 ablation,
Fig. 3 RandomSkip map, the Sec. 3.3 thresholds) from the raw rows of :mod:`impl.vskipper.serving_commands`.

Every percentage is the protocol's paired statistic (:func:`impl.serving.protocol.summarize`): the mean
of per-repetition percentage changes of the treatment arm against upstream on the same schedule, with a
t-based 95% interval; *resolved* means the interval excludes zero; one repetition is never resolved;
``n`` is always printed. Latencies improve when negative, TPS / RPS when positive.

Tables (``<name>.csv`` and ``<name>.md``):

- ``vskipper_flexidepth``: the trained skipper: held-out skip ratio and LM loss vs the dense model;
- ``vskipper_thresholds``: per policy and phase, the Project-Only share, the share guard S, the size
  threshold N, the cost-model inputs (a, b, c) and the break-even share (the rule's text is in the
  report);
- ``vskipper_knee`` (one row per sweep rung) and ``vskipper_knee_summary`` (status, Q*, load points);
- ``vskipper_cells``: every summary row of the main cells (long form: lane, arm, metric);
- ``vskipper_table2``: Table 2 shape: per (workload, load point, lane), the served hybrid's % change of
  E2E mean / p99, TTFT mean, TPOT mean and makespan;
- ``vskipper_table4``: Table 4: throughput under saturation. *Saturation* is, per workload, the load
  point with the largest multiple of Q* above 1 (the paper's overload point, 1.25 x Q*; none: the table
  is empty); per lane (matched first), upstream's and the served hybrid's mean TPS and RPS inside the
  injection window (over repetitions) and the paired % change with its t-based 95 % interval (n
  repetitions; one repetition has no interval and is never resolved);
- ``vskipper_ablation``: Table 3 shape: E2E mean and makespan change of every mechanism arm at the knee;
- ``vskipper_randomskip``: Fig. 3 data: mean E2E change per (r, d, switch setting);
- ``vskipper_modes``: share of prefill / decode rows each routed arm served in routed mode, promotions
  and probes (mean over repetitions);
- ``vskipper_gate``: per measured lane, whether it passed the matched-work gate (or was rejected /
  skipped) and why;
- ``vskipper_table5`` (when the quality rule ran): Table 5 (left) shape: per suite, metric (and BBH
  subtask), the arm means A/B/C/D in percentage points, B - A and D - C (paired), the DiD
  ``(D - C) - (B - A)`` with its t-based 95% interval (per document), n documents, token-identity
  counts between arms and the prompt-hash gate verdict (PASS, or FAIL with the gate's message);
- ``vskipper_first_token`` (when the quality rule ran): App. E.1 / Table 9 shape: per agreement
  document and arm pair (B/C/D vs A, D vs B), the largest top-5 first-token log-probability
  difference in nats, argmax agreement and ``agree`` (within ``tol``);
- ``vskipper_table5_served`` (when the served-at-knee rule ran): Table 5 (right) shape: per suite,
  metric (and BBH subtask), the checkpoint's score served by the hybrid and by always-route under a
  seeded Poisson stream at the knee (pp), the paired per-document difference hybrid - always-route with
  its t-based 95 % interval, and the share of decode rows each arm served in routed mode
  (``routed`` = hybrid / always-route), the rate and whose knee it came from; a rejected or skipped
  suite gets one row with its status.

``vskipper_table6`` / ``vskipper_table7`` (Sec. 4.4: cross-model, hardware transfer) are written by their
own rule from :mod:`impl.vskipper.transfer`; :func:`report_section` adds their subsection when present.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import pandas as pd

from impl.provenance import atomic_path, read_jsonl
from impl.serving.fmt import fmt_change
from impl.serving.fmt import num as _num

from .transfer import transfer_section_lines

__all__ = [
    "TABLE_NAMES",
    "FIGURE_NAMES",
    "TABLE2_METRICS",
    "fmt_change",
    "flexidepth_table",
    "thresholds_table",
    "knee_tables",
    "summary_frame",
    "table2",
    "table4",
    "ablation_table",
    "randomskip_table",
    "modes_table",
    "gate_table",
    "quality_table5",
    "first_token_table",
    "quality_served_table",
    "quality_served_section_lines",
    "quality_section_lines",
    "vskipper_tables",
    "vskipper_figures",
    "report_section",
]

TABLE_NAMES = ("vskipper_flexidepth", "vskipper_thresholds", "vskipper_knee", "vskipper_knee_summary",
               "vskipper_cells", "vskipper_table2", "vskipper_table4", "vskipper_ablation", "vskipper_randomskip",
               "vskipper_modes", "vskipper_gate")
QUALITY_TABLE_NAMES = ("vskipper_table5", "vskipper_first_token")
QUALITY_SERVED_TABLE_NAMES = ("vskipper_table5_served",)
FIGURE_NAMES = ("vskipper_fig3", "vskipper_knee")
#: metric -> column label of the Table 2 shape
TABLE2_METRICS = {"e2e_mean_s": "E2E mean", "e2e_p99_s": "E2E p99", "ttft_mean_s": "TTFT mean",
                  "tpot_mean_s": "TPOT mean", "makespan_s": "makespan"}
TABLE4_METRICS = {"tps_window": "TPS (window)", "rps_window": "RPS (window)"}
SERVED, UPSTREAM = "vskipper", "upstream"

_SUMMARY_COLS = ["experiment", "workload", "point", "factor", "rate", "knee_status", "lane", "treatment", "metric",
                 "better", "n", "mean", "ci_low", "ci_high", "resolved", "improved", "text", "r", "d", "k",
                 "skip_share", "baseline_mean", "treatment_mean"]


# ------------------------------------------------------------------------------------------ helpers
def _rows(paths: Iterable) -> list[dict]:
    out: list[dict] = []
    for p in paths or []:
        out.extend(read_jsonl(p))
    return out


def _jsons(paths: Iterable) -> list[dict]:
    return [json.loads(Path(p).read_text(encoding="utf-8")) for p in paths or []]


def _share(summary: dict | None, phase: str) -> float:
    if not summary:
        return math.nan
    r = (summary.get("rows") or {}).get(phase) or {}
    tot = (r.get("routed") or 0) + (r.get("dense") or 0)
    return r.get("routed", 0) / tot if tot else math.nan


def _frame(records: list[dict], cols: Sequence[str]) -> pd.DataFrame:
    df = pd.DataFrame(records)
    for c in cols:
        if c not in df:
            df[c] = pd.Series(dtype=object)
    return df[list(cols) + [c for c in df.columns if c not in cols]] if len(df) else pd.DataFrame(columns=list(cols))


# ------------------------------------------------------------------------------------------- tables
def flexidepth_table(summaries: list[dict]) -> pd.DataFrame:
    """One row per trained skipper: routed layers, budget, held-out skip ratio and LM loss against the
    dense model (``loss_delta`` = skipper - dense, nats/token), before and after training."""
    cols = ["model", "routed_layers", "steps", "train_seconds", "eval_skip_ratio", "eval_lm_loss", "eval_dense_lm_loss",
            "loss_delta", "eval_skip_ratio_before", "eval_lm_loss_before", "train_skip_ratio_last", "skip_alpha",
            "trainable_params"]
    recs = []
    for s in summaries:
        recs.append({"model": s.get("model"), "routed_layers": " ".join(map(str, s.get("routed_layers", []))),
                     "steps": s.get("steps"), "train_seconds": s.get("seconds"),
                     "eval_skip_ratio": s.get("eval_skip_ratio"), "eval_lm_loss": s.get("eval_lm_loss"),
                     "eval_dense_lm_loss": s.get("eval_dense_lm_loss"),
                     "loss_delta": _num(s.get("eval_lm_loss")) - _num(s.get("eval_dense_lm_loss")),
                     "eval_skip_ratio_before": s.get("eval_skip_ratio_before"),
                     "eval_lm_loss_before": s.get("eval_lm_loss_before"),
                     "train_skip_ratio_last": s.get("train_skip_ratio_last"),
                     "skip_alpha": (s.get("config") or {}).get("skip_alpha"),
                     "trainable_params": s.get("trainable_params")})
    return _frame(recs, cols)


def _threshold_rows(policy: str, thr: dict, profile: dict, extra: dict) -> list[dict]:
    out = []
    for ph, n_key, g_key in (("prefill", "min_prefill_tokens", "min_skip_share"),
                             ("decode", "enter_threshold", "decode_min_skip_share")):
        pp = profile.get(ph, {})
        out.append({"policy": policy, **extra, "phase": ph, "share": thr["skip_share"][ph], "guard_S": thr[g_key],
                    "threshold_N": thr[n_key], "unit": pp.get("unit"), "profitable": thr[n_key] is not None,
                    "break_even_share": thr["break_even_share"][ph], "a_fixed_s": pp.get("fixed_cost_s"),
                    "b_per_row_s": pp.get("fixed_cost_per_row_s"),
                    "c_per_row_layer_s": pp.get("saving_per_row_layer_s"),
                    "n_routed": thr["inputs"]["n_routed_layers"], "device": profile.get("device"),
                    "threads": profile.get("threads")})
    return out


def thresholds_table(docs: list[dict]) -> pd.DataFrame:
    """One row per (policy[, r, d], phase) of the profile-mode JSONs: share, guard S, threshold N (None =
    no batch size pays: the phase stays dense), the cost model's a, b, c and the break-even share."""
    cols = ["policy", "r", "d", "k", "phase", "share", "guard_S", "threshold_N", "unit", "profitable",
            "break_even_share", "a_fixed_s", "b_per_row_s", "c_per_row_layer_s", "n_routed", "device", "threads"]
    recs = []
    for doc in docs:
        if doc.get("thresholds"):
            recs += _threshold_rows(doc["policy"], doc["thresholds"], doc["profile"], {})
        for g in doc.get("grid", []):
            recs += _threshold_rows("randomskip", g["thresholds"], doc["profile"],
                                    {"r": g["r"], "d": g["d"], "k": g["k"]})
    return _frame(recs, cols)


def knee_tables(docs: list[dict]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """``(rungs, summary)`` of the knee JSONs: one row per sweep rung (rate, TPS in the window, E2E, ...,
    ``is_q_star_used``) and one per workload (the upstream arm's engine and attention backend, status, Q*,
    the rate used, the load points, the rule's message)."""
    rung_cols = ["workload", "rate", "tps_window", "rps_window", "e2e_mean_s", "ttft_mean_s", "tpot_mean_s",
                 "makespan_s", "output_tokens", "is_q_star_used"]
    sum_cols = ["workload", "model", "engine", "attention_backend", "status", "bracketed", "q_star", "q_star_used",
                "requests", "max_new_tokens", "eps", "rates", "load_points", "message"]
    rungs, summ = [], []
    for k in docs:
        for r in k.get("rows", []):
            rungs.append({"workload": k["workload"], **{c: r.get(c) for c in rung_cols[1:-1]},
                          "is_q_star_used": math.isclose(float(r["rate"]), float(k["q_star_used"]))})
        arm = k.get("arm_settings") or {}
        summ.append({"workload": k["workload"], "model": k.get("model"), "engine": k.get("engine", arm.get("engine")),
                     "attention_backend": arm.get("attention_backend"), "status": k["status"],
                     "bracketed": k["bracketed"], "q_star": k["q_star"], "q_star_used": k["q_star_used"],
                     "requests": k.get("requests"), "max_new_tokens": k.get("max_new_tokens"), "eps": k.get("eps"),
                     "rates": " ".join(f"{x:g}" for x in k.get("rates", [])),
                     "load_points": ", ".join(f"{lab} {rate:.3g}" for lab, rate in k.get("load_points", {}).items()),
                     "message": k.get("message")})
    return _frame(rungs, rung_cols), _frame(summ, sum_cols)


def summary_frame(rows: list[dict]) -> pd.DataFrame:
    """Long form of the protocol's ``kind="summary"`` rows (one per experiment, workload, load point,
    lane, treatment arm and metric; RandomSkip rows carry r, d, k and the skip share)."""
    recs = []
    for r in rows:
        if r.get("kind") != "summary":
            continue
        recs.append({"experiment": r.get("experiment", "main"), "workload": r.get("workload"),
                     "point": r.get("point", r.get("cell")), "factor": r.get("factor"), "rate": r.get("rate"),
                     "knee_status": r.get("knee_status"), "lane": r.get("lane"), "treatment": r.get("treatment"),
                     "metric": r.get("metric"), "better": r.get("better"), "n": r.get("n"),
                     "mean": r.get("pct_mean", math.nan), "ci_low": r.get("pct_ci_low", math.nan),
                     "ci_high": r.get("pct_ci_high", math.nan), "resolved": r.get("pct_resolved", False),
                     "improved": r.get("improved", False), "text": r.get("text"), "r": r.get("r"), "d": r.get("d"),
                     "k": r.get("k"), "skip_share": r.get("skip_share"),
                     "baseline_mean": r.get("baseline_mean", math.nan),
                     "treatment_mean": r.get("treatment_mean", math.nan)})
    return _frame(recs, _SUMMARY_COLS)


def _wide(long: pd.DataFrame, metrics: dict, keys: list[str]) -> pd.DataFrame:
    cols = keys + ["n"] + list(metrics.values())
    if not len(long):
        return pd.DataFrame(columns=cols)
    sub = long[long.metric.isin(list(metrics))]
    recs = []
    for key, g in sub.groupby(keys, sort=False, dropna=False):
        rec = dict(zip(keys, key if isinstance(key, tuple) else (key,)))
        rec["n"] = int(g["n"].max())
        for m, label in metrics.items():
            x = g[g.metric == m]
            rec[label] = fmt_change(*x[["mean", "ci_low", "ci_high", "n", "resolved"]].iloc[0]) if len(x) else "-"
        recs.append(rec)
    return _frame(recs, cols)


def table2(long: pd.DataFrame) -> pd.DataFrame:
    """Table 2 shape: the served hybrid's % change against upstream per (workload, load point, lane),
    for :data:`TABLE2_METRICS` (``*`` = resolved)."""
    sub = long[(long.experiment == "main") & (long.treatment == SERVED)] if len(long) else long
    return _wide(sub, TABLE2_METRICS, ["workload", "point", "factor", "rate", "knee_status", "lane"])


TABLE4_COLS = ["workload", "point", "factor", "rate", "knee_status", "lane", "saturation", "n",
               "upstream TPS", "vskipper TPS", "TPS (window)", "tps_pct_mean", "tps_ci_low", "tps_ci_high",
               "tps_resolved", "upstream RPS", "vskipper RPS", "RPS (window)", "rps_pct_mean", "rps_ci_low",
               "rps_ci_high", "rps_resolved"]


def saturation_points(long: pd.DataFrame) -> dict:
    """``workload -> (point label, factor)`` of its saturation point: the main-cell load point with the
    largest multiple of Q* above 1 (vSkipper Sec. 4.1 "Metrics": saturated throughput at 1.25 x Q*);
    workloads without such a point are absent."""
    out: dict = {}
    if not len(long):
        return out
    sub = long[(long.experiment == "main") & (pd.to_numeric(long.factor, errors="coerce") > 1.0)]
    for w, g in sub.groupby("workload", sort=False):
        f = pd.to_numeric(g.factor, errors="coerce")
        top = g[f == f.max()].iloc[0]
        out[w] = (top.point, float(top.factor))
    return out


def table4(long: pd.DataFrame) -> pd.DataFrame:
    """Table 4: throughput under saturation (vSkipper Sec. 4.2, Table 4).

    Per workload, the saturation point (:func:`saturation_points`: the largest load point above Q*, the
    paper's 1.25 x Q*) and each lane (matched first): upstream's and the served hybrid's mean output
    tokens/s (``TPS``) and completed requests/s (``RPS``) inside the injection window over the
    repetitions, and the paired % change of the hybrid against upstream (mean of per-repetition changes
    with the t-based 95 % interval; ``*`` = resolved; positive is better).

    Args:
        long: :func:`summary_frame` of the main cells' rows (``baseline_mean`` / ``treatment_mean`` are
            the arms' means of the metric over repetitions).

    Returns:
        one row per (workload, lane) with :data:`TABLE4_COLS`; empty (with the columns) when no load
        point lies above Q*.
    """
    sat = saturation_points(long)
    recs = []
    for w, (point, factor) in sat.items():
        sub = long[(long.experiment == "main") & (long.treatment == SERVED) & (long.workload == w) &
                   (long.point == point)]
        lanes = sorted(set(sub.lane.dropna()), key=lambda x: (x != "matched", x))
        for lane in lanes:
            g = sub[sub.lane == lane]
            first = g.iloc[0]
            rec = {"workload": w, "point": point, "factor": factor, "rate": first.rate,
                   "knee_status": first.knee_status, "lane": lane, "saturation": f"{factor:g} x Q*", "n": int(g["n"].max())}
            for m, tag in (("tps_window", "tps"), ("rps_window", "rps")):
                x = g[g.metric == m]
                label = tag.upper()
                if not len(x):
                    rec.update({f"upstream {label}": math.nan, f"vskipper {label}": math.nan, f"{label} (window)": "-"})
                    continue
                x = x.iloc[0]
                rec.update({f"upstream {label}": _num(x.baseline_mean), f"vskipper {label}": _num(x.treatment_mean),
                            f"{label} (window)": fmt_change(x["mean"], x.ci_low, x.ci_high, x.n, x.resolved),
                            f"{tag}_pct_mean": _num(x["mean"]), f"{tag}_ci_low": _num(x.ci_low),
                            f"{tag}_ci_high": _num(x.ci_high), f"{tag}_resolved": str(x.resolved).lower() == "true"})
            recs.append(rec)
    return _frame(recs, TABLE4_COLS)


def modes_table(rows: list[dict]) -> pd.DataFrame:
    """Share of prefill and decode rows each routed arm served in routed mode (from the mode switch's
    per-run summary), promotions and probes, averaged over repetitions, per (experiment, workload,
    point, lane, arm[, r, d])."""
    cols = ["experiment", "workload", "point", "lane", "arm", "r", "d", "runs", "prefill_routed_share",
            "decode_routed_share", "promotions", "probes", "share_estimate"]
    recs = []
    for r in rows:
        if r.get("kind") != "cell" or r.get("arm") == UPSTREAM:
            continue
        ps = (r.get("arm_settings") or {}).get("planner_summary")
        if not ps:
            continue
        recs.append({"experiment": r.get("experiment", "main"), "workload": r.get("workload"),
                     "point": r.get("point", r.get("cell")), "lane": r.get("lane"), "arm": r["arm"], "r": r.get("r"),
                     "d": r.get("d"), "prefill_routed_share": _share(ps, "prefill"),
                     "decode_routed_share": _share(ps, "decode"), "promotions": ps.get("promotions"),
                     "probes": len(ps.get("probes") or []), "share_estimate": ps.get("share_estimate")})
    if not recs:
        return pd.DataFrame(columns=cols)
    df = pd.DataFrame(recs)
    keys = ["experiment", "workload", "point", "lane", "arm", "r", "d"]
    df[["r", "d"]] = df[["r", "d"]].astype(object).where(df[["r", "d"]].notna(), "")
    out = df.groupby(keys, sort=False).agg(runs=("arm", "size"), prefill_routed_share=("prefill_routed_share", "mean"),
                                           decode_routed_share=("decode_routed_share", "mean"),
                                           promotions=("promotions", "mean"), probes=("probes", "mean"),
                                           share_estimate=("share_estimate", "mean")).reset_index()
    return out[cols]


def ablation_table(rows: list[dict]) -> pd.DataFrame:
    """Table 3 shape: per (workload, lane, arm) at the knee, the mean E2E, TTFT and makespan % change
    against upstream with n, and the share of decode / prefill rows the arm routed."""
    cols = ["workload", "point", "lane", "arm", "n", "E2E mean", "TTFT mean", "makespan", "decode_routed_share",
            "prefill_routed_share"]
    long = summary_frame(rows)
    if not len(long):
        return pd.DataFrame(columns=cols)
    modes = modes_table(rows)
    recs = []
    for (w, p, lane, arm), g in long.groupby(["workload", "point", "lane", "treatment"], sort=False):
        rec = {"workload": w, "point": p, "lane": lane, "arm": arm, "n": int(g["n"].max())}
        for m, label in (("e2e_mean_s", "E2E mean"), ("ttft_mean_s", "TTFT mean"), ("makespan_s", "makespan")):
            x = g[g.metric == m]
            rec[label] = fmt_change(*x[["mean", "ci_low", "ci_high", "n", "resolved"]].iloc[0]) if len(x) else "-"
        mm = modes[(modes.workload == w) & (modes.lane == lane) & (modes.arm == arm)] if len(modes) else modes
        rec["decode_routed_share"] = float(mm["decode_routed_share"].mean()) if len(mm) else math.nan
        rec["prefill_routed_share"] = float(mm["prefill_routed_share"].mean()) if len(mm) else math.nan
        recs.append(rec)
    return _frame(recs, cols)


def randomskip_table(rows: list[dict]) -> pd.DataFrame:
    """Fig. 3 data: per (r, d, switch setting) the mean E2E % change against upstream at the map's load
    point (``mean``, interval, n, resolved), the realised skip share s = r k / n_routed and the routed
    row shares."""
    cols = ["workload", "point", "r", "d", "k", "skip_share", "setting", "n", "mean", "ci_low", "ci_high", "resolved",
            "text", "decode_routed_share", "prefill_routed_share"]
    long = summary_frame(rows)
    if not len(long):
        return pd.DataFrame(columns=cols)
    e2e = long[long.metric == "e2e_mean_s"]
    modes = modes_table(rows)
    recs = []
    for _, x in e2e.iterrows():
        mm = modes[(modes.arm == x.treatment) & (modes.r.astype(str) == str(x.r)) & (modes.d.astype(str) == str(x.d))] \
            if len(modes) else modes
        recs.append({"workload": x.workload, "point": x.point, "r": x.r, "d": x.d, "k": x.k, "skip_share": x.skip_share,
                     "setting": x.treatment, "n": x.n, "mean": x["mean"], "ci_low": x.ci_low, "ci_high": x.ci_high,
                     "resolved": x.resolved, "text": fmt_change(x["mean"], x.ci_low, x.ci_high, x.n, x.resolved),
                     "decode_routed_share": float(mm["decode_routed_share"].mean()) if len(mm) else math.nan,
                     "prefill_routed_share": float(mm["prefill_routed_share"].mean()) if len(mm) else math.nan})
    return _frame(recs, cols)


def gate_table(rows: list[dict]) -> pd.DataFrame:
    """One row per measured lane (experiment, workload, point, lane[, r, d]): ``status`` ``ok`` (every
    repetition passed the matched-work gate and every request completed; natural lanes have no gate),
    ``rejected`` (with the reason) or ``skipped`` (knee not bracketed and ``on_boundary: skip``)."""
    cols = ["experiment", "workload", "point", "lane", "r", "d", "status", "repetitions", "arms", "knee_status",
            "message"]
    groups: dict[tuple, dict] = {}
    for r in rows:
        kind = r.get("kind")
        if kind not in ("cell", "rejected", "skipped"):
            continue
        key = (r.get("experiment", "main"), r.get("workload"), r.get("point", r.get("cell")), r.get("lane", ""),
               r.get("r", ""), r.get("d", ""))
        g = groups.setdefault(key, {"status": "ok", "reps": set(), "arms": set(), "knee": r.get("knee_status"),
                                    "message": ""})
        if kind == "cell":
            if r.get("repetition", -1) >= 0:
                g["reps"].add(r["repetition"])
            g["arms"].add(r["arm"])
        else:
            g["status"] = kind
            g["message"] = r.get("error") or r.get("reason") or ""
    recs = [dict(zip(["experiment", "workload", "point", "lane", "r", "d"], k), status=g["status"],
                 repetitions=len(g["reps"]), arms=" ".join(sorted(g["arms"])), knee_status=g["knee"],
                 message=g["message"][:300]) for k, g in groups.items()]
    return _frame(recs, cols)


TABLE5_COLS = ["suite", "task", "metric", "primary", "n", "mean_A", "mean_B", "mean_C", "mean_D", "B_minus_A",
               "D_minus_C", "did_mean", "did_ci_low", "did_ci_high", "did_resolved", "did", "tokens_equal_AB",
               "tokens_equal_AC", "tokens_equal_BD", "tokens_equal_all", "gate", "message"]
FIRST_TOKEN_COLS = ["suite", "task", "doc_id", "arm", "reference", "k", "max_abs_diff", "tol", "argmax_equal",
                    "top_ids_equal", "agree"]


def _pp(mean, low, high, n) -> str:
    """``"+0.45 [-0.10, +1.00]"`` (pp, two decimals), ``"+0.45 (n=1)"`` without an interval."""
    mean, low, high = _num(mean), _num(low), _num(high)
    if not math.isfinite(mean):
        return "-"
    if not (math.isfinite(low) and math.isfinite(high)):
        return f"{mean:+.2f} (n={n})"
    return f"{mean:+.2f} [{low:+.2f}, {high:+.2f}]"


def _pp_of(r: dict, key: str, n: int) -> str:
    """:func:`_pp` of row ``r``'s ``{key}_mean`` / ``_ci_low`` / ``_ci_high``, with ``" *"`` appended when
    ``{key}_resolved`` is true (the interval excludes 0)."""
    txt = _pp(r.get(f"{key}_mean"), r.get(f"{key}_ci_low"), r.get(f"{key}_ci_high"), n)
    return txt + " *" if str(r.get(f"{key}_resolved")).lower() == "true" else txt


def quality_table5(rows: list[dict]) -> pd.DataFrame:
    """Table 5 (left) shape from quality-cell rows: one row per ``kind: "summary"`` row (suite, metric,
    BBH subtask; ``task`` = ``all`` for the suite level, primary metric first) and one ``FAIL`` row per
    suite the prompt-hash gate rejected. Means and differences are in percentage points; ``did`` is the
    DiD's text with its 95% interval (``*`` = resolved: the interval excludes 0)."""
    recs = []
    for r in rows:
        kind = r.get("kind")
        if kind == "summary":
            n = int(r["n"])
            did = _pp_of(r, "did", n)
            recs.append({
                "suite": r["suite"], "task": r.get("task") or "all", "metric": r["metric"],
                "primary": bool(r.get("primary")), "n": n, **{f"mean_{a}": r.get(f"mean_{a}") for a in "ABCD"},
                "B_minus_A": _pp_of(r, "B_minus_A", n), "D_minus_C": _pp_of(r, "D_minus_C", n),
                "did_mean": r.get("did_mean"), "did_ci_low": r.get("did_ci_low"), "did_ci_high": r.get("did_ci_high"),
                "did_resolved": bool(r.get("did_resolved")), "did": did,
                **{f"tokens_equal_{p}": r.get(f"tokens_equal_{p}") for p in ("AB", "AC", "BD", "all")},
                "gate": "PASS" if r.get("prompt_hashes_equal") else "FAIL", "message": "",
            })
        elif kind == "rejected":
            recs.append({"suite": r.get("suite"), "task": "all", "metric": "-", "primary": True, "gate": "FAIL",
                         "message": str(r.get("error") or r.get("reason") or "")[:300]})
    df = _frame(recs, TABLE5_COLS)
    if len(df):
        order = {s: i for i, s in enumerate(("gsm8k", "bbh", "coqa"))}
        df = df.assign(_s=df.suite.map(lambda x: order.get(x, 9)), _t=(df.task != "all").astype(int),
                       _p=(~df.primary.astype(bool)).astype(int))
        df = df.sort_values(["_s", "_t", "task", "_p", "metric"], kind="stable").drop(columns=["_s", "_t", "_p"])
    return df.reset_index(drop=True)


TABLE5_SERVED_COLS = ["suite", "task", "metric", "primary", "n", "point", "factor", "rate", "knee_workload",
                      "knee_status", "mean_hybrid", "mean_always_route", "diff", "diff_mean", "diff_ci_low",
                      "diff_ci_high", "diff_resolved", "routed", "routed_share_hybrid", "routed_share_always_route",
                      "routed_share_docs_hybrid", "routed_share_docs_always_route", "switch_routed_share_hybrid",
                      "prefill_routed_share_hybrid", "prefill_routed_share_always_route", "tokens_equal", "n_requests",
                      "n_padding", "status", "message"]


def _share_txt(a, b) -> str:
    a, b = _num(a), _num(b)
    f = lambda x: f"{x:.3f}" if math.isfinite(x) else "-"  # noqa: E731
    return f"{f(a)} / {f(b)}"


def quality_served_table(rows: list[dict]) -> pd.DataFrame:
    """Table 5 (right) shape from quality-served rows: one row per ``kind: "served_summary"`` row (suite,
    metric, BBH subtask; ``task`` = ``all`` at the suite level, primary metric first) and one row per
    rejected / skipped suite. Means and the difference hybrid - always-route are in percentage points
    (``diff``: mean with its t-based 95 % interval over documents, ``*`` = resolved); ``routed`` is the
    share of decode rows served in routed mode, hybrid / always-route, over the whole stream."""
    recs = []
    for r in rows:
        kind = r.get("kind")
        if kind == "served_summary":
            n = int(r["n"])
            diff = _pp_of(r, "diff", n)
            recs.append({
                "suite": r["suite"], "task": r.get("task") or "all", "metric": r["metric"],
                "primary": bool(r.get("primary")), "n": n, "point": r.get("point"), "factor": r.get("factor"),
                "rate": r.get("rate"), "knee_workload": r.get("knee_workload"), "knee_status": r.get("knee_status"),
                "mean_hybrid": r.get("mean_hybrid"), "mean_always_route": r.get("mean_always-route"), "diff": diff,
                "diff_mean": r.get("diff_mean"), "diff_ci_low": r.get("diff_ci_low"),
                "diff_ci_high": r.get("diff_ci_high"), "diff_resolved": bool(r.get("diff_resolved")),
                "routed": _share_txt(r.get("routed_share_hybrid"), r.get("routed_share_always-route")),
                "routed_share_hybrid": r.get("routed_share_hybrid"),
                "routed_share_always_route": r.get("routed_share_always-route"),
                "routed_share_docs_hybrid": r.get("routed_share_docs_hybrid"),
                "routed_share_docs_always_route": r.get("routed_share_docs_always-route"),
                "switch_routed_share_hybrid": r.get("switch_routed_share_hybrid"),
                "prefill_routed_share_hybrid": r.get("prefill_routed_share_hybrid"),
                "prefill_routed_share_always_route": r.get("prefill_routed_share_always-route"),
                "tokens_equal": r.get("tokens_equal"), "n_requests": r.get("n_requests"),
                "n_padding": r.get("n_padding"), "status": "ok", "message": "",
            })
        elif kind in ("rejected", "skipped"):
            recs.append({"suite": r.get("suite"), "task": "all", "metric": "-", "primary": True,
                         "point": r.get("point"), "rate": r.get("rate"), "knee_workload": r.get("knee_workload"),
                         "knee_status": r.get("knee_status"), "status": kind,
                         "message": str(r.get("error") or r.get("reason") or "")[:300]})
    df = _frame(recs, TABLE5_SERVED_COLS)
    if len(df):
        order = {s: i for i, s in enumerate(("gsm8k", "bbh", "coqa"))}
        df = df.assign(_s=df.suite.map(lambda x: order.get(x, 9)), _t=(df.task != "all").astype(int),
                       _p=(~df.primary.astype(bool)).astype(int))
        df = df.sort_values(["_s", "_t", "task", "_p", "metric"], kind="stable").drop(columns=["_s", "_t", "_p"])
    return df.reset_index(drop=True)


def first_token_table(rows: list[dict]) -> pd.DataFrame:
    """App. E.1 shape from quality-cell rows: every ``kind: "first_token"`` row (one per agreement
    document and arm pair)."""
    recs = [{c: r.get(c) for c in FIRST_TOKEN_COLS} for r in rows if r.get("kind") == "first_token"]
    return _frame(recs, FIRST_TOKEN_COLS)


def vskipper_tables(*, knees=(), thresholds=(), flexidepth=(), cells=(), ablations=(),
                    randomskip=(), quality=None, quality_served=None) -> dict[str, pd.DataFrame]:
    """Every vSkipper table from the raw files (paths): knee JSONs, profile-mode JSONs, FlexiDepth
    training summaries, serve-cell JSONLs (main and ablation), randomskip-map JSONLs and, when
    ``quality`` / ``quality_served`` is not None, quality-cell / quality-served JSONLs.

    Returns:
        ``{name: DataFrame}`` for every name of :data:`TABLE_NAMES` (empty frames with their columns
        where an experiment did not run), plus :data:`QUALITY_TABLE_NAMES` when ``quality`` is given and
        :data:`QUALITY_SERVED_TABLE_NAMES` when ``quality_served`` is given.
    """
    main, abl, rnd = _rows(cells), _rows(ablations), _rows(randomskip)
    long = summary_frame(main)
    rungs, ksum = knee_tables(_jsons(knees))
    extra = {}
    if quality is not None:
        qrows = _rows(quality)
        extra = {"vskipper_table5": quality_table5(qrows), "vskipper_first_token": first_token_table(qrows)}
    if quality_served is not None:
        extra["vskipper_table5_served"] = quality_served_table(_rows(quality_served))
    return {**extra,
        "vskipper_flexidepth": flexidepth_table(_jsons(flexidepth)),
        "vskipper_thresholds": thresholds_table(_jsons(thresholds)),
        "vskipper_knee": rungs,
        "vskipper_knee_summary": ksum,
        "vskipper_cells": long,
        "vskipper_table2": table2(long),
        "vskipper_table4": table4(long),
        "vskipper_ablation": ablation_table(abl),
        "vskipper_randomskip": randomskip_table(rnd),
        "vskipper_modes": modes_table(main + abl + rnd),
        "vskipper_gate": gate_table(main + abl + rnd),
    }


# ------------------------------------------------------------------------------------------ figures
def _read(td: Path, name: str) -> pd.DataFrame:
    p = td / f"{name}.csv"
    if not p.is_file() or p.stat().st_size <= 1:
        return pd.DataFrame()
    return pd.read_csv(p)


def fig3(df: pd.DataFrame, out: str | Path) -> None:
    """Fig. 3 shape: one heat map per switch setting (always-route, shared thresholds, per-policy
    thresholds) of the mean E2E % change against upstream over the r x d grid; annotated with the value
    (``*`` = resolved) and the skip share s. Writes a placeholder figure when there is no data."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = ["always-route", "shared", "per-policy"]
    titles = {"always-route": "(a) always route", "shared": "(b) FlexiDepth's thresholds",
              "per-policy": "(c) rule-derived per policy"}
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.2), squeeze=False)
    if not len(df):
        for ax in axes[0]:
            ax.axis("off")
        axes[0][1].text(0.5, 0.5, "RandomSkip map not run", ha="center", va="center")
    else:
        rs, ds = sorted(df["r"].unique()), sorted(df["d"].unique())
        lim = max(1.0, float(np.nanmax(np.abs(df["mean"].astype(float)))) if df["mean"].notna().any() else 1.0)
        im = None
        for ax, st in zip(axes[0], settings):
            g = df[df.setting == st]
            grid = np.full((len(rs), len(ds)), np.nan)
            for _, x in g.iterrows():
                grid[rs.index(x.r), ds.index(x.d)] = x["mean"]
            im = ax.imshow(grid, cmap="RdBu_r", vmin=-lim, vmax=lim, origin="lower")
            for i, r in enumerate(rs):
                for j, d in enumerate(ds):
                    x = g[(g.r == r) & (g.d == d)]
                    if len(x):
                        x = x.iloc[0]
                        star = "*" if str(x.resolved).lower() == "true" else ""
                        ax.text(j, i, f"{x['mean']:+.1f}{star}\ns={x.skip_share:.2f}", ha="center", va="center",
                                fontsize=8)
            ax.set_xticks(range(len(ds)), [f"{d:g}" for d in ds])
            ax.set_yticks(range(len(rs)), [f"{r:g}" for r in rs])
            ax.set_xlabel("d (fraction of routed layers skipped)")
            if st == settings[0]:
                ax.set_ylabel("r (fraction of rows skipping)")
            ax.set_title(titles[st])
        fig.colorbar(im, ax=axes[0].tolist(), label="mean E2E change vs upstream (%)")
        fig.suptitle(f"RandomSkip at {df['point'].iloc[0]} ({df['workload'].iloc[0]}), n={int(df['n'].max())}; "
                     "* = 95% interval excludes 0")
    _save(fig, out)


def knee_figure(rungs: pd.DataFrame, summ: pd.DataFrame, out: str | Path) -> None:
    """Output token rate in the injection window vs offered rate per workload (upstream, natural
    generation), Q* (or the boundary rung used) and the load points marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    if not len(rungs):
        ax.axis("off")
        ax.text(0.5, 0.5, "no knee sweep", ha="center", va="center")
    for w, g in rungs.groupby("workload", sort=False) if len(rungs) else []:
        g = g.sort_values("rate")
        line, = ax.plot(g["rate"], g["tps_window"], marker="o", label=w)
        s = summ[summ.workload == w].iloc[0] if len(summ) else None
        if s is not None:
            note = "" if str(s.status) == "ok" else f" ({s.status} rung)"
            ax.axvline(float(s.q_star_used), color=line.get_color(), ls="--", lw=1,
                       label=f"{w}: Q* = {float(s.q_star_used):.3g}{note}")
    ax.set_xlabel("offered rate (req/s)")
    ax.set_ylabel("output tokens/s in the injection window")
    ax.set_title("Knee sweep on upstream (natural generation)")
    if len(rungs):
        ax.legend(fontsize=8)
    _save(fig, out)


def _save(fig, out) -> None:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(out) as tmp:
        fig.savefig(tmp, dpi=110, bbox_inches="tight", format="png")
    import matplotlib.pyplot as plt

    plt.close(fig)


def vskipper_figures(tables_dir: str | Path, out_dir: str | Path) -> list[Path]:
    """Write every figure of :data:`FIGURE_NAMES` from the tables; returns their paths."""
    td, od = Path(tables_dir), Path(out_dir)
    fig3(_read(td, "vskipper_randomskip"), od / "vskipper_fig3.png")
    knee_figure(_read(td, "vskipper_knee"), _read(td, "vskipper_knee_summary"), od / "vskipper_knee.png")
    return [od / f"{n}.png" for n in FIGURE_NAMES]


# ------------------------------------------------------------------------------------------- report
def _md(df: pd.DataFrame) -> str:
    return df.to_markdown(index=False, floatfmt=".3g")


RULE_TEXT = (
    "**Threshold rule (Sec. 3.3, `impl.vskipper.mode.derive_thresholds`).** The profile times, per phase and "
    "batch size n, a dense step, a routed step where the router runs but no row skips, and a routed step where "
    "every row skips every routed layer; it fits the routed mode's fixed cost a + b n and the saving "
    "c n n_routed s of Project-Only share s. Routing pays iff c n_routed s n > a + b n. The share guard is "
    "S = share_slack x (the policy's share) and the size threshold N = ceil(margin a / (c n_routed S - margin b)) "
    "rows (prefill: prompt tokens of an admission batch; decode: running decode requests); no N when "
    "c n_routed S <= margin b (that phase stays dense). Prefill mode is fixed at admission (probing the share "
    "every `probe_every` admitted batches); decode is routed once the decode load reaches N, with one promotion "
    "dense -> routed that never reverts.")


def _true(col: pd.Series) -> pd.Series:
    return col.astype(str).str.lower().eq("true")


def quality_section_lines(tables_dir: str | Path, tol: float = 0.01) -> list[str]:
    """Report lines of the quality 2x2 (Table 5 left, App. E.1) from ``vskipper_table5`` /
    ``vskipper_first_token`` in ``tables_dir``; ``[]`` when the quality rule did not run. PASS/FAIL lines:
    the prompt-hash gate (every suite's arms fed identical token ids) and first-token agreement of C vs A
    (upstream engine vs lm-eval's HF backend on the base model: every top-5 log-probability within
    ``tol`` nats and the same argmax); D vs B (the paper's served-vs-native check of the checkpoint) is
    reported beside it."""
    td = Path(tables_dir)
    t5, ft = _read(td, "vskipper_table5"), _read(td, "vskipper_first_token")
    if not (td / "vskipper_table5.csv").is_file():
        return []
    lines = ["### Task quality: the 2x2 difference-in-differences (Table 5 left shape; App. E.1)", "",
             "Arms on the same documents and prompt token ids: **A** base model in lm-eval's HF backend, **B** the "
             "FlexiDepth checkpoint in plain PyTorch (routed layers), **C** base model served by the upstream arm "
             "(the unmodified continuous-batching engine), **D** the checkpoint served always-route. Scores in "
             "percentage points (GSM8K composite exact match, BBH exact match, CoQA F1); B - A is the checkpoint's "
             "own cost, D - C what it costs when served; DiD = (D - C) - (B - A), per-document paired, mean with a "
             "t-based 95% interval, `*` = resolved (interval excludes 0), n = documents. Tiny models score near "
             "zero: the shape of the check is what is reproduced, not the paper's numbers. C and D are served by the "
             "vSkipper HTTP server (`impl.vskipper.server`, in the rule's process) with lm-eval's `local-completions` "
             "client sending the prompt token ids.", ""]
    if not len(t5):
        return lines + ["- the quality rule ran but wrote no summary rows", ""]
    gate_ok = bool(t5["gate"].eq("PASS").all())
    bad = t5[t5["gate"] != "PASS"]
    suites = sorted(set(t5["suite"].astype(str)))
    n_docs = t5[(t5["task"] == "all") & _true(t5["primary"])]["n"]
    lines.append(f"- prompt-hash gate: every arm fed identical prompt token ids on every document: "
                 f"**{'PASS' if gate_ok else 'FAIL'}** (suites {', '.join(suites)}; "
                 f"{int(pd.to_numeric(n_docs, errors='coerce').fillna(0).sum())} documents"
                 + ("; " + "; ".join(f"{r.suite}: {r.message}" for r in bad.itertuples()) if len(bad) else "") + ")")
    if len(ft):
        for arm, ref, what in (("C", "A", "upstream engine vs HF backend, base model"),
                               ("D", "B", "served always-route vs plain PyTorch, checkpoint")):
            sel = ft[(ft["arm"] == arm) & (ft["reference"] == ref)]
            if not len(sel):
                continue
            worst = float(pd.to_numeric(sel["max_abs_diff"]).max())
            ok = bool(_true(sel["argmax_equal"]).all() and worst <= tol)
            line = (f"- first-token agreement {arm} vs {ref} ({what}): top-5 log-probabilities within {tol:g} nats "
                    f"and the same first token on {int(_true(sel['agree']).sum())}/{len(sel)} documents, worst "
                    f"{worst:.2g} nats")
            lines.append(line + (f": **{'PASS' if ok else 'FAIL'}**" if arm == "C" else f" ({'agree' if ok else 'DISAGREE'})"))
    else:
        lines.append("- first-token agreement: not measured (`vskipper.quality.first_token_docs: 0`)")
    prim = t5[(t5["task"] == "all") & _true(t5["primary"])]
    if len(prim):
        res = int(_true(prim["did_resolved"]).sum())
        lines.append(f"- Claim (Sec. 4.3): serving adds no resolved quality loss beyond the checkpoint's own (every DiD "
                     f"interval contains 0). Here: resolved DiD on {res}/{len(prim)} suites ("
                     + "; ".join(f"{r.suite} {r.did}, n = {r.n}" for r in prim.itertuples()) + ").")
    cols = ["suite", "task", "metric", "n", "mean_A", "mean_B", "mean_C", "mean_D", "B_minus_A", "D_minus_C", "did",
            "tokens_equal_AB", "tokens_equal_AC", "tokens_equal_BD", "tokens_equal_all", "gate"]
    shown = t5[t5["gate"] == "PASS"]
    lines += ["", _md(shown[cols]) if len(shown) else "(no suite passed the gate)", "",
              "Token identity: documents whose generated token ids are equal between arms (A = B: checkpoint "
              "changes nothing; A = C: the engine reproduces the HF backend; B = D: serving reproduces the "
              "checkpoint).", ""]
    if len(ft):
        lines += [_md(ft.drop(columns=["k", "tol"])), ""]
    return lines


def quality_served_section_lines(tables_dir: str | Path) -> list[str]:
    """Report lines of Table 5 (right) from ``vskipper_table5_served`` in ``tables_dir``; ``[]`` when the
    served-at-knee rule did not run."""
    td = Path(tables_dir)
    if not (td / "vskipper_table5_served.csv").is_file():
        return []
    t = _read(td, "vskipper_table5_served")
    lines = ["### Task quality served at the knee: hybrid vs always-route (Table 5 right shape; App. E.3)", "",
             "The FlexiDepth checkpoint served by the **hybrid** (mode switch with the derived thresholds) and by "
             "**always-route**: each document's request of the 2x2 (same prompt token ids, stop strings and budget) "
             "in one seeded Poisson stream at the load point's rate (the knee, 0.95 x Q* of `knee_workload`), padded "
             "with that workload's frozen prompts (not scored), the same schedule for both arms; each response cut by "
             "the 2x2's stop rule and scored by lm-eval. `diff` = hybrid - always-route in pp, per-document paired, "
             "t-based 95% interval, `*` = resolved; `routed` = share of decode rows served in routed mode, hybrid / "
             "always-route, over the whole stream (from each request's modes as the server reports them); "
             "`prefill_routed_share_hybrid` = share of the stream's requests whose prefill the hybrid routed; "
             "`tokens_equal` = documents with identical generated ids in both arms. One repetition, as in the paper.",
             ""]
    if not len(t):
        return lines + ["- the served-at-knee rule ran but wrote no summary rows", ""]
    bad = t[t["status"] != "ok"]
    prim = t[(t["status"] == "ok") & (t["task"] == "all") & _true(t["primary"])]
    if len(prim):
        res = int(_true(prim["diff_resolved"]).sum())
        lines.append("- Claim (Sec. 4.3): under load at the knee, no resolved difference from always-route. Here: "
                     f"resolved on {res}/{len(prim)} suites ("
                     + "; ".join(f"{r.suite} {r.diff}, n = {int(r.n)}, routed {r.routed}" for r in prim.itertuples())
                     + ").")
    if len(bad):
        lines.append("- not measured: " + "; ".join(f"{r.suite}: {r.status} ({r.message})" for r in bad.itertuples()))
    cols = ["suite", "task", "metric", "n", "point", "rate", "knee_workload", "mean_hybrid", "mean_always_route", "diff",
            "routed", "routed_share_docs_hybrid", "prefill_routed_share_hybrid", "tokens_equal", "n_requests",
            "n_padding"]
    shown = t[t["status"] == "ok"]
    shown = shown.assign(n=pd.to_numeric(shown["n"]).astype(int)) if len(shown) else shown
    lines += ["", _md(shown[cols]) if len(shown) else "(no suite measured)", ""]
    return lines


def report_section(tables_dir: str | Path, figures_dir: str | Path, base: str | Path) -> list[str]:
    """Markdown lines of the vSkipper section of REPORT.md: checks (matched-work gate, knee bracketed),
    the FlexiDepth skipper, the thresholds and their rule, the knee, the Table 2 / 4 / 3 shapes, the
    RandomSkip map (Fig. 3 shape), the routed-row shares, the quality tables and the Table 6 / 7 shapes
    (:func:`impl.vskipper.transfer.transfer_section_lines`), with links to every table and figure."""
    td, fd, base = Path(tables_dir), Path(figures_dir), Path(base)
    rel = lambda p: os.path.relpath(p, base).replace(os.sep, "/")  # noqa: E731
    t = {n: _read(td, n) for n in TABLE_NAMES}
    lines = ["## vSkipper: serving on tiny models (Sec. 4 shapes: Tables 2-7, Table 3 ablation, Fig. 3)", "",
             "Arms run in process on transformers' continuous-batching engine (CPU, one engine thread): **upstream** "
             "is the unmodified engine serving the base model; **vskipper** is the same engine with the trained "
             "FlexiDepth-style skipper bound and the profitability-aware mode switch (rule-derived thresholds). "
             "Percent changes are paired within repetitions (same seeded Poisson schedule, alternating arm order), "
             "mean with a t-based 95% interval, `*` = resolved (interval excludes 0), n printed; one repetition is "
             "never resolved. Latency: negative is better; TPS/RPS: positive is better. These are timings on a "
             "shared CPU: on CPU, decode is bound by reading weights and by the packed attention, so row skipping "
             "pays mostly in prefill (the per-step timing section), and small cells are noisy.", ""]
    gate, ksum = t["vskipper_gate"], t["vskipper_knee_summary"]
    if "status" not in gate:
        gate = pd.DataFrame(columns=["experiment", "workload", "point", "lane", "status"])
    measured = gate[gate.status != "skipped"]
    if len(measured):
        ok = bool((measured.status == "ok").all())
        bad = measured[measured.status != "ok"]
        rejected = ", ".join(f"{r.experiment}/{r.workload}/{r.point}/{r.lane}" for r in bad.itertuples())
        lines.append(f"- every measured lane passed the matched-work gate (per-request output token counts equal "
                     f"across arms and to the recorded lengths) and served every request: "
                     f"**{'PASS' if ok else 'FAIL'}** ({len(measured)} lanes"
                     + (f"; rejected: {rejected}" if len(bad) else "") + ")")
    else:
        lines.append("- no serving lane was measured")
    if len(ksum):
        br = bool(ksum["bracketed"].astype(str).str.lower().eq("true").all())
        lines.append(f"- the knee sweep brackets Q* for every workload: **{'PASS' if br else 'FAIL'}**"
                     + ("" if br else " (a sweep check, not a bug: the cells ran at the load points of the boundary "
                        "rung and are labelled `knee_status` top/bottom; extend `vskipper.knee.rates`)"))
    skipped = gate[gate.status == "skipped"]
    if len(skipped):
        lines.append(f"- cells skipped because the knee was not bracketed (`on_boundary: skip`): {len(skipped)}")
    lines.append("")
    if len(t["vskipper_flexidepth"]):
        lines += ["### FlexiDepth-style skipper (stage-1 training on the frozen base model)", "",
                  "Held-out ShareGPT windows: `eval_skip_ratio` = share of (token, routed layer) pairs taking "
                  "Project-Only; `loss_delta` = LM loss of the skipper minus the dense model (nats/token).", "",
                  _md(t["vskipper_flexidepth"]), ""]
    if len(t["vskipper_thresholds"]):
        th = t["vskipper_thresholds"]
        lines += ["### Mode-switch thresholds (Sec. 3.3), derived on this machine", "", RULE_TEXT, "",
                  _md(th[th.policy != "randomskip"]), ""]
        n_rs = int((th.policy == "randomskip").sum())
        if n_rs:
            lines += [f"Per-policy thresholds of the RandomSkip grid: `vskipper_thresholds.csv` ({n_rs} rows).", ""]
    if len(ksum):
        lines += ["### Knee (upstream, natural generation; App. M)", "", _md(ksum.drop(columns=["message"])), "",
                  *[f"- {r.workload}: {r.message}" for r in ksum.itertuples()], ""]
    if len(t["vskipper_table2"]):
        lines += ["### Serving comparison at matched work and in the natural lane (Table 2 shape)", "",
                  "Served hybrid vs upstream, % change per load point (rates in req/s).", "",
                  _md(t["vskipper_table2"]), ""]
        long = t["vskipper_cells"]
        e2e = long[(long.metric == "e2e_mean_s") & (long.treatment == SERVED) & (long.lane == "matched")]
        if len(e2e):
            res_lower = int(((e2e["mean"] < 0) & e2e["resolved"].astype(str).str.lower().eq("true")).sum())
            lines += [f"- Claim (Sec. 4.2): mean E2E lower at matched work on every row, resolved on most. Here: mean "
                      f"lower on {int((e2e['mean'] < 0).sum())}/{len(e2e)} rows, resolved lower on "
                      f"{res_lower}/{len(e2e)} (n = {int(e2e['n'].max())} repetitions).", ""]
    t4 = t["vskipper_table4"]
    if len(t4):
        t4p = td / "vskipper_table4.csv"
        lines += ["### Throughput under saturation (Table 4)", "",
                  "Saturation = per workload the largest load point above Q* (the paper's overload, 1.25 x Q*). "
                  "Output tokens/s (TPS) and completed requests/s (RPS) inside the injection window, each arm's mean "
                  "over repetitions; % change of the served hybrid against upstream, paired per repetition, mean "
                  "with t-based 95% interval (`*` = resolved; positive is better). The matched lane is the main "
                  f"comparison. Table: [vskipper_table4]({rel(t4p)}).", "",
                  _md(t4[["workload", "saturation", "rate", "lane", "n", "upstream TPS", "vskipper TPS", "TPS (window)",
                          "upstream RPS", "vskipper RPS", "RPS (window)"]]), ""]
        m = t4[t4.lane == "matched"]
        if len(m):
            lines += ["- Claim (Sec. 4.2, Table 4): under saturation vSkipper raises RPS (+11.3% GSM8K, +7.4% BBH). "
                      "Here (matched lane): "
                      + "; ".join(f"{r['workload']} RPS {r['RPS (window)']}, TPS {r['TPS (window)']} (n = {r['n']})"
                                  for _, r in m.iterrows()) + ".", ""]
    elif len(t["vskipper_cells"]):
        lines += ["### Throughput under saturation (Table 4)", "",
                  "No load point above Q* is configured (`vskipper.load_points`), so saturated throughput is not "
                  "measured.", ""]
    if len(t["vskipper_ablation"]):
        lines += ["### Mechanism ablation at the knee (Table 3 shape)", "",
                  "Each arm against upstream in the same repetitions; routed shares are the fraction of decode / "
                  "prefill rows the arm served in routed mode.", "", _md(t["vskipper_ablation"]), ""]
    rs = t["vskipper_randomskip"]
    if len(rs):
        lines += ["### RandomSkip map (Fig. 3 shape)", "",
                  "RandomSkip routes a fraction r of rows around k = d x n_routed (rounded half up) of the routed "
                  "layers (skip share s = r k / n_routed), under (a) always-route, (b) FlexiDepth's thresholds for "
                  "every policy and (c) thresholds derived by the rule for each policy; mean E2E % change against "
                  "upstream at the same load point.", ""]
        p = fd / "vskipper_fig3.png"
        if p.is_file():
            lines += [f"![RandomSkip map]({rel(p)})", ""]
        lines += [_md(rs.drop(columns=["text"])), ""]
        ar, pp = rs[rs.setting == "always-route"], rs[rs.setting == "per-policy"]
        if len(ar) and len(pp):
            lines += [f"- Claim (Sec. 4.4): without the switch unprofitable policies cost latency; per-policy "
                      f"thresholds keep them dense. Here: worst always-route change {ar['mean'].max():+.1f}%, worst "
                      f"per-policy change {pp['mean'].max():+.1f}%; best always-route {ar['mean'].min():+.1f}%, best "
                      f"per-policy {pp['mean'].min():+.1f}% (n = {int(rs['n'].max())} repetition(s); resolved: "
                      f"{int(rs['resolved'].astype(str).str.lower().eq('true').sum())}/{len(rs)} arm-policies).", ""]
    if len(t["vskipper_modes"]):
        lines += ["### Routed-row shares (mode switch decisions, mean over repetitions)", "",
                  _md(t["vskipper_modes"]), ""]
    p = fd / "vskipper_knee.png"
    if p.is_file():
        lines += [f"![Knee sweep]({rel(p)})", ""]
    lines += quality_section_lines(td)
    lines += quality_served_section_lines(td)
    lines += transfer_section_lines(td, base)
    lines += ["Tables: " + ", ".join(f"[{p.stem}]({rel(p)})" for p in sorted(td.glob("vskipper_*.csv"))), ""]
    return lines
