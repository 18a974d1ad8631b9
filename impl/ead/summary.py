"""Per-(model, workload) summaries of EAD token rows: histogram, S_EAD, S_X for uniform exploration
sets (Prop. 7 / Eq. 13), and the single-exit selection workload (Eq. 4) over a grid of exit depths.

Speedups are micro averages (all tokens of the measurement pooled, Eq. 12); per-prompt (macro)
means of stable EAD are reported next to them for paired comparisons.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Iterable

import numpy as np

from .accounting import (
    depth_side_speedup,
    resolution,
    s_ead,
    s_x,
    s_x_lower_bound,
    selection_trace,
    uniform_exploration_set,
)


def _by_prompt(rows: Iterable[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        out[r["prompt_id"]].append(r)
    for v in out.values():
        v.sort(key=lambda r: r["t"])
    return dict(out)


def num_layers_of(rows: list[dict]) -> int:
    """L, from the length of the ``omega`` lists of EAD rows (all rows must agree).

    Raises:
        ValueError: no rows, or rows of different depths.
    """
    if not rows:
        raise ValueError("no EAD rows")
    Ls = {len(r["omega"]) for r in rows}
    if len(Ls) != 1:
        raise ValueError(f"EAD rows disagree on the number of layers: {sorted(Ls)}")
    return Ls.pop()


def ead_summary(rows: list[dict]) -> dict[str, Any]:
    """Headline numbers of one (model, workload) EAD measurement.

    Returns:
        dict with L, n_prompts, n_tokens, mean_ead, mean_stable_ead (micro), macro_mean_stable_ead
        (mean over prompts of the per-prompt mean), s_ead (stable, micro), s_ead_unstable,
        hist (counts of stable EAD at depths 1..L), ar_match (all prompts equal AR), distinct_2
        (mean over prompts of distinct token bigrams / bigrams of the generated text: near 0 means
        the model loops, which makes EAD trivially shallow for both compared models).
    """
    L = num_layers_of(rows)
    se = np.array([r["stable_ead"] for r in rows])
    e = np.array([r["ead"] for r in rows])
    prompts = _by_prompt(rows).values()
    per_prompt = [np.mean([r["stable_ead"] for r in v]) for v in prompts]
    distinct = []
    for v in prompts:
        ids = [r["token_id"] for r in v]
        bigrams = list(zip(ids, ids[1:]))
        if bigrams:
            distinct.append(len(set(bigrams)) / len(bigrams))
    return {
        "L": L,
        "n_prompts": len(per_prompt),
        "n_tokens": int(se.size),
        "mean_ead": float(e.mean()),
        "mean_stable_ead": float(se.mean()),
        "macro_mean_stable_ead": float(np.mean(per_prompt)),
        "s_ead": s_ead(se, L),
        "s_ead_unstable": s_ead(e, L),
        "hist": np.bincount(se, minlength=L + 1)[1:].tolist(),
        "ar_match": all(r["ar_match"] for r in rows),
        "distinct_2": float(np.mean(distinct)) if distinct else float("nan"),
    }


def s_x_rows(rows: list[dict]) -> list[dict[str, Any]]:
    """S_X of DEX-1/K's uniform exploration set for every K dividing L, with the resolution
    Delta(X), the Eq. (14) lower bound and S_EAD."""
    L = num_layers_of(rows)
    se = np.array([r["stable_ead"] for r in rows])
    out = []
    for K in (k for k in range(1, L + 1) if L % k == 0):
        X = uniform_exploration_set(L, K)
        out.append({
            "K": K,
            "exploration_set": list(X),
            "resolution": resolution(X, L),
            "s_x": s_x(se, X, L),
            "s_x_lower_bound": s_x_lower_bound(se, X, L),
            "s_ead": s_ead(se, L),
        })
    return out


def selection_rows(rows: list[dict], num_speculations: Iterable[int]) -> list[dict[str, Any]]:
    """Depth-side speedup of single-exit selection (Eq. 4 via :func:`selection_trace`) for every
    exit depth s in [1, L-1] and every number of speculations; prompts are traced separately
    and their workloads pooled (micro)."""
    L = num_layers_of(rows)
    prompts = _by_prompt(rows)
    out = []
    for g in num_speculations:
        for s in range(1, L):
            work = np.concatenate([
                selection_trace([r["stable_ead"] for r in v], s, L, g) for v in prompts.values()
            ])
            acc = np.mean([r["stable_ead"] <= s for r in rows])
            out.append({"num_speculations": g, "exit_depth": s, "acceptance": float(acc),
                        "s_sel": depth_side_speedup(work, L)})
    return out
