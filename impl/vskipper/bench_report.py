"""Tables and REPORT.md section of the vSkipper step benchmark (:mod:`impl.vskipper.bench`).

:func:`bench_tables` turns the summaries written by ``python -m impl vskipper-bench`` into
``vskipper_bench.{csv,md}`` (per model, cell and arm: median step time, measured routed / upstream
ratio, FLOP-predicted ratio, gap, realised Project-Only share), ``vskipper_bench_targets.{csv,md}``
(the issue's targets per model, PASS / FAIL / NA), ``vskipper_bench_profile.{csv,md}`` (where
decode time goes) and ``vskipper_bench_prefill_profile.{csv,md}`` (torch-profiler split of the prefill
step for upstream, the cohort all-RUN path and the RandomSkip arm with the largest prefill gap).
:func:`report_section` renders them for REPORT.md.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable

import pandas as pd

__all__ = ["bench_tables", "report_section", "TABLES"]

TABLES = ("vskipper_bench", "vskipper_bench_targets", "vskipper_bench_profile", "vskipper_bench_prefill_profile")

# routed sections that exist only because rows are routed (the rest is the layer's own work on fewer rows)
ROUTING_SECTIONS = ("route", "gather", "scatter")


def _write(df: pd.DataFrame, out: Path, name: str) -> None:
    df.to_csv(out / f"{name}.csv", index=False)
    (out / f"{name}.md").write_text((df.to_markdown(index=False, floatfmt=".3f") if len(df) else "(no rows)") + "\n",
                                    encoding="utf-8")


def bench_tables(summaries: Iterable[str | os.PathLike], out_dir: str | os.PathLike) -> dict[str, pd.DataFrame]:
    """Write the four tables (:data:`TABLES`) from ``vskipper-bench`` summary JSON files; returns them by name."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ratios, targets, prof, pprof = [], [], [], []
    for f in summaries:
        s = json.loads(Path(f).read_text(encoding="utf-8"))
        lab = s["label"]
        for r in s["ratios"]:
            ci = r.get("ratio_ci95") or [None, None]
            ratios.append({"model": lab, **{k: r.get(k) for k in ("cell", "arm", "skip_share", "t_step_s",
                                                                  "measured_ratio")},
                           "ratio_ci_lo": ci[0], "ratio_ci_hi": ci[1],
                           **{k: r.get(k) for k in ("flop_pred_ratio", "abs_gap", "hybrid_routed")}})
        t = s["targets"]
        targets.append({"model": lab, "threads": s.get("threads"), "allocator": s.get("allocator"),
                        "repeats": s.get("settings", {}).get("repeats"),
                        **{f"{k}{x}": t.get(f"{k}{x}") for k in ("all_run", "prefill_flop", "hybrid_dense")
                           for x in ("", "_worst", "_ci", "_n")}, "aa_control_worst": t.get("aa_control_worst"),
                        "all_run_bookkeeping_worst": t.get("all_run_bookkeeping_worst")})
        for p in s.get("decode_profile", []):
            prof.append({"model": lab, "cell": p["cell"], "arm": p["arm"], "total_ms": 1e3 * p["total_s"],
                         **{f"{k}_%": 100 * v for k, v in p["shares"].items()}})
        for p in s.get("prefill_profile", []):
            wall = 1e3 * p["wall_s"]
            routing = sum(p["sections_ms"].get(k, 0.0) for k in ROUTING_SECTIONS)
            pprof.append({"model": lab, "cell": p["cell"], "arm": p["arm"], "wall_ms": wall,
                          "profiled_ratio": p["measured_ratio"], "flop_pred_ratio": p["flop_pred_ratio"],
                          "bench_gap": p.get("bench_gap"), "routing_ms": routing if p["sections_ms"] else None,
                          "routing_%": 100 * routing / wall if p["sections_ms"] else None,
                          **{f"{k}_ms": v for k, v in p["ops_ms"].items()},
                          **{f"sec_{k}_ms": v for k, v in p["sections_ms"].items()}})
    dfs = {"vskipper_bench": pd.DataFrame(ratios), "vskipper_bench_targets": pd.DataFrame(targets),
           "vskipper_bench_profile": pd.DataFrame(prof), "vskipper_bench_prefill_profile": pd.DataFrame(pprof)}
    for name, df in dfs.items():
        _write(df, out, name)
    return dfs


def report_section(tables_dir, figures_dir, base) -> list[str]:
    """Markdown lines of the step-benchmark section of REPORT.md."""
    td, base = Path(tables_dir), Path(base)
    rel = lambda p: os.path.relpath(p, base).replace(os.sep, "/")  # noqa: E731

    def read(n):
        f = td / f"{n}.csv"
        # keep "NA" (a target with nothing to check) as text, not NaN
        kw = {"keep_default_na": False, "na_values": [""]} if n == "vskipper_bench_targets" else {}
        return pd.read_csv(f, **kw) if f.is_file() and f.stat().st_size > 1 else pd.DataFrame()

    md = lambda d: d.to_markdown(index=False, floatfmt=".3f")  # noqa: E731
    ratios, targets, prof, pprof = (read(n) for n in TABLES)
    lines = ["## vSkipper: per-step timings vs FLOP accounting (timings only)", "",
             "Engine-shaped packed steps on this CPU (shared cores, so compare ratios). measured = median over "
             "rounds of t_arm / mean(t_upstream before, t_upstream after): every arm is timed between two "
             "upstream steps, so the machine's drift cancels (ratio_ci_lo / _hi in the table: t interval of "
             "the mean paired ratio); flop = F_routed / F_full (impl/vskipper/bench.py: skipped "
             "rows save q/o projections, attention over the packed K columns and the MLP; K/V projections and the "
             "LM head stay). The wide model is randomly initialised: its outputs mean nothing.", ""]
    if len(targets):
        for _, t in targets.iterrows():
            def w(k):
                v = t.get(f"{k}_worst")
                return "-" if v is None or pd.isna(v) else f"{v:+.3f}" if k != "prefill_flop" else f"{v:.3f}"
            def ci(k):
                v = t.get(f"{k}_ci")
                return "" if v is None or (isinstance(v, float) and pd.isna(v)) else f", intervals: {v}"
            lines.append(f"- **{t['model']}**: all-RUN <= 2% over upstream: **{t['all_run']}** (worst {w('all_run')}"
                         f"{ci('all_run')}); prefill RandomSkip |measured - FLOP| <= 0.05: **{t['prefill_flop']}** "
                         f"(worst {w('prefill_flop')}{ci('prefill_flop')}); hybrid within 2% where the switch keeps "
                         f"it dense: **{t['hybrid_dense']}** (worst {w('hybrid_dense')}{ci('hybrid_dense')}); "
                         f"A/A control (upstream timed as an arm): worst {w('aa_control')}; all-RUN routing "
                         f"bookkeeping (wrapper minus layer time, forward hooks): at most "
                         f"{w('all_run_bookkeeping')} of a step")
        lines += ["", "Verdicts from the medians; \"intervals\" says what the rows' 95% intervals resolve: "
                  "*within* (every interval inside the tolerance), *outside* (one wholly outside), *unresolved* "
                  "(the noise of this shared VM is wider than the tolerance at these repeats).", ""]
    if len(ratios):
        keep = ratios[~ratios.arm.isin(["upstream"])]
        piv = keep.pivot_table(index=["model", "arm"], columns="cell", values=["measured_ratio", "flop_pred_ratio"],
                               sort=False)
        piv.columns = [f"{c} {'meas' if v == 'measured_ratio' else 'flop'}" for v, c in piv.columns]
        piv = piv[sorted(piv.columns, key=lambda c: (c.split()[0], c.split()[1] != "meas"))]
        lines += ["### Routed / upstream step-time ratio, measured vs FLOP prediction", "",
                  md(piv.reset_index()), ""]
    if len(pprof):
        lines += ["### Where routed prefill time goes (torch profiler, ms per step)", "",
                  "Upstream, the cohort path with every row RUN (what gathering, masking and scattering cost "
                  "with nothing skipped) and the RandomSkip arm farthest from its FLOP prediction in the "
                  "benchmark (`bench_gap`), profiled in the same run. Operator columns are self CPU time by "
                  "category; `sec_*` are the routed layers' labelled sections; `routing_ms` = route + gather + "
                  "scatter, the work that exists only because rows are routed (the rest is the layers' own "
                  "work on fewer rows). The profiler adds overhead, so `profiled_ratio` is not the benchmark's "
                  "ratio.", "", md(pprof), ""]
    if len(prof):
        lines += ["### Where decode time goes (% of a step; forward-hook timers)", "", md(prof), ""]
    lines += ["Tables: " + ", ".join(f"[{p.stem}]({rel(p)})" for p in sorted(td.glob("vskipper_bench*.csv"))), ""]
    return lines
