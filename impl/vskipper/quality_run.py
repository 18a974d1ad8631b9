"""The quality 2x2 end to end (vSkipper Sec. 4.1 "Quality", Table 5 left, App. E.1-E.2).

:func:`run_quality` generates the task YAMLs over the local data, evaluates the four arms with
lm-eval on the same documents, gates on identical prompt token ids, computes the per-document paired
DiD ``(D - C) - (B - A)`` with a 95 % interval per suite and metric, measures first-token agreement
on a few prompts, and writes the rows (with provenance) under ``out``.

Outputs (``out`` is a directory):

- ``tasks/``: the generated lm-eval task YAMLs (``tasks.json`` lists the data files);
- ``quality.jsonl``: one row per document x arm (``kind="doc"``), one per suite x metric and per BBH
  task (``kind="summary"``), one per agreement prompt x arm pair (``kind="first_token"``);
- ``summary.json``: the summary rows, the first-token rows and the run's configuration;
- ``lm_eval_<arm>.json``: lm-eval's aggregate results of each arm (served arms: also the server's
  ``/v1/vskipper/stats`` after the arm);
- ``requests.jsonl``: one row per document of the reference arm (the first): ``task``, ``doc_id``,
  ``request_id``, ``prompt_ids``, ``prompt_hash``, ``until`` (stop strings), ``max_gen_toks``,
  ``max_length``, ``add_bos_token`` - what the served-at-knee pass replays (:mod:`impl.vskipper.quality_served`).

Arms C and D are served over HTTP by default (``served="http"``): for each, a
:class:`~impl.vskipper.quality_arms.ServedEndpoint` (the vSkipper server, ``upstream`` for C, ``always-route``
with the skipper for D) is started in this process on 127.0.0.1, port 0, lm-eval's
``local-completions`` client (:class:`~impl.vskipper.quality_arms.RecordingCompletionsLM`) evaluates the tasks
against it, and the server is shut down after the arm. ``served="sglang"`` serves them by upstream
SGLang instead (C: SGLang on the base model; D: vSkipper's routed Llama inside SGLang, always-route with
the checkpoint's skipper; :mod:`impl.vskipper.quality_sglang`), evaluated by the same client speaking
SGLang's dialect. ``served="inprocess"`` runs them as :class:`~impl.vskipper.quality_arms.EngineLM` on
the same engine without HTTP.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import time
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import datasets.config as dcfg
import huggingface_hub.constants as hcst
import lm_eval
import torch
from lm_eval.tasks import TaskManager
from transformers import AutoConfig

from impl.models.load import load_model, load_tokenizer
from impl.provenance import provenance, write_json, write_jsonl
from impl.quality.did import check_prompt_hashes, first_token_agreement, per_doc_scores, summarize
from impl.quality.tasks import PRIMARY_METRIC, QUALITY_SUITES, TaskOptions, TaskSet, write_task_yamls
from impl.vskipper.skipper import Skipper, build_skipper

from .quality_arms import (
    ARMS,
    SERVER_ARM,
    EngineLM,
    GenRecord,
    PlainRoutedLM,
    RecordingCompletionsLM,
    RecordingHFLM,
    ServedEndpoint,
    default_max_length,
    eos_ids_in_dir,
    eos_ids_of,
)
from .quality_sglang import SGLangCompletionsLM, sglang_quality_arm

__all__ = ["QualityResult", "run_quality", "resolve_skipper", "offline", "request_rows", "SERVED_MODES"]

#: how arms C and D are served (``run_quality(served=...)``)
SERVED_MODES = ("http", "inprocess", "sglang")


@dataclass
class QualityResult:
    """What :func:`run_quality` produced.

    Attributes:
        rows: every row written to ``quality.jsonl``.
        summary: the ``kind="summary"`` rows.
        first_token: the ``kind="first_token"`` rows.
        records: ``arm -> {(task, doc_id): GenRecord}``.
        scores: ``arm -> {(task, doc_id): per-document scores}`` (:func:`impl.quality.did.per_doc_scores`).
        tasks: the generated :class:`~impl.quality.tasks.TaskSet`.
        out: the output directory.
        wall_s: ``arm -> seconds`` of its load + lm-eval evaluation (informational, not a speed comparison).
        served_stats: ``arm -> the server's stats`` after each HTTP-served arm.
        requests: the ``requests.jsonl`` rows (:func:`request_rows` of the reference arm).
    """

    rows: list[dict[str, Any]] = field(default_factory=list)
    summary: list[dict[str, Any]] = field(default_factory=list)
    first_token: list[dict[str, Any]] = field(default_factory=list)
    records: dict[str, dict[tuple[str, int], GenRecord]] = field(default_factory=dict)
    scores: dict[str, dict[tuple[str, int], dict]] = field(default_factory=dict)
    tasks: TaskSet | None = None
    out: Path | None = None
    wall_s: dict[str, float] = field(default_factory=dict)
    served_stats: dict[str, dict] = field(default_factory=dict)
    requests: list[dict[str, Any]] = field(default_factory=list)

    def summary_for(self, suite: str, metric: str | None = None) -> dict[str, Any]:
        """The suite-level summary row of ``metric`` (default: the suite's primary metric)."""
        if metric is None:
            m, f = PRIMARY_METRIC[suite]
            metric = f"{m},{f}"
        for r in self.summary:
            if r["suite"] == suite and r["metric"] == metric and r.get("task") is None:
                return r
        raise KeyError(f"no summary row for suite {suite!r}, metric {metric!r}")


@contextlib.contextmanager
def offline():
    """Run lm-eval / datasets / huggingface_hub fully offline inside the block (environment variables and
    the already-imported libraries' flags), restoring the previous state afterwards."""
    env_keys = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")
    old_env = {k: os.environ.get(k) for k in env_keys}
    patched: list[tuple[Any, str, Any]] = []
    try:
        for k in env_keys:
            os.environ[k] = "1"

        for mod, attr in ((hcst, "HF_HUB_OFFLINE"), (dcfg, "HF_HUB_OFFLINE"), (dcfg, "HF_DATASETS_OFFLINE")):
            if hasattr(mod, attr):
                patched.append((mod, attr, getattr(mod, attr)))
                setattr(mod, attr, True)
        yield
    finally:
        for mod, attr, val in reversed(patched):
            setattr(mod, attr, val)
        for k, v in old_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def resolve_skipper(skipper):
    """A :class:`~impl.vskipper.skipper.Skipper` from an instance, a registered name, or a spec dict
    ``{"name": ..., **kwargs}`` (:func:`impl.vskipper.skipper.build_skipper`).

    Raises:
        ValueError: for anything else or an unknown name.
    """

    if isinstance(skipper, Skipper):
        return skipper
    if isinstance(skipper, str):
        return build_skipper(skipper)
    if isinstance(skipper, Mapping):
        spec = dict(skipper)
        name = spec.pop("name", None)
        if not name:
            raise ValueError(f"a skipper spec needs a 'name' key, got {dict(skipper)}")
        return build_skipper(name, **spec)
    raise ValueError(f"skipper must be a Skipper, a registered name or a spec dict, got {type(skipper).__name__}")


def _skipper_desc(skipper) -> dict[str, Any]:
    return {"class": type(skipper).__name__, "name": getattr(skipper, "registered_name", None),
            "routed_layers": list(skipper.routed_layers), "repr": repr(skipper)}


def _jsonable(obj):
    """JSON-safe copy (functions and other objects in lm-eval's configs become their ``str``)."""
    return json.loads(json.dumps(obj, default=str))


def _lm_eval_version() -> str:
    try:
        return version("lm_eval")
    except Exception:  # noqa: BLE001
        return "unknown"


def _evaluate(lm, ts: TaskSet, tm, limit, seed: int, fewshot_seed: int) -> dict:
    res = lm_eval.simple_evaluate(
        model=lm, tasks=ts.task_names, task_manager=tm, limit=limit, log_samples=True, bootstrap_iters=0,
        random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=fewshot_seed,
        apply_chat_template=False,
    )
    if res is None:
        raise RuntimeError("lm_eval.simple_evaluate returned nothing")
    return res


def request_rows(records: Mapping[tuple[str, int], GenRecord], suite_of: Mapping[str, str], *, max_length: int,
                 add_bos_token: bool | None) -> list[dict[str, Any]]:
    """One request row per document (sorted by task, doc id): what a document's request was, for the
    served-at-knee pass (Table 5 right) to replay: ``suite``, ``task``, ``doc_id``, ``request_id``,
    ``prompt_ids``, ``prompt_hash``, ``until`` (stop strings incl. the EOS string), ``max_gen_toks``
    [tokens], ``max_length`` [tokens] and ``add_bos_token`` (the tokenization rule, to re-check the ids)."""
    out = []
    for key, rec in sorted(records.items()):
        out.append({"kind": "request", "suite": suite_of.get(key[0]), "task": rec.task, "doc_id": rec.doc_id,
                    "request_id": rec.request_id, "prompt_ids": list(rec.prompt_ids), "prompt_hash": rec.prompt_hash,
                    "until": list(rec.until), "max_gen_toks": rec.max_gen_toks, "max_length": int(max_length),
                    "add_bos_token": add_bos_token})
    return out


def _agreement_keys(records: Mapping[tuple[str, int], GenRecord], ts: TaskSet, per_suite: int) -> list[tuple[str, int]]:
    keys = []
    for suite, names in ts.tasks.items():
        mine = sorted(k for k in records if ts.suite_of.get(k[0]) == suite)
        keys += mine[:per_suite]
    return keys


@dataclass(frozen=True)
class _ArmSetup:
    """What every arm of one :func:`run_quality` call is built from (its arguments of the same names)."""

    model_dir: Path
    ckpt_dir: Path
    tokenizer: Any
    skipper: Skipper | None
    served: str
    device: str
    dtype: str
    cb_config: Any
    max_length: int
    add_bos_token: bool | None
    max_logprobs: int
    request_timeout_s: float
    http_concurrency: int
    sglang_launch: Any = None
    sglang_policy: tuple[str, dict] | None = None


@contextlib.contextmanager
def _arm_lm(arm: str, s: _ArmSetup):
    """The lm-eval model of ``arm`` and its server's stats (a callable; None unless served), freed on exit.

    A: transformers (HFLM) on the base model; B: the checkpoint's skipper in process (plain routed
    forward); C / D: the continuous-batching engine, dense on the base model / routed with the skipper,
    over HTTP (``served="http"``: lm-eval's ``local-completions`` client against an in-process server)
    or in process; or upstream SGLang / vSkipper inside SGLang (``served="sglang"``).
    """

    common = dict(max_length=s.max_length, add_bos_token=s.add_bos_token)
    model = endpoint = lm = None
    if arm in ("C", "D") and s.served == "sglang":
        with _sglang_arm_lm(arm, s) as pair:
            yield pair
        return
    try:
        if arm == "A":
            lm = RecordingHFLM(arm="A", pretrained=str(s.model_dir), tokenizer=str(s.model_dir), device=s.device,
                               dtype=s.dtype, batch_size=1, **common)
        else:
            model = load_model(s.ckpt_dir if arm in ("B", "D") else s.model_dir,
                               dtype=getattr(torch, s.dtype)).to(s.device)
            if arm == "B":
                lm = PlainRoutedLM(model, s.tokenizer, s.skipper, arm="B", **common)
            elif s.served == "http":
                endpoint = ServedEndpoint(model, s.tokenizer, SERVER_ARM[arm],
                                          skipper=s.skipper if arm == "D" else None, cb_config=s.cb_config,
                                          served_model_name=f"vsk-quality-{arm}", max_logprobs=s.max_logprobs,
                                          request_timeout_s=s.request_timeout_s).start()
                mc = model.config
                cfg_m = mc.get_text_config() if hasattr(mc, "get_text_config") else mc
                lm = RecordingCompletionsLM(arm, base_url=endpoint.completions_url,
                                            model=endpoint.served_model_name, tokenizer=s.model_dir,
                                            max_length=s.max_length, eos_ids=eos_ids_of(model.config, getattr(model, "generation_config", None)),
                                            add_bos_token=s.add_bos_token, num_concurrent=s.http_concurrency,
                                            timeout_s=s.request_timeout_s, received=endpoint.received,
                                            vocab_size=int(cfg_m.vocab_size), max_logprobs=s.max_logprobs)
            elif arm == "C":
                lm = EngineLM(model, s.tokenizer, mode="dense", cb_config=s.cb_config, arm="C", **common)
            else:
                lm = EngineLM(model, s.tokenizer, mode="routed", skipper=s.skipper, cb_config=s.cb_config, arm="D",
                              **common)
        yield lm, (None if endpoint is None else endpoint.stats)
    finally:
        if endpoint is not None:
            endpoint.close()
        del lm, model, endpoint  # the caller drops its own references and collects


@contextlib.contextmanager
def _sglang_arm_lm(arm: str, s: _ArmSetup):
    """Arm C or D served by upstream SGLang (:mod:`impl.vskipper.quality_sglang`) and its client."""
    policy, kwargs = s.sglang_policy if arm == "D" and s.sglang_policy else (None, None)
    mc = AutoConfig.from_pretrained(s.model_dir, local_files_only=True)
    eos = eos_ids_in_dir(s.model_dir)
    cfg_m = mc.get_text_config() if hasattr(mc, "get_text_config") else mc
    with sglang_quality_arm(arm, s.sglang_launch, policy=policy, policy_kwargs=kwargs,
                            request_timeout_s=s.request_timeout_s) as server:
        lm = SGLangCompletionsLM(arm, generate_url=f"{server.server.url}/generate",
                                 base_url=f"{server.server.url}/v1/completions", model=server.served_model_name,
                                 tokenizer=s.model_dir, max_length=s.max_length, eos_ids=eos,
                                 add_bos_token=s.add_bos_token, num_concurrent=s.http_concurrency,
                                 timeout_s=s.request_timeout_s, vocab_size=int(cfg_m.vocab_size),
                                 max_logprobs=s.max_logprobs)
        try:
            yield lm, server.describe
        finally:
            del lm


def _doc_rows(result: QualityResult, arms: Sequence[str], prov: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One ``kind="doc"`` row per document x arm (no ids), with its primary metric's score."""

    ts = result.tasks
    rows: list[dict[str, Any]] = []
    for arm in arms:
        for key, rec in sorted(result.records[arm].items()):
            sc = result.scores[arm][key]
            suite = ts.suite_of[key[0]]
            m, f = PRIMARY_METRIC[suite]
            primary = f"{m},{f}"
            rows.append({
                "kind": "doc", "suite": suite, **rec.to_row(with_ids=False), "arm_desc": ARMS[arm],
                "metric": primary, "score": sc["scores"].get(primary), "scores": sc["scores"],
                "filtered": sc["filtered"], "target": sc.get("target"), **prov,
            })
    return rows


def _did_rows(result: QualityResult, n_docs: int, prov: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The ``kind="summary"`` rows: the paired DiD per suite x metric (:func:`impl.quality.did.summarize`),
    and per task for the primary metric where a suite has several tasks (BBH)."""

    ts = result.tasks
    summary: list[dict[str, Any]] = []
    for suite, names in ts.tasks.items():
        keys = sorted(k for k in result.records["A"] if ts.suite_of[k[0]] == suite)
        if not keys:
            continue
        m, f = PRIMARY_METRIC[suite]
        primary = f"{m},{f}"
        metrics = sorted(result.scores["A"][keys[0]]["scores"])
        for metric in metrics:
            row = summarize(result.scores, result.records, keys, metric, suite=suite)
            row.update({"kind": "summary", "task": None, "primary": metric == primary, "n_docs_checked": n_docs,
                        "prompt_hashes_equal": True, **prov})
            summary.append(row)
        if len(names) > 1:
            for name in names:
                tkeys = [k for k in keys if k[0] == name]
                if tkeys:
                    row = summarize(result.scores, result.records, tkeys, primary, suite=suite)
                    row.update({"kind": "summary", "task": name, "primary": True, "prompt_hashes_equal": True,
                                **prov})
                    summary.append(row)
    return summary


def _first_token_rows(result: QualityResult, agreement_lp: Mapping[tuple[str, int], Mapping[str, torch.Tensor]],
                      reference: str, tol: float, prov: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The ``kind="first_token"`` rows: per agreement prompt and arm pair
    (:func:`impl.quality.did.first_token_agreement`, top-5, tolerance ``tol`` nats; App. E.1)."""

    rows = []
    for key, lps in sorted(agreement_lp.items()):
        rec = result.records[reference][key]
        for r in first_token_agreement(lps, k=5, tol=tol):
            rows.append({"kind": "first_token", "suite": result.tasks.suite_of[key[0]], "task": key[0],
                         "doc_id": key[1], "prompt_hash": rec.prompt_hash, **r, **prov})
    return rows


def run_quality(
    model_dir: str | os.PathLike,
    skipper,
    data_dir: str | os.PathLike,
    tasks: Sequence[str] = QUALITY_SUITES,
    limit: int | float | None = None,
    out: str | os.PathLike = "results/quality",
    *,
    checkpoint_dir: str | os.PathLike | None = None,
    options: TaskOptions | None = None,
    device: str = "cpu",
    dtype: str = "float32",
    max_length: int | None = None,
    add_bos_token: bool | None = None,
    cb_config=None,
    first_token_docs: int = 2,
    tol: float = 0.01,
    seed: int = 1234,
    run_id: str | None = None,
    config: Mapping[str, Any] | None = None,
    arms: Iterable[str] = ("A", "B", "C", "D"),
    served: str = "http",
    http_concurrency: int | None = None,
    max_logprobs: int = 20,
    request_timeout_s: float = 3600.0,
    sglang_launch=None,
    sglang_policy: tuple[str, Mapping[str, Any]] | None = None,
) -> QualityResult:
    """Run the quality 2x2 (A base / B checkpoint in process; C base / D checkpoint served) on ``tasks``.

    Args:
        model_dir: the base model's local Hugging Face directory (its tokenizer is used by every arm).
        skipper: the checkpoint's skipper for arms B and D: a :class:`~impl.vskipper.skipper.Skipper`
            (e.g. RandomSkip, a loaded FlexiDepth skipper), a registered name, or a spec dict
            ``{"name": ..., **kwargs}``.
        data_dir: the data folder (SOURCES.md).
        tasks: suites among :data:`~impl.quality.tasks.QUALITY_SUITES` (``gsm8k``, ``bbh``, ``coqa``).
        limit: lm-eval ``limit``: the first N documents of each lm-eval task (each BBH task counts
            separately); None for all.
        out: output directory (see the module docstring).
        checkpoint_dir: the checkpoint's model directory for B and D (default ``model_dir``: the
            skipper runs on the base weights, as FlexiDepth and RandomSkip do).
        options: :class:`~impl.quality.tasks.TaskOptions` (few-shot, generation budgets, BBH tasks).
        device: torch device of every arm.
        dtype: weight dtype name (``"float32"``, ``"bfloat16"``, ...).
        max_length: context window used by every arm for left truncation (default: lm-eval's rule on
            the base model's config).
        add_bos_token: lm-eval's ``add_bos_token`` (None: the tokenizer's own rule), for every arm.
        cb_config: engine configuration of arms C and D, the same for both (default
            :func:`impl.vskipper.engine.routed_cb_config`).
        first_token_docs: documents per suite (the first by doc id) used for first-token agreement
            (0 turns it off).
        tol: agreement tolerance in nats (App. E.1: 0.01).
        seed: lm-eval random seeds.
        run_id, config: provenance (``config`` is hashed; default: this call's arguments).
        arms: the arms to run; the DiD needs all four.
        served: ``"http"`` (default): C and D are served by the vSkipper HTTP server in this process and
            evaluated by lm-eval's ``local-completions`` client; ``"inprocess"``: the same engine
            without HTTP (:class:`~impl.vskipper.quality_arms.EngineLM`); ``"sglang"``: upstream SGLang
            serves C (base model) and D (vSkipper's routed Llama, always-route), the same client.
        http_concurrency: HTTP requests in flight (default: ``cb_config.max_requests_per_batch``, else 8).
        max_logprobs: top-k log-probabilities the served arms return for first-token agreement.
        request_timeout_s: per-request timeout of the served arms, seconds.
        sglang_launch: ``served="sglang"``: the :class:`~impl.serving.sglang_server.SGLangLaunch` of the
            base model (device, dtype, KV-cache size, interpreter); D serves a routed copy of it.
        sglang_policy: ``served="sglang"`` with D: ``(policy, kwargs)`` of the skipper D's server builds
            (:func:`impl.vskipper.skipper.build_skipper`; FlexiDepth ``("flexidepth", {"checkpoint": DIR})``),
            the same skipper as ``skipper`` (arm B).

    Returns:
        a :class:`QualityResult` (also written under ``out``).

    Raises:
        impl.quality.did.PromptMismatchError: when the arms fed different token ids to any document.
        ValueError: for an unknown suite / arm / skipper / ``served`` mode / dtype.
        RuntimeError: when a served arm's engine received other ids than its client sent.
        FileNotFoundError: for a missing model directory or data file.
    """

    arms = [a for a in arms]
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        raise ValueError(f"unknown arm(s) {unknown}; choices: {list(ARMS)}")
    if served not in SERVED_MODES:
        raise ValueError(f"served must be one of {SERVED_MODES}, got {served!r}")
    if served == "sglang" and any(a in arms for a in ("C", "D")):
        if sglang_launch is None:
            raise ValueError("served='sglang' needs sglang_launch (the base model's SGLangLaunch)")
        if "D" in arms and not sglang_policy:
            raise ValueError("served='sglang' with arm D needs sglang_policy = (policy, kwargs) of the skipper")
    opts = options or TaskOptions()
    model_dir = Path(model_dir)
    ckpt_dir = Path(checkpoint_dir) if checkpoint_dir is not None else model_dir
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    skip = resolve_skipper(skipper) if any(a in arms for a in ("B", "D")) else None
    if not isinstance(getattr(torch, dtype, None), torch.dtype):
        raise ValueError(f"dtype must name a torch dtype (float32, bfloat16, ...), got {dtype!r}")

    tokenizer = load_tokenizer(model_dir)
    if max_length is None:
        max_length = default_max_length(AutoConfig.from_pretrained(model_dir, local_files_only=True), tokenizer)
    cfg = dict(config) if config is not None else {
        "model_dir": str(model_dir), "checkpoint_dir": str(ckpt_dir), "data_dir": str(data_dir),
        "tasks": list(tasks), "limit": limit, "options": opts.to_dict(), "device": device, "dtype": dtype,
        "max_length": max_length, "add_bos_token": add_bos_token, "seed": seed, "tol": tol,
        "first_token_docs": first_token_docs, "arms": arms,
        "skipper": None if skip is None else _skipper_desc(skip),
        "cb_config": None if cb_config is None else repr(cb_config), "served": served,
    }
    prov = provenance(cfg, seed=seed, device=device, dtype=dtype, run_id=run_id)
    prov["lm_eval_version"] = _lm_eval_version()

    ts = write_task_yamls(data_dir, out / "tasks", tasks, opts)
    result = QualityResult(tasks=ts, out=out)
    agreement_lp: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
    agreement_keys: list[tuple[str, int]] | None = None
    if http_concurrency is None:
        http_concurrency = int(getattr(cb_config, "max_requests_per_batch", 0) or 8)
    setup = _ArmSetup(model_dir=model_dir, ckpt_dir=ckpt_dir, tokenizer=tokenizer, skipper=skip, served=served,
                      device=device, dtype=dtype, cb_config=cb_config, max_length=max_length,
                      add_bos_token=add_bos_token, max_logprobs=max_logprobs, request_timeout_s=request_timeout_s,
                      http_concurrency=http_concurrency, sglang_launch=sglang_launch,
                      sglang_policy=None if sglang_policy is None else (str(sglang_policy[0]), dict(sglang_policy[1])))

    with offline():
        tm = TaskManager(include_path=str(ts.include_path), include_defaults=False)
        for arm in arms:
            t0 = time.perf_counter()
            with _arm_lm(arm, setup) as (lm, server_stats):
                res = _evaluate(lm, ts, tm, limit, seed, opts.fewshot_seed)
                result.wall_s[arm] = time.perf_counter() - t0
                scores = per_doc_scores(res.get("samples", {}), arm)
                if set(scores) != set(lm.records):
                    raise RuntimeError(
                        f"arm {arm}: lm-eval scored {len(scores)} documents but {len(lm.records)} were generated"
                    )
                result.records[arm] = dict(lm.records)
                result.scores[arm] = scores
                # gate early: every arm against the first one
                first = arms[0]
                check_prompt_hashes({first: result.records[first], arm: result.records[arm]})
                if first_token_docs > 0:
                    if agreement_keys is None:
                        agreement_keys = _agreement_keys(result.records[arm], ts, first_token_docs)
                    for key in agreement_keys:
                        rec = result.records[arm][key]
                        agreement_lp.setdefault(key, {})[arm] = lm.first_token_logprobs(rec.prompt_ids, rec.request_id)
                agg = {"results": res.get("results"), "configs": res.get("configs"), "n-samples": res.get("n-samples"),
                       "arm": arm, "arm_desc": ARMS[arm], "wall_s": result.wall_s[arm],
                       "served": served if arm in SERVER_ARM else "inprocess"}
                if server_stats is not None:
                    result.served_stats[arm] = server_stats()
                    agg.update(server_arm=SERVER_ARM[arm], server_stats=result.served_stats[arm])
                write_json(out / f"lm_eval_{arm}.json", _jsonable(agg))
            del lm, server_stats  # the arm's model goes before the next arm loads its own
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    n_docs = check_prompt_hashes(result.records)
    result.requests = request_rows(result.records[arms[0]], ts.suite_of, max_length=max_length,
                                   add_bos_token=add_bos_token)
    write_jsonl(out / "requests.jsonl", result.requests)
    rows = _doc_rows(result, arms, prov)
    if all(a in arms for a in ("A", "B", "C", "D")):
        result.summary = _did_rows(result, n_docs, prov)
    result.first_token = _first_token_rows(result, agreement_lp, arms[0], tol, prov)
    rows += result.summary + result.first_token
    result.rows = rows
    write_jsonl(out / "quality.jsonl", rows)
    write_json(out / "summary.json", {"config": cfg, "provenance": prov, "summary": result.summary,
                                      "first_token": result.first_token,
                                      "wall_s": result.wall_s, "n_docs": n_docs, "served": served,
                                      "served_stats": _jsonable(result.served_stats)})
    return result
