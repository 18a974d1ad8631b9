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
