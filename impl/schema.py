"""The core config sections as typed models (pydantic v2): the one source of the keys, bounds and
defaults of ``data_dir`` ... ``ar_bench``. :mod:`impl.config` generates its JSON schema
(:data:`impl.config.SCHEMA`) and its defaults from :class:`CoreConfig`; the method sections (``dex``,
``tev``, ``vskipper``) bring their own models (``impl/<family>/schema.py``).

Imports pydantic only (no torch): Snakemake reads the schema at parse time.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Mapping

from pydantic import ConfigDict, Field
from pydantic.json_schema import SkipJsonSchema

from .models.corpus import SOURCES
from .sections import Section
from .workloads import SUITES

__all__ = ["core_config", "CoreConfig", "ModelEntry", "Gguf", "EarlyExit", "WorkloadEntry", "Ead", "Compare", "ArBench",
           "Tokenizer", "Corpus", "TinyArch", "Training"]

PosInt = Annotated[int, Field(ge=1)]
PosNum = Annotated[float, Field(gt=0)]
NonNegInt = Annotated[int, Field(ge=0)]
Suite = Literal[tuple(SUITES)]  # type: ignore[valid-type]
Source = Literal[tuple(SOURCES)]  # type: ignore[valid-type]
Chars = Annotated[int, Field(ge=1000)]
_MODEL_NAME = "^[A-Za-z0-9][A-Za-z0-9_.-]*$"


class EarlyExit(Section):
    """``models.<name>.early_exit``: LayerSkip-style early-exit loss of a tiny model's training."""

    enabled: bool
    layers_per_step: PosInt | SkipJsonSchema[None] = None
    position_fraction: Annotated[float, Field(gt=0, le=1)] | SkipJsonSchema[None] = None
    weight: Annotated[float, Field(ge=0)] | SkipJsonSchema[None] = None


class Gguf(Section):
    """``models.<name>.gguf``: GGUF source that rule convert_<name> turns into the HF directory at path."""

    file: str = Field(min_length=1, description="file inside the installed package, or a path without one")
    package: Annotated[str, Field(min_length=1)] | SkipJsonSchema[None] = Field(
        None, description="installed PyPI distribution")
    version: Annotated[str, Field(min_length=1)] | SkipJsonSchema[None] = None
    sha256: Annotated[str, Field(pattern="^[0-9a-fA-F]{64}$")] | SkipJsonSchema[None] = None


class ModelEntry(Section):
    """One entry of ``models``: a tiny model trained in the DAG or a pretrained HF directory."""

    model_config = ConfigDict(json_schema_extra={"allOf": [
        # pretrained without a gguf source: path required (with one, path defaults to models_dir/<name>)
        {"if": {"properties": {"kind": {"const": "pretrained"}}, "not": {"required": ["gguf"]}},
         "then": {"required": ["path"]}},
        # a gguf source only on pretrained models
        {"if": {"properties": {"kind": {"const": "tiny"}}}, "then": {"not": {"required": ["gguf"]}}},
    ]})

    kind: Literal["tiny", "pretrained"]
    path: str | SkipJsonSchema[None] = Field(None, description="local HF directory (kind: pretrained; with a gguf "
                                                               "source: where to convert it, default models_dir/<name>)")
    gguf: Gguf | SkipJsonSchema[None] = None
    early_exit: EarlyExit | SkipJsonSchema[None] = None
    description: str | SkipJsonSchema[None] = None


class WorkloadEntry(Section):
    """One entry of ``workloads``: a frozen prompt suite."""

    n_prompts: PosInt
    template: Annotated[str, Field(min_length=1)] | SkipJsonSchema[None] = None
    chat: Annotated[str, Field(min_length=1)] | SkipJsonSchema[None] = Field(
        None, description="user-message template: models with a chat template get it as one user turn through "
                          "their own template (the plain template otherwise)")
    max_prompt_tokens: Annotated[int, Field(ge=2)] | SkipJsonSchema[None] = Field(
        None, description="this suite's prompt cap in tokens (overlong_prompt applies); null = the top-level "
                          "max_prompt_tokens")


class Compare(Section):
    """``ead.compare``: paired per-prompt comparison of mean stable EAD (treatment - baseline)."""

    baseline: str
    treatment: str
    shared: bool | SkipJsonSchema[None] = Field(
        None, description="also teacher-force both models on each other's generations (needs one tokenizer; "
                          "default: same kind)")


class Ead(Section):
    """``ead``: oracle EAD measurement (DEX Def. 1) and the AR baseline of the foundation."""

    models: list[str] = Field(min_length=1)
    workloads: list[Suite] = Field(min_length=1)
    max_new_tokens: PosInt
    stop_at_eos: bool = True
    num_speculations: list[PosInt] = Field([1, 4], min_length=1)
    n_prompts: PosInt | dict[str, PosInt] | SkipJsonSchema[None] = Field(
        None, description="EAD and AR-bench prompts per suite (the suite's first n): one int for every model, or "
                          "a mapping model -> int (unlisted models: the whole suite)")
    compare: Compare | SkipJsonSchema[None] = Field(
        None, description="paired per-prompt comparison of mean stable EAD (treatment - baseline)")
    nested_chains: list[Annotated[list[PosInt], Field(min_length=2)]] = [[2, 4, 12], [3, 6, 12]]


class ArBench(Section):
    """``ar_bench``: the AR wall-clock baseline."""

    max_new_tokens: PosInt = 64
    warmup_prompts: NonNegInt = 2
    repetitions: PosInt = 1


class Tokenizer(Section):
    """``tokenizer``: the tiny models' byte-level BPE."""

    vocab_size: Annotated[int, Field(ge=257)] = 4096


class Corpus(Section):
    """``corpus``: the tiny models' training text."""

    sources: Annotated[list[Source], Field(min_length=1, json_schema_extra={"uniqueItems": True})] = list(SOURCES)
    max_chars_per_source: Chars | Annotated[dict[str, Chars], Field(
        json_schema_extra={"propertyNames": {"enum": list(SOURCES)}})] = Field(
        4_000_000, description="character budget: one int for every source, or a mapping source -> int")
    val_fraction: Annotated[float, Field(gt=0, lt=0.5)] = 0.02


class TinyArch(Section):
    """``tiny_arch``: shape of the tiny Llamas trained in the DAG."""

    num_layers: Annotated[int, Field(ge=2)] = 12
    hidden_size: PosInt = 128
    num_heads: PosInt = 4
    intermediate_size: PosInt = 352
    max_position_embeddings: Annotated[int, Field(ge=16)] = 1024


class Training(Section):
    """``training``: the tiny models' LM training (one schedule: :mod:`impl.schedule`)."""

    steps: PosInt = 800
    batch_size: PosInt = 8
    seq_len: Annotated[int, Field(ge=8)] = 256
    lr: PosNum = 3e-3
    warmup_steps: NonNegInt = 50
    weight_decay: Annotated[float, Field(ge=0)] = 0.1
    grad_clip: PosNum = 1.0
    eval_windows: PosInt = 64
    threads: PosInt = 2


class CoreConfig(Section):
    """impl harness configuration (the core sections; the method sections are added by
    :func:`impl.config.full_schema`)."""

    data_dir: str = Field(description="folder with the datasets of SOURCES.md")
    results_dir: str
    figures_dir: str
    models_dir: str = Field(description="cache of trained tiny models")
    logs_dir: str = "logs"
    seed: NonNegInt
    threads: PosInt = 1
    device: Annotated[str, Field(pattern="^(cpu|cuda(:[0-9]+)?)$")] = "cpu"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    tokenizer: Tokenizer = Field(default_factory=Tokenizer)
    corpus: Corpus = Field(default_factory=Corpus)
    tiny_arch: TinyArch = Field(default_factory=TinyArch)
    training: Training = Field(default_factory=Training)
    models: Annotated[dict[str, ModelEntry], Field(
        min_length=1, json_schema_extra={"propertyNames": {"pattern": _MODEL_NAME}})]
    max_prompt_tokens: Annotated[int, Field(ge=2)] = 512
    overlong_prompt: Literal["truncate_left", "skip"] = "truncate_left"
    workloads: Annotated[dict[str, WorkloadEntry], Field(
        min_length=1, json_schema_extra={"propertyNames": {"enum": list(SUITES)}})]
    ead: Ead
    ar_bench: ArBench = Field(default_factory=ArBench)


def core_config(cfg: Mapping[str, Any]) -> CoreConfig:
    """The core sections of a validated config (:func:`impl.config.validate_config`, defaults filled in)
    as a typed :class:`CoreConfig`: what a command reads (``core.seed``, ``core.ead.max_new_tokens``),
    not ``cfg["..."]``. The method sections and any keys a command added are left out.

    Raises:
        pydantic.ValidationError: ``cfg`` is not a validated config (a programming error: commands get
            configs through :func:`impl.runtime.config_from_args`).
    """
    return CoreConfig.model_validate({k: cfg[k] for k in CoreConfig.model_fields if k in cfg})


def prompt_cap(core: CoreConfig, suite: str | None) -> int:
    """The most prompt tokens a suite's frozen prompts may have: ``workloads.<suite>.max_prompt_tokens`` when
    set, else the top-level ``max_prompt_tokens`` (also for ``suite=None`` or a suite not in ``workloads``).

    Args:
        core (CoreConfig): the validated core config.
        suite (str | None): the suite the prompts belong to (their rows' ``suite`` field).

    Returns:
        int: the cap, >= 2.
    """
    w = core.workloads.get(suite) if suite is not None else None
    return w.max_prompt_tokens if w is not None and w.max_prompt_tokens is not None else core.max_prompt_tokens
