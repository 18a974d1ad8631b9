"""vSkipper Table 6 (cross-model) and Table 7 (hardware transfer) shapes (vSkipper Sec. 4.4) from the raw
outputs of the serving rules: knee JSONs, serve-cell JSONL rows, profile-mode (thresholds) JSONs,
FlexiDepth training summaries and quality-cell JSONL rows.

Each row of either table is one *target*: the main run (``vskipper.model`` on the config's device and
threads) or an extra one (``vskipper.cross_model.models`` / ``vskipper.devices``, see
:func:`impl.vskipper.schema.target_config`), each with its own knee, its own rule-derived thresholds and a
matched-work cell at ``cross_model.point`` on ``cross_model.workload``.

The latency comparison is recomputed from the cell rows (``kind: "cell"``, ``phase: "measure"``, matched
lane): per repetition, upstream's and the served hybrid's mean E2E over the cell's requests; the paired
percentage change ``100 (vskipper - upstream) / upstream`` per repetition, its mean and t-based 95 %
interval (:func:`impl.stats.percent_change`, the same statistic as Table 2's summary rows); *resolved* =
the interval excludes 0; one repetition is never resolved.

- ``vskipper_table6``: per model, Q* of its knee, the matched-work mean E2E change, served accuracy
  (arms C = base model served by upstream and D = skipper served always-route of the quality 2x2 on the
  workload, one repetition, primary metric in percentage points) and *Skip* = the always-route
  Project-Only decode share (profile-mode's share, measured under always-route on the first load
  workload's prompts).
- ``vskipper_table7``: per device (the main run first), its own knee and thresholds and the matched-work
  mean E2E change against upstream on the same device.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Iterable, Mapping

import pandas as pd

from impl.provenance import read_jsonl
from impl.serving.fmt import fmt_change
from impl.stats import percent_change

__all__ = ["TRANSFER_TABLE_NAMES", "TABLE6_COLS", "TABLE7_COLS", "paired_e2e", "table6", "table7",
           "transfer_tables", "transfer_section_lines"]

TRANSFER_TABLE_NAMES = ("vskipper_table6", "vskipper_table7")
SERVED, UPSTREAM = "vskipper", "upstream"
_CHANGE_COLS = ["workload", "point", "factor", "q_star", "q_star_used", "knee_status", "rate", "lane", "n",
                "upstream_e2e_s", "vskipper_e2e_s", "E2E mean", "e2e_pct_mean", "e2e_ci_low", "e2e_ci_high",
                "e2e_resolved", "status", "message"]
TABLE6_COLS = ["model", "role", "workload", "point", "q_star_used", "knee_status", "rate", "n", "E2E mean",
               "e2e_pct_mean", "e2e_ci_low", "e2e_ci_high", "e2e_resolved", "acc_metric", "acc_n",
               "acc_base_served", "acc_skipper_served", "served accuracy", "skip_decode", "skip_prefill",
               "eval_skip_ratio", "upstream_e2e_s", "vskipper_e2e_s", "q_star", "factor", "lane", "status", "message"]
TABLE7_COLS = ["device_name", "role", "device", "threads", "workload", "point", "q_star_used", "knee_status", "rate",
               "n", "E2E mean", "e2e_pct_mean", "e2e_ci_low", "e2e_ci_high", "e2e_resolved", "decode_threshold_N",
               "prefill_threshold_N", "skip_decode", "upstream_e2e_s", "vskipper_e2e_s", "q_star", "factor", "lane",
               "status", "message"]


def _read_json(path) -> dict:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"no such JSON file: {p}")
    return json.loads(p.read_text(encoding="utf-8"))


def _read_rows(path) -> list[dict]:
    if not Path(path).is_file():
        raise FileNotFoundError(f"no such JSONL file: {path}")
    return read_jsonl(path)


def paired_e2e(rows: Iterable[Mapping], lane: str = "matched", metric: str = "e2e_mean_s") -> dict:
    """The served hybrid's paired % change of ``metric`` against upstream in one lane of one serve-cell file.

    Args:
        rows: the cell file's rows (:func:`impl.vskipper.serving_commands.cmd_serve_cell`): ``kind: "cell"`` rows with
            ``phase: "measure"``, ``repetition``, ``arm`` (``upstream`` / ``vskipper``) and ``metric`` [s];
            ``kind: "rejected"`` / ``"skipped"`` rows mark a lane rejected by the matched-work gate / a cell
            skipped because the knee was not bracketed.
        lane: ``matched`` (the paper's comparison) or ``natural``.
        metric: a per-run cell metric (default mean E2E latency, seconds).

    Returns:
        ``{"status": "ok" | "rejected" | "skipped" | "missing", "message", "lane", "n" (repetitions with both
        arms), "upstream_e2e_s", "vskipper_e2e_s" (the arms' means over those repetitions), "e2e_pct_mean",
        "e2e_ci_low", "e2e_ci_high", "e2e_resolved", "E2E mean" (text, ``*`` = resolved), and the cell's
        "workload", "point", "factor", "rate" [req/s], "knee_status", "q_star", "q_star_used"}``; the
        statistics are NaN (and ``E2E mean`` "-") unless the status is ``ok``.

    Source: vSkipper Sec. 4.1 (paired statistics), Tables 6 and 7.
    """

    rows = list(rows)
    nan = math.nan
    out: dict = {"status": "missing", "message": "", "lane": lane, "n": 0, "upstream_e2e_s": nan,
                 "vskipper_e2e_s": nan, "e2e_pct_mean": nan, "e2e_ci_low": nan, "e2e_ci_high": nan,
                 "e2e_resolved": False, "E2E mean": "-"}
    first = next((r for r in rows if r.get("kind") in ("cell", "rejected", "skipped")), {})
    for k in ("workload", "point", "factor", "rate", "knee_status", "q_star", "q_star_used"):
        out[k] = first.get(k, first.get("cell") if k == "point" else None)
    skipped = [r for r in rows if r.get("kind") == "skipped"]
    rejected = [r for r in rows if r.get("kind") == "rejected" and r.get("lane") == lane]
    if skipped:
        return {**out, "status": "skipped", "message": str(skipped[0].get("reason") or "")[:300]}
    if rejected:
        r = rejected[0]
        return {**out, "status": "rejected", "message": str(r.get("error") or r.get("reason") or "")[:300]}
    cells = pd.DataFrame([r for r in rows if r.get("kind") == "cell" and r.get("lane") == lane
                          and r.get("phase", "measure") == "measure" and r.get("arm") in (UPSTREAM, SERVED)])
    if not len(cells):
        return {**out, "message": f"no measured {lane}-lane cell rows"}
    wide = cells.pivot_table(index="repetition", columns="arm", values=metric, aggfunc="first").dropna()
    if UPSTREAM not in wide or SERVED not in wide or not len(wide):
        return {**out, "message": f"no repetition with both {UPSTREAM} and {SERVED} rows"}
    res = percent_change(wide[UPSTREAM].to_numpy(), wide[SERVED].to_numpy())
    return {**out, "status": "ok", "n": res.n, "upstream_e2e_s": float(wide[UPSTREAM].mean()),
            "vskipper_e2e_s": float(wide[SERVED].mean()), "e2e_pct_mean": res.mean, "e2e_ci_low": res.ci_low,
            "e2e_ci_high": res.ci_high, "e2e_resolved": bool(res.resolved),
            "E2E mean": fmt_change(res.mean, res.ci_low, res.ci_high, res.n, res.resolved)}


def _knee_fields(path) -> dict:
    k = _read_json(path)
    return {"workload": k.get("workload"), "q_star": k.get("q_star"), "q_star_used": k.get("q_star_used"),
            "knee_status": k.get("status")}


def _served_accuracy(rows: list[dict], suite: str) -> dict:
    """Arms C (base served by upstream) and D (skipper served always-route) of the quality 2x2 on ``suite``:
    the suite-level primary metric's means in percentage points and n documents (one repetition)."""
    out = {"acc_metric": None, "acc_n": None, "acc_base_served": math.nan, "acc_skipper_served": math.nan,
           "served accuracy": "-"}
    for r in rows:
        if r.get("kind") == "rejected":
            return {**out, "served accuracy": "gate FAIL"}
        if (r.get("kind") == "summary" and r.get("suite") == suite and r.get("task") in (None, "all")
                and r.get("primary")):
            c, d = float(r["mean_C"]), float(r["mean_D"])
            return {"acc_metric": r["metric"], "acc_n": int(r["n"]), "acc_base_served": c, "acc_skipper_served": d,
                    "served accuracy": f"{c:.1f} / {d:.1f}"}
    return out


def _frame(recs: list[dict], cols: list[str]) -> pd.DataFrame:
    df = pd.DataFrame(recs)
    for c in cols:
        if c not in df:
            df[c] = pd.Series(dtype=object)
    return df[cols] if len(df) else pd.DataFrame(columns=cols)


def _target_change(t: Mapping) -> dict:
    """Knee fields and the matched-lane change of target ``t`` (``knee`` / ``cell`` paths)."""
    ch = paired_e2e(_read_rows(t["cell"]))
    for k, v in _knee_fields(t["knee"]).items():  # the knee JSON is the source of Q* and its status
        if v is not None or ch.get(k) is None:
            ch[k] = v
    return ch


def table6(targets: Iterable[Mapping]) -> pd.DataFrame:
    """Table 6 shape (vSkipper Sec. 4.4): cross-model comparison at each model's knee.

    Args:
        targets: one mapping per model (main first): ``name`` (model), ``role`` (``main`` / ``extra``),
            ``knee`` (knee JSON), ``cell`` (serve-cell JSONL at the comparison point), ``thresholds``
            (profile-mode JSON: the always-route shares), optional ``flexidepth`` (training summary: held-out
            skip ratio) and ``quality`` (quality-cell JSONL of the workload: served accuracy).

    Returns:
        one row per model with :data:`TABLE6_COLS`: Q* used, the matched-work mean E2E % change (text and
        numbers, n repetitions, resolved), served accuracy ``C / D`` (pp; ``-`` without a quality file),
        ``skip_decode`` / ``skip_prefill`` (always-route Project-Only share per phase) and the lane's status.

    Raises:
        FileNotFoundError: naming a missing input file.
    """
    recs = []
    for t in targets:
        rec = {"model": t["name"], "role": t.get("role", "extra"), **_target_change(t)}
        share = _read_json(t["thresholds"]).get("share") or {}
        rec.update(skip_decode=share.get("decode", math.nan), skip_prefill=share.get("prefill", math.nan))
        rec["eval_skip_ratio"] = _read_json(t["flexidepth"]).get("eval_skip_ratio") if t.get("flexidepth") else math.nan
        acc = _served_accuracy(_read_rows(t["quality"]), rec["workload"]) if t.get("quality") else \
            _served_accuracy([], rec["workload"])
        recs.append({**rec, **acc})
    return _frame(recs, TABLE6_COLS)


def table7(targets: Iterable[Mapping]) -> pd.DataFrame:
    """Table 7 shape (vSkipper Sec. 4.4): hardware transfer, each device with its own knee and its own
    rule-derived thresholds, mean % change of E2E against upstream on the same device (matched lane).

    Args:
        targets: one mapping per device (main first): ``name``, ``role``, ``knee``, ``cell``, ``thresholds``
            (profile-mode JSON on that device: its ``device`` / ``threads`` and thresholds N).

    Returns:
        one row per device with :data:`TABLE7_COLS` (``decode_threshold_N`` / ``prefill_threshold_N``: the
        rule's size thresholds on that device, NaN = that phase stays dense).

    Raises:
        FileNotFoundError: naming a missing input file.
    """
    recs = []
    for t in targets:
        thr = _read_json(t["thresholds"])
        th, prof = thr.get("thresholds") or {}, thr.get("profile") or {}
        n_dec, n_pre = th.get("enter_threshold"), th.get("min_prefill_tokens")
        recs.append({"device_name": t["name"], "role": t.get("role", "extra"),
                     "device": prof.get("device", thr.get("device")),
                     "threads": prof.get("threads"), **_target_change(t),
                     "decode_threshold_N": math.nan if n_dec is None else n_dec,
                     "prefill_threshold_N": math.nan if n_pre is None else n_pre,
                     "skip_decode": (thr.get("share") or {}).get("decode", math.nan)})
    return _frame(recs, TABLE7_COLS)


def transfer_tables(models: Iterable[Mapping] = (), devices: Iterable[Mapping] = ()) -> dict[str, pd.DataFrame]:
    """``{"vskipper_table6": ..., "vskipper_table7": ...}``, each only when its targets are given."""
    models, devices = list(models), list(devices)
    out = {}
    if models:
        out["vskipper_table6"] = table6(models)
    if devices:
        out["vskipper_table7"] = table7(devices)
    return out


# ------------------------------------------------------------------------------------------- report
def _read(td: Path, name: str) -> pd.DataFrame | None:
    p = td / f"{name}.csv"
    if not p.is_file():
        return None
    return pd.read_csv(p) if p.stat().st_size > 1 else pd.DataFrame()


def _true(col: pd.Series) -> pd.Series:
    return col.astype(str).str.lower().eq("true")


def _md(df: pd.DataFrame) -> str:
    return df.to_markdown(index=False, floatfmt=".3g")


def _knee_check(df: pd.DataFrame, name_col: str, what: str) -> str:
    """The check line saying whether every row's own knee sweep bracketed Q* (``knee_status == "ok"``);
    an unbracketed row ran at the load point of a boundary rung, so its change is not at its knee."""
    st = df["knee_status"].astype(str) if "knee_status" in df.columns else pd.Series([], dtype=str)
    bad = [f"{r[name_col]}: {r['knee_status']}" for _, r in df[st != "ok"].iterrows()] if len(st) else []
    return (f"- {what}: every row's own knee sweep brackets Q*: **{'PASS' if not bad else 'FAIL'}**"
            + (f" (unbracketed: {', '.join(bad)}; the row ran at a boundary rung, not at its knee: extend "
               "`vskipper.knee.rates`)" if bad else ""))


def transfer_section_lines(tables_dir: str | Path, base: str | Path) -> list[str]:
    """REPORT.md lines of Table 6 and Table 7 (``[]`` when neither table exists in ``tables_dir``); links are
    relative to ``base`` (the report's folder)."""
    td = Path(tables_dir)
    rel = lambda p: os.path.relpath(p, base).replace(os.sep, "/")  # noqa: E731
    lines: list[str] = []
    t6, t7 = _read(td, "vskipper_table6"), _read(td, "vskipper_table7")
    if t6 is not None:
        lines += ["### Cross-model comparison at each model's knee (Table 6 shape; Sec. 4.4)", "",
                  "Each model has its own FlexiDepth-style skipper, its own rule-derived thresholds and its own knee "
                  "(upstream, natural generation); `E2E mean` = the served hybrid's matched-work mean E2E % change "
                  "against upstream at the load point, paired per repetition (t-based 95% interval, `*` = resolved, n "
                  "repetitions), recomputed from the cell rows. `served accuracy` = base model served by upstream / "
                  "skipper served always-route (arms C / D of the quality 2x2 on the workload, primary metric in pp, "
                  "one repetition). `skip_decode` = the always-route Project-Only decode share (profile-mode). "
                  f"Table: [vskipper_table6]({rel(td / 'vskipper_table6.csv')}).", ""]
        if len(t6):
            cols = ["model", "role", "workload", "point", "q_star_used", "knee_status", "rate", "n", "E2E mean",
                    "served accuracy", "acc_metric", "acc_n", "skip_decode", "skip_prefill", "status"]
            lines += [_md(t6[cols]), ""]
            ok = t6[t6["status"] == "ok"]
            lines.append("- Claim (Sec. 4.4, Table 6): the gain follows the skip share (Qwen3-4B, skip 0.119: no "
                         "resolved change, +2.7 +/- 2.8%; Qwen3-8B, skip 0.416: -6.6 +/- 0.3%). Here: "
                         + "; ".join(f"{r['model']} skip {float(r['skip_decode']):.3f}: {r['E2E mean']} (n = {r['n']})"
                                     for _, r in t6.iterrows())
                         + f" (resolved on {int(_true(ok['e2e_resolved']).sum())}/{len(t6)} models).")
            bad = t6[t6["status"] != "ok"]
            if len(bad):
                lines.append("- not measured: " + "; ".join(f"{r.model}: {r.status} ({r.message})"
                                                            for r in bad.itertuples()))
            lines.append(_knee_check(ok, "model", "Table 6"))
            lines.append("")
    if t7 is not None:
        cpu_only = len(t7) and t7["device"].astype(str).eq("cpu").all()
        lines += ["### Hardware transfer (Table 7 shape; Sec. 4.4)", "",
                  "The matched-work comparison of `vskipper.model` on each device, each with its own knee and its own "
                  "rule-derived thresholds (profiled on that device), as the served hybrid's mean E2E % change against "
                  "upstream on the same device (paired per repetition, t-based 95% interval, `*` = resolved). "
                  + ("**All rows are CPU configurations of this one machine that differ in torch intra-op threads, "
                     "not different accelerators**: they test that thresholds and knee are re-derived per setting, "
                     "not the paper's H100 / RTX A6000 transfer. " if cpu_only else "")
                  + f"Table: [vskipper_table7]({rel(td / 'vskipper_table7.csv')}).", ""]
        if len(t7):
            cols = ["device_name", "role", "device", "threads", "workload", "point", "q_star_used", "knee_status",
                    "rate", "n", "E2E mean", "decode_threshold_N", "prefill_threshold_N", "status"]
            lines += [_md(t7[cols]), ""]
            lines.append("- Claim (Sec. 4.4, Table 7): the gain transfers (H100 -39.4 +/- 0.2%, RTX A6000 -30.0 +/- "
                         "4.2%, n = 3). Here: " + "; ".join(
                             f"{r['device_name']} ({r['device']}, {r['threads']} thread(s), Q* "
                             f"{float(r['q_star_used']):.3g} req/s): {r['E2E mean']} (n = {r['n']})"
                             for _, r in t7.iterrows()) + ".")
            lines.append(_knee_check(t7[t7["status"] == "ok"], "device_name", "Table 7"))
            lines.append("")
    return lines
