"""Figures (matplotlib, Agg backend) from the tables built by :mod:`impl.report.tables`."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from ..provenance import atomic_path  # noqa: E402


def _grid(n: int, width: float = 4.0, height: float = 3.0):
    cols = min(n, 4)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(width * cols, height * rows), squeeze=False)
    flat = axes.ravel()
    for ax in flat[n:]:
        ax.set_visible(False)
    return fig, flat


def _save(fig, path: str | Path) -> None:
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)


def ead_histograms(hist: pd.DataFrame, summary: pd.DataFrame, path: str | Path) -> None:
    """Stable-EAD distribution per workload, one bar series per model, means marked (DEX Fig. 6
    shape)."""
    workloads = sorted(hist["workload"].unique())
    models = list(dict.fromkeys(hist["model"]))
    fig, axes = _grid(len(workloads))
    width = 0.8 / max(1, len(models))
    for ax, w in zip(axes, workloads):
        for i, m in enumerate(models):
            h = hist[(hist.workload == w) & (hist.model == m)]
            if h.empty:
                continue
            ax.bar(h["stable_ead"] + (i - (len(models) - 1) / 2) * width, h["fraction"], width=width,
                   label=m, color=f"C{i}")
            mean = summary[(summary.workload == w) & (summary.model == m)]["mean_stable_ead"].iloc[0]
            ax.axvline(mean, color=f"C{i}", ls="--", lw=1)
        ax.set_title(f"{w}")
        ax.set_xlabel("stable EAD (layers)")
        ax.set_ylabel("fraction of tokens")
        ax.legend(fontsize=7)
    fig.suptitle("Stable EAD distribution (dashed: mean)")
    _save(fig, path)


def s_x_vs_k(sx: pd.DataFrame, path: str | Path) -> None:
    """Depth-side speedup S_X of DEX-1/K's uniform exploration set vs K, with the S_EAD oracle."""
    workloads = sorted(sx["workload"].unique())
    fig, axes = _grid(len(workloads))
    for ax, w in zip(axes, workloads):
        for i, m in enumerate(dict.fromkeys(sx["model"])):
            d = sx[(sx.workload == w) & (sx.model == m)].sort_values("K")
            if d.empty:
                continue
            ax.plot(d["K"], d["s_x"], "o-", color=f"C{i}", label=f"{m} S_X")
            ax.axhline(d["s_ead"].iloc[0], color=f"C{i}", ls="--", lw=1, label=f"{m} S_EAD")
        ax.set_xscale("log", base=2)
        ks = sorted(sx["K"].unique())
        ax.set_xticks(ks, [str(k) for k in ks])
        ax.set_title(w)
        ax.set_xlabel("explorers K (uniform X)")
        ax.set_ylabel("depth-side speedup")
        ax.legend(fontsize=7)
    fig.suptitle("S_X vs K (Prop. 7, Eq. 13); dashed: EAD oracle")
    _save(fig, path)


def selection_curves(sel: pd.DataFrame, sx: pd.DataFrame, path: str | Path) -> None:
    """Single-exit selection speedup (Eq. 4) vs exit depth, per model, next to S_EAD."""
    workloads = sorted(sel["workload"].unique())
    fig, axes = _grid(len(workloads))
    for ax, w in zip(axes, workloads):
        for i, m in enumerate(dict.fromkeys(sel["model"])):
            for j, g in enumerate(sorted(sel["num_speculations"].unique())):
                d = sel[(sel.workload == w) & (sel.model == m) & (sel.num_speculations == g)]
                ax.plot(d["exit_depth"], d["s_sel"], ["-", ":", "-."][j % 3], color=f"C{i}",
                        label=f"{m} selection, {g} spec.")
            e = sx[(sx.workload == w) & (sx.model == m)]
            if not e.empty:
                ax.axhline(e["s_ead"].iloc[0], color=f"C{i}", ls="--", lw=1, label=f"{m} S_EAD")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_title(w)
        ax.set_xlabel("exit depth s")
        ax.set_ylabel("depth-side speedup")
        ax.legend(fontsize=6)
    fig.suptitle("Single-exit depth selection (Eq. 4) vs the EAD oracle")
    _save(fig, path)


def loss_by_depth(depth: pd.DataFrame, training: pd.DataFrame, path: str | Path) -> None:
    """Validation loss of the intermediate readout at each depth, per model, with the unigram line."""
    fig, axes = _grid(1, 5.0, 3.5)
    ax = axes[0]
    for i, m in enumerate(dict.fromkeys(depth["model"])):
        d = depth[depth.model == m]
        ax.plot(d["depth"], d["val_loss"], "o-", color=f"C{i}", label=m)
    ax.axhline(training["unigram_baseline"].iloc[0], color="grey", ls="--", label="unigram")
    ax.set_xlabel("readout depth l")
    ax.set_ylabel("validation loss (nats/token)")
    ax.legend(fontsize=7)
    ax.set_title("Intermediate readout loss")
    _save(fig, path)


def ead_means(summary: pd.DataFrame, shared: pd.DataFrame | None, path: str | Path) -> None:
    """Mean stable EAD per workload and model: on each model's own generations and, when given, on
    shared contexts."""
    panels = [("own generations (Def. 1)", summary)] + ([("shared contexts", shared)] if shared is not None else [])
    fig, axes = _grid(len(panels), 5.0, 3.2)
    for ax, (title, df) in zip(axes, panels):
        workloads = sorted(df["workload"].unique())
        models = list(dict.fromkeys(df["model"]))
        width = 0.8 / max(1, len(models))
        for i, m in enumerate(models):
            vals = [df[(df.workload == w) & (df.model == m)]["mean_stable_ead"].mean() for w in workloads]
            ax.bar([j + (i - (len(models) - 1) / 2) * width for j in range(len(workloads))], vals, width=width,
                   label=m, color=f"C{i}")
        ax.set_xticks(range(len(workloads)), workloads, rotation=20)
        ax.set_ylabel("mean stable EAD (layers)")
        ax.set_title(title)
        ax.legend(fontsize=7)
    _save(fig, path)


def dex_fig3(arms: pd.DataFrame, path: str | Path) -> None:
    """DEX Fig. 3 shape: per variant (row) and workload (column), greedy depth-side speedup of the
    tuned baselines and DEX-1/K, dashed lines at the EAD and stable-EAD oracles."""
    g = arms[(arms.figure == "fig3") & (arms.temperature == 0)]
    variants = list(dict.fromkeys(g["variant"]))
    suites = list(dict.fromkeys(g["suite"]))
    fig, axes = plt.subplots(len(variants), len(suites), figsize=(4.2 * len(suites), 3.2 * len(variants)),
                             squeeze=False)
    for i, v in enumerate(variants):
        for j, s in enumerate(suites):
            ax = axes[i, j]
            c = g[(g.variant == v) & (g.suite == s)]
            bars = c[~c.arm.str.endswith("oracle")]
            colors = ["C1" if a.startswith("dex") else "C7" for a in bars["arm"]]
            ax.bar(range(len(bars)), bars["depth_speedup"], color=colors)
            ax.set_xticks(range(len(bars)), bars["arm"], rotation=60, ha="right", fontsize=7)
            for arm, ls in (("ead_oracle", "--"), ("stable_ead_oracle", ":")):
                o = c[c.arm == arm]
                if len(o):
                    ax.axhline(o["depth_speedup"].iloc[0], color="k", ls=ls, lw=1, label=arm.replace("_", " "))
            ax.axhline(1.0, color="grey", lw=0.5)
            ax.set_title(f"{v} / {s}", fontsize=9)
            ax.set_ylabel("depth-side speedup over AR")
            ax.legend(fontsize=6)
    fig.suptitle("Depth-axis comparison (Prop. 7 layer accounting; DEX orange, baselines grey)")
    _save(fig, path)


def dex_fig5(fig5: pd.DataFrame, path: str | Path) -> None:
    """DEX Fig. 5 shape: per (variant, workload), measured end-to-end wall speedup over AR of every arm
    of the ``dex_fig5`` table (per-prompt mean with its 95% interval; AR at 1, DEX orange, speculative
    arms blue, the multi-process arms green, baselines grey). Without speculative arms the figure says so."""
    cells = list(dict.fromkeys(zip(fig5["variant"], fig5["suite"]))) if len(fig5) else []
    if not cells:
        fig, ax = plt.subplots(figsize=(5, 1.6))
        ax.axis("off")
        ax.text(0.5, 0.5, "no speculative arms in this run (dex.speculative is off)", ha="center", va="center")
        _save(fig, path)
        return
    fig, axes = _grid(len(cells), 4.4, 3.4)
    for ax, (v, s) in zip(axes, cells):
        c = fig5[(fig5.variant == v) & (fig5.suite == s)]
        colors = ["C1" if str(a).startswith("dex") else "C2" if "measured" in str(k)
                  else "C0" if str(k).startswith(("speculative", "parallel")) else "C7" for a, k in zip(c["arm"], c["kind"])]
        err = [(c["speedup_mean"] - c["ci_low"]).clip(lower=0).fillna(0), (c["ci_high"] - c["speedup_mean"]).clip(lower=0).fillna(0)]
        ax.bar(range(len(c)), c["speedup_mean"], color=colors, yerr=err, capsize=2)
        ax.set_xticks(range(len(c)), c["arm"], rotation=60, ha="right", fontsize=7)
        ax.axhline(1.0, color="grey", lw=0.5)
        ax.set_title(f"{v} / {s}", fontsize=9)
        ax.set_ylabel("wall speedup over AR (per prompt)")
    fig.suptitle("End-to-end greedy throughput on this machine (Fig. 5 shape; green: several processes, measured)")
    _save(fig, path)


def _paired_bars(ax, t: pd.DataFrame, labels: list[str], a: tuple[str, str], b: tuple[str, str]) -> None:
    """Two bars per row of ``t``: columns ``a[0]`` and ``b[0]`` labelled ``a[1]`` and ``b[1]``."""
    x = range(len(t))
    ax.bar([i - 0.2 for i in x], t[a[0]], 0.4, label=a[1])
    ax.bar([i + 0.2 for i in x], t[b[0]], 0.4, label=b[1])
    ax.set_xticks(list(x), labels, fontsize=6)
    ax.legend(fontsize=7)


def dex_fig4(arms: pd.DataFrame, path: str | Path) -> None:
    """DEX Fig. 4 shape: left, resolution scaling (depth-side and projected K-device speedup vs K);
    right-top, single exit vs full exploration; right-bottom, vanilla vs DECS at each temperature.
    Means over workloads per variant."""
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.6))
    res = arms[(arms.figure == "fig3") & arms.arm.str.match(r"^dex-1/\d+$")]
    for i, (v, g) in enumerate(res.groupby("variant", sort=False)):
        m = g.groupby("K")[["depth_speedup", "projected_speedup"]].mean().reset_index()
        axes[0].plot(m["K"], m["depth_speedup"], "o-", color=f"C{i}", label=f"{v} depth-side")
        axes[0].plot(m["K"], m["projected_speedup"], "s--", color=f"C{i}", label=f"{v} projected K-device")
    axes[0].set_xlabel("explorers K (DEX-1/K)")
    axes[0].set_ylabel("speedup over AR")
    axes[0].set_title("resolution scaling")
    axes[0].legend(fontsize=6)
    single = arms[arms.figure == "fig4_single"]
    rows = []
    for _, r in single.iterrows():
        full = arms[(arms.variant == r.variant) & (arms.suite == r.suite) & (arms.arm == r.arm[: -len("-single")])]
        if len(full):
            rows.append({"variant": r.variant, "K": r.K, "single": r.depth_speedup, "full": full["depth_speedup"].iloc[0]})
    if rows:
        t = pd.DataFrame(rows).groupby(["variant", "K"]).mean().reset_index()
        _paired_bars(axes[1], t, [f"{v}\nK={int(k)}" for v, k in zip(t["variant"], t["K"])],
                     ("single", "single exit"), ("full", "full exploration"))
    axes[1].set_title("single exit vs full exploration")
    axes[1].set_ylabel("depth-side speedup")
    decs = arms[(arms.figure == "fig4_decs") & arms.arm.str.contains("-decs")]
    rows = []
    for _, r in decs.iterrows():
        van = arms[(arms.variant == r.variant) & (arms.suite == r.suite) & (arms.arm == r.arm.replace("-decs", ""))]
        if len(van):
            rows.append({"variant": r.variant, "T": r.temperature, "vanilla": van["depth_speedup"].iloc[0],
                         "decs": r.depth_speedup})
    if rows:
        t = pd.DataFrame(rows).groupby(["variant", "T"]).mean().reset_index()
        _paired_bars(axes[2], t, [f"{v}\nT={T:g}" for v, T in zip(t["variant"], t["T"])],
                     ("vanilla", "vanilla"), ("decs", "DECS"))
    axes[2].set_title("vanilla vs DECS")
    axes[2].set_ylabel("depth-side speedup")
    _save(fig, path)
