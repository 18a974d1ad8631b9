"""The optional ``dex:`` config section (DEX experiments: Fig. 3, Fig. 4, Table 1): typed models (the one
source of its keys, bounds and defaults), the JSON schema and defaults generated from them, and
cross-checks. Registered in :data:`impl.config.CONFIG_SECTIONS`; imported at validation time (also by
Snakemake at parse time), so it imports nothing heavy (pydantic, no torch).

A command reads the section as a typed object: ``DexSection.model_validate(cfg["dex"])``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from ..sections import Section, section_defaults, section_schema, typed_section
from ..tev.schema import Drafter, check_prompt_mix
from ..workloads.suites import SUITES

__all__ = ["dex_section", "DexSection", "Distributed", "Decs", "Adapters", "Baselines", "Draft", "Speculative",
           "PromptLookup", "LookaheadArm", "AssistedArm", "TrainedHead", "PearlArm", "DEFAULTS", "SECTION", "check"]

PosInt = Annotated[int, Field(ge=1)]
PosNum = Annotated[float, Field(gt=0)]
Suite = Literal[tuple(SUITES)]  # type: ignore[valid-type]


class Distributed(Section):
    """``dex.distributed``: multi-process runs (one torch.distributed rank per explorer) on the first
    dex model and workload, measuring communication per round."""

    explorers: list[Annotated[int, Field(ge=2)]] = [2, 3]
    n_prompts: PosInt = Field(2, description="first n prompts, each decoded and recorded (the first is also "
                              "decoded once before, unrecorded, as warm-up)")
    max_new_tokens: PosInt = 32


class Decs(Section):
    """``dex.decs``: the DECS cells (DEX Sec. 4, sampled decoding)."""

    explorers: list[PosInt] = [4]
    temperatures: list[Annotated[float, Field(ge=0)]] = [0.0, 1.0]


class Adapters(Section):
    """``dex.adapters``: inducing adapters (DEX App. C.2) trained on a frozen backbone."""

    models: list[str] = []
    steps: PosInt = 300
    batch_size: PosInt = 8
    seq_len: Annotated[int, Field(ge=8)] = 256
    lr: PosNum = 5e-3
    position_fraction: Annotated[float, Field(gt=0, le=1)] = 0.25
    max_chars: Annotated[int, Field(ge=10000)] = 4_000_000
    threads: PosInt = 2


class Draft(Section):
    """``dex.draft``: the small draft model of each dex model for the speculative arms (DEX Fig. 5;
    :mod:`impl.models.draft`): a copy of the model keeping ``layers`` evenly spaced decoder layers,
    distilled to it on ShareGPT by full-vocabulary KL (embeddings and LM head frozen)."""

    layers: PosInt = Field(4, description="decoder layers kept (evenly spaced, first and last included)")
    steps: PosInt = 60
    batch_size: PosInt = 4
    seq_len: Annotated[int, Field(ge=8)] = 128
    lr: PosNum = 1e-4
    position_fraction: Annotated[float, Field(gt=0, le=1)] = 0.25
    max_chars: Annotated[int, Field(ge=10000)] = 1_000_000
    threads: PosInt = 2


class SelfSpec(Section):
    """``dex.baselines.self_spec``: the LayerSkip self-speculation grid."""

    exit_layers: list[PosInt] = Field([1, 2, 3, 4, 6], min_length=1)
    num_speculations: list[PosInt] = Field([2, 4, 6, 8], min_length=1)


class AdaDecode(Section):
    """``dex.baselines.adadecode``: the AdaDecode grid."""

    shortcut_every: PosInt = 2
    num_speculations: list[PosInt] = Field([2, 4, 6, 8], min_length=1)
    thresholds: list[Annotated[float, Field(ge=0, le=1)]] = Field([0.2, 0.4, 0.6, 0.8], min_length=1)


class Baselines(Section):
    """``dex.baselines``: the tuned depth-selection baselines."""

    tune_prompts: PosInt = Field(3, description="prompts per workload used for tuning")
    self_spec: SelfSpec = Field(default_factory=SelfSpec)
    adadecode: AdaDecode = Field(default_factory=AdaDecode)
    dynamic_exit: bool = True
    hf_early_exit: bool = Field(True, description="transformers' assistant_early_exit at the tuned self_spec "
                                                  "parameters, as a library reference arm")


class PromptLookup(Section):
    """``dex.speculative.prompt_lookup``: transformers' prompt-lookup decoding (method ``hf_prompt_lookup``)."""

    num_tokens: PosInt = Field(4, description="most draft tokens per verification")
    max_matching_ngram_size: PosInt = Field(2, description="longest n-gram looked up in the context")


class LookaheadArm(Section):
    """``dex.speculative.lookahead``: Lookahead decoding (method ``lookahead``; Fu et al. 2024)."""

    window: PosInt = Field(5, description="W, lookahead positions per level")
    ngram: Annotated[int, Field(ge=2)] = Field(4, description="N, the n-gram size (N - 1 window levels)")
    max_candidates: PosInt = Field(5, description="G, n-grams verified per step")


class AssistedArm(Section):
    """``dex.speculative.assisted``: transformers' assisted decoding with the model's ``dex.draft`` model
    (method ``hf_assisted``)."""

    num_assistant_tokens: PosInt = Field(4, description="draft tokens per verification")


class TrainedHead(Section):
    """``dex.speculative.dflash``: the trained draft head arm (method ``dflash_chain``): TEV's DFlash-style
    block drafter of the model drafting a chain verified in one target pass. A model in tev.models uses
    its TEV drafters (rule tev_train); any other plain dex model gets a base drafter trained with
    ``drafter``'s settings (rule train_head: the same training code, no ExitTrain objectives)."""

    objective: Literal["base", "token", "prefix", "exit"] = Field(
        "exit", description="which of the model's TEV drafters (base, or an ExitTrain objective; models not in "
                            "tev.models have only base)")
    depth: PosInt = Field(4, description="chain length (at most the drafter's block_size)")
    drafter: Drafter | None = Field(None, description="the base drafter's settings for dex models not in tev.models "
                                                      "(keys of tev.drafter); null: those models have no such arm")


class PearlArm(Section):
    """``dex.speculative.pearl``: PEARL (method ``pearl``) with the model's ``dex.draft`` model."""

    gamma: PosInt = Field(4, description="the draft window")
    distributed: bool = Field(True, description="also on two torch.distributed ranks (target, draft) for the "
                                                "first of dex.models on every dex workload (rule dex_pearl_ranks)")


class TensorParallelArm(Section):
    """``dex.speculative.tensor_parallel``: transformers' tensor-parallel plan over ``ranks`` torch.distributed
    ranks (:mod:`impl.spec.tensor_parallel`) for the first of dex.models on every dex workload (rule
    dex_tensor_parallel)."""

    ranks: Annotated[int, Field(ge=2)] = Field(2, description="K; must divide the attention heads, the key-value "
                                                              "heads and the MLP width (SmolLM2-135M: 3)")


class Speculative(Section):
    """``dex.speculative``: the speculative arms of Fig. 5, run greedy in every DEX cell of a plain
    (not adapted) model beside AR, DEX and the baselines; null = that arm is off."""

    prompt_lookup: PromptLookup | None = None
    lookahead: LookaheadArm | None = None
    assisted: AssistedArm | None = Field(None, description="needs dex.draft (the draft model)")
    pearl: PearlArm | None = Field(None, description="needs dex.draft (the draft model)")
    dflash: TrainedHead | None = Field(None, description="in the cells of the models in tev.models (their TEV "
                                                         "drafters)")
    tensor_parallel: TensorParallelArm | None = None


class DexSection(Section):
    """DEX experiments (Fig. 3, Fig. 4, Table 1); absent = no DEX rules."""

    models: list[str] = Field(min_length=1)
    workloads: list[Suite] = Field(min_length=1)
    n_prompts: PosInt = Field(8, description="first n prompts of each frozen suite")
    max_new_tokens: PosInt = 64
    stop_at_eos: bool = True
    explorers: list[PosInt] = Field([], description="K of the uniform DEX-1/K sets; [] = every K dividing L")
    exploration_sets: list[Annotated[list[PosInt], Field(min_length=1)]] = Field(
        [], description="extra (non-uniform) exploration sets")
    dedupe: bool = Field(True, description="merge repeated candidates of one slot (lossless)")
    single_exit: bool = Field(True, description="single-exit ablation for every K > 2")
    distributed: Distributed = Field(default_factory=Distributed)
    decs: Decs = Field(default_factory=Decs)
    adapters: Adapters = Field(default_factory=Adapters)
    baselines: Baselines = Field(default_factory=Baselines)
    draft: Draft | None = Field(None, description="draft model per dex model (rule train_draft); null = none")
    speculative: Speculative = Field(default_factory=Speculative)


SECTION: dict[str, Any] = section_schema(DexSection, description=DexSection.__doc__.strip())
DEFAULTS: dict[str, Any] = section_defaults(DexSection)


def dex_section(cfg: dict[str, Any], *, why: str = "") -> DexSection:
    """The validated config's ``dex`` section as a typed object.

    Raises:
        SystemExit: the config has no ``dex`` section (one line; ``why`` is appended).
    """
    return typed_section(cfg, "dex", DexSection, why=why)


def check(out: dict[str, Any]) -> None:
    """Cross-checks of the ``dex`` section (names, and depths against L where every model is tiny).

    Raises:
        impl.config.ConfigError: one line naming the key.
    """
    from ..config import ConfigError

    d = out["dex"]
    for key in ("models", "adapters.models"):
        names = d["models"] if key == "models" else d["adapters"]["models"]
        for i, m in enumerate(names):
            if m not in out["models"]:
                raise ConfigError(f"config: 'dex.{key}[{i}]' names '{m}', which is not a key of 'models'")
    for i, m in enumerate(d["adapters"]["models"]):
        if m not in d["models"]:
            raise ConfigError(f"config: 'dex.adapters.models[{i}]' names '{m}', which is not in 'dex.models'")
    spec = d.get("speculative") or {}
    for arm in ("assisted", "pearl"):
        if spec.get(arm) is not None and d.get("draft") is None:
            raise ConfigError(f"config: 'dex.speculative.{arm}' needs 'dex.draft' (the draft model it decodes with)")
    fl = spec.get("dflash")
    if fl is not None:
        head = TrainedHead(**fl)
        tev = out.get("tev") or {}
        in_tev = set(tev.get("models") or []) & set(d["models"])
        if not in_tev and head.drafter is None:
            raise ConfigError("config: 'dex.speculative.dflash' needs a model of 'dex.models' in 'tev.models' "
                              "(its TEV drafters) or 'dex.speculative.dflash.drafter' (a drafter trained for DEX)")
        if head.drafter is not None:
            check_prompt_mix(out, head.drafter.model_dump(), "dex.speculative.dflash.drafter")
        if in_tev:
            H = (tev.get("drafter") or {}).get("block_size")
            if H is not None and head.depth > H:
                raise ConfigError(f"config: 'dex.speculative.dflash.depth' = {head.depth} "
                                  f"exceeds 'tev.drafter.block_size' = {H}")
            objs = ["base"] + list((tev.get("exittrain") or {}).get("objectives") or [])
            if head.objective not in objs:
                raise ConfigError(f"config: 'dex.speculative.dflash.objective' = {head.objective!r} is not "
                                  f"a drafter the TEV rules train ({', '.join(objs)})")
        if head.drafter is not None and set(d["models"]) - in_tev:
            if head.depth > head.drafter.block_size:
                raise ConfigError(f"config: 'dex.speculative.dflash.depth' = {head.depth} exceeds "
                                  f"'dex.speculative.dflash.drafter.block_size' = {head.drafter.block_size}")
            if head.objective != "base":
                raise ConfigError(f"config: 'dex.speculative.dflash.objective' = {head.objective!r}: the drafters "
                                  "trained for DEX (models not in tev.models) have only 'base'")
    tp = spec.get("tensor_parallel")
    first = out["models"].get(d["models"][0]) if d["models"] else None
    if tp is not None and first is not None:
        K = tp.get("ranks", TensorParallelArm().ranks)
        if first["kind"] == "tiny":
            a = out["tiny_arch"]
            bad = [f"tiny_arch.{k} = {a[k]}" for k in ("num_heads", "intermediate_size") if a.get(k) and a[k] % K]
        else:  # a pretrained model: its config.json once the directory exists (else the rule refuses K in one line)
            import json
            from pathlib import Path

            f = Path(first.get("path") or "") / "config.json"
            c = json.loads(f.read_text()) if first.get("path") and f.is_file() else {}
            bad = [f"{k} = {c[k]} ({f})" for k in ("num_attention_heads", "num_key_value_heads", "intermediate_size")
                   if isinstance(c.get(k), int) and c[k] % K]
        if bad:
            raise ConfigError(f"config: 'dex.speculative.tensor_parallel.ranks' = {K} does not divide {', '.join(bad)}")
    for i, w in enumerate(d["workloads"]):
        if w not in out["workloads"]:
            raise ConfigError(f"config: 'dex.workloads[{i}]' names '{w}', which is not a key of 'workloads'")
    if all(out["models"][m]["kind"] == "tiny" for m in d["models"]):
        L = out["tiny_arch"]["num_layers"]
        for i, k in enumerate(d["explorers"]):
            if L % k:
                raise ConfigError(f"config: 'dex.explorers[{i}]' = {k} does not divide tiny_arch.num_layers ({L})")
        for i, k in enumerate(d["distributed"]["explorers"]):
            if L % k:
                raise ConfigError(f"config: 'dex.distributed.explorers[{i}]' = {k} does not divide tiny_arch.num_layers ({L})")
        for i, k in enumerate(d["decs"]["explorers"]):
            if L % k:
                raise ConfigError(f"config: 'dex.decs.explorers[{i}]' = {k} does not divide tiny_arch.num_layers ({L})")
        for i, xs in enumerate(d["exploration_sets"]):
            if list(xs) != sorted(set(xs)) or xs[-1] != L or xs[0] < 1:
                raise ConfigError(f"config: 'dex.exploration_sets[{i}]' = {xs} must be strictly increasing depths "
                                  f"in [1, {L}] ending at L = {L}")
        for i, e in enumerate(d["baselines"]["self_spec"]["exit_layers"]):
            if not 1 <= e < L:
                raise ConfigError(f"config: 'dex.baselines.self_spec.exit_layers[{i}]' = {e} is outside [1, {L - 1}]")
    ad = d["adapters"]
    if any(out["models"][m]["kind"] == "tiny" for m in ad["models"]) and ad["seq_len"] > out["tiny_arch"]["max_position_embeddings"]:
        raise ConfigError(f"config: 'dex.adapters.seq_len' = {ad['seq_len']} exceeds "
                          f"'tiny_arch.max_position_embeddings' = {out['tiny_arch']['max_position_embeddings']}")
    need = out["max_prompt_tokens"] + d["max_new_tokens"]
    if any(out["models"][m]["kind"] == "tiny" for m in d["models"]) and need > out["tiny_arch"]["max_position_embeddings"]:
        raise ConfigError(f"config: 'max_prompt_tokens' + 'dex.max_new_tokens' = {need} exceeds "
                          f"'tiny_arch.max_position_embeddings'")
    la = (d.get("speculative") or {}).get("lookahead")
    if la is not None and any(out["models"][m]["kind"] == "tiny" for m in d["models"]):
        W, N = la.get("window", LookaheadArm().window), la.get("ngram", LookaheadArm().ngram)
        if need + W + N - 3 > out["tiny_arch"]["max_position_embeddings"]:
            raise ConfigError(f"config: 'max_prompt_tokens' + 'dex.max_new_tokens' + the lookahead window "
                              f"(window + ngram - 3 = {W + N - 3}) = {need + W + N - 3} exceeds "
                              f"'tiny_arch.max_position_embeddings'")
