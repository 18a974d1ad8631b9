"""The vSkipper protocol on two engines side by side: transformers' continuous batching (the main run) and
upstream SGLang with vSkipper as an out-of-tree model (``vskipper.sglang_section``), for the report's
SGLang section (issue "Upstream SGLang as a real engine arm", item 5).

Each engine's run writes the ordinary vSkipper tables (:func:`impl.vskipper.serving_report.vskipper_tables`)
into its own folder; :func:`engine_tables` reads those folders and lines them up:

- ``vskipper_engines_knee``: the knee summary of every engine (its upstream arm's engine and attention
  backend, Q*, status);
- ``vskipper_engines_table2``: the Table 2 shape (served hybrid vs upstream, % change per workload, load
  point and lane) with one row per engine, on the (workload, point) pairs both engines measured;
- ``vskipper_engines_gate``: per engine, the measured lanes and how many passed the matched-work gate.

Comparisons are within an engine (hybrid vs upstream on the same engine, paired); across engines only the
effects are set side by side, never the raw times (different kernels, different schedulers).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

import pandas as pd

__all__ = ["ENGINE_TABLE_NAMES", "engine_tables", "report_section"]

#: tables written by :func:`engine_tables`
ENGINE_TABLE_NAMES = ("vskipper_engines_knee", "vskipper_engines_table2", "vskipper_engines_gate")
_TABLE2_KEYS = ["workload", "point", "lane"]


def _read(td: Path, name: str) -> pd.DataFrame:
    p = td / f"{name}.csv"
    if not p.is_file() or p.stat().st_size <= 1:
        return pd.DataFrame()
    return pd.read_csv(p)


def _backend(knee: pd.DataFrame) -> str:
    if "attention_backend" not in knee or not len(knee):
        return "-"
    vals = sorted({str(x) for x in knee["attention_backend"].dropna()})
    return ", ".join(vals) if vals else "-"


def engine_tables(dirs: Mapping[str, str | os.PathLike]) -> dict[str, pd.DataFrame]:
    """The side-by-side tables of the engines' vSkipper runs.

    Args:
        dirs: engine label -> the folder of that engine's vSkipper tables (``vskipper_knee_summary``,
            ``vskipper_table2``, ``vskipper_gate``), in display order (the main engine first).

    Returns:
        ``{name: DataFrame}`` for :data:`ENGINE_TABLE_NAMES`; a table is empty (with its columns) when no
        engine has rows for it.

    Raises:
        ValueError: for fewer than two engines.
        FileNotFoundError: for a folder that does not exist.
    """
    if len(dirs) < 2:
        raise ValueError(f"engine_tables compares at least two engines, got {list(dirs)}")
    knees, t2s, gates = [], [], []
    for engine, d in dirs.items():
        td = Path(d)
        if not td.is_dir():
            raise FileNotFoundError(f"{td}: no tables folder for engine {engine!r}")
        k = _read(td, "vskipper_knee_summary")
        backend = _backend(k)
        if len(k):
            k = k.drop(columns=[c for c in ("engine", "message") if c in k])
            k.insert(0, "engine", engine)
            knees.append(k)
        t2 = _read(td, "vskipper_table2")
        if len(t2):
            t2.insert(0, "engine", engine)
            t2.insert(1, "attention_backend", backend)
            t2s.append(t2)
        g = _read(td, "vskipper_gate")
        if len(g) and "status" in g:
            measured = g[g.status != "skipped"]
            gates.append({"engine": engine, "attention_backend": backend, "lanes": len(measured),
                          "passed": int((measured.status == "ok").sum()),
                          "rejected": int((measured.status != "ok").sum())})
    knee = pd.concat(knees, ignore_index=True) if knees else pd.DataFrame(columns=["engine", "workload", "q_star"])
    if t2s:
        t2 = pd.concat(t2s, ignore_index=True)
        keyset = [set(map(tuple, g[_TABLE2_KEYS].astype(str).values)) for _, g in t2.groupby("engine", sort=False)]
        common = set.intersection(*keyset) if len(keyset) == len(dirs) else set()
        t2 = t2[[tuple(map(str, r)) in common for r in t2[_TABLE2_KEYS].values]]
        order = {e: i for i, e in enumerate(dirs)}
        t2 = t2.assign(_e=t2.engine.map(order)).sort_values(_TABLE2_KEYS + ["_e"], kind="stable").drop(columns="_e")
        t2 = t2.reset_index(drop=True)
    else:
        t2 = pd.DataFrame(columns=["engine", "attention_backend", *_TABLE2_KEYS])
    gate = pd.DataFrame(gates, columns=["engine", "attention_backend", "lanes", "passed", "rejected"])
    return {"vskipper_engines_knee": knee, "vskipper_engines_table2": t2, "vskipper_engines_gate": gate}


def _md(df: pd.DataFrame) -> str:
    return df.to_markdown(index=False, floatfmt=".4g")


def report_section(tables_dir: str | Path, figures_dir: str | Path, base: str | Path) -> list[str]:
    """Markdown lines of REPORT.md's "vSkipper on upstream SGLang" section from ``tables_dir`` (the SGLang
    run's vSkipper tables plus :data:`ENGINE_TABLE_NAMES`): the gate check per engine, the engines and
    attention backends, the knees, Table 2 on both engines side by side, and SGLang's Table 4, Table 3
    (ablation), routed-row shares and (with ``sglang_section.quality``) its quality 2x2 and first-token
    agreement."""
    td, base = Path(tables_dir), Path(base)
    rel = lambda p: os.path.relpath(p, base).replace(os.sep, "/")  # noqa: E731
    t = {n: _read(td, n) for n in ENGINE_TABLE_NAMES + ("vskipper_table4", "vskipper_ablation", "vskipper_modes",
                                                        "vskipper_table5", "vskipper_first_token")}
    lines = ["## vSkipper on upstream SGLang (both engines side by side)", "",
             "The vSkipper protocol again with both arm families on upstream SGLang's own server: **upstream** is "
             "SGLang serving the base model, **vskipper** (and the ablation arms) SGLang serving vSkipper as an "
             "out-of-tree model (`impl/vskipper/sglang_model/`: SGLang's Llama with routed decoder layers, the "
             "project's skippers and mode switch; one server per arm). Same prompts, workloads, knee rule, matched "
             "work and paired repetitions as the main run; the FlexiDepth checkpoint and the mode-switch thresholds "
             "are the main run's (the threshold profile measures in-process forwards, not SGLang's). Effects are "
             "paired within an engine; across engines only the effects are compared, never raw times. On SGLang "
             "a Project-Only row still runs the attention backend's read (the backend's per-request metadata fixes "
             "the row set), so it skips the output projection and the MLP only.", ""]
    gate = t["vskipper_engines_gate"]
    if len(gate):
        sg = gate[gate.engine != gate.engine.iloc[0]]
        ok = bool(len(sg)) and bool((sg.rejected == 0).all()) and bool((sg.lanes > 0).all())
        lines += [f"- every SGLang lane passed the matched-work gate and served every request: "
                  f"**{'PASS' if ok else 'FAIL'}** ("
                  + "; ".join(f"{r.engine}: {r.passed}/{r.lanes}" for r in gate.itertuples()) + ")", "",
                  _md(gate), ""]
    if len(t["vskipper_engines_knee"]):
        kn = t["vskipper_engines_knee"]
        cols = [c for c in ("engine", "workload", "attention_backend", "status", "q_star", "q_star_used", "requests")
                if c in kn]
        lines += ["### Knee Q* per engine (upstream arm, natural generation)", "", _md(kn[cols]), ""]
    t2 = t["vskipper_engines_table2"]
    if len(t2):
        lines += ["### Table 2 shape on both engines", "",
                  "Served hybrid vs upstream on the same engine, % change per load point (`*` = resolved), rows of "
                  "one (workload, point, lane) next to each other.", "", _md(t2), ""]
    if len(t["vskipper_table4"]):
        lines += ["### Table 4 shape on SGLang (throughput under saturation)", "", _md(t["vskipper_table4"]), ""]
    if len(t["vskipper_ablation"]):
        lines += ["### Mechanism ablation on SGLang (Table 3 shape)", "", _md(t["vskipper_ablation"]), ""]
    if len(t["vskipper_modes"]):
        lines += ["### Routed-row shares on SGLang (the mode controller inside the server)", "",
                  _md(t["vskipper_modes"]), ""]
    if len(t["vskipper_table5"]):
        lines += ["### Quality 2x2 with the served arms on SGLang (Table 5 left shape)", "",
                  "A (lm-eval's HF backend) and B (the checkpoint in plain PyTorch) as in the main run; C = upstream "
                  "SGLang on the base model, D = vSkipper inside SGLang always-route, both driven by lm-eval's "
                  "`local-completions` client with the same token ids (the prompt-hash gate compares the ids SGLang "
                  "received). DiD = (D - C) - (B - A) per document, paired.", "", _md(t["vskipper_table5"]), ""]
    if len(t["vskipper_first_token"]):
        lines += ["First-token agreement on SGLang (App. E.1; served top-k log-probabilities from `/generate`):", "",
                  _md(t["vskipper_first_token"]), ""]
    lines += ["Tables: " + ", ".join(f"[{p.stem}]({rel(p)})" for p in sorted(td.glob("vskipper_*.csv"))), ""]
    return lines
