"""The optional ``vskipper:`` config section (vSkipper Sec. 4, Tables 2-7, Fig. 3): typed models (the one
source of its keys, bounds and defaults), the JSON schema and defaults generated from them, and
cross-checks. Absent section = no vSkipper serving rules.

Plugged into :mod:`impl.config` through ``CONFIG_SECTIONS``: this module exposes :data:`SECTION` (the
section's JSON schema, generated from :class:`VskipperSection`), :data:`DEFAULTS` (merged under the
user's values) and :func:`check` (cross-key checks on the whole validated config, raising
:class:`impl.config.ConfigError` one-liners that name the key). :func:`vskipper_section` gives a
command the typed section. Snakemake imports it at parse time, so it imports nothing heavy (pydantic,
no torch).

Keys (units in brackets):

- ``model``: the base model (a key of ``models``) the FlexiDepth-style skipper is trained on and served
  with; upstream serves this model unmodified.
- ``workloads``: load workloads (keys of ``workloads``); each gets its own knee and cells.
- ``max_new_tokens`` [tokens]: natural generation cap of every request (the matched-work lane
  replays the baseline's natural lengths, so this is also the largest replayed length).
- ``requests``: requests per performance cell, cycled through the suite's frozen prompts (a cycled
  request gets a ``#k`` id suffix, so RandomSkip hashes it as a new request).
- ``repetitions``: paired repetitions per main cell (the paper uses 6; one is never resolved).
- ``lanes``: ``matched`` (replayed lengths, EOS ignored, gated) and/or ``natural`` (App. G).
- ``load_points``: label -> multiple of Q* (default, the paper's: below 0.75, knee 0.95, overload 1.25;
  a mapping given replaces the default entirely, filled in by :func:`check`). The label
  ``knee`` is where the ablation and the RandomSkip map run (``randomskip.point``).
- ``timeout_s`` [s]: per-run completion timeout.
- ``engine``: transformers continuous-batching settings shared by every arm: ``page_size`` [tokens],
  ``num_blocks`` (null: enough pages for every request of a run at once), ``max_batch_tokens``
  [tokens per forward], ``max_requests_per_batch``.
- ``engines``: the serving engine of each arm family: ``upstream`` is ``transformers`` (in process, the
  default) or ``sglang`` (upstream SGLang's own server, started from ``vskipper.sglang``: ``python``,
  ``attention_backend``, ``max_total_tokens`` [tokens], ``ready_timeout_s`` [s], ``extra_args``); the
  knee sweep and every serving cell then drive it over HTTP with token-id prompts; ``routed`` is
  ``transformers`` (default) or ``sglang``: the hybrid, the always-route and ablation arms and the
  RandomSkip map's arms served by SGLang with vSkipper as an out-of-tree model (one server per arm;
  :class:`impl.vskipper.sglang_routed.RoutedSGLangArm`).
- ``knee``: the Q* sweep on the upstream arm under natural generation: ``rates`` (>= 3, increasing),
  absolute [req/s] with ``scale: absolute`` or multiples of the upstream arm's serial capacity
  (``1 / mean E2E`` of ``probe_requests`` requests served one at a time,
  :func:`impl.serving.knee.serial_capacity`) with ``scale: capacity``, so one grid brackets the knee
  of models of very different speed; growth threshold ``eps``, ``requests`` (null = ``requests``), ``on_boundary``:
  ``boundary`` (when the knee falls on the bottom/top rung, cells run at the load points of that rung
  and every row and table says the knee was not bracketed) or ``skip`` (cells write one ``skipped``
  row instead of measuring).
- ``flexidepth``: stage-1 training budget of the skipper (``steps``, ``batch_size``, ``seq_len``
  [tokens], ``lr``, ``skip_alpha``, ``routed_layers`` (null = the second half of the layers),
  ``threads``, ``max_chars`` of ShareGPT text tokenized for training, ``eval_windows``).
- ``profile``: the routed-cost profile and the threshold rule (:func:`impl.vskipper.mode.profile_routed_cost`,
  :func:`impl.vskipper.mode.derive_thresholds`): ``prefill_tokens`` [prompt tokens per batch],
  ``prefill_prompt_len`` [tokens], ``decode_requests`` [running requests], ``decode_context``
  [tokens], ``repeats``, ``share_slack``, ``margin``, ``probe_every`` [admitted batches], and
  ``share_prompts``: prompts of the first load workload generated under always-route to measure the
  policy's Project-Only share per phase.
- ``ablations``: mechanism ablation arms run at the knee beside the served hybrid (Table 3):
  any of ``prefill-only``, ``decode-only``, ``no-promotion``, ``always-route``; ``[]`` = no ablation
  rule. ``ablation_repetitions``: their paired repetitions (paper: 1).
- ``randomskip``: the Fig. 3 map: ``r`` and ``d`` grids (fractions in [0, 1]), ``point`` (a label of
  ``load_points``), ``repetitions``, ``requests`` (null = ``requests``), hash ``seed``,
  ``layer_choice`` (``per_row`` | ``fixed``); ``r: []`` = no map rule.
- ``bench`` (optional): settings of the per-step timing benchmark (rule ``vskipper_bench``), named as
  the ``vskipper-bench`` flags with underscores (``prefill_tokens``, ``decode_requests``, ``r``, ``d``,
  ``wide_hidden``, ...); a key left out takes the command's default
  (:data:`impl.vskipper.commands.BENCH_DEFAULTS`), a flag given on the command line wins; and
  ``models``: further keys of ``models`` timed too (all-RUN and RandomSkip arms only).
- ``quality`` (optional; absent = no quality rule): the lm-eval 2x2 DiD of rule ``vskipper_quality``
  (Sec. 4.3, Table 5 left; :mod:`impl.quality`), one job per suite. ``tasks`` (required: suites among
  gsm8k, bbh, coqa; giving the list is what turns the rule on); the other keys default to
  :data:`QUALITY_DEFAULTS` (filled in by :func:`check`): ``limit`` (documents per lm-eval task, each BBH
  subtask counting separately; null = every document), ``bbh_subtasks`` (BBH task files under
  ``bbh/tasks/``), ``gsm8k_num_fewshot`` (GSM8K few-shot examples; BBH uses the three CoT exemplars of
  its prompt file, CoQA is zero-shot), ``max_gen_toks`` [tokens] per suite (generation budget; each
  must leave room for a prompt in the tiny context), ``first_token_docs`` (documents per suite whose
  top-5 first-token log-probabilities are compared across arms, App. E.1; 0 = none), ``tol``
  [nats] (agreement tolerance, paper: 0.01), ``http_concurrency`` (requests lm-eval keeps in flight
  against the served arms C and D; null = ``vskipper.engine.max_requests_per_batch``, capped by the
  documents) and ``served``: the served-at-knee pass of rule ``vskipper_quality_served`` (Table 5
  right: the checkpoint served by the hybrid and by always-route under a seeded Poisson stream;
  :mod:`impl.vskipper.quality_served`), null = no such rule, else a mapping (defaults :data:`SERVED_DEFAULTS`)
  with ``point`` (a label of ``load_points``: the stream's rate is that multiple of Q*; paper: the knee,
  0.95 x Q*), ``workload`` (whose knee JSON gives Q*: a key of ``vskipper.workloads``; null = the suite
  itself when it is a load workload, else the first load workload - the tiny default sweeps only
  GSM8K) and ``requests`` (requests in the stream, padded with the knee workload's frozen prompts at
  ``max_new_tokens``, not scored; null = ``vskipper.requests``; 0 = the scored documents only).
- ``cross_model`` (optional; absent or ``models: []`` = no cross-model rules, no Table 6): the Table 6
  shape (Sec. 4.4): ``models`` (keys of ``models`` other than ``vskipper.model``, which contributes its row
  from the main outputs), each getting its own FlexiDepth skipper (``{models_dir}/{model}-flexidepth``), its
  own rule-derived thresholds, its own knee on ``workload`` and a matched-lane cell at ``point`` (a label of
  ``load_points``); ``workload`` (one of ``vskipper.workloads``, default gsm8k); ``repetitions`` (null =
  ``vskipper.repetitions``; paper: 3 for the Qwen3 rows). Served accuracy (base served vs skipper served,
  arms C and D of the quality 2x2) needs ``vskipper.quality`` with ``workload`` among its tasks.
- ``devices`` (optional; absent or ``[]`` = no transfer rules, no Table 7): the Table 7 shape (Sec. 4.4,
  hardware transfer): a list of ``{name, device, threads, repetitions?, resources?}``; each entry re-runs
  the thresholds profile, the knee on ``cross_model.workload`` and a matched-lane cell at
  ``cross_model.point`` for ``vskipper.model`` with that ``device`` (as the top-level key: ``cpu``,
  ``cuda``, ``cuda:N``) and ``threads`` (torch intra-op threads), against upstream on the same device.
  ``name`` (unique, ``[A-Za-z0-9][A-Za-z0-9_.-]*``) names the output folder; ``repetitions`` (null =
  ``vskipper.repetitions``); ``resources``: Snakemake resources of that device's jobs (e.g.
  ``slurm_partition``, ``gres``, ``constraint``, ``mem_mb``, ``runtime``) so a cluster profile routes them
  to that hardware. :func:`target_config` derives each extra target's effective config.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field
from pydantic.json_schema import SkipJsonSchema

from ..sections import Section, section_defaults, section_schema, typed_section

__all__ = ["VskipperSection", "vskipper_section", "SECTION", "DEFAULTS", "DEFAULT_LOAD_POINTS", "ABLATION_ARMS",
           "SERVED_ARMS",
           "QUALITY_TASKS", "QUALITY_DEFAULTS", "SERVED_DEFAULTS", "CROSS_DEFAULTS", "served_knee_workload",
           "transfer_settings", "target_config", "check"]

#: ablation arm names (a subset of :data:`impl.vskipper.mode.ABLATIONS`; no torch import here)
ABLATION_ARMS = ("prefill-only", "decode-only", "no-promotion", "always-route")
#: every engine arm the server serves (:class:`impl.vskipper.driver.CompletionEngine`), in order
SERVED_ARMS = ("upstream", "hybrid", "always-route", "prefill-only", "decode-only", "no-promotion", "never-route")
#: tasks the quality rule may score
QUALITY_TASKS = ("gsm8k", "bbh", "coqa")
_NAME = "^[A-Za-z0-9][A-Za-z0-9_.-]*$"  # model / device names: safe as one path component
_LABEL = "^[A-Za-z][A-Za-z0-9_]*$"  # load-point labels
_RESOURCE = "^[A-Za-z_][A-Za-z0-9_]*$"  # Snakemake resource names
_LANES = ("matched", "natural")
_SUITES = ["gsm8k", "humaneval", "xsum", "mt_bench", "math500", "bbh", "coqa"]

PosInt = Annotated[int, Field(ge=1)]
NonNegInt = Annotated[int, Field(ge=0)]
PosNum = Annotated[float, Field(gt=0)]
NonNegNum = Annotated[float, Field(ge=0)]
Fraction = Annotated[float, Field(ge=0, le=1)]
Name = Annotated[str, Field(pattern=_NAME)]
Label = Annotated[str, Field(pattern=_LABEL)]
Suite = Literal[tuple(_SUITES)]  # type: ignore[valid-type]
_UNIQUE = {"uniqueItems": True}


class Engine(Section):
    """``vskipper.engine``: transformers continuous-batching settings shared by every arm."""

    page_size: Annotated[int, Field(ge=8)] = Field(64, description="[tokens]")
    num_blocks: PosInt | None = Field(None, description="null: enough pages for every request of a run at once")
    max_batch_tokens: Annotated[int, Field(ge=16)] = Field(2048, description="[tokens per forward]")
    max_requests_per_batch: PosInt = 64


class Engines(Section):
    """``vskipper.engines``: the serving engine of each arm family (issue "Upstream SGLang as a real engine
    arm")."""

    upstream: Literal["transformers", "sglang"] = Field(
        "transformers", description="transformers: the unmodified model on transformers' continuous batching "
                                    "(in process); sglang: upstream SGLang's own server (vskipper.sglang), driven "
                                    "over HTTP by the same protocol (knee, matched work, paired repetitions)")
    routed: Literal["transformers", "sglang"] = Field(
        "transformers", description="the routed arms (hybrid, always-route, ablations, the RandomSkip map): "
                                    "transformers (the routed layers in process) or sglang (vSkipper as an "
                                    "out-of-tree SGLang model, impl.vskipper.sglang_model: one SGLang server per "
                                    "arm, from vskipper.sglang; Llama-family models)")


class Sglang(Section):
    """``vskipper.sglang``: how the SGLang server of an ``sglang`` arm family starts
    (:class:`impl.serving.sglang_server.SGLangLaunch`)."""

    python: str = Field(".venv-sglang/bin/python", description="the SGLang environment's interpreter "
                                                                "(scripts/setup_sglang.sh)")
    attention_backend: str | None = Field(None, description="--attention-backend; null: torch_native on CPU, "
                                                            "SGLang's choice on CUDA")
    max_total_tokens: PosInt | None = Field(16384, description="KV-cache size [tokens]; null: SGLang's own "
                                                               "sizing (GPU only)")
    ready_timeout_s: PosNum = Field(900.0, description="start-up limit [s]")
    extra_args: list[str] = Field([], description="further launch_server arguments, verbatim")
    server_per_run: bool = Field(False, description="false: each SGLang arm's server starts on the arm's first run "
                                                    "and stays up until the cell ends (every arm's server up at "
                                                    "once); true: each run starts its arm's server and stops it "
                                                    "after (one server on the device at a time, a start-up per "
                                                    "run: for a GPU that cannot hold every arm's model at once)")
    upstream_graphs: bool = Field(False, description="graph capture (CUDA graphs) on the upstream SGLang arm: "
                                                     "false (default) runs it without, as every routed arm must "
                                                     "run (its routes change per step), so the arms compare like "
                                                     "for like; true measures upstream as SGLang ships it")


class Knee(Section):
    """``vskipper.knee``: the Q* sweep on the upstream arm under natural generation."""

    rates: list[PosNum] = Field([4.0, 8.0, 12.0, 16.0, 24.0, 32.0], min_length=3, json_schema_extra=_UNIQUE,
                                description="arrival rates [req/s] (scale: absolute) or multiples of the serial "
                                            "capacity (scale: capacity)")
    scale: Literal["absolute", "capacity"] = Field(
        "absolute", description="absolute: rates in req/s; capacity: rates x the upstream arm's serial capacity "
                                "1 / mean E2E of probe_requests requests served one at a time")
    probe_requests: PosInt = Field(4, description="requests of the serial-capacity probe (scale: capacity)")
    eps: NonNegNum = Field(0.02, description="growth threshold")
    requests: PosInt | None = Field(None, description="null = vskipper.requests")
    on_boundary: Literal["boundary", "skip"] = "boundary"


class FlexiDepth(Section):
    """``vskipper.flexidepth``: the router / projector training of the FlexiDepth skipper."""

    steps: PosInt = 200
    batch_size: PosInt = 8
    seq_len: Annotated[int, Field(ge=8)] = 128
    lr: PosNum = 3e-3
    skip_alpha: NonNegNum = 0.1
    routed_layers: Annotated[list[NonNegInt], Field(min_length=1, json_schema_extra=_UNIQUE)] | None = None
    threads: PosInt = 1
    max_chars: Annotated[int, Field(ge=10000)] = 2_000_000
    eval_windows: PosInt = 16


class Profile(Section):
    """``vskipper.profile``: the thresholds profile (routed cost per phase)."""

    prefill_tokens: list[PosInt] = Field([128, 512], min_length=1)
    prefill_prompt_len: PosInt = 64
    decode_requests: list[PosInt] = Field([8, 32], min_length=1)
    decode_context: PosInt = 96
    repeats: PosInt = 5
    share_slack: Annotated[float, Field(gt=0, le=1)] = 0.7
    margin: PosNum = 1.0
    probe_every: PosInt = 64
    share_prompts: PosInt = 8


class RandomSkipMap(Section):
    """``vskipper.randomskip``: the Fig. 3 map; ``r: []`` = no map rule."""

    r: list[Fraction] = Field([0.25, 0.5, 0.75], json_schema_extra=_UNIQUE)
    d: list[Fraction] = Field([0.25, 0.5, 0.75], json_schema_extra=_UNIQUE)
    point: str = "knee"
    repetitions: PosInt = 1
    requests: PosInt | None = None
    seed: NonNegInt = 0
    layer_choice: Literal["per_row", "fixed"] = "per_row"


class Bench(Section):
    """``vskipper.bench`` (optional): settings of the per-step timing benchmark (rule vskipper_bench),
    named as the ``vskipper-bench`` flags; a key left out takes the command's default
    (``impl.vskipper.commands.BENCH_DEFAULTS``), a flag wins over both."""

    models: list[Name] = Field(default_factory=list, description="further models timed beside vskipper.model "
                               "and the wide model (keys of 'models'; all-RUN and RandomSkip arms, no FlexiDepth "
                               "or hybrid arms: those run on vskipper.model)")
    prefill_tokens: Annotated[list[PosInt], Field(min_length=1)] | SkipJsonSchema[None] = None
    prompt_len: PosInt | SkipJsonSchema[None] = None
    decode_requests: Annotated[list[PosInt], Field(min_length=1)] | SkipJsonSchema[None] = None
    decode_context: PosInt | SkipJsonSchema[None] = None
    repeats: PosInt | SkipJsonSchema[None] = None
    warmup: NonNegInt | SkipJsonSchema[None] = None
    cell_budget_s: NonNegNum | SkipJsonSchema[None] = None
    max_repeats: PosInt | SkipJsonSchema[None] = None
    target_budget_s: NonNegNum | SkipJsonSchema[None] = None
    target_max_repeats: PosInt | SkipJsonSchema[None] = None
    r: Annotated[list[Fraction], Field(min_length=1, json_schema_extra=_UNIQUE)] | SkipJsonSchema[None] = None
    d: Annotated[list[Fraction], Field(min_length=1, json_schema_extra=_UNIQUE)] | SkipJsonSchema[None] = None
    hybrid: bool | SkipJsonSchema[None] = None
    profile_repeats: PosInt | SkipJsonSchema[None] = None
    profile_steps: PosInt | SkipJsonSchema[None] = None
    profile_requests: list[PosInt] | SkipJsonSchema[None] = None
    wide_hidden: PosInt | SkipJsonSchema[None] = None
    wide_intermediate: PosInt | SkipJsonSchema[None] = None
    wide_layers: PosInt | SkipJsonSchema[None] = None
    wide_heads: PosInt | SkipJsonSchema[None] = None


class BenchServing(Section):
    """``vskipper.http.bench_serving``: SGLang's ``bench_serving`` client against every served arm
    (:mod:`impl.vskipper.bench_serving`); off while ``python`` is null."""

    python: str | None = Field(None, description="a Python with SGLang installed (scripts/setup_sglang.sh: "
                                                 ".venv-sglang/bin/python); null: the check does not run")
    num_prompts: PosInt = Field(8, description="measured requests per arm (after one warm-up)")
    output_len: Annotated[int, Field(ge=4)] = Field(32, description="tokens per request, EOS ignored")
    context_len: Annotated[int, Field(ge=8)] = Field(512, description="longest prompt + output kept [tokens]")
    max_concurrency: PosInt | None = Field(4, description="requests in flight; null: no cap (open loop)")
    request_rate: PosNum | None = Field(None, description="Poisson arrivals [requests/s]; null: all at once. With a "
                                                          "rate and max_concurrency null the project's load "
                                                          "generator replays the same prompts at the same rate and "
                                                          "the two clients' E2E / TTFT / TPOT are compared")
    models: list[Name] | None = Field(None, description="models measured (rule vskipper_bench_serving); "
                                                        "null: every model of the config")
    arms: Annotated[list[Literal[SERVED_ARMS]], Field(min_length=1, json_schema_extra=_UNIQUE)] = Field(  # type: ignore[valid-type]
        default_factory=lambda: list(SERVED_ARMS), description="arms measured (default: every served arm)")
    knee: bool = Field(True, description="also at the knee (rule vskipper_knee_bench_serving): upstream and the hybrid "
                                         "(FlexiDepth, its rule-derived thresholds) of vskipper.model, open loop at "
                                         "the knee point x Q* of the first vSkipper workload, on that workload's "
                                         "prompts, each compared with the project's load generator")
    knee_num_prompts: PosInt | None = Field(None, description="measured requests per arm at the knee; null: "
                                                              "vskipper.requests")


class Http(Section):
    """``vskipper.http``: every engine arm over HTTP on every tiny model (rule vskipper_http)."""

    n_prompts: PosInt = Field(4, description="requests per OpenAI-client check")
    max_tokens: PosInt = Field(16, description="tokens per request (EOS ignored)")
    limit: PosInt = Field(4, description="GSM8K documents served to lm-eval local-completions")
    r: Fraction = 0.5
    d: Fraction = 0.5
    bench_serving: BenchServing = Field(default_factory=BenchServing)


class MaxGenToks(Section):
    """``vskipper.quality.max_gen_toks``: lm-eval generation budgets per task [tokens]."""

    gsm8k: PosInt = 64
    bbh: PosInt = 64
    coqa: PosInt = 32


class Served(Section):
    """``vskipper.quality.served``: the served-at-knee pass (Table 5 right); ``served: null`` = off."""

    point: Label = "knee"
    workload: Suite | None = None
    requests: NonNegInt | None = None


class Quality(Section):
    """``vskipper.quality`` (optional; absent = no quality rule): the lm-eval 2x2 DiD (Table 5)."""

    tasks: Annotated[list[Literal[QUALITY_TASKS]], Field(min_length=1, json_schema_extra=_UNIQUE)]  # type: ignore[valid-type]
    limit: PosInt | None = 8
    bbh_subtasks: Annotated[list[Annotated[str, Field(pattern="^[a-z0-9_]+$")]],
                            Field(min_length=1, json_schema_extra=_UNIQUE)] = [
        "boolean_expressions", "sports_understanding"]
    gsm8k_num_fewshot: NonNegInt = 5
    max_gen_toks: MaxGenToks = Field(default_factory=MaxGenToks)
    first_token_docs: NonNegInt = 1
    tol: PosNum = 0.01
    http_concurrency: PosInt | None = None
    # object or null (null: no served-at-knee rule)
    served: Served | None = Field(default_factory=Served)


class CrossModel(Section):
    """``vskipper.cross_model`` (Table 6, Sec. 4.4): models besides ``vskipper.model``."""

    models: Annotated[list[Name], Field(json_schema_extra=_UNIQUE)] = Field(
        [], description="models besides vskipper.model (keys of models)")
    workload: Suite = "gsm8k"
    point: Label = "knee"
    repetitions: PosInt | None = None


class Device(Section):
    """One entry of ``vskipper.devices`` (Table 7, Sec. 4.4)."""

    name: Name
    device: Annotated[str, Field(pattern="^(cpu|cuda(:[0-9]+)?)$")]
    threads: PosInt = Field(description="torch intra-op threads of this device's jobs")
    repetitions: PosInt | None = None
    resources: dict[str, str | int] = Field(
        {}, json_schema_extra={"propertyNames": {"pattern": _RESOURCE}}, description="Snakemake resources of this device's jobs (slurm_partition, gres, ...)")


class SglangSection(Section):
    """``vskipper.sglang_section``: the vSkipper protocol again with both arm families on upstream SGLang
    (vSkipper as an out-of-tree SGLang model), beside the main run, for the report's SGLang section."""

    workloads: Annotated[list[Suite], Field(min_length=1, json_schema_extra=_UNIQUE)] | None = Field(
        None, description="load workloads measured on SGLang (a subset of vskipper.workloads; null: all)")
    points: Annotated[list[Label], Field(min_length=1, json_schema_extra=_UNIQUE)] | None = Field(
        None, description="load points measured on SGLang (labels of vskipper.load_points; null: all)")
    ablation: bool = Field(True, description="the mechanism ablation on SGLang (first SGLang workload, at the knee; "
                                             "needs vskipper.ablations)")
    repetitions: PosInt | None = Field(None, description="paired repetitions per SGLang cell (null: "
                                                         "vskipper.repetitions)")
    quality: bool = Field(True, description="the quality 2x2 (Table 5 left) again with arms C and D served by SGLang "
                                            "(upstream SGLang / vSkipper inside SGLang always-route), every suite of "
                                            "vskipper.quality.tasks; nothing when vskipper.quality is absent")


class VskipperSection(Section):
    """vSkipper serving experiments (Sec. 4: knee, matched-work cells, ablations, RandomSkip map); absent = no vSkipper rules"""

    # absent = off (bench, quality, cross_model, devices) or replaced whole when given (load_points):
    # not merged from the defaults; check() fills load_points, quality and cross_model in
    optional_keys = ("load_points", "bench", "quality", "cross_model", "devices", "sglang_section")

    model: str = Field("tiny-std", description="base model served (a key of models)")
    workloads: Annotated[list[Suite], Field(min_length=1, json_schema_extra=_UNIQUE)] = ["gsm8k"]
    max_new_tokens: PosInt = 32
    requests: PosInt = Field(48, description="requests per performance cell")
    repetitions: PosInt = Field(2, description="paired repetitions per main cell (paper: 6)")
    lanes: Annotated[list[Literal[_LANES]], Field(min_length=1, json_schema_extra=_UNIQUE)] = list(_LANES)  # type: ignore[valid-type]
    load_points: Annotated[dict[str, PosNum], Field(min_length=1, json_schema_extra={"propertyNames": {"pattern": _LABEL}})] = Field(
        {"below": 0.75, "knee": 0.95, "overload": 1.25}, description="label -> multiple of Q*")
    timeout_s: PosNum = 300.0
    engine: Engine = Field(default_factory=Engine)
    engines: Engines = Field(default_factory=Engines)
    sglang: Sglang = Field(default_factory=Sglang)
    knee: Knee = Field(default_factory=Knee)
    flexidepth: FlexiDepth = Field(default_factory=FlexiDepth)
    profile: Profile = Field(default_factory=Profile)
    ablations: Annotated[list[Literal[ABLATION_ARMS]], Field(json_schema_extra=_UNIQUE)] = list(ABLATION_ARMS)  # type: ignore[valid-type]
    ablation_repetitions: PosInt = 1
    randomskip: RandomSkipMap = Field(default_factory=RandomSkipMap)
    bench: Bench | SkipJsonSchema[None] = None
    http: Http = Field(default_factory=Http)
    quality: Quality | SkipJsonSchema[None] = None
    cross_model: CrossModel | SkipJsonSchema[None] = None
    devices: list[Device] | SkipJsonSchema[None] = None
    sglang_section: SglangSection | SkipJsonSchema[None] = None


SECTION: dict[str, Any] = section_schema(VskipperSection, description=VskipperSection.__doc__.strip())
DEFAULTS: dict[str, Any] = section_defaults(VskipperSection)
#: the keys whose absence means something (off, or the default mapping): given as null they are absent, so an
#: overlay turns off what an earlier config file set (``impl.config.validate_config``)
OPTIONAL_KEYS: tuple[str, ...] = VskipperSection.optional_keys
#: the checkpoints vSkipper inside SGLang serves (``config.json``'s ``architectures[0]``;
#: :mod:`impl.vskipper.sglang_model` subclasses SGLang's Llama)
SGLANG_ROUTED_ARCHITECTURES: tuple[str, ...] = ("LlamaForCausalLM",)
#: default ``load_points`` (the paper's); not in :data:`DEFAULTS` because a user's mapping replaces it
#: entirely (a deep merge could not drop a label) - :func:`check` fills it in when absent
DEFAULT_LOAD_POINTS: dict[str, float] = dict(VskipperSection.model_fields["load_points"].default)
#: defaults of the optional ``quality`` section, merged under the user's keys by :func:`check` when the
#: section is given (not in :data:`DEFAULTS`: an absent section means no quality rule). Sized for the
#: embedded CPU default (about 5 minutes for the three suites on 2 cores); the paper scores every
#: held-out document with lm-eval's budgets.
QUALITY_DEFAULTS: dict[str, Any] = {k: v for k, v in section_defaults(Quality).items() if k != "served"}
#: defaults of ``vskipper.quality.served`` (the served-at-knee pass, Table 5 right), merged under a given
#: mapping; ``served: null`` turns the pass off
SERVED_DEFAULTS: dict[str, Any] = section_defaults(Served)
#: defaults of ``vskipper.cross_model`` (Table 6), merged under a given mapping by :func:`check`; the
#: workload and load point also set where the Table 7 device targets are measured
CROSS_DEFAULTS: dict[str, Any] = section_defaults(CrossModel)


def vskipper_section(cfg: dict[str, Any]) -> VskipperSection:
    """The validated config's ``vskipper`` section as a typed object.

    Raises:
        SystemExit: the config has no ``vskipper`` section (one line).
    """
    return typed_section(cfg, "vskipper", VskipperSection)


def optional_vskipper_section(cfg: dict[str, Any]) -> VskipperSection | None:
    """The validated config's ``vskipper`` section as a typed object, or None when the config has none
    (commands that also run without it, with their own defaults)."""
    return VskipperSection.model_validate(cfg["vskipper"]) if cfg.get("vskipper") else None


def _error(msg: str):
    from impl.config import ConfigError  # impl.config imports this module lazily: no cycle at import

    return ConfigError(f"config: {msg}")


def _check_quality(cfg: dict[str, Any], v: dict[str, Any]) -> None:
    """Fill in :data:`QUALITY_DEFAULTS` under ``vskipper.quality`` and check it against the data folder
    (BBH subtask files, when the folder exists) and the tiny context."""

    q = v["quality"]
    for k, val in QUALITY_DEFAULTS.items():
        if k == "max_gen_toks":
            q[k] = {**val, **(q.get(k) or {})}
        elif k not in q:
            q[k] = list(val) if isinstance(val, list) else val
    if "served" not in q:
        q["served"] = dict(SERVED_DEFAULTS)
    elif q["served"] is not None:
        q["served"] = {**SERVED_DEFAULTS, **q["served"]}
    sv = q["served"]
    if sv is not None:
        if sv["point"] not in v["load_points"]:
            raise _error(f"'vskipper.quality.served.point' = '{sv['point']}' is not a label of 'vskipper.load_points' "
                         f"({', '.join(v['load_points'])})")
        if sv["workload"] is not None and sv["workload"] not in v["workloads"]:
            raise _error(f"'vskipper.quality.served.workload' = '{sv['workload']}' is not one of 'vskipper.workloads' "
                         f"({', '.join(v['workloads'])}): only their knee is swept")
    bbh = Path(str(cfg.get("data_dir", ""))) / "bbh" / "tasks"
    if "bbh" in q["tasks"] and bbh.is_dir():
        for i, name in enumerate(q["bbh_subtasks"]):
            if not (bbh / f"{name}.json").is_file():
                raise _error(f"'vskipper.quality.bbh_subtasks[{i}]' = '{name}' has no task file {bbh / name}.json")
    if cfg["models"][v["model"]]["kind"] == "tiny":
        ctx = cfg["tiny_arch"]["max_position_embeddings"]
        for suite in q["tasks"]:
            n = q["max_gen_toks"][suite]
            if n >= ctx // 2:
                raise _error(f"'vskipper.quality.max_gen_toks.{suite}' = {n} leaves fewer than half of "
                             f"'tiny_arch.max_position_embeddings' = {ctx} positions for the prompt")


def served_knee_workload(v: dict[str, Any], suite: str) -> str:
    """The load workload whose knee gives the served-at-knee rate of quality suite ``suite``:
    ``vskipper.quality.served.workload`` when set, else ``suite`` when it is one of ``vskipper.workloads``,
    else the first of them.

    Raises:
        KeyError: when the quality section or its ``served`` mapping is absent.
    """
    sv = v["quality"]["served"]
    if sv is None:
        raise KeyError("vskipper.quality.served is null: no served-at-knee pass")
    if sv.get("workload"):
        return sv["workload"]
    return suite if suite in v["workloads"] else v["workloads"][0]


def transfer_settings(v: dict[str, Any]) -> dict[str, Any]:
    """The Table 6 / Table 7 targets of a validated ``vskipper`` section: ``{"models": [...], "devices":
    [...], "workload", "point", "repetitions"}`` (``vskipper.cross_model`` over :data:`CROSS_DEFAULTS`;
    ``devices`` = ``vskipper.devices`` or ``[]``). Empty lists mean no extra rules (vSkipper Sec. 4.4)."""
    return {**CROSS_DEFAULTS, **(v.get("cross_model") or {}), "devices": list(v.get("devices") or [])}


def _check_transfer(cfg: dict[str, Any], v: dict[str, Any]) -> None:
    """Fill in :data:`CROSS_DEFAULTS` under a given ``vskipper.cross_model`` and check the Table 6 / 7 keys."""
    if v.get("cross_model") is not None:
        v["cross_model"] = {**CROSS_DEFAULTS, **v["cross_model"]}
    x = transfer_settings(v)
    for i, m in enumerate(x["models"]):
        if m not in cfg["models"]:
            raise _error(f"'vskipper.cross_model.models[{i}]' names '{m}', which is not a key of 'models' "
                         f"({', '.join(cfg['models'])})")
        if m == v["model"]:
            raise _error(f"'vskipper.cross_model.models[{i}]' = '{m}' is 'vskipper.model' (its row comes from the "
                         "main outputs); list only the other models")
    seen: dict[str, int] = {}
    for i, d in enumerate(x["devices"]):
        if d["name"] in seen:
            raise _error(f"'vskipper.devices[{i}].name' = '{d['name']}' repeats 'vskipper.devices[{seen[d['name']]}]"
                         ".name' (device names must be unique: they name the output folders)")
        seen[d["name"]] = i
    if not (x["models"] or x["devices"]):
        return
    used = "'vskipper.cross_model.models'" if x["models"] else "'vskipper.devices'"
    if x["workload"] not in v["workloads"]:
        raise _error(f"'vskipper.cross_model.workload' = '{x['workload']}' is not one of 'vskipper.workloads' "
                     f"({', '.join(v['workloads'])}): the main model's row of {used} comes from its cells")
    if x["point"] not in v["load_points"]:
        raise _error(f"'vskipper.cross_model.point' = '{x['point']}' is not a label of 'vskipper.load_points' "
                     f"({', '.join(v['load_points'])})")


def target_config(cfg: dict[str, Any], *, model: str | None = None, device: str | None = None) -> dict[str, Any]:
    """The effective config of one extra Table 6 / Table 7 target (vSkipper Sec. 4.4), handed to the
    same commands as the main run (``--config-json``).

    Args:
        cfg: the validated whole config (``vskipper`` present).
        model: a name of ``vskipper.cross_model.models``: ``vskipper.model`` becomes it,
            ``vskipper.repetitions`` becomes ``cross_model.repetitions`` (when set) and the quality
            section keeps only ``cross_model.workload`` (dropped when that is not one of its tasks; no
            served-at-knee pass).
        device: a ``vskipper.devices[].name``: the top-level ``device`` and ``threads`` become that
            entry's; ``vskipper.repetitions`` becomes its ``repetitions`` (when set).

    Returns:
        a new validated config (``cross_model`` and ``devices`` removed, so the target is a plain single-model,
        single-device run); ``cfg`` is not modified.

    Raises:
        KeyError: naming the model / device when it is not one of the targets.
        impl.config.ConfigError: when the derived config does not validate.
    """

    from impl.config import validate_config

    out = copy.deepcopy(cfg)
    v = out["vskipper"]
    x = transfer_settings(v)
    if model is not None:
        if model not in x["models"]:
            raise KeyError(f"{model!r} is not in vskipper.cross_model.models ({', '.join(x['models'])})")
        v["model"] = model
        if x["repetitions"]:
            v["repetitions"] = x["repetitions"]
        q = v.get("quality")
        if q is not None:
            if x["workload"] in q["tasks"]:
                v["quality"] = {**q, "tasks": [x["workload"]], "served": None}
            else:
                del v["quality"]
    if device is not None:
        dev = {d["name"]: d for d in x["devices"]}
        if device not in dev:
            raise KeyError(f"{device!r} is not a vskipper.devices name ({', '.join(dev)})")
        out["device"], out["threads"] = dev[device]["device"], dev[device]["threads"]
        if dev[device].get("repetitions"):
            v["repetitions"] = dev[device]["repetitions"]
    v.pop("cross_model", None)
    v.pop("devices", None)
    return validate_config(out, check_paths=False)


def _check_bench_models(cfg: dict[str, Any], v: dict[str, Any]) -> None:
    for i, m in enumerate((v.get("bench") or {}).get("models") or []):
        if m not in cfg["models"]:
            raise _error(f"'vskipper.bench.models[{i}]' names '{m}', which is not a key of 'models'")
        if m == v["model"]:
            raise _error(f"'vskipper.bench.models[{i}]' = '{m}' is vskipper.model, which the benchmark always times")


def _interpreter_problem(path: str) -> str | None:
    """Why ``path`` cannot be the SGLang environment's interpreter (None when it can: an executable file)."""
    p = Path(path)
    if not p.is_file():
        return "is not a file"
    if not os.access(p, os.X_OK):
        return "is not executable"
    return None


def _check_bench_serving(cfg: dict[str, Any], v: dict[str, Any]) -> None:
    b = (v.get("http") or {}).get("bench_serving") or {}
    why = _interpreter_problem(b["python"]) if b.get("python") else None
    if why:
        raise _error(f"'vskipper.http.bench_serving.python' = '{b['python']}' {why} (create the SGLang "
                     "environment with scripts/setup_sglang.sh, or set it to null)")
    for i, m in enumerate(b.get("models") or []):
        if m not in cfg["models"]:
            raise _error(f"'vskipper.http.bench_serving.models[{i}]' names '{m}', which is not a key of 'models'")


def _check_sglang_section(cfg: dict[str, Any], v: dict[str, Any]) -> None:
    sec = v.get("sglang_section")
    if sec is None:
        return
    sec.update({k: x for k, x in section_defaults(SglangSection).items() if k not in sec})
    why = _interpreter_problem(v["sglang"]["python"])
    if why:
        raise _error(f"'vskipper.sglang_section' needs 'vskipper.sglang.python' = '{v['sglang']['python']}', which "
                     f"{why} (create the SGLang environment with scripts/setup_sglang.sh)")
    _check_routed_architecture(cfg, v["model"], "vskipper.sglang_section")
    for i, w in enumerate(sec["workloads"] or []):
        if w not in v["workloads"]:
            raise _error(f"'vskipper.sglang_section.workloads[{i}]' = '{w}' is not one of 'vskipper.workloads' "
                         f"({', '.join(v['workloads'])})")
    for i, p in enumerate(sec["points"] or []):
        if p not in v["load_points"]:
            raise _error(f"'vskipper.sglang_section.points[{i}]' = '{p}' is not a label of 'vskipper.load_points' "
                         f"({', '.join(v['load_points'])})")


def sglang_section_settings(v: dict[str, Any]) -> dict[str, Any] | None:
    """The resolved ``vskipper.sglang_section`` (None when off): ``workloads`` and ``points`` filled in from the
    main run's, ``ablation`` true only when ``vskipper.ablations`` is non-empty, ``quality`` only when
    ``vskipper.quality`` is set."""
    sec = v.get("sglang_section")
    if sec is None:
        return None
    return {"workloads": list(sec.get("workloads") or v["workloads"]),
            "points": list(sec.get("points") or v["load_points"]),
            "ablation": bool(sec.get("ablation", True) and v["ablations"]),
            "repetitions": sec.get("repetitions"),
            "quality": bool(sec.get("quality", True) and v.get("quality"))}


def engine_config(cfg: dict[str, Any], engine: str = "sglang") -> dict[str, Any]:
    """The effective config of the SGLang section's jobs: the main config with both arm families on
    ``engine`` (``vskipper.engines``), ``vskipper.repetitions`` from the section (when set), and the
    extra targets, the served-at-knee pass, the section itself and (unless the section's ``quality``)
    the quality 2x2 removed (a plain single-engine serving run).

    Raises:
        ValueError: for an engine other than ``sglang`` or a config without the section.
        impl.config.ConfigError: when the derived config does not validate.
    """
    from impl.config import validate_config

    if engine != "sglang":
        raise ValueError(f"engine_config: only 'sglang' has a section, got {engine!r}")
    sec = sglang_section_settings(cfg["vskipper"])
    if sec is None:
        raise ValueError("engine_config: vskipper.sglang_section is not set")
    out = copy.deepcopy(cfg)
    v = out["vskipper"]
    v["engines"] = {"upstream": engine, "routed": engine}
    if sec["repetitions"]:
        v["repetitions"] = sec["repetitions"]
    for key in ("sglang_section", "cross_model", "devices", "bench") + (() if sec["quality"] else ("quality",)):
        v.pop(key, None)
    if v.get("quality"):
        v["quality"]["served"] = None  # the served-at-knee pass stays on the main run's engine
    return validate_config(out, check_paths=False)


def _check_engines(cfg: dict[str, Any], v: dict[str, Any]) -> None:
    for family in ("upstream", "routed"):
        why = _interpreter_problem(v["sglang"]["python"]) if v["engines"][family] == "sglang" else None
        if why:
            raise _error(f"'vskipper.engines.{family}' = 'sglang' needs 'vskipper.sglang.python' = "
                         f"'{v['sglang']['python']}', which {why} (create the SGLang environment with "
                         "scripts/setup_sglang.sh)")
    if v["engines"]["routed"] == "sglang":  # every model the routed arms serve: vskipper.model, Table 6's models
        for m in [v["model"], *((v.get("cross_model") or {}).get("models") or [])]:
            _check_routed_architecture(cfg, m, "vskipper.engines.routed")


def _check_routed_architecture(cfg: dict[str, Any], name: str, key: str) -> None:
    """Model ``name`` (a key of ``models``), when its directory exists, is a checkpoint vSkipper inside SGLang
    serves (:data:`SGLANG_ROUTED_ARCHITECTURES`); a model the DAG has not made yet is checked when it serves."""
    import json

    from impl.config import model_dir

    if name not in cfg["models"]:
        return  # named by the key's own check
    f = model_dir(cfg, name) / "config.json"
    if not f.is_file():
        return
    try:
        archs = json.loads(f.read_text(encoding="utf-8")).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return  # an unreadable config.json fails where the model loads, naming the file
    if not archs or archs[0] not in SGLANG_ROUTED_ARCHITECTURES:
        raise _error(f"'{key}' serves model '{name}' with vSkipper inside SGLang, which takes "
                     f"{', '.join(SGLANG_ROUTED_ARCHITECTURES)} checkpoints; {f} names {archs or 'none'} "
                     "(serve its routed arms on transformers: vskipper.engines.routed: transformers)")


def check(cfg: dict[str, Any]) -> None:
    """Cross-checks of the merged ``vskipper`` section against the whole config.

    Fills in ``vskipper.load_points`` (:data:`DEFAULT_LOAD_POINTS`) when absent. Checks:
    ``vskipper.model`` is a key of ``models``; ``vskipper.workloads[i]`` are keys of
    ``workloads``; ``vskipper.randomskip.point`` is a label of ``vskipper.load_points`` (when the map
    runs); ``vskipper.randomskip.r`` and ``d`` are both empty or both non-empty; the Table 6 / 7 keys
    (``vskipper.cross_model.models[i]`` are other keys of ``models``, ``vskipper.devices[i].name`` are unique,
    ``cross_model.workload`` / ``point`` name a load workload / load point when a target is given); for tiny models,
    ``vskipper.flexidepth.routed_layers`` lie in ``[0, tiny_arch.num_layers)``, and the longest request
    (``max_prompt_tokens + vskipper.max_new_tokens``) and ``vskipper.profile.decode_context + 1`` fit the
    context; ``vskipper.sglang.python`` is an existing file when ``vskipper.engines.upstream`` or
    ``routed`` is ``sglang``; ``vskipper.http.bench_serving.python``, when set, is an existing file (the SGLang
    environment of ``scripts/setup_sglang.sh``) and its ``models[i]`` are keys of ``models``.

    Raises:
        impl.config.ConfigError: one line naming the key.
    """
    v = cfg["vskipper"]
    v.setdefault("load_points", dict(DEFAULT_LOAD_POINTS))
    _check_bench_serving(cfg, v)
    _check_engines(cfg, v)
    _check_sglang_section(cfg, v)
    _check_bench_models(cfg, v)
    if v.get("quality") is not None:
        _check_quality(cfg, v)
    if v["model"] not in cfg["models"]:
        raise _error(f"'vskipper.model' names '{v['model']}', which is not a key of 'models' "
                     f"({', '.join(cfg['models'])})")
    for i, w in enumerate(v["workloads"]):
        if w not in cfg["workloads"]:
            raise _error(f"'vskipper.workloads[{i}]' names '{w}', which is not a key of 'workloads'")
    _check_transfer(cfg, v)
    rs = v["randomskip"]
    if bool(rs["r"]) != bool(rs["d"]):
        raise _error("'vskipper.randomskip.r' and 'vskipper.randomskip.d' must both be empty (no map) "
                     "or both non-empty")
    if rs["r"] and rs["point"] not in v["load_points"]:
        raise _error(f"'vskipper.randomskip.point' = '{rs['point']}' is not a label of 'vskipper.load_points' "
                     f"({', '.join(v['load_points'])})")
    if v["ablations"] and "knee" not in v["load_points"]:
        raise _error("'vskipper.ablations' run at the knee: 'vskipper.load_points' needs a 'knee' label "
                     "(or set ablations: [])")
    prof = v["profile"]
    for i, n in enumerate(prof["prefill_tokens"]):
        if n < prof["prefill_prompt_len"]:
            raise _error(f"'vskipper.profile.prefill_tokens[{i}]' = {n} is below 'vskipper.profile.prefill_prompt_len' "
                         f"= {prof['prefill_prompt_len']}")
    if cfg["models"][v["model"]]["kind"] == "tiny":
        L = cfg["tiny_arch"]["num_layers"]
        for i, layer in enumerate(v["flexidepth"]["routed_layers"] or []):
            if layer >= L:
                raise _error(f"'vskipper.flexidepth.routed_layers[{i}]' = {layer} is outside [0, {L}) "
                             "(tiny_arch.num_layers)")
        ctx = cfg["tiny_arch"]["max_position_embeddings"]
        need = cfg["max_prompt_tokens"] + v["max_new_tokens"]
        if need > ctx:
            raise _error(f"'max_prompt_tokens' + 'vskipper.max_new_tokens' = {need} exceeds "
                         f"'tiny_arch.max_position_embeddings' = {ctx}")
        for key, n in (("decode_context", prof["decode_context"] + 1),
                       ("prefill_prompt_len", prof["prefill_prompt_len"]),
                       ("flexidepth.seq_len", v["flexidepth"]["seq_len"])):
            if n > ctx:
                raise _error(f"'vskipper.{key if '.' in key else 'profile.' + key}' needs {n} positions, more than "
                             f"'tiny_arch.max_position_embeddings' = {ctx}")
