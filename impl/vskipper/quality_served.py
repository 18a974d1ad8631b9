"""The checkpoint served at the knee: hybrid vs always-route (vSkipper Sec. 4.3, Table 5 right; App. E.3).

Table 5 (right) evaluates the served hybrid under load at the knee: the FlexiDepth checkpoint is served by
the hybrid arm (vSkipper with the profitability-aware mode switch) and by always-route, each document's
request arrives in a seeded Poisson stream at the knee rate, and each document is scored by the task's
own metric; the paired per-document difference hybrid - always-route has a 95 % t interval ("Intervals
are computed per document with n = 1"), and each arm reports the share of decode rows it served in
routed mode ("routed: share of decode rows, hybrid / always-route").

:func:`run_served_knee` does this for one suite:

1. **Requests.** Each document's request is taken from the quality run (``requests.jsonl`` of
   :func:`impl.vskipper.quality_run.run_quality`): its prompt token ids (the ids all four 2x2 arms fed), its stop
   strings (lm-eval's ``until`` plus the EOS string) and its budget ``max_gen_toks``; the request id is
   ``<task>/<doc_id>`` as in arms B and D. Optionally the stream is padded to ``n_requests`` requests
   with the load workload's frozen token-id prompts (natural generation to EOS or the workload's cap,
   no stop strings, not scored), as the paper pads the GSM8K and CoQA load with training-split prompts
   and scores only the held-out documents (Sec. 4.1 "Workloads"). :func:`build_stream` orders documents
   and padding by a seeded permutation.
2. **Load.** :func:`impl.serving.arrivals.poisson_arrivals` at ``rate`` requests/s (the knee: a load
   point of the ``vskipper_knee`` output, 0.95 x Q*) with a seed from the run seed and the suite; the
   same schedule and order are replayed against each arm. :func:`run_stream` is an open-loop client
   (one thread per request, no concurrency cap, every request served to completion) POSTing token-id
   prompts with ``stop``, ``max_tokens`` and ``request_id`` to ``/v1/completions`` of a
   :class:`~impl.vskipper.quality_arms.ServedEndpoint` (the vSkipper HTTP server in this process on 127.0.0.1,
   port 0): ``hybrid`` (the given :class:`~impl.vskipper.mode.ModeSwitch`) and ``always-route``, each a
   fresh engine (fresh switch state) on the same engine settings.
3. **Cut and score.** Each response's token ids are cut by the 2x2's stop rule
   (:class:`~impl.vskipper.quality_arms.StopRule`, HFLM's) and decoded into the scored text. Scoring runs lm-eval
   itself (:func:`lm_eval.simple_evaluate` over the same generated task YAMLs, documents and seeds) with
   :class:`ReplayLM`, which answers each ``generate_until`` request with its document's served text after
   checking that lm-eval's context encodes to the recorded prompt ids (prompt-hash gate): the task's own
   filters and ``process_results`` score every document (:func:`impl.quality.did.per_doc_scores`).
4. **Summaries.** Per suite and metric: each arm's mean (pp), the paired difference hybrid - always-route
   with its t-based 95 % interval (:func:`impl.stats.paired_difference`), and per arm the routed share of
   decode rows: from each request's modes as the server reports them (``decode_routed_from``: the
   absolute token index of its first routed decode row; a request with ``P`` prompt tokens and ``n``
   generated tokens has ``n - 1`` decode rows, rows at indices ``>= decode_routed_from`` routed), over
   every request of the stream (and over the scored documents only), plus the mode switch's own
   decode-row counters (hybrid).

Rows (``kind``): ``served_doc`` (document x arm: ids, response, scores, modes, times),
``served_request`` (every stream request x arm, times and modes, no ids), ``served_arm`` (per arm: counts,
E2E mean, routed shares, the server's stats), ``served_summary`` (suite x metric, BBH also per task).
Times are seconds from the injection start.

Source: vSkipper paper Sec. 4.1 ("Load", "Quality"), Sec. 4.3 and Table 5 (right), App. E.3 / Table 10.
"""

from __future__ import annotations

import gc
import math
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import torch
from lm_eval.api.model import LM
from lm_eval.models.utils import normalize_gen_kwargs
from lm_eval.tasks import TaskManager

from impl.models.load import load_model, load_tokenizer
from impl.provenance import provenance, write_json, write_jsonl
from impl.quality.did import PromptMismatchError, per_doc_scores
from impl.quality.tasks import PRIMARY_METRIC, TaskOptions, write_task_yamls
from impl.serving.arrivals import poisson_arrivals
from impl.serving.protocol import cell_seed
from impl.stats import paired_difference
from impl.vskipper.driver import ARMS as SERVER_ARMS
from impl.vskipper.engine import sized_cb_config
from impl.vskipper.spec import parse_skipper_spec

from .quality_arms import ServedEndpoint, StopRule, encode_context, eos_ids_of, post_json, prompt_hash
from .quality_run import _evaluate, _jsonable, offline
from .schema import Engine

__all__ = [
    "SERVED_ARMS",
    "StreamRequest",
    "ServedStreamError",
    "ServedKneeResult",
    "doc_requests",
    "build_stream",
    "routed_decode_rows",
    "run_stream",
    "stream_cb_config",
    "ReplayLM",
    "served_summary",
    "run_served_knee",
]

#: the served arms of Table 5 (right), in the order they run
SERVED_ARMS: tuple[str, ...] = ("hybrid", "always-route")
_REQUEST_KEYS = ("task", "doc_id", "request_id", "prompt_ids", "prompt_hash", "until", "max_gen_toks", "max_length")


class ServedStreamError(RuntimeError):
    """A served stream did not complete (a request failed or timed out). ``rows`` holds the rows measured
    before the failure."""

    def __init__(self, message: str, rows: Sequence[Mapping[str, Any]] = ()):
        super().__init__(message)
        self.rows = [dict(r) for r in rows]


@dataclass(frozen=True)
class StreamRequest:
    """One request of the served stream.

    Attributes:
        request_id: engine request id (``<task>/<doc_id>`` for a document, ``pad/<id>`` for padding).
        prompt_ids: prompt token ids.
        max_tokens: generation budget [tokens].
        stop: stop strings sent to the server (documents: their ``until``; padding: none).
        task, doc_id: the lm-eval document (None for padding: not scored).
        prompt_hash: the document's prompt hash from the quality run (None for padding).
    """

    request_id: str
    prompt_ids: tuple[int, ...]
    max_tokens: int
    stop: tuple[str, ...] = ()
    task: str | None = None
    doc_id: int | None = None
    prompt_hash: str | None = None

    @property
    def scored(self) -> bool:
        """True for a document of the quality run (padding is not scored)."""
        return self.task is not None

    def body(self, model: str) -> dict[str, Any]:
        """The ``/v1/completions`` body: token-id prompt, greedy, ``max_tokens``, ``stop``, ``request_id``."""
        return {"model": model, "prompt": list(self.prompt_ids), "max_tokens": int(self.max_tokens), "temperature": 0,
                "stop": list(self.stop), "request_id": self.request_id}


@dataclass
class ServedKneeResult:
    """What :func:`run_served_knee` produced.

    Attributes:
        rows: every row (``served_doc``, ``served_request``, ``served_arm``, ``served_summary``).
        summary: the ``served_summary`` rows.
        arm_rows: the ``served_arm`` rows.
        responses: ``arm -> request id -> response record`` (see :func:`run_stream`).
        scores: ``arm -> {(task, doc_id): per-document scores}``.
        stream: the stream, in arrival order.
        schedule: the arrival schedule (offsets in seconds, rate in requests/s).
        out: the output directory.
    """

    rows: list[dict[str, Any]] = field(default_factory=list)
    summary: list[dict[str, Any]] = field(default_factory=list)
    arm_rows: list[dict[str, Any]] = field(default_factory=list)
    responses: dict[str, dict[str, dict]] = field(default_factory=dict)
    scores: dict[str, dict[tuple[str, int], dict]] = field(default_factory=dict)
    stream: list[StreamRequest] = field(default_factory=list)
    schedule: Any = None
    out: Path | None = None

    def summary_for(self, suite: str, metric: str | None = None) -> dict[str, Any]:
        """The suite-level summary row of ``metric`` (default: the suite's primary metric).

        Raises:
            KeyError: when there is no such row.
        """

        if metric is None:
            m, f = PRIMARY_METRIC[suite]
            metric = f"{m},{f}"
        for r in self.summary:
            if r["suite"] == suite and r["metric"] == metric and r.get("task") is None:
                return r
        raise KeyError(f"no served summary row for suite {suite!r}, metric {metric!r}")


# ------------------------------------------------------------------------------------------ requests
def doc_requests(rows: Iterable[Mapping[str, Any]]) -> list[StreamRequest]:
    """The documents' requests from ``requests.jsonl`` rows of the quality run (sorted by task, doc id).

    Args:
        rows: request rows (:func:`impl.vskipper.quality_run.request_rows`): ``task``, ``doc_id``, ``request_id``,
            ``prompt_ids``, ``prompt_hash``, ``until``, ``max_gen_toks``, ``max_length``.

    Raises:
        ValueError: for a row missing a key (named), an empty prompt, a hash that does not match the ids,
            a budget < 1, or a document listed twice.

    Source: vSkipper App. E.1 (identical token ids in every arm), Table 5 (right).
    """

    out: dict[tuple[str, int], StreamRequest] = {}
    for i, r in enumerate(rows):
        if r.get("kind", "request") != "request":
            continue
        missing = [k for k in _REQUEST_KEYS if k not in r]
        if missing:
            raise ValueError(f"request row {i}: missing key(s) {missing}")
        ids = tuple(int(t) for t in r["prompt_ids"])
        if not ids:
            raise ValueError(f"request row {i} ({r['task']}/{r['doc_id']}): 'prompt_ids' is empty")
        if prompt_hash(ids) != r["prompt_hash"]:
            raise ValueError(f"request row {i} ({r['task']}/{r['doc_id']}): 'prompt_hash' {r['prompt_hash']} does not "
                             f"match its prompt_ids ({prompt_hash(ids)})")
        if int(r["max_gen_toks"]) < 1:
            raise ValueError(f"request row {i}: 'max_gen_toks' must be >= 1, got {r['max_gen_toks']}")
        key = (str(r["task"]), int(r["doc_id"]))
        if key in out:
            raise ValueError(f"request row {i}: document {key} is listed twice")
        out[key] = StreamRequest(str(r["request_id"]), ids, int(r["max_gen_toks"]), tuple(str(s) for s in r["until"]),
                                 key[0], key[1], str(r["prompt_hash"]))
    return [out[k] for k in sorted(out)]


def build_stream(docs: Sequence[StreamRequest], pad_prompts: Iterable[Mapping[str, Any]] = (), *,
                 n_requests: int | None = None, pad_max_tokens: int = 32, seed: int = 0) -> list[StreamRequest]:
    """The served stream: the documents plus padding up to ``n_requests``, in a seeded order.

    Args:
        docs: the documents' requests (:func:`doc_requests`).
        pad_prompts: the load workload's frozen prompt rows (``id``, ``input_ids``; rows with an ``error``
            are skipped), cycled; a cycled row's id gets ``#k``. Padding requests are ``pad/<id>``,
            budget ``pad_max_tokens``, no stop strings, not scored.
        n_requests: total requests (None or <= len(docs): documents only).
        pad_max_tokens: budget of a padding request [tokens].
        seed: seed of the permutation (``numpy.random.default_rng``).

    Returns:
        the requests in arrival order.

    Raises:
        ValueError: for no documents, padding needed but no usable prompt row, or repeated request ids.

    Source: vSkipper Sec. 4.1 "Workloads" (load padded with training-split prompts, held-out documents scored).
    """
    if not docs:
        raise ValueError("the served stream needs at least one document")
    n_pad = max(0, int(n_requests or 0) - len(docs))
    pads: list[StreamRequest] = []
    if n_pad:
        usable = [r for r in pad_prompts if r.get("input_ids") and not r.get("error")]
        if not usable:
            raise ValueError(f"{n_pad} padding requests needed but no usable prompt row (need 'input_ids')")
        for i in range(n_pad):
            row = usable[i % len(usable)]
            rid = f"pad/{row['id']}" + ("" if i < len(usable) else f"#{i // len(usable)}")
            pads.append(StreamRequest(rid, tuple(int(t) for t in row["input_ids"]), int(pad_max_tokens)))
    allreq = list(docs) + pads
    ids = [r.request_id for r in allreq]
    if len(set(ids)) != len(ids):
        raise ValueError(f"repeated request ids in the stream: {sorted({i for i in ids if ids.count(i) > 1})[:5]}")
    order = np.random.default_rng(int(seed)).permutation(len(allreq))
    return [allreq[int(i)] for i in order]


def stream_cb_config(engine: Engine, stream: Sequence[StreamRequest]):
    """The engine configuration of both served arms: the cache of
    :func:`impl.vskipper.engine.sized_cb_config` holds every request of the stream at once (prompt +
    budget tokens each), so no request is evicted."""

    return sized_cb_config(engine, (len(r.prompt_ids) + r.max_tokens for r in stream))


# ----------------------------------------------------------------------------------------- the load
def routed_decode_rows(prompt_len: int, n_tokens: int, decode_routed_from: int | None) -> tuple[int, int]:
    """``(decode rows, routed decode rows)`` of one request: ``n_tokens - 1`` decode rows (the first
    token comes from prefill) fed at absolute indices ``prompt_len .. prompt_len + n_tokens - 2``; those
    at indices ``>= decode_routed_from`` were routed (None: decode stayed dense).

    Raises:
        ValueError: for a negative length.

    Source: vSkipper Table 5 (right) / Table 10 "routed: share of decode rows".
    """
    if prompt_len < 0 or n_tokens < 0:
        raise ValueError(f"lengths must be >= 0, got prompt_len={prompt_len}, n_tokens={n_tokens}")
    rows = max(0, int(n_tokens) - 1)
    if decode_routed_from is None or rows == 0:
        return rows, 0
    start = max(int(decode_routed_from), int(prompt_len))
    return rows, max(0, int(prompt_len) + rows - start)


def run_stream(url: str, model: str, stream: Sequence[StreamRequest], schedule, *, timeout_s: float = 600.0
               ) -> dict[str, dict[str, Any]]:
    """Replay ``stream`` open loop against a completions endpoint at the arrivals of ``schedule``.

    Request ``i`` is POSTed (non-streaming, its own thread, no concurrency cap) at
    ``t0 + schedule.offsets_s[i]``; the call returns once every request answered or ``timeout_s``
    passed after the last submission.

    Args:
        url: the ``/v1/completions`` URL.
        model: the served model name.
        stream: requests in arrival order (same length as the schedule).
        schedule: an :class:`~impl.serving.arrivals.ArrivalSchedule` (seconds).
        timeout_s: per-request socket timeout and the wait after the last submission, seconds.

    Returns:
        ``request id -> record``: ``scheduled_s``, ``arrival_s``, ``finish_s``, ``e2e_s`` (seconds from the
        injection start / from arrival), ``error`` (None on success), ``token_ids``, ``text``,
        ``finish_reason``, ``vskipper`` (the server's modes object), ``prompt_tokens``,
        ``completion_tokens``.

    Raises:
        ValueError: when the stream and the schedule differ in length.

    Source: vSkipper Sec. 4.1 "Load" (seeded Poisson arrivals, no client-side concurrency cap).
    """

    if len(stream) != len(schedule.offsets_s):
        raise ValueError(f"{len(stream)} requests but {len(schedule.offsets_s)} scheduled arrivals")
    out: dict[str, dict[str, Any]] = {}
    lock = threading.Lock()
    t0 = time.perf_counter()

    def one(req: StreamRequest, scheduled: float, arrival: float) -> None:
        rec: dict[str, Any] = {"request_id": req.request_id, "scheduled_s": scheduled, "arrival_s": arrival,
                               "finish_s": None, "e2e_s": None, "error": None, "token_ids": [], "text": None,
                               "finish_reason": None, "vskipper": {}, "prompt_tokens": len(req.prompt_ids),
                               "completion_tokens": 0}
        try:
            resp = post_json(url, req.body(model), timeout_s=timeout_s)
            ch = resp["choices"][0]
            now = time.perf_counter() - t0
            rec.update(finish_s=now, e2e_s=now - arrival, token_ids=[int(t) for t in ch.get("token_ids") or []],
                       text=ch.get("text"), finish_reason=ch.get("finish_reason"),
                       vskipper=dict(ch.get("vskipper") or {}),
                       completion_tokens=int((resp.get("usage") or {}).get("completion_tokens", 0)))
        except Exception as e:  # noqa: BLE001 - recorded, the caller decides
            rec["error"] = f"{type(e).__name__}: {e}"
        with lock:
            out[req.request_id] = rec

    threads = []
    for req, off in zip(stream, schedule.offsets_s):
        delay = t0 + float(off) - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        th = threading.Thread(target=one, args=(req, float(off), time.perf_counter() - t0), daemon=True,
                              name=f"served-{req.request_id}")
        th.start()
        threads.append(th)
    deadline = time.perf_counter() + float(timeout_s)
    for th in threads:
        th.join(timeout=max(0.0, deadline - time.perf_counter()))
    with lock:
        for req, off in zip(stream, schedule.offsets_s):
            if req.request_id not in out:
                out[req.request_id] = {"request_id": req.request_id, "scheduled_s": float(off), "arrival_s": None,
                                       "finish_s": None, "e2e_s": None, "error": f"no answer within {timeout_s:.0f} s",
                                       "token_ids": [], "text": None, "finish_reason": None, "vskipper": {},
                                       "prompt_tokens": len(req.prompt_ids), "completion_tokens": 0}
        return dict(out)


# ----------------------------------------------------------------------------------------- scoring
class ReplayLM:
    """An lm-eval LM that answers ``generate_until`` with the served texts (built lazily as a subclass of
    ``lm_eval.api.model.LM``; use :meth:`make`).

    Each request's context is re-encoded with the quality run's rule
    (:func:`~impl.vskipper.quality_arms.encode_context`, left truncation to ``max_length - max_gen_toks``) and
    must hash to the document's recorded prompt hash (else
    :class:`~impl.quality.did.PromptMismatchError`); a document without a served text is an error.
    """

    @staticmethod
    def make(texts: Mapping[tuple[str, int], str], hashes: Mapping[tuple[str, int], str], tokenizer, *,
             max_length: int, add_bos_token: bool | None, default_max_gen_toks: int = 256):
        """Build the LM.

        Args:
            texts: ``(task, doc_id) -> scored text``.
            hashes: ``(task, doc_id) -> prompt hash`` of the served prompt ids.
            tokenizer: the base model's tokenizer.
            max_length: the quality run's context window [tokens].
            add_bos_token: the quality run's ``add_bos_token``.
            default_max_gen_toks: lm-eval's default budget.
        """

        class _Replay(LM):
            def __init__(self):
                super().__init__()
                self.seen: list[tuple[str, int]] = []

            def loglikelihood(self, requests, disable_tqdm: bool = False):
                raise NotImplementedError("the served replay answers generate_until only")

            def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
                raise NotImplementedError("the served replay answers generate_until only")

            def generate_until(self, requests, disable_tqdm: bool = False):
                res = []
                for req in requests:
                    key = (str(req.task_name), int(req.doc_id))
                    if key not in texts:
                        raise ValueError(f"no served response for document {key} (was it in the quality run's "
                                         "requests?)")
                    kw = normalize_gen_kwargs(req.args[1], default_max_gen_toks)
                    ids = encode_context(tokenizer, req.args[0], int(max_length) - int(kw["max_gen_toks"]),
                                         add_bos_token)
                    if prompt_hash(ids) != hashes[key]:
                        raise PromptMismatchError(
                            f"document {key}: lm-eval's context encodes to {prompt_hash(ids)} ({len(ids)} tokens) "
                            f"but the served prompt hash is {hashes[key]}")
                    self.seen.append(key)
                    res.append(texts[key])
                return res

        return _Replay()


def _mean(xs: Sequence[float]) -> float:
    return float(sum(xs) / len(xs)) if xs else math.nan


def served_summary(scores: Mapping[str, Mapping[tuple[str, int], Mapping[str, Any]]], keys: Iterable[tuple[str, int]],
                   metric: str, *, suite: str, arms: Sequence[str] = SERVED_ARMS, scale: float = 100.0,
                   confidence: float = 0.95) -> dict[str, Any]:
    """One Table 5 (right) row for ``metric`` over the documents ``keys`` (paired by document).

    Args:
        scores: ``arm -> {(task, doc_id): {"scores": {metric: value in [0, 1]}}}``.
        keys: the documents.
        metric: ``"metric,filter"`` as lm-eval names it.
        suite: the suite label.
        arms: ``(treatment, reference)``, default ``("hybrid", "always-route")``.
        scale: 100: percentage points.
        confidence: interval level.

    Returns:
        ``suite``, ``metric``, ``n``, ``mean_<arm>`` (pp) per arm, and ``diff_*`` = the paired difference
        treatment - reference (:func:`impl.stats.paired_difference`: mean, sd, se, ci_low, ci_high, t_stat,
        p_value, resolved), ``treatment``, ``reference``.

    Raises:
        KeyError: when an arm lacks a document or the metric; ValueError: for no documents.

    Source: vSkipper Sec. 4.3 ("Intervals are computed per document with n = 1"), Table 5 (right).
    """

    keys = sorted(keys)
    if not keys:
        raise ValueError(f"suite {suite}: no documents to summarise")
    treat, ref = arms[0], arms[1]
    vals = {a: [scale * float(scores[a][k]["scores"][metric]) for k in keys] for a in (treat, ref)}
    row: dict[str, Any] = {"suite": suite, "metric": metric, "n": len(keys), "scale": scale, "confidence": confidence,
                           "treatment": treat, "reference": ref}
    for a in (treat, ref):
        row[f"mean_{a}"] = _mean(vals[a])
    pr = paired_difference(vals[ref], vals[treat], confidence)
    row.update({f"diff_{k}": v for k, v in pr.to_dict().items() if k != "confidence"})
    return row


def _arm_share(recs: Iterable[Mapping[str, Any]], lengths: Mapping[str, int]) -> dict[str, Any]:
    rows = routed = pre = 0
    n = 0
    for r in recs:
        v = r.get("vskipper") or {}
        d, rr = routed_decode_rows(lengths[r["request_id"]], len(r.get("token_ids") or []), v.get("decode_routed_from"))
        rows += d
        routed += rr
        pre += int(bool(v.get("prefill_routed")))
        n += 1
    return {"decode_rows": rows, "decode_routed_rows": routed,
            "routed_share": routed / rows if rows else math.nan,
            "prefill_routed_share": pre / n if n else math.nan}


# ----------------------------------------------------------------------------------- pass phases
def _check_arms_and_rate(arms: Sequence[str], rate: float) -> list[str]:
    arms = list(arms)
    if len(arms) != 2 or len(set(arms)) != 2 or any(a not in SERVER_ARMS or a == "upstream" for a in arms):
        raise ValueError(f"arms must be two distinct vSkipper server arms (treatment, reference), got {arms}")
    if not (isinstance(rate, (int, float)) and math.isfinite(rate) and rate > 0):
        raise ValueError(f"rate must be a positive number of requests/s, got {rate!r}")
    return arms


@dataclass
class _ArmPass:
    """One arm's served stream: ``responses`` (request id -> :func:`run_stream` record), the server's
    ``stats``, the prompt ids the engine ``received`` per request id, and the pass's ``wall_s`` [s]."""

    responses: dict[str, dict]
    stats: dict
    received: dict[str, list[int]]
    wall_s: float


def _serve_arm(model, tokenizer, arm: str, skipper, switch, cb, stream: Sequence[StreamRequest], schedule,
               timeout_s: float) -> _ArmPass:
    """Replay ``stream`` on ``schedule`` against a fresh in-process server of ``arm`` (step 2 above)."""

    ep = ServedEndpoint(model, tokenizer, arm, skipper=skipper, switch=switch if arm != "always-route" else None,
                        cb_config=cb, served_model_name=f"vsk-served-{arm}", request_timeout_s=timeout_s)
    t0 = time.perf_counter()
    with ep:
        got = run_stream(ep.completions_url, ep.served_model_name, stream, schedule, timeout_s=timeout_s)
        stats = ep.stats()
        received = dict(ep.received)
    wall = time.perf_counter() - t0
    gc.collect()
    return _ArmPass(responses=got, stats=stats, received=received, wall_s=wall)


def _request_rows(stream: Sequence[StreamRequest], served: _ArmPass, suite: str, arm: str, pos: int,
                  stamp: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The ``served_request`` rows of one arm's pass (every stream request, times and modes, no ids)."""

    rows = []
    for r in stream:
        rec = served.responses[r.request_id]
        rows.append({"kind": "served_request", "suite": suite, "arm": arm, "order_position": pos,
                     "request_id": r.request_id, "scored": r.scored, "task": r.task, "doc_id": r.doc_id,
                     "n_prompt_tokens": len(r.prompt_ids), "max_tokens": r.max_tokens,
                     "n_tokens": len(rec["token_ids"]), **{k: rec[k] for k in (
                         "scheduled_s", "arrival_s", "finish_s", "e2e_s", "error", "finish_reason")},
                     "vskipper": rec["vskipper"], **stamp})
    return rows


def _check_arm_pass(arm: str, stream: Sequence[StreamRequest], served: _ArmPass,
                    rows: Sequence[Mapping[str, Any]]) -> None:
    """Raise :class:`ServedStreamError` (``rows`` attached) when a request failed, and
    :class:`PromptMismatchError` when the engine received other prompt ids than the quality run fed."""

    failed = [r for r in stream if served.responses[r.request_id]["error"] is not None]
    if failed:
        raise ServedStreamError(f"arm {arm}: {len(failed)} of {len(stream)} requests failed; first "
                                f"{failed[0].request_id}: {served.responses[failed[0].request_id]['error']}", rows)
    bad = [r.request_id for r in stream if served.received.get(r.request_id) != list(r.prompt_ids)]
    if bad:
        raise PromptMismatchError(f"arm {arm}: the engine received other prompt ids than the quality run fed on "
                                  f"{len(bad)} request(s), first {bad[0]}")


@dataclass
class _Cut:
    """One arm's responses cut by the 2x2's stop rule: ``texts`` and ``ids`` per ``(task, doc_id)`` and how
    many documents' cut text equals the server's own ``text`` (``server_text_equal``)."""

    texts: dict[tuple[str, int], str]
    ids: dict[tuple[str, int], list[int]]
    server_text_equal: int


def _cut_responses(docs: Sequence[StreamRequest], responses: Mapping[str, Mapping[str, Any]], tokenizer,
                   eos_ids) -> _Cut:
    """Cut each document's served token ids by its stop rule and decode the scored text (step 3 above)."""

    cut = _Cut(texts={}, ids={}, server_text_equal=0)
    for d in docs:
        rec = responses[d.request_id]
        rule = StopRule(tokenizer, d.stop, eos_ids)
        ids = rule.cut(rec["token_ids"][: d.max_tokens])
        text = rule.text(ids)
        cut.texts[(d.task, d.doc_id)] = text
        cut.ids[(d.task, d.doc_id)] = ids
        cut.server_text_equal += int(text == rec["text"])
    return cut


def _score_arms(cuts: Mapping[str, _Cut], hashes: Mapping[tuple[str, int], str], arms: Sequence[str], tokenizer,
                data_dir, suite: str, out: Path, opts: TaskOptions, limit, seed: int, *, max_length: int,
                add_bos_token) -> dict[str, dict[tuple[str, int], dict]]:
    """Score each arm's cut texts with lm-eval itself through :class:`ReplayLM` (step 3 above); writes
    ``lm_eval_<arm>.json`` under ``out``.

    Raises:
        ValueError: when lm-eval scored other documents than the quality run's requests.
    """

    scores: dict[str, dict[tuple[str, int], dict]] = {}
    ts = write_task_yamls(data_dir, out / "tasks", (suite,), opts)
    with offline():
        tm = TaskManager(include_path=str(ts.include_path), include_defaults=False)
        for arm in arms:
            lm = ReplayLM.make(cuts[arm].texts, hashes, tokenizer, max_length=max_length, add_bos_token=add_bos_token)
            res = _evaluate(lm, ts, tm, limit, seed, opts.fewshot_seed)
            sc = per_doc_scores(res.get("samples", {}), arm)
            if set(sc) != set(hashes):
                missing = sorted(set(hashes) - set(sc))[:5]
                extra_docs = sorted(set(sc) - set(hashes))[:5]
                raise ValueError(f"arm {arm}: lm-eval scored other documents than the quality run's requests "
                                 f"(not scored: {missing}; not requested: {extra_docs}); same limit and options?")
            scores[arm] = sc
            write_json(out / f"lm_eval_{arm}.json", _jsonable({"results": res.get("results"), "arm": arm}))
    return scores


def _doc_rows(docs: Sequence[StreamRequest], responses: Mapping[str, Mapping[str, Any]],
              scores: Mapping[tuple[str, int], Mapping[str, Any]], cut: _Cut, suite: str, arm: str, primary: str,
              stamp: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The ``served_doc`` rows of one arm (document: ids, response, scores, modes, times)."""

    rows = []
    for d in docs:
        key = (d.task, d.doc_id)
        rec = responses[d.request_id]
        sc = scores[key]
        v = rec["vskipper"]
        dr, rr = routed_decode_rows(len(d.prompt_ids), len(rec["token_ids"]), v.get("decode_routed_from"))
        rows.append({"kind": "served_doc", "suite": suite, "arm": arm, "task": d.task, "doc_id": d.doc_id,
                     "request_id": d.request_id, "prompt_hash": prompt_hash(list(d.prompt_ids)),
                     "n_prompt_tokens": len(d.prompt_ids), "gen_ids": cut.ids[key],
                     "n_gen_tokens": len(cut.ids[key]), "n_served_tokens": len(rec["token_ids"]),
                     "response": cut.texts[key], "server_text": rec["text"], "finish_reason": rec["finish_reason"],
                     "max_gen_toks": d.max_tokens, "metric": primary, "score": sc["scores"].get(primary),
                     "scores": sc["scores"], "filtered": sc["filtered"], "target": sc.get("target"),
                     "prefill_routed": v.get("prefill_routed"), "decode_routed_from": v.get("decode_routed_from"),
                     "promoted": v.get("promoted"), "decode_rows": dr, "decode_routed_rows": rr,
                     "scheduled_s": rec["scheduled_s"], "arrival_s": rec["arrival_s"], "e2e_s": rec["e2e_s"],
                     **stamp})
    return rows


def _arm_row(served: _ArmPass, stream: Sequence[StreamRequest], docs: Sequence[StreamRequest],
             lengths: Mapping[str, int], schedule, suite: str, arm: str, pos: int, rate: float,
             server_text_equal: int, stamp: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """One arm's ``served_arm`` row (counts, E2E mean, routed shares, the server's stats) and its routed
    shares (step 4 above)."""

    got = served.responses
    all_share = _arm_share(got.values(), lengths)
    doc_share = _arm_share((got[d.request_id] for d in docs), lengths)
    ms = (served.stats.get("mode_switch") or {}).get("rows", {}).get("decode") or {}
    tot = (ms.get("routed") or 0) + (ms.get("dense") or 0)
    shares = {"routed_share": all_share["routed_share"], "routed_share_docs": doc_share["routed_share"],
              "prefill_routed_share": all_share["prefill_routed_share"],
              "switch_routed_share": (ms.get("routed", 0) / tot) if tot else
              (1.0 if arm == "always-route" else math.nan)}
    e2e = [got[r.request_id]["e2e_s"] for r in stream]
    row = {"kind": "served_arm", "suite": suite, "arm": arm, "order_position": pos, "n_requests": len(stream),
           "n_docs": len(docs), "n_padding": len(stream) - len(docs), "n_failed": 0, "rate": rate,
           "window_s": schedule.window_s, "schedule_seed": schedule.seed, "wall_s": served.wall_s,
           "e2e_mean_s": _mean(e2e), "output_tokens": sum(len(got[r.request_id]["token_ids"]) for r in stream),
           **all_share, "routed_share_docs": doc_share["routed_share"],
           "decode_rows_docs": doc_share["decode_rows"],
           "decode_routed_rows_docs": doc_share["decode_routed_rows"],
           "switch_decode_rows": ms or None, "switch_routed_share": shares["switch_routed_share"],
           "server_text_equal": server_text_equal, "server_stats": _jsonable(served.stats), **stamp}
    return row, shares


def _summary_rows(result: ServedKneeResult, cuts: Mapping[str, _Cut], shares: Mapping[str, Mapping[str, Any]],
                  hashes: Mapping[tuple[str, int], str], stream: Sequence[StreamRequest], docs: Sequence[StreamRequest],
                  schedule, suite: str, arms: Sequence[str], rate: float, primary: str,
                  stamp: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The ``served_summary`` rows: per metric over the suite, and per task for the primary metric when the
    suite has several tasks (BBH)."""

    treat, ref = arms
    keys = sorted(hashes)
    metrics = sorted(result.scores[treat][keys[0]]["scores"])
    common = {"n_requests": len(stream), "n_padding": len(stream) - len(docs), "rate": rate,
              "window_s": schedule.window_s, "schedule_seed": schedule.seed,
              "tokens_equal": sum(cuts[treat].ids[k] == cuts[ref].ids[k] for k in keys),
              **{f"routed_share_{a}": shares[a]["routed_share"] for a in arms},
              **{f"routed_share_docs_{a}": shares[a]["routed_share_docs"] for a in arms},
              **{f"prefill_routed_share_{a}": shares[a]["prefill_routed_share"] for a in arms},
              **{f"switch_routed_share_{a}": shares[a]["switch_routed_share"] for a in arms},
              **{f"e2e_mean_s_{r['arm']}": r["e2e_mean_s"] for r in result.arm_rows},
              "prompt_hashes_equal": True}
    summary = []
    for metric in metrics:
        row = served_summary(result.scores, keys, metric, suite=suite, arms=arms)
        row.update({"kind": "served_summary", "task": None, "primary": metric == primary, **common, **stamp})
        summary.append(row)
    names = sorted({k[0] for k in keys})
    if len(names) > 1:
        for name in names:
            tkeys = [k for k in keys if k[0] == name]
            row = served_summary(result.scores, tkeys, primary, suite=suite, arms=arms)
            row.update({"kind": "served_summary", "task": name, "primary": True,
                        "tokens_equal": sum(cuts[treat].ids[k] == cuts[ref].ids[k] for k in tkeys),
                        "prompt_hashes_equal": True, **stamp})
            summary.append(row)
    return summary


# ----------------------------------------------------------------------------------------- the pass
def run_served_knee(
    model_dir: str | os.PathLike,
    skipper,
    requests: Iterable[Mapping[str, Any]],
    data_dir: str | os.PathLike,
    suite: str,
    *,
    rate: float,
    switch,
    out: str | os.PathLike,
    limit: int | float | None,
    options=None,
    pad_prompts: Iterable[Mapping[str, Any]] = (),
    n_requests: int | None = None,
    pad_max_tokens: int = 32,
    seed: int = 1234,
    device: str = "cpu",
    dtype: str = "float32",
    engine: Engine | None = None,
    timeout_s: float = 600.0,
    arms: Sequence[str] = SERVED_ARMS,
    extra: Mapping[str, Any] | None = None,
    config: Mapping[str, Any] | None = None,
    run_id: str | None = None,
) -> ServedKneeResult:
    """Serve one suite's documents at the knee under the hybrid and always-route and score them (module
    docstring; Table 5 right).

    Args:
        model_dir: the base model directory (its tokenizer is the quality run's).
        skipper: the checkpoint's skipper: a :class:`~impl.vskipper.skipper.Skipper` or a spec for
            :func:`impl.vskipper.spec.parse_skipper_spec` (e.g. ``"flexidepth:DIR"``).
        requests: the quality run's request rows of this suite (``requests.jsonl``).
        data_dir: the data folder (task YAMLs are regenerated over it).
        suite: ``gsm8k``, ``bbh`` or ``coqa``.
        rate: offered rate [requests/s] (the knee: 0.95 x Q*).
        switch: the hybrid's :class:`~impl.vskipper.mode.ModeSwitch`.
        out: output directory (``tasks/``, ``served.jsonl``, ``summary.json``).
        limit: the quality run's lm-eval ``limit`` (the same documents are scored).
        options: the quality run's :class:`~impl.quality.tasks.TaskOptions`.
        pad_prompts, n_requests, pad_max_tokens: padding of the stream (:func:`build_stream`).
        seed: run seed; the order and schedule seeds derive from it and the suite
            (:func:`impl.serving.protocol.cell_seed`).
        device, dtype: where the served model runs.
        engine: the typed ``vskipper.engine`` section (:func:`stream_cb_config`); default: its defaults
            (page 64, 2048 batch tokens, 64 requests per batch).
        timeout_s: per-request timeout, seconds.
        arms: served arms, first the treatment, then the reference (default hybrid, always-route).
        extra: fields stamped on every row (e.g. the knee: point, factor, rate, workload, status).
        config, run_id: provenance (``config`` is hashed; default: this call's arguments).

    Returns:
        a :class:`ServedKneeResult` (also written under ``out``).

    Raises:
        ServedStreamError: when a request of the stream failed (rows measured so far attached).
        impl.quality.did.PromptMismatchError: when the server received other ids than the quality run
            fed, or lm-eval's contexts no longer encode to them.
        ValueError: for bad requests / arms / rate (message names the item).

    Source: vSkipper Sec. 4.3, Table 5 (right), App. E.3.
    """

    arms = _check_arms_and_rate(arms, rate)
    req_rows = [dict(r) for r in requests]
    docs = doc_requests(req_rows)
    if not docs:
        raise ValueError(f"suite {suite}: no document requests")
    max_length = int(req_rows[0]["max_length"])
    add_bos = req_rows[0].get("add_bos_token")
    opts = options or TaskOptions()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    eng = engine if engine is not None else Engine()
    stream = build_stream(docs, pad_prompts, n_requests=n_requests, pad_max_tokens=pad_max_tokens,
                          seed=cell_seed(seed, suite, "quality-served-order"))
    if len(stream) < 2:
        raise ValueError(f"suite {suite}: a Poisson stream needs at least 2 requests, got {len(stream)} "
                         "(raise the quality limit or pad with vskipper.quality.served.requests)")
    schedule = poisson_arrivals(rate, len(stream), seed=cell_seed(seed, suite, "quality-served"))
    base = dict(extra or {})
    cfg = dict(config) if config is not None else {
        "model_dir": str(model_dir), "suite": suite, "rate": rate, "limit": limit, "n_requests": len(stream),
        "pad_max_tokens": pad_max_tokens, "seed": seed, "engine": eng, "arms": arms, "switch": switch.to_dict(),
        "options": opts.to_dict(), "timeout_s": timeout_s}
    prov = provenance(cfg, seed=seed, device=device, dtype=dtype, run_id=run_id)
    stamp = {**base, **prov}
    cb = stream_cb_config(eng, stream)

    tokenizer = load_tokenizer(model_dir)
    model = load_model(model_dir, dtype=getattr(torch, dtype)).to(device)
    sk = parse_skipper_spec(skipper, model)
    result = ServedKneeResult(stream=stream, schedule=schedule, out=out)
    rows: list[dict[str, Any]] = []
    passes: dict[str, _ArmPass] = {}
    for pos, arm in enumerate(arms):
        passes[arm] = _serve_arm(model, tokenizer, arm, sk, switch, cb, stream, schedule, timeout_s)
        result.responses[arm] = passes[arm].responses
        rows += _request_rows(stream, passes[arm], suite, arm, pos, stamp)
        _check_arm_pass(arm, stream, passes[arm], rows)

    # cut by the 2x2's stop rule and score with lm-eval
    eos_ids = eos_ids_of(model.config, getattr(model, "generation_config", None))
    cuts = {arm: _cut_responses(docs, result.responses[arm], tokenizer, eos_ids) for arm in arms}
    hashes = {(d.task, d.doc_id): d.prompt_hash for d in docs}
    result.scores = _score_arms(cuts, hashes, arms, tokenizer, data_dir, suite, out, opts, limit, seed,
                                max_length=max_length, add_bos_token=add_bos)

    m_, f_ = PRIMARY_METRIC[suite]
    primary = f"{m_},{f_}"
    for arm in arms:
        rows += _doc_rows(docs, result.responses[arm], result.scores[arm], cuts[arm], suite, arm, primary, stamp)
    lengths = {r.request_id: len(r.prompt_ids) for r in stream}
    shares: dict[str, dict[str, Any]] = {}
    for pos, arm in enumerate(arms):
        arow, shares[arm] = _arm_row(passes[arm], stream, docs, lengths, schedule, suite, arm, pos, rate,
                                     cuts[arm].server_text_equal, stamp)
        rows.append(arow)
        result.arm_rows.append(arow)

    result.summary = _summary_rows(result, cuts, shares, hashes, stream, docs, schedule, suite, arms, rate,
                                   primary, stamp)
    rows += result.summary
    result.rows = rows
    write_jsonl(out / "served.jsonl", rows)
    write_json(out / "summary.json", _jsonable({"config": cfg, "provenance": prov, "summary": result.summary,
                                                "arms": [{k: v for k, v in r.items() if k != "server_stats"}
                                                         for r in result.arm_rows],
                                                "schedule": schedule.to_dict(),
                                                "stream": [r.request_id for r in stream]}))
    del model
    gc.collect()
    return result
