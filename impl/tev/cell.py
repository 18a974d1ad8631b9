"""One TEV benchmark cell: every decoding arm of the TEV/ExitTrain tables on one (model, workload).

Arms (TEV Sec. 6, App. D), each at every configured temperature T:

- ``ar``: autoregressive decoding, the speed and exactness reference;
- ``chain``: DFlash-style chain decoding (no tree) with the base drafter (the token-trained
  DFlash-style drafter, standing for the paper's released checkpoint);
- ``ddtree``: DDTree, best-first tree with budget B and the predraw-follow verifier, base drafter;
- ``exittrain+tev``: the exit-guided drafter with Tree Exit Verification (main table);
- ``draft-opd``: Draft-OPD, DDTree with only the drafter replaced by the position-wise distilled one
  (Sec. 6 "Methods"; main table);
- objective ablation (Table 2): ``token+tev``, ``prefix+tev``, ``opd+tev`` and ``exittrain+tev``, all
  fine-tuned from the base drafter with matched initialisation, data and steps;
- crossed drafter x verifier grid (Table 4): {base, exit} drafter x {predraw, tev} verifier;
- budget robustness (Table 5): ``ddtree`` and ``exittrain+tev`` at each extra budget.

The tau-target cell (``tev.target_prompts``, :func:`target_arms`) runs only ``ar``, ``ddtree`` and
``exittrain+tev`` at T = 0, on more prompts than the full cell can afford on a CPU.

Arms run prompt-major (for each prompt, every arm in turn) so speed ratios compare arms in the same
run. Every row checks itself: at T = 0 the token ids equal AR's (``ar_match``); at T > 0 the exit-law
calibration is recorded (observed mean tau vs mean 1 + C_p over the row's rounds, TEV Eq. 11).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm import tqdm

from ..spec.ar import ar_decode
from ..spec.sampling import DecodeRule
from .decode import tev_decode

log = logging.getLogger("impl.tev.cell")


@dataclass(frozen=True)
class TEVArm:
    """One decoding configuration.

    Attributes:
        name: display name (``ddtree``, ``exittrain+tev``, ``token+tev@B32`` ...).
        drafter: key of the drafter to use (``token``, ``prefix``, ``exit``); None for AR.
        verifier: ``predraw_follow``, ``sequential_residual`` or ``tev``; None for AR.
        tree_mode: ``best_first`` or ``chain``.
        budget: B, non-root tree nodes per round.
        tables: which tables the arm feeds (``main``, ``objective``, ``crossed``, ``budget``).
    """

    name: str
    drafter: str | None = None
    verifier: str | None = None
    tree_mode: str = "best_first"
    budget: int = 0
    tables: tuple[str, ...] = field(default_factory=tuple)


def tev_arms(budget: int, extra_budgets=(), drafters=("base", "token", "prefix", "exit", "opd")) -> list[TEVArm]:
    """The arms of a cell (module docstring). Drafter keys: ``base`` (the token-trained DFlash-style
    drafter, the "released" checkpoint of the paper), ``token`` / ``prefix`` / ``exit`` / ``opd``
    (fine-tuned from ``base`` with matched compute by :func:`impl.tev.train.train_exittrain`). Arms
    needing a drafter not in ``drafters`` are left out."""
    have = set(drafters)
    arms = [TEVArm("ar", tables=("main",))]
    if "base" in have:
        arms += [TEVArm("chain", "base", "predraw_follow", "chain", budget, ("main",)),
                 TEVArm("ddtree", "base", "predraw_follow", "best_first", budget, ("main", "crossed", "budget")),
                 TEVArm("base+tev", "base", "tev", "best_first", budget, ("crossed",))]
    for key in ("token", "prefix", "opd"):
        if key in have:
            arms.append(TEVArm(f"{key}+tev", key, "tev", "best_first", budget, ("objective",)))
    if "opd" in have:
        arms.append(TEVArm("draft-opd", "opd", "predraw_follow", "best_first", budget, ("main",)))
    if "exit" in have:
        arms += [TEVArm("exittrain+tev", "exit", "tev", "best_first", budget, ("main", "objective", "crossed", "budget")),
                 TEVArm("exit+predraw", "exit", "predraw_follow", "best_first", budget, ("crossed",))]
    for b in extra_budgets:
        if b == budget:
            continue
        if "base" in have:
            arms.append(TEVArm(f"ddtree@B{b}", "base", "predraw_follow", "best_first", b, ("budget",)))
        if "exit" in have:
            arms.append(TEVArm(f"exittrain+tev@B{b}", "exit", "tev", "best_first", b, ("budget",)))
    return arms


#: the arms of the tau-target cell (``tev.target_prompts``): the reference, the base drafter's tree and the
#: headline method
TARGET_ARMS = ("ar", "ddtree", "exittrain+tev")


def target_arms(budget: int, drafters=("base", "exit")) -> list[TEVArm]:
    """The tau-target cell's arms (:data:`TARGET_ARMS` at budget B, feeding the ``target`` table): the
    same configurations as the full cell's arms of those names.

    Raises:
        ValueError: ``drafters`` lacks ``base`` or ``exit``.
    """
    if not {"base", "exit"} <= set(drafters):
        raise ValueError(f"the tau-target cell needs the base and exit drafters, got {sorted(drafters)}")
    return [TEVArm(a.name, a.drafter, a.verifier, a.tree_mode, a.budget, ("target",))
            for a in tev_arms(budget, (), drafters) if a.name in TARGET_ARMS]


def run_tev_cell(target, drafters: dict[str, Any], prompts: list[dict], arms: list[TEVArm], *,
                 temperatures=(0.0, 1.0), depth: int, max_new_tokens: int, eos: int | None, seed: int,
                 progress: bool = False) -> list[dict]:
    """Decode every prompt with every arm at every temperature.

    Args:
        target: causal LM (eval mode).
        drafters: drafter key -> drafter (:class:`impl.tev.drafter.BlockDrafter`).
        prompts: token-id prompt rows (``id``, ``input_ids``, optional ``suite``).
        arms: from :func:`tev_arms`; must include ``ar``.
        temperatures: decoding temperatures (0 = greedy).
        depth: maximum tree depth H (<= drafter block size).
        max_new_tokens, eos: generation budget and stop token.
        seed: sampling seed; prompt i at temperature T uses ``seed + i`` for every arm.

    Returns:
        one row per (arm, temperature, prompt): tokens, rounds, ``taus`` (per round, bonus counted),
        ``coverages`` (C_p per round), ``seconds`` (decode wall time), stage seconds summed per stage,
        ``ar_match`` (T = 0) or ``calibration`` (T > 0: mean tau, mean 1 + C_p). A prompt that cannot
        be decoded gives rows with ``error``.

    Raises:
        ValueError: no ``ar`` arm, or an arm naming a drafter not in ``drafters``.
    """

    if not any(a.name == "ar" for a in arms):
        raise ValueError("a TEV cell needs the 'ar' arm (the exactness and speed reference)")
    missing = sorted({a.drafter for a in arms if a.drafter and a.drafter not in drafters})
    if missing:
        raise ValueError(f"arms need drafters {missing}, which were not given")
    # warm-up (excluded): a short decode per arm
    if prompts:
        for a in arms:
            _run(target, drafters, a, list(prompts[0]["input_ids"]), 2, 0.0, None, depth, seed)
    rows = []
    for i, p in enumerate(tqdm(prompts, desc="tev", disable=not progress, mininterval=5)):
        ids = list(p.get("input_ids") or [])
        for T in temperatures:
            ref = None
            for a in arms:
                row = {"prompt_id": p.get("id"), "suite": p.get("suite"), "arm": a.name, "drafter": a.drafter,
                       "verifier": a.verifier, "tree_mode": a.tree_mode if a.drafter else None,
                       "budget": a.budget, "depth": depth, "temperature": T, "tables": list(a.tables),
                       "seed": seed + i, "n_prompt_tokens": len(ids)}
                try:
                    out = _run(target, drafters, a, ids, max_new_tokens, T, eos, depth, seed + i)
                except ValueError as e:
                    rows.append({**row, "error": str(e)})
                    continue
                row.update(out)
                if a.name == "ar":
                    ref = out["token_ids"]
                if T == 0:
                    row["ar_match"] = out["token_ids"] == ref
                rows.append(row)
    return rows


def _run(target, drafters, a: TEVArm, ids, n, T, eos, depth, seed) -> dict:
    t0 = time.perf_counter()
    if a.drafter is None:
        gen = torch.Generator().manual_seed(seed)
        r = ar_decode(target, ids, n, eos_token_id=eos, temperature=T, generator=gen) if T > 0 else \
            ar_decode(target, ids, n, eos_token_id=eos, rule=DecodeRule())
        return {"token_ids": r.tokens, "n_new_tokens": len(r.tokens), "seconds": time.perf_counter() - t0,
                "rounds": len(r.tokens), "taus": [1] * len(r.tokens)}
    gen = torch.Generator().manual_seed(seed)
    r = tev_decode(target, drafters[a.drafter], ids, n, budget=a.budget, depth=depth, verifier=a.verifier,
                   temperature=T, generator=gen, eos_token_id=eos, tree_mode=a.tree_mode)
    out = {"token_ids": r.tokens, "n_new_tokens": len(r.tokens), "seconds": time.perf_counter() - t0,
           "rounds": r.rounds, "taus": r.taus, "committed": r.committed, "coverages": r.coverages,
           "tree_sizes": r.tree_sizes, "prefill_seconds": r.prefill_seconds,
           "stage_seconds": {k: sum(v) for k, v in r.stage_seconds.items()}}
    if T > 0:
        out["calibration"] = {"mean_tau": r.mean_tau, "mean_expected_tau": r.mean_expected_tau}
    return out


__all__ = ["TARGET_ARMS", "TEVArm", "run_tev_cell", "target_arms", "tev_arms"]
