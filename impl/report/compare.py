"""Compare two runs' tables: what a refactor must leave unchanged (harness issue 13: "every table
regenerates the same").

Two directories of tables (``results/tables`` of two runs of the same config, e.g. the smoke run before
and after a change) are compared file by file (every ``*.csv`` under either, by relative path). Columns
are split in two kinds:

* **timing columns** — wall-clock measurements and what is derived from them (seconds, ms, tokens per
  second, wall and projected speedups, their intervals and verdicts, latencies): they change from run to
  run and are reported, not compared;
* **every other column** — token counts, AR verdicts, rounds identity, depth accounting (``depth_speedup``
  and critical layers are counts), EAD, losses of seeded training, parameters: compared exactly (floats
  to ``rtol``, default 1e-9; NaN equals NaN).

Names alone do not say everything: some tables hold time-derived values under plain names (TEV's
``SR``, DEX's overhead shares, vSkipper's E2E effects and break-even thresholds, the step benchmark's
measured ratios). :data:`TABLE_TIMING` names them per table, and :data:`TIMED_ROWS` marks rows whose
values are chosen or measured by the clock (the DEX arm picked as fastest, a cell whose ``metric`` is a
latency); both are reported, not compared.

A file present on one side only, a different row count or column set, or a differing compared value
makes the comparison fail (the command exits 1), naming the file, the column and the first differing row.
Other values chosen *from* timings (a tuned baseline's parameters, a vSkipper knee) can still differ
between two runs of the same code on a loaded machine: read the named column before calling it a
regression.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from fnmatch import fnmatch
from pathlib import Path

import numpy as np
import pandas as pd

__all__ = ["TIMING", "TABLE_TIMING", "TIMED_ROWS", "is_timing", "FileDiff", "compare_tables", "compare_dirs"]

#: column names that hold wall-clock measurements or values derived from them (regular expression)
TIMING = re.compile(r"(seconds|_s$|_s_|_ms|ms_|^ms$|per_s|throughput|latency|wall|projected|"
                    r"speedup_mean|ci_low|ci_high|above_ar|p_value|t_stat|^speedup|_speedup_vs|time|ratio_measured|_window$)")
#: timing-looking names that are counts (layer accounting, DEX Prop. 7)
NOT_TIMING = {"depth_speedup", "critical_layers", "layer_work"}


#: per table (glob on the path relative to the tables directory): column globs measured from timings
TABLE_TIMING: dict[str, tuple[str, ...]] = {
    "tev/*.csv": ("SR",),  # TEV's wall-clock speedup ratio
    "tev/tev_latency.csv": ("*_us", "*ratio*"),
    "dex/dex_overhead.csv": ("*_share",),  # shares of the measured round time
    "dex/dex_walltime_model.csv": ("delta_*",),  # fitted from measured round times
    "vskipper/*.csv": ("E2E *", "TTFT *", "TPOT *", "makespan", "e2e_*", "ttft_*", "tpot_*", "*threshold_N",
                       "profitable", "break_even_share", "tps_window"),
    "vskipper/vskipper_randomskip.csv": ("mean", "ci_low", "ci_high", "resolved", "text"),  # E2E % effects
    "vskipper_bench/*.csv": ("measured_ratio", "ratio_ci_*", "abs_gap", "*_%", "*_worst", "*_ms", "t_step_s",
                             "profiled_ratio", "bench_gap", "*_ci", "repeats"),
}
#: (table glob, key column, predicate on its value, column globs): in the rows whose key matches, those
#: columns were chosen or measured by the clock
TIMED_ROWS: tuple[tuple[str, str, object, tuple[str, ...]], ...] = (
    ("dex/dex_fig5.csv", "kind", lambda v: "by wall" in str(v), ("*",)),  # the DEX arm picked as fastest
    ("vskipper/*.csv", "metric", lambda v: is_timing(str(v)),
     ("mean", "ci_low", "ci_high", "resolved", "improved", "text", "baseline_mean", "treatment_mean")),
    # the RandomSkip arm profiled is the one with the largest measured prefill gap
    ("vskipper_bench/vskipper_bench_prefill_profile.csv", "arm", lambda v: str(v).startswith("random"), ("*",)),
)


def is_timing(column: str, table: str = "") -> bool:
    """Whether ``column`` (of ``table``, a path relative to the tables directory) holds a wall-clock
    measurement or a value derived from one (module docstring)."""
    if any(fnmatch(table, t) and any(fnmatch(column, c) for c in cols) for t, cols in TABLE_TIMING.items()):
        return True
    return column not in NOT_TIMING and bool(TIMING.search(column))


def _timed_rows(df: pd.DataFrame, table: str, column: str) -> np.ndarray:
    """Per row: whether ``column``'s value in that row was chosen or measured by the clock (TIMED_ROWS)."""
    timed = np.zeros(len(df), dtype=bool)
    for t, key, pred, cols in TIMED_ROWS:
        if fnmatch(table, t) and key in df and any(fnmatch(column, c) for c in cols):
            timed |= np.array([bool(pred(v)) for v in df[key]], dtype=bool)
    return timed


@dataclass
class FileDiff:
    """The comparison of one table.

    Attributes:
        path: the table's path relative to both directories.
        problems: what differs (empty: the compared columns are equal).
        timing_columns: columns reported, not compared.
        compared_columns: columns compared.
    """

    path: str
    problems: list[str] = field(default_factory=list)
    timing_columns: list[str] = field(default_factory=list)
    compared_columns: list[str] = field(default_factory=list)


def _equal(a: pd.Series, b: pd.Series, rtol: float) -> np.ndarray:
    """Per-row equality of two columns: numbers to ``rtol`` (NaN == NaN), anything else as text."""
    na, nb = pd.to_numeric(a, errors="coerce"), pd.to_numeric(b, errors="coerce")
    numeric = na.notna() | a.isna()
    both = numeric.to_numpy() & (nb.notna() | b.isna()).to_numpy()
    eq = np.where(both, np.isclose(na.to_numpy(dtype=float), nb.to_numpy(dtype=float), rtol=rtol, atol=0.0,
                                   equal_nan=True), False)
    text = a.astype(str).to_numpy() == b.astype(str).to_numpy()
    return np.where(both, eq, text)


def compare_tables(a: pd.DataFrame, b: pd.DataFrame, path: str = "", rtol: float = 1e-9) -> FileDiff:
    """Compare two versions of one table (rows in order; module docstring for the column kinds).

    Returns:
        :class:`FileDiff`; ``problems`` names the first differing row of each differing column.
    """
    d = FileDiff(path)
    if list(a.columns) != list(b.columns):
        only_a, only_b = sorted(set(a.columns) - set(b.columns)), sorted(set(b.columns) - set(a.columns))
        d.problems.append(f"columns differ: only in A {only_a}, only in B {only_b}" if only_a or only_b
                          else "same columns in another order")
    if len(a) != len(b):
        d.problems.append(f"{len(a)} rows in A, {len(b)} in B")
        return d
    for c in [c for c in a.columns if c in b.columns]:
        if is_timing(c, path):
            d.timing_columns.append(c)
            continue
        d.compared_columns.append(c)
        eq = _equal(a[c].reset_index(drop=True), b[c].reset_index(drop=True), rtol)
        eq |= _timed_rows(a.reset_index(drop=True), path, c) | _timed_rows(b.reset_index(drop=True), path, c)
        if not eq.all():
            i = int(np.argmin(eq))
            d.problems.append(f"column {c!r} differs in {int((~eq).sum())} rows; first at row {i}: "
                              f"{a[c].tolist()[i]!r} vs {b[c].tolist()[i]!r}")
    return d


def compare_dirs(a: str | Path, b: str | Path, rtol: float = 1e-9) -> list[FileDiff]:
    """Compare every ``*.csv`` under two table directories (by relative path).

    Raises:
        FileNotFoundError: either directory does not exist (naming it).
    """
    a, b = Path(a), Path(b)
    for p in (a, b):
        if not p.is_dir():
            raise FileNotFoundError(f"no such tables directory: {p}")
    paths = sorted({str(f.relative_to(a)) for f in a.rglob("*.csv")} | {str(f.relative_to(b)) for f in b.rglob("*.csv")})
    out = []
    for rel in paths:
        fa, fb = a / rel, b / rel
        if not fa.is_file() or not fb.is_file():
            out.append(FileDiff(rel, [f"only in {'A' if fa.is_file() else 'B'}"]))
            continue
        ta = pd.read_csv(fa) if fa.stat().st_size > 1 else pd.DataFrame()
        tb = pd.read_csv(fb) if fb.stat().st_size > 1 else pd.DataFrame()
        out.append(compare_tables(ta, tb, rel, rtol))
    return out
