"""The optional ``tev:`` config section (TEV/ExitTrain experiments): typed models (the one source of its
keys, bounds and defaults), the JSON schema and defaults generated from them, and cross-checks.
Imported by :mod:`impl.config` at validation time, so it imports nothing heavy (pydantic, no torch).

A command reads the section as a typed object: ``t = TevSection.model_validate(cfg["tev"])``, then
``t.drafter.steps``; :class:`impl.tev.drafter.DrafterTrainConfig` and
:class:`impl.tev.train.ExitTrainConfig` take their defaults from these models.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from ..sections import Section, section_defaults, section_schema, typed_section

__all__ = ["tev_section", "Drafter", "ExitTrain", "Latency", "TevSection", "SECTION", "DEFAULTS", "check"]

PosInt = Annotated[int, Field(ge=1)]
PosNum = Annotated[float, Field(gt=0)]
NonNegNum = Annotated[float, Field(ge=0)]
Suite = Literal["gsm8k", "humaneval", "xsum", "mt_bench", "math500", "bbh", "coqa"]
Objective = Literal["token", "prefix", "exit", "opd"]
PromptSource = Literal["sharegpt", "gsm8k", "math500", "humaneval", "mt_bench"]  # impl.tev.prompts.PROMPT_SOURCES


class Drafter(Section):
    """``tev.drafter``: the DFlash-style block drafter (TEV App. C) and its base training on rollouts
    of the target."""

    block_size: PosInt = Field(8, description="H: drafted positions per block (the deepest tree)")
    n_layers: PosInt = Field(2, description="non-causal draft layers")
    prompts: Annotated[int, Field(ge=4)] = Field(200, description="prompts rolled out by the target (all sources)")
    prompt_mix: dict[PromptSource, PosNum] = Field(
        {"sharegpt": 1.0}, min_length=1,
        description="share of each prompt source (TEV App. D's open-perfectblend mixture, offline parts): sharegpt "
                    "= ShareGPT first user turns (chat), gsm8k = GSM8K train questions rendered as the gsm8k "
                    "workload (math); math500 / humaneval / mt_bench = that workload's records outside its frozen "
                    "sample, rendered as the workload (needs workloads.<suite>); interleaved evenly (impl/tev/prompts.py)")
    prompt_max_tokens: PosInt = Field(96, description="prompt tokens kept per rollout [tokens]")
    rollout_new_tokens: PosInt = Field(64, description="response tokens per rollout [tokens]")
    rollout_temperature: NonNegNum = Field(0.0, description="0: greedy rollouts")
    rollout_batch_size: PosInt = Field(1, description="greedy rollouts per transformers generate call (left padding; "
                                                      "faster on a real target); 1: one exact AR decode per prompt")
    steps: PosInt = Field(300, description="optimiser steps of the base drafter")
    batch_size: PosInt = Field(8, description="rollouts per step")
    lr: PosNum = Field(2e-3, description="peak AdamW learning rate")
    gamma: PosNum = Field(4.0, description="DFlash position decay: depth d weighted exp(-(d-1)/gamma)")
    threads: PosInt = Field(1, description="torch threads of the training job")
    heldout_fraction: Annotated[float, Field(gt=0, lt=1)] = Field(
        0.1, description="the last ceil(fraction x n) rollouts are held out (the learning curve and the held-out "
                         "metrics; evaluation time grows with their number)")
    curve_points: Annotated[int, Field(ge=0)] = Field(
        0, description="learning curve: held-out tau (teacher-forced chain, and the B = tev.budget tree at T = 0) "
                       "measured at this many evenly spaced steps of the base training; 0: none")


class ExitTrain(Section):
    """``tev.exittrain``: the fine-tuning objectives of TEV Sec. 5 (token-only, prefix-weighted,
    exit-guided) and Draft-OPD (the paper's on-policy distillation control), matched in steps and data
    order."""

    steps: PosInt = Field(100, description="optimiser steps per objective")
    batch_size: PosInt = Field(4, description="rollouts per step (App. D: 4)")
    tree_contexts_per_seq: PosInt = Field(2, description="contexts per rollout that get a realised tree")
    budget: PosInt = Field(64, description="B: non-root nodes of each training tree (App. D: 64)")
    # lambda_exit ~ B: Eq. 14 divides by the node count, so L_exit is ~ weighted CE / B
    lambda_exit: NonNegNum = Field(64.0, description="lambda_exit of Eq. 15 (the paper gives no value)")
    lambda_opd: NonNegNum = Field(1.0, description="weight of Draft-OPD's forward KL beside L_tok (per-row means)")
    target_temperature: NonNegNum = Field(1.0, description="temperature of the target rows behind w(v) and Draft-OPD's KL")
    lr: PosNum = Field(3e-4, description="peak AdamW learning rate")
    objectives: list[Objective] = Field(["token", "prefix", "exit", "opd"], min_length=1,
                                        json_schema_extra={"uniqueItems": True})


class Latency(Section):
    """``tev.latency``: the verifier-latency benchmark (TEV vs predraw vs sequential residual on the
    same trees)."""

    budgets: list[PosInt] = Field([32, 64, 128], min_length=1)
    trees: PosInt = Field(30, description="trees per budget")
    temperature: PosNum = 1.0
    repeats: PosInt = Field(3, description="timed passes per tree")
    vocab_sizes: list[PosInt] = Field([], description="V' below the target's V at which every verifier is also "
                                      "timed on the same trees, restricted to V' columns (how the ratio moves with V); "
                                      "each >= 2 * max(budgets) + 1; values >= V are skipped",
                                      json_schema_extra={"uniqueItems": True})
    law_draws: Annotated[int, Field(ge=0)] = Field(
        100, description="untimed calls per tree of every interleaved verifier for the tau-law check (Cor. 1: TEV and "
                         "predraw both at 1 + C_p on the same trees); 0: the check reads the timed calls only")


class TevSection(Section):
    """TEV / ExitTrain experiments (Tables 1-5); absent = no TEV rules."""

    models: list[str] = Field(min_length=1)
    workloads: list[Suite] = Field(min_length=1)
    n_prompts: PosInt = Field(6, description="first n prompts of each frozen suite")
    max_new_tokens: PosInt = 64
    stop_at_eos: bool = True
    temperatures: list[NonNegNum] = Field([0.0, 1.0], min_length=1)
    budget: PosInt = Field(64, description="B of the main cells")
    budgets: list[PosInt] = Field([32, 64, 128], description="budget robustness (Table 5)")
    depth: PosInt = Field(8, description="maximum tree depth")
    target_prompts: PosInt | None = Field(
        None, description="the tau-target cell: AR, DDTree and ExitTrain + TEV at B = tev.budget, T = 0 on the first "
                          "target_prompts prompts of each workload (more prompts than the full cells, few arms), "
                          "which the report's tau-target line then reads; null: off (the line reads the full cells)")
    drafter: Drafter = Field(default_factory=Drafter)
    exittrain: ExitTrain = Field(default_factory=ExitTrain)
    latency: Latency = Field(default_factory=Latency)


SECTION: dict[str, Any] = section_schema(TevSection, description=TevSection.__doc__.strip())
DEFAULTS: dict[str, Any] = section_defaults(TevSection)


def tev_section(cfg: dict[str, Any]) -> TevSection:
    """The validated config's ``tev`` section as a typed object.

    Raises:
        SystemExit: the config has no ``tev`` section (one line).
    """
    return typed_section(cfg, "tev", TevSection)


def check_prompt_mix(cfg: dict[str, Any], drafter: dict[str, Any], where: str) -> None:
    """A drafter's held-out prompt sources (``math500``, ``humaneval``, ``mt_bench``: a workload's records
    outside its frozen sample) need that workload in the config.

    Raises:
        impl.config.ConfigError: one line naming the key.
    """
    from ..config import ConfigError

    for s in drafter.get("prompt_mix") or {}:
        if s not in ("sharegpt", "gsm8k") and s not in cfg["workloads"]:
            raise ConfigError(f"config: '{where}.prompt_mix.{s}' is {s}'s records outside its frozen sample, but "
                              f"'workloads' has no '{s}' (its n_prompts is the sample left out)")


def min_restricted_vocab(budgets) -> int:
    """The narrowest vocabulary V' the latency benchmark can restrict a tree of every budget to: a tree of
    N = B + 1 nodes needs 2 N - 1 = 2 B + 1 columns (:func:`impl.tev.latency.restrict_vocab`)."""
    return 2 * max(budgets) + 1


def check(cfg: dict[str, Any]) -> None:
    """Cross-checks of the ``tev`` section (model and workload names, depth vs block size).

    Raises:
        impl.config.ConfigError: one line naming the key.
    """
    from ..config import ConfigError

    t = cfg["tev"]
    for i, m in enumerate(t["models"]):
        if m not in cfg["models"]:
            raise ConfigError(f"config: 'tev.models[{i}]' names '{m}', which is not a key of 'models'")
    for i, w in enumerate(t["workloads"]):
        if w not in cfg["workloads"]:
            raise ConfigError(f"config: 'tev.workloads[{i}]' names '{w}', which is not a key of 'workloads'")
    if t["depth"] > t["drafter"]["block_size"]:
        raise ConfigError(f"config: 'tev.depth' = {t['depth']} exceeds 'tev.drafter.block_size' = "
                          f"{t['drafter']['block_size']} (a tree is at most one drafted block deep)")
    check_prompt_mix(cfg, t["drafter"], "tev.drafter")
    lat = t["latency"]
    least = min_restricted_vocab(lat["budgets"])
    for i, v in enumerate(lat["vocab_sizes"]):
        if v < least:
            raise ConfigError(f"config: 'tev.latency.vocab_sizes[{i}]' = {v} is below 2 * max('tev.latency.budgets') "
                              f"+ 1 = {least} (a restricted vocabulary must hold every tree's tokens)")
    for w in t["workloads"] if t.get("target_prompts") else ():
        have = cfg["workloads"][w]["n_prompts"]
        if t["target_prompts"] > have:
            raise ConfigError(f"config: 'tev.target_prompts' = {t['target_prompts']} exceeds 'workloads.{w}.n_prompts' "
                              f"= {have} (the target cell reads the first prompts of the frozen suite)")
    need = cfg["max_prompt_tokens"] + t["max_new_tokens"]
    if any(cfg["models"][m]["kind"] == "tiny" for m in t["models"]) and need > cfg["tiny_arch"]["max_position_embeddings"]:
        raise ConfigError("config: 'max_prompt_tokens' + 'tev.max_new_tokens' exceeds 'tiny_arch.max_position_embeddings'")
