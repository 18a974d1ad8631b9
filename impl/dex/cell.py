"""One DEX benchmark cell: every arm of the depth-axis experiments on one (model, workload).

The arms of DEX Fig. 3 (DEX-1/K for each K and the depth-selection baselines against AR), Fig. 4
(resolution scaling = the K sweep; single-exit vs full exploration; vanilla vs DECS at greedy and
T = 1) and the data for Table 1 (overhead profile) run in one process, prompt-major (for each
prompt, every arm in turn), so that walltime ratios between arms are taken in the same run under
the same machine conditions. Every output is checked against the AR arm of the same temperature
and the verdict written into its row; greedy DEX arms without DECS also check the rounds identity
rounds(t+1) = 1 + k_t against k_t predicted by the EAD measurement of the same prompt (first match
over X, DEX Sec. 3 / Prop. 7).

Baselines are tuned as the paper does (App. D: a grid on a few prompts per workload), here on
prompts disjoint from the evaluated ones, with the depth-side speedup (Prop. 7 layer accounting)
as the objective because it is free of machine noise; the tuned values are written to the rows.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from ..config import ADAPTED_SUFFIX, split_variant, variant_name  # noqa: F401  (re-exported)
from ..ead.accounting import uniform_exploration_set, validate_exploration_set
from ..ead.measure import measure_prompt
from ..methods import build_method
from ..spec.sampling import DecodeRule
from .schema import DexSection

log = logging.getLogger("impl.dex.cell")


@dataclass(frozen=True)
class Arm:
    """One decoding configuration of a cell.

    Attributes:
        name: display name (``dex-1/4``, ``dex-1/4-single``, ``dex-1/4-decs@T1``, ``self_spec`` ...).
        method: a method of :func:`impl.methods.build_method`.
        params: its parameters (JSON-serialisable).
        temperature: decoding temperature (0 = greedy).
        figure: which experiment the arm belongs to (``fig3``, ``fig4_single``, ``fig4_decs``, ``ar``).
    """

    name: str
    method: str
    params: dict[str, Any] = field(default_factory=dict)
    temperature: float = 0.0
    figure: str = "fig3"


def exploration_sets(dex: DexSection, L: int) -> list[tuple[int, ...]]:
    """Uniform DEX-1/K sets for ``dex.explorers`` (every K dividing L when empty) plus
    ``dex.exploration_sets``, deduplicated, in order.

    Raises:
        ValueError: a K that does not divide L or an invalid set.
    """
    ks = dex.explorers or [k for k in range(2, L + 1) if L % k == 0]
    sets = [uniform_exploration_set(L, k) for k in ks]
    sets += [validate_exploration_set(x, L) for x in dex.exploration_sets]
    return list(dict.fromkeys(sets))


def adapter_depths(dex: DexSection, L: int) -> list[int]:
    """Non-final depths of every exploration set the experiments use (where adapters attach)."""
    sets = exploration_sets(dex, L) + [uniform_exploration_set(L, k) for k in dex.decs.explorers]
    return sorted({d for X in sets for d in X[:-1]})


def set_name(X: tuple[int, ...], L: int) -> str:
    """``dex-1/K`` for a uniform set, else ``dex[d0,d1,...]``."""
    K = len(X)
    if L % K == 0 and X == uniform_exploration_set(L, K):
        return f"dex-1/{K}"
    return "dex[" + ",".join(map(str, X)) + "]"


def _t(T: float) -> str:
    return f"@T{T:g}"


def dex_arms(dex: DexSection, L: int) -> list[Arm]:
    """AR and DEX arms of a cell (baselines are added by :func:`tune_baselines`)."""
    dd = dex.dedupe
    arms = [Arm("ar", "ar", {}, 0.0, "ar")]
    for X in exploration_sets(dex, L):
        arms.append(Arm(set_name(X, L), "dex", {"exploration_set": list(X), "dedupe": dd}))
        if dex.single_exit and len(X) > 2:
            arms.append(Arm(set_name(X, L) + "-single", "dex",
                            {"exploration_set": list(X), "single_exit": True, "dedupe": dd}, 0.0, "fig4_single"))
    temps = dex.decs.temperatures
    for T in temps:
        if T > 0:
            arms.append(Arm("ar" + _t(T), "ar", {}, T, "ar"))
    for k in dex.decs.explorers:
        X = uniform_exploration_set(L, k)
        for T in temps:
            base = set_name(X, L)
            if T > 0 or base not in {a.name for a in arms}:
                arms.append(Arm(base + (_t(T) if T > 0 else ""), "dex", {"exploration_set": list(X), "dedupe": dd},
                                T, "fig4_decs"))
            arms.append(Arm(base + "-decs" + (_t(T) if T > 0 else ""), "dex",
                            {"exploration_set": list(X), "decs": True, "dedupe": dd}, T, "fig4_decs"))
    names = [a.name for a in arms]
    assert len(names) == len(set(names)), names
    return arms


def speculative_arms(dex: DexSection, draft_dir: str | None = None, tev_drafters: str | None = None) -> list[Arm]:
    """The speculative arms of Fig. 5 that ``dex.speculative`` turns on, greedy (figure ``fig5``):
    ``prompt_lookup`` (transformers' prompt-lookup decoding), ``lookahead`` (Lookahead decoding),
    ``assisted`` (transformers' assisted decoding with the model's draft model at ``draft_dir``),
    ``pearl`` (PEARL with that draft model; its rows carry the two-device time) and
    ``dflash_chain`` (the trained draft head: the model's TEV drafter ``tev_drafters/<objective>``,
    chain verification; only where ``tev_drafters`` is given, i.e. for the models TEV trains).

    Raises:
        ValueError: ``assisted`` or ``pearl`` is on but no ``draft_dir`` is given.
    """
    sp = dex.speculative
    arms = []
    if sp.prompt_lookup is not None:
        arms.append(Arm("prompt_lookup", "hf_prompt_lookup", sp.prompt_lookup.model_dump(), 0.0, "fig5"))
    if sp.lookahead is not None:
        arms.append(Arm("lookahead", "lookahead", sp.lookahead.model_dump(), 0.0, "fig5"))
    if (sp.assisted is not None or sp.pearl is not None) and not draft_dir:
        raise ValueError("dex.speculative.assisted / pearl need the draft model's directory (rule train_draft's output)")
    if sp.assisted is not None:
        arms.append(Arm("assisted", "hf_assisted", {"assistant": str(draft_dir), **sp.assisted.model_dump()},
                        0.0, "fig5"))
    if sp.pearl is not None:
        arms.append(Arm("pearl", "pearl", {"draft": str(draft_dir), "gamma": sp.pearl.gamma}, 0.0, "fig5"))
    if sp.dflash is not None and tev_drafters:
        arms.append(Arm("dflash_chain", "dflash_chain",
                        {"drafter": f"{tev_drafters}/{sp.dflash.objective}", "depth": sp.dflash.depth}, 0.0, "fig5"))
    return arms


def baseline_grid(dex: DexSection, L: int) -> dict[str, list[dict[str, Any]]]:
    """The tuning grid of each depth-selection baseline (DEX App. D, scaled to depth L)."""
    b = dex.baselines
    grids: dict[str, list[dict[str, Any]]] = {}
    ss = b.self_spec
    grids["self_spec"] = [{"exit_layer": e, "num_speculations": n}
                          for e, n in itertools.product(ss.exit_layers, ss.num_speculations) if e < L]
    ad = b.adadecode
    shortcuts = list(range(ad.shortcut_every, L, ad.shortcut_every))
    grids["adadecode"] = [{"shortcut_layers": shortcuts, "num_speculations": n, "threshold": th}
                          for n, th in itertools.product(ad.num_speculations, ad.thresholds)]
    if b.dynamic_exit:
        # DEL runs its dynamic configuration (no exit/length grid, App. D); only its draft-confidence
        # threshold is scanned, because a tiny model's readouts are rarely as confident as a 70B's
        grids["dynamic_exit"] = [{"confidence_threshold": c} for c in (0.0, 0.25, 0.5)]
    return grids


def depth_speedup(rows: list[dict], L: int) -> float:
    """AR's critical-path layer work over the method's, pooled over rows: L * sum(tokens) /
    sum(critical layers) (DEX Prop. 7 accounting)."""
    n = sum(r["n_new_tokens"] for r in rows)
    c = sum(r["critical_layers_total"] for r in rows)
    return L * n / c if c else float("nan")


def tune_baselines(model, prompts: list[dict], dex: DexSection, L: int, max_new_tokens: int,
                   eos: int | None) -> tuple[list[Arm], list[dict]]:
    """Grid-search each baseline on ``prompts`` (greedy) and return its best arm.

    Objective: depth-side speedup over AR (:func:`depth_speedup`); ties go to the first grid
    point. Returns ``(arms, tuning_rows)``; a tuning row per grid point records its speedup.
    """
    rule = DecodeRule()
    arms, rows = [], []
    for method, grid in baseline_grid(dex, L).items():
        best, best_s = None, -1.0
        for params in grid:
            run = build_method(method, model, rule, params)
            out = []
            for p in prompts:
                r = run(list(p["input_ids"]), max_new_tokens, eos)
                out.append({"n_new_tokens": len(r["token_ids"]), "critical_layers_total": r["critical_layers_total"]})
            s = depth_speedup(out, L)
            rows.append({"kind": "tuning", "method": method, "params": params, "depth_speedup": s,
                         "tune_prompt_ids": [p["id"] for p in prompts]})
            if s > best_s:
                best, best_s = params, s
        arms.append(Arm(method, method, best, 0.0, "fig3"))
        log.info("tuned %s: %s (depth speedup %.3f on %d prompts)", method, best, best_s, len(prompts))
        if method == "self_spec" and dex.baselines.hf_early_exit:
            # the library's own LayerSkip-style early exit at the same (exit layer, draft length): a
            # reference next to the project's LSSD, greedy, not itself a tuned baseline
            arms.append(Arm("hf_early_exit", "hf_early_exit", dict(best), 0.0, "fig3"))
    return arms, rows


def predicted_match_index(ead_rows: list[dict], X: tuple[int, ...]) -> list[int]:
    """k_t per token from an EAD measurement: the index of the shallowest depth of X whose
    candidate equals the final-depth token (K-1 when only L matches)."""
    return [next(k for k, d in enumerate(X) if r["candidates"][d - 1] == r["token_id"]) for r in ead_rows]


def run_cell(model, prompts: list[dict], arms: list[Arm], *, max_new_tokens: int, eos: int | None, seed: int,
             adapters: dict | None = None, progress: bool = False) -> list[dict]:
    """Decode every prompt with every arm (prompt-major) and check each output against AR.

    Args:
        model: causal LM (eval mode).
        prompts: token-id prompt rows (``id``, ``input_ids``, optional ``suite``).
        arms: the cell's arms; an AR arm is required for every temperature used.
        max_new_tokens, eos: generation budget and stop token (None = ignore EOS).
        seed: seed of the per-position Gumbel noise (sampling arms).
        adapters: inducing adapters by depth, used by DEX arms (App. C.2).

    Returns:
        one row per (arm, prompt): arm name, method, params, temperature, prompt id, token ids,
        ``n_new_tokens``, ``seconds`` (wall), ``critical_layers_total``, ``ar_match`` and for greedy
        DEX arms without DECS ``rounds_identity`` (bool) with ``predicted_match_index``; plus two
        oracle rows per prompt (Def. 1): ``ead_oracle`` (critical layers = sum of EADs, the earliest
        matching depth: no lossless depth-side method that reuses matching readouts can do better,
        because DEX's first match over X is at or above it) and ``stable_ead_oracle`` (sum of stable
        EADs, the paper's convention for S_EAD; DEX can exceed it when a shallow candidate matches
        before the token stabilises). A prompt that cannot be decoded gives rows with ``error``.

    Raises:
        ValueError: no AR arm for a temperature some arm uses.
    """

    temps = {a.temperature for a in arms}
    ar_arm = {a.temperature: a for a in arms if a.method == "ar"}
    missing = sorted(temps - set(ar_arm))
    if missing:
        raise ValueError(f"cell has no AR arm for temperature(s) {missing}")
    runs = {a.name: build_method(a.method, model, DecodeRule(a.temperature, seed), a.params,
                                 adapters if a.method == "dex" else None) for a in arms}
    # warm-up (excluded): one short decode per arm on the first prompt
    if prompts:
        for a in arms:
            try:
                runs[a.name](list(prompts[0]["input_ids"]), 2, None)
            except ValueError:
                break
    rows: list[dict] = []
    for p in tqdm(prompts, desc="cell", disable=not progress, mininterval=5):
        base = {"prompt_id": p.get("id"), "suite": p.get("suite"), "n_prompt_tokens": len(p.get("input_ids") or [])}
        try:
            ead = measure_prompt(model, list(p["input_ids"]), max_new_tokens, eos_token_id=eos, adapters=adapters)
        except (ValueError, KeyError) as e:
            rows.append({**base, "arm": "ead_oracle", "error": str(e)})
            continue
        oracles = []
        for name, key in (("ead_oracle", "ead"), ("stable_ead_oracle", "stable_ead")):
            oracles.append({**base, "arm": name, "method": name, "temperature": 0.0, "figure": "fig3",
                            "token_ids": [r["token_id"] for r in ead], "n_new_tokens": len(ead),
                            key: [r[key] for r in ead], "critical_layers_total": sum(r[key] for r in ead),
                            "adapters": bool(adapters)})
        rows.extend(oracles)
        ref: dict[float, list[int]] = {}
        order = sorted(arms, key=lambda a: a.method != "ar")  # AR arms first: they are the references
        for a in order:
            row = {**base, "arm": a.name, "method": a.method, "params": a.params, "temperature": a.temperature,
                   "figure": a.figure, "seed": seed}
            try:
                t0 = time.perf_counter()
                out = runs[a.name](list(p["input_ids"]), max_new_tokens, eos)
                out["seconds"] = time.perf_counter() - t0
            except ValueError as e:
                rows.append({**row, "error": str(e)})
                continue
            row.update(out)
            row["n_new_tokens"] = len(out["token_ids"])
            if a.method == "ar":
                ref[a.temperature] = out["token_ids"]
                row["ar_match"] = True
            else:
                row["ar_match"] = out["token_ids"] == ref.get(a.temperature)
            if a.method == "dex" and a.temperature == 0 and not a.params.get("decs") and not a.params.get("single_exit"):
                X = tuple(a.params["exploration_set"])
                pred = predicted_match_index(ead, X)
                row["predicted_match_index"] = pred
                got = out["rounds"]
                K = len(X)
                row["rounds_identity"] = (len(got) == len(pred) and got[0] == K
                                          and all(got[t + 1] == 1 + pred[t] for t in range(len(got) - 1))
                                          and out["match_index"] == pred)
            rows.append(row)
        for o in oracles:
            o["ar_match"] = o["token_ids"] == ref.get(0.0) if 0.0 in ref else None
    return rows


__all__ = ["ADAPTED_SUFFIX", "variant_name", "split_variant", "Arm", "exploration_sets", "adapter_depths", "set_name", "dex_arms", "speculative_arms", "baseline_grid", "depth_speedup",
           "tune_baselines", "predicted_match_index", "run_cell"]
