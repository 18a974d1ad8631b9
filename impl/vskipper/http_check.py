"""Engine arms in process and behind HTTP: does every arm answer real clients, and answer them right?

The paper serves each arm (``upstream``, ``hybrid``, ``always-route``; Sec. 4.1 "Arms") behind an
HTTP server and drives it with an OpenAI-style load generator (``ignore_eos`` requests) and with
lm-eval's ``local-completions`` client. :func:`check_arms` starts each arm of one model directory
in-process on ``127.0.0.1:0`` (:func:`impl.vskipper.server.serve`) and runs five checks against it,
one result row per (model, arm, skipper, check):

``client_stream``
    the load generator's OpenAI-style client (:class:`impl.serving.arms.HTTPCompletionsArm`, with
    ``ignore_eos`` sent as the ``ignore_eos`` field and ``stream: true``) sends a few real prompts
    (token-id lists from the workload suite files, ``results/workloads/<model>/<suite>.jsonl``) as
    token-id prompts. PASS when every request finished without error with exactly ``max_tokens``
    tokens (``usage.completion_tokens``), ``finish_reason == "length"``, the server counted the
    prompt's tokens, and the streamed text equals the decoded in-process reference ids.
``greedy_ids``
    the same prompts again as streaming ``ignore_eos`` requests read by a plain SSE reader that keeps
    each chunk's ``token_ids`` (this server's extension; the load generator's client keeps text
    only). PASS when every request streamed exactly ``max_tokens`` token ids and they equal, id for
    id, the same arm run in process (:func:`in_process_reference`: :func:`~impl.vskipper.engine.generate_greedy`
    on a separately loaded copy of the model with the same skipper, mode, mode switch, request ids
    and engine settings).
``openai_sdk``
    the OpenAI Python SDK (``openai.OpenAI`` pointed at the arm's ``/v1``): ``models.list()`` names the
    served model; each prompt as a non-streaming token-id completion (``ignore_eos`` and ``request_id``
    through ``extra_body``) whose text must equal the in-process reference's and whose usage counts
    exactly ``max_tokens``; then the same request again streamed with ``stream_options.include_usage``:
    the same text, ``usage`` only on the last chunk (which has no choices); a chat completion (with
    the model's chat template; a model without one must get a 400, which the SDK raises as
    ``BadRequestError``); ``max_tokens: 0`` raised as ``BadRequestError``, the arm serving afterwards.
``lm_eval``
    ``lm_eval.simple_evaluate(model="local-completions", ...)`` against the arm's
    ``/v1/completions`` (the model directory's Hugging Face tokenizer, token-id requests left-truncated
    to the served context, greedy) on the first ``limit`` documents of the offline GSM8K task
    (:func:`impl.quality.tasks.write_task_yamls` over ``data_dir``). PASS when it completed with a
    finite ``exact_match,composite`` value and the server served one request per document.
``endpoints``
    ``GET /health`` (200, ``ok``, the arm), ``GET /v1/models`` (the served name), malformed requests
    (invalid JSON, ``max_tokens: 0``, ``temperature > 0``, an unknown model, an out-of-vocabulary
    token id, ``GET /v1/completions``) each answered with its 4xx, and afterwards a valid request still
    served (200, exactly its ``max_tokens``) with ``/health`` 200 and no failed engine request.

Determinism. Requests are sent one at a time, and the reference runs one prompt per engine call in
the same order (one :class:`~impl.vskipper.mode.ModeController` carried across the calls for the
hybrid arm), so the server and the reference see batches of the same composition; RandomSkip hashes
the request id, which the client sends as ``X-Request-ID``. The hybrid arm's default switch
(:data:`HYBRID_SWITCH`: no prefill token minimum, share prior 1.0 with probes off, decode routed from a
load of one) routes every request at this load, so it exercises the switch's planner path while its
decisions do not depend on arrival timing; pass ``switch=`` for another one (the reference replays
it, but decisions that depend on timing can then make ``greedy_ids`` fail spuriously).

Each row also records the routed share of the arm as the server saw it (``routed_share``: rows the
arm ran in routed mode / all rows, from the mode switch's counters for ``hybrid``; 1 for
``always-route``, 0 for ``upstream``) and the realised Project-Only share of the routed layers
(``skip_share``, from ``/v1/vskipper/stats``), both cumulative over the server's life up to that check.

:func:`write_outputs` writes the rows as CSV and a summary JSON atomically (a failed run leaves no
partial file). Sources: vSkipper paper Sec. 4.1 (arms, clients), App. E.1 (served quality arms).
"""

from __future__ import annotations

import copy
import csv
import io
import json
import logging
import math
import os
import shutil
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import lm_eval
import openai
import torch
from lm_eval.tasks import TaskManager
from transformers import AutoConfig

from impl.models.load import load_model, load_tokenizer
from impl.provenance import read_jsonl, write_json, write_text
from impl.quality.tasks import TaskOptions, write_task_yamls
from impl.serving.arms import HTTPCompletionsArm
from impl.serving.arrivals import poisson_arrivals
from impl.serving.loadgen import Request, run_load
from impl.serving.metrics import request_metrics
from impl.stats import welch_difference
from impl.vskipper.quality_run import offline

from .bench_serving import RESULT_KEYS, bench_serving, sglang_python_ok, sharegpt_prompts, workload_prompts
from .engine import bind_skipper, generate_greedy, routed_cb_config, unbind_skipper
from .mode import ModeController, ModeSwitch
from .schema import SERVED_ARMS, BenchServing, Engine
from .server import serve
from .spec import parse_skipper_spec

log = logging.getLogger(__name__)

__all__ = [
    "ARMS",
    "CHECKS",
    "COLUMNS",
    "DEFAULT_CHECKS",
    "SERVED_ARMS",
    "HYBRID_SWITCH",
    "check_arms",
    "default_skipper_specs",
    "in_process_reference",
    "load_prompts",
    "write_outputs",
]

#: the paper's three serving arms (Sec. 4.1), the default; any arm of :data:`SERVED_ARMS` may be checked
ARMS = ("upstream", "hybrid", "always-route")
#: the checks, in the order they run per arm; ``bench_serving`` needs a Python with SGLang
CHECKS = ("client_stream", "greedy_ids", "openai_sdk", "lm_eval", "endpoints", "bench_serving")
#: the checks run when none are named
DEFAULT_CHECKS = CHECKS[:5]
#: the checks whose answers are compared with the in-process reference (they run first, in this order,
#: and the reference replays their requests: the hybrid switch's state carries over between requests)
REFERENCE_CHECKS = ("client_stream", "greedy_ids", "openai_sdk")
#: CSV columns, in order (the timing columns: SGLang ``bench_serving``'s TTFT / TPOT / ITL [ms], output
#: throughput [tokens/s], benchmark duration [s]; empty for the other checks)
COLUMNS = ("model", "arm", "skipper", "check", "verdict", "detail", "requests", "max_tokens", "tokens_exact",
           "ids_match", "text_match", "metric", "metric_value", "served_requests", "routed_share", "skip_share",
           *RESULT_KEYS.values(), "clients_agree", "bench_e2e_ms", "loadgen_e2e_ms", "bench_ttft_ms", "loadgen_ttft_ms",
           "bench_tpot_ms", "loadgen_tpot_ms", "wall_s")
#: the hybrid arm's default mode switch (module docstring): routes every phase of every request at any
#: load through the switch's planner, without timing-dependent probes
HYBRID_SWITCH = ModeSwitch(min_prefill_tokens=0, min_skip_share=0.0, probe_every=1_000_000, enter_threshold=1,
                           initial_share=1.0)
_LM_EVAL_METRIC = "exact_match,composite"
_TIMEOUT_S = 300.0


# ======================================================================================================
# Inputs
# ======================================================================================================
def load_prompts(path: str | os.PathLike, n: int) -> tuple[list[list[int]], list[str]]:
    """The first ``n`` token-id prompts of a workload suite file (rule ``workload_tokens``:
    ``results/workloads/<model>/<suite>.jsonl``, one JSON object per line with ``id`` and
    ``input_ids``); all of them when the file holds fewer.

    Returns:
        ``(prompts, ids)``: the token-id lists and the records' ids.

    Raises:
        FileNotFoundError: for a missing file; ValueError: for ``n < 1``, a file without records, or a
            record without a non-empty ``input_ids`` list.
    """

    if int(n) < 1:
        raise ValueError(f"need at least one prompt, got n={n}")
    rows = read_jsonl(path)
    out, ids = [], []
    for i, r in enumerate(rows[: int(n)]):
        ii = r.get("input_ids")
        if not isinstance(ii, list) or not ii:
            raise ValueError(f"{path}: record {i} has no non-empty 'input_ids' list")
        out.append([int(t) for t in ii])
        ids.append(str(r.get("id", i)))
    if not out:
        raise ValueError(f"{path}: no prompts")
    return out, ids


def default_skipper_specs(flexidepth: str | os.PathLike | None = None,
                          randomskip: str = "r=0.5,d=0.5") -> list[str]:
    """The skipper specs of the routed arms (:func:`impl.vskipper.spec.parse_skipper_spec` syntax):
    the FlexiDepth checkpoint when one is given and present, else RandomSkip with ``randomskip``'s
    parameters (``r=...,d=...[,seed=...,layers=...]``)."""
    if flexidepth is not None and (Path(flexidepth) / "flexidepth.json").is_file():
        return [f"flexidepth:{flexidepth}"]
    return [f"randomskip:{randomskip}"]


def _cb_overrides(model_dir: Path, engine: Engine | None, n_prompts: int) -> tuple[dict, int]:
    """Engine settings shared by the served arm and its reference (the typed ``vskipper.engine``
    section; None: transformers' defaults but for the page size, 64); a ``num_blocks`` of None sizes the
    paged cache for ``n_prompts`` full-context requests + 4 pages. Returns ``(overrides, max_model_len)``."""

    cfg = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    ctx = int(getattr(cfg, "max_position_embeddings", 0) or 4096)
    eng = {} if engine is None else engine.model_dump(exclude_none=True)
    page = int(eng.get("page_size", 64))
    eng["page_size"] = page
    eng.setdefault("num_blocks", max(1, int(n_prompts)) * math.ceil((ctx + 1) / page) + 4)
    return eng, ctx


# ======================================================================================================
# In-process reference
# ======================================================================================================
def in_process_reference(model_dir: str | os.PathLike, arm: str, skipper_spec: Any, prompts: Sequence[Sequence[int]],
                         request_ids: Sequence[str], max_tokens: int, *, switch: ModeSwitch | None = None,
                         cb_overrides: Mapping[str, Any] | None = None, dtype: str = "float32",
                         device: str = "cpu") -> list[list[int]]:
    """The greedy token ids the arm produces in process, one prompt per engine call in order.

    ``upstream``: :func:`~impl.vskipper.engine.generate_greedy` on the unmodified model (dense);
    ``always-route``: on a model bound with the skipper (``mode="routed"``); ``hybrid``: routed with a
    :class:`~impl.vskipper.mode.ModeController` of ``switch`` as planner, one controller carried across
    the calls (the server keeps one for its life); the mechanism ablations (``prefill-only``,
    ``decode-only``, ``no-promotion``, ``never-route``): the same with ``switch`` under that ablation
    (:meth:`~impl.vskipper.mode.ModeSwitch.ablation`, as the engine applies it). Every request generates exactly ``max_tokens``
    tokens (no EOS stop: the ``ignore_eos`` requests' reference).

    Args:
        model_dir: the Hugging Face model directory (loaded afresh here, on ``device`` in ``dtype``).
        arm: one of :data:`SERVED_ARMS`.
        skipper_spec: the routed arms' policy (:func:`~impl.vskipper.spec.parse_skipper_spec`).
        prompts, request_ids: the requests (the ids matter to RandomSkip).
        max_tokens: tokens per request.
        switch: the hybrid arm's :class:`~impl.vskipper.mode.ModeSwitch` (default :data:`HYBRID_SWITCH`).
        cb_overrides: :func:`~impl.vskipper.engine.routed_cb_config` overrides (as the server's).

    Raises:
        ValueError: for another arm or a routed arm without a skipper; RuntimeError: when the engine
            fails a request.
    """

    if arm not in SERVED_ARMS:
        raise ValueError(f"in-process reference for arm {arm!r}: choose from {', '.join(SERVED_ARMS)}")
    if arm != "upstream" and skipper_spec is None:
        raise ValueError(f"arm {arm!r} needs a skipper spec")
    model = load_model(model_dir, dtype=getattr(torch, dtype)).to(device)
    cb = routed_cb_config(**dict(cb_overrides or {}))
    out: list[list[int]] = []
    if arm == "upstream":
        for p, rid in zip(prompts, request_ids):
            out += generate_greedy(model, [p], max_new_tokens=int(max_tokens), mode="dense", request_ids=[rid],
                                   cb_config=cb)
        return out
    bind_skipper(model, parse_skipper_spec(skipper_spec, model))
    try:
        sw = HYBRID_SWITCH if switch is None else switch
        planner = None if arm == "always-route" else ModeController(sw.ablation(_switch_setting(arm)))
        for p, rid in zip(prompts, request_ids):
            out += generate_greedy(model, [p], max_new_tokens=int(max_tokens), mode="routed", request_ids=[rid],
                                   cb_config=cb, planner=planner)
    finally:
        unbind_skipper(model)
    return out


def _switch_setting(arm: str) -> str:
    """The :meth:`~impl.vskipper.mode.ModeSwitch.ablation` setting a switch arm serves under."""
    return "served" if arm == "hybrid" else arm


# ======================================================================================================
# HTTP helpers
# ======================================================================================================
def _http(url: str, path: str, body: Any = None, *, raw: bytes | None = None, method: str | None = None,
          timeout: float = 60.0) -> tuple[int, Any]:
    """One request; returns ``(status, parsed JSON or text)`` (HTTP errors are returned, not raised)."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(url + path, data=data, method=method or ("GET" if data is None else "POST"),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, text = r.status, r.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode("utf-8", "replace")
    try:
        return status, json.loads(text)
    except json.JSONDecodeError:
        return status, text


def _stream_ids(url: str, body: Mapping[str, Any], request_id: str, timeout: float = _TIMEOUT_S) -> dict:
    """A streaming ``/v1/completions`` request read as server-sent events, keeping every chunk's
    ``token_ids``, the last ``finish_reason``, the ``usage`` chunk and the request's ``vskipper`` modes.
    Returns a dict with those and ``error`` (None on success)."""
    out: dict[str, Any] = {"token_ids": [], "chunks": 0, "finish_reason": None, "usage": None, "vskipper": None,
                           "done": False, "error": None}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(dict(body, stream=True, stream_options={"include_usage": True})).encode(),
                                 method="POST",
                                 headers={"Content-Type": "application/json", "X-Request-ID": request_id})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            for raw in resp:
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    out["done"] = True
                    break
                obj = json.loads(payload)
                if "error" in obj:
                    out["error"] = str(obj["error"])
                    break
                if obj.get("usage"):
                    out["usage"] = obj["usage"]
                for ch in obj.get("choices") or []:
                    out["chunks"] += 1
                    out["token_ids"] += [int(t) for t in ch.get("token_ids") or []]
                    if ch.get("finish_reason"):
                        out["finish_reason"] = ch["finish_reason"]
                    if ch.get("vskipper"):
                        out["vskipper"] = ch["vskipper"]
    except urllib.error.HTTPError as e:
        out["error"] = f"HTTP {e.code}: {e.read().decode('utf-8', 'replace')[:300]}"
    except Exception as e:  # connection errors, malformed stream
        out["error"] = f"{type(e).__name__}: {e}"
    if out["error"] is None and not out["done"]:
        out["error"] = "stream ended without [DONE]"
    return out


def _token_id_client(base_url: str, model: str, tokenizer, name: str):
    """The load generator's OpenAI-style client, sending token-id prompts (this server accepts them; the
    client's text route would re-tokenize) and ``ignore_eos`` as the request field."""

    class _TokenIdPrompts(HTTPCompletionsArm):
        def body(self, input_ids, max_new_tokens, ignore_eos):
            b = super().body(input_ids, max_new_tokens, ignore_eos)
            b["prompt"] = [int(t) for t in input_ids]
            return b

    return _TokenIdPrompts(base_url, model, detokenize=lambda ids: tokenizer.decode(ids), name=name,
                           ignore_eos_via="field", request_timeout_s=_TIMEOUT_S, include_usage=True)


def _shares(url: str, arm: str) -> tuple[float | None, float | None]:
    """``(routed_share, skip_share)`` of the arm so far (module docstring)."""
    code, st = _http(url, "/v1/vskipper/stats")
    if code != 200 or not isinstance(st, dict):
        return None, None
    skip = (st.get("project_only_share") or {}).get("all")
    if arm == "upstream":
        return 0.0, None
    if arm == "always-route":
        return 1.0, skip
    rows = ((st.get("mode_switch") or {}).get("rows") or {})
    routed = sum(int((rows.get(k) or {}).get("routed", 0)) for k in ("prefill", "decode"))
    dense = sum(int((rows.get(k) or {}).get("dense", 0)) for k in ("prefill", "decode"))
    return (routed / (routed + dense) if routed + dense else None), skip


def _row(model: str, arm: str, skipper: str | None, check: str, ok: bool, detail: str, **kw) -> dict:
    row = {c: None for c in COLUMNS}
    row.update(model=model, arm=arm, skipper=skipper or "", check=check, verdict="PASS" if ok else "FAIL",
               detail=detail)
    row.update({k: v for k, v in kw.items() if k in row})
    return row


# ======================================================================================================
# The checks
# ======================================================================================================
def _check_client(server, tokenizer, prompts, rids, refs, max_tokens) -> dict:
    """``client_stream``: the load generator's client, ``ignore_eos`` + streaming (module docstring)."""
    arm = _token_id_client(server.url, server.engine.served_model_name, tokenizer, f"http-{server.engine.arm}")
    arm.start()
    traces = {}
    try:
        for rid, p in zip(rids, prompts):
            arm.submit(rid, p, int(max_tokens), ignore_eos=True)
            traces.update(arm.wait([rid], timeout_s=_TIMEOUT_S))
    finally:
        arm.stop()
    problems, exact, text_ok = [], 0, 0
    for rid, p, ref in zip(rids, prompts, refs):
        tr = traces[rid]
        if tr.error is not None:
            problems.append(f"{rid}: {tr.error[:120]}")
            continue
        n_ok = tr.output_tokens == int(max_tokens) and tr.finish_reason == "length"
        exact += int(n_ok)
        if not n_ok:
            problems.append(f"{rid}: {tr.output_tokens} tokens, finish {tr.finish_reason!r}")
        if tr.prompt_tokens != len(p):
            problems.append(f"{rid}: server counted {tr.prompt_tokens} prompt tokens, sent {len(p)}")
        want = tokenizer.decode(ref, skip_special_tokens=True)
        if tr.output_text == want:
            text_ok += 1
        else:
            problems.append(f"{rid}: streamed text differs from the in-process ids' text")
    n = len(rids)
    ok = not problems and exact == n and text_ok == n
    detail = (f"{n} streaming ignore_eos requests via HTTPCompletionsArm: {exact}/{n} exactly {max_tokens} tokens, "
              f"{text_ok}/{n} texts equal in-process" + ("" if ok else "; " + "; ".join(problems[:4])))
    return dict(ok=ok, detail=detail, requests=n, max_tokens=int(max_tokens), tokens_exact=exact == n,
                text_match=text_ok == n)


def _check_ids(server, prompts, rids, refs, max_tokens) -> dict:
    """``greedy_ids``: streamed token ids vs the in-process reference (module docstring)."""
    problems, exact, same, routed_req = [], 0, 0, 0
    for rid, p, ref in zip(rids, prompts, refs):
        got = _stream_ids(server.url, {"prompt": [int(t) for t in p], "max_tokens": int(max_tokens),
                                       "temperature": 0, "ignore_eos": True}, rid)
        if got["error"] is not None:
            problems.append(f"{rid}: {got['error'][:120]}")
            continue
        ids = got["token_ids"]
        n_ok = (len(ids) == int(max_tokens) and got["finish_reason"] == "length"
                and (got["usage"] or {}).get("completion_tokens") == int(max_tokens))
        exact += int(n_ok)
        if not n_ok:
            problems.append(f"{rid}: {len(ids)} ids, finish {got['finish_reason']!r}")
        if ids == list(ref):
            same += 1
        else:
            k = next((i for i, (a, b) in enumerate(zip(ids, ref)) if a != b), min(len(ids), len(ref)))
            problems.append(f"{rid}: ids differ from in-process at token {k}")
        v = got["vskipper"] or {}
        routed_req += int(bool(v.get("prefill_routed")) or v.get("decode_routed_from") is not None)
    n = len(rids)
    ok = not problems and exact == n and same == n
    detail = (f"{n} streamed requests: {exact}/{n} exactly {max_tokens} ids, {same}/{n} equal to generate_greedy "
              f"in process, {routed_req}/{n} routed in some phase" + ("" if ok else "; " + "; ".join(problems[:4])))
    return dict(ok=ok, detail=detail, requests=n, max_tokens=int(max_tokens), tokens_exact=exact == n,
                ids_match=same == n)


def _check_openai_sdk(server, tokenizer, prompts, rids, refs, max_tokens) -> dict:
    """``openai_sdk``: the OpenAI Python SDK against the arm (module docstring)."""
    eng = server.engine
    name = eng.served_model_name
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=_TIMEOUT_S)
    problems, exact, text_ok, stream_ok = [], 0, 0, 0
    listed = [m.id for m in client.models.list().data]
    if listed != [name]:
        problems.append(f"models.list() gave {listed}")
    for rid, p, ref in zip(rids, prompts, refs):
        want = tokenizer.decode(ref, skip_special_tokens=True)
        kw = dict(model=name, prompt=[int(t) for t in p], max_tokens=int(max_tokens), temperature=0,
                  extra_body={"ignore_eos": True, "request_id": rid})
        out = client.completions.create(**kw)
        ch = out.choices[0]
        n_ok = out.usage.completion_tokens == int(max_tokens) and ch.finish_reason == "length"
        exact += int(n_ok)
        if not n_ok:
            problems.append(f"{rid}: {out.usage.completion_tokens} tokens, finish {ch.finish_reason!r}")
        if ch.text == want:
            text_ok += 1
        else:
            problems.append(f"{rid}: text differs from the in-process ids' text")
        # the same request (same id: RandomSkip draws the same routes) streamed, usage on the last chunk only
        chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        usage = [c.usage for c in chunks if c.usage is not None]
        last = chunks[-1] if chunks else None
        s_ok = (text == want and len(usage) == 1 and last is not None and not last.choices
                and last.usage.completion_tokens == int(max_tokens))
        stream_ok += int(s_ok)
        if not s_ok:
            problems.append(f"{rid}: stream gave {'the same' if text == want else 'another'} text, "
                            f"{len(usage)} usage chunks, last chunk choices {len(last.choices) if last else None}")
    has_template = bool(getattr(tokenizer, "chat_template", None))
    try:
        chat = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "What is 2 + 3?"}],
                                              max_tokens=8, temperature=0)
        chat_ok = (has_template and isinstance(chat.choices[0].message.content, str)
                   and 1 <= chat.usage.completion_tokens <= 8)
        chat_what = f"chat completion {chat.usage.completion_tokens} tokens"
    except openai.BadRequestError as e:
        chat_ok, chat_what = not has_template, f"chat refused ({e.status_code}: no chat template)"
    if not chat_ok:
        problems.append(f"{chat_what} (chat template: {has_template})")
    try:
        client.completions.create(model=name, prompt=[int(t) for t in prompts[0]], max_tokens=0)
        problems.append("max_tokens 0 was accepted")
    except openai.BadRequestError:
        pass
    after = client.completions.create(model=name, prompt=[int(t) for t in prompts[0]], max_tokens=2,
                                      extra_body={"ignore_eos": True})
    if after.usage.completion_tokens != 2:
        problems.append(f"after the refused request: {after.usage.completion_tokens} tokens")
    n = len(rids)
    ok = not problems and exact == n == text_ok == stream_ok
    detail = (f"openai {openai.__version__}: {n} token-id completions, {exact}/{n} exactly {max_tokens} tokens, "
              f"{text_ok}/{n} texts equal in-process, {stream_ok}/{n} streams (include_usage) equal with one usage "
              f"chunk; {chat_what}; max_tokens 0 -> BadRequestError"
              + ("" if ok else "; " + "; ".join(problems[:4])))
    return dict(ok=ok, detail=detail, requests=3 * n + 3, max_tokens=int(max_tokens), tokens_exact=exact == n,
                text_match=text_ok == n == stream_ok)


def _check_lm_eval(server, model_dir: Path, tm, limit: int, seed: int) -> dict:
    """``lm_eval``: ``simple_evaluate(model="local-completions")`` against the arm (module docstring)."""

    eng = server.engine
    before = eng.counters["requests"]
    args = dict(base_url=f"{server.url}/v1/completions", model=eng.served_model_name,
                tokenizer_backend="huggingface", tokenizer=str(model_dir), tokenized_requests=True,
                max_length=int(eng.max_model_len), num_concurrent=1, max_retries=1, timeout=int(_TIMEOUT_S),
                seed=int(seed))
    with offline():
        res = lm_eval.simple_evaluate(model="local-completions", model_args=args, tasks=["vsk_gsm8k"], task_manager=tm,
                                      limit=int(limit), bootstrap_iters=0, log_samples=False, random_seed=seed,
                                      numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed,
                                      apply_chat_template=False)
    served = eng.counters["requests"] - before
    if res is None:
        return dict(ok=False, detail="simple_evaluate returned nothing", served_requests=served, metric=_LM_EVAL_METRIC)
    r = (res.get("results") or {}).get("vsk_gsm8k") or {}
    val = r.get(_LM_EVAL_METRIC)
    n_docs = int(((res.get("n-samples") or {}).get("vsk_gsm8k") or {}).get("effective", limit))
    finite = isinstance(val, (int, float)) and math.isfinite(float(val))
    ok = finite and served == n_docs and eng.counters["failed"] == 0
    detail = (f"lm_eval local-completions on vsk_gsm8k, {n_docs} docs: {_LM_EVAL_METRIC} = "
              f"{val if not finite else round(float(val), 4)}, {served} requests served")
    if not ok:
        detail += f" (expected {n_docs}; engine failures {eng.counters['failed']})"
    return dict(ok=ok, detail=detail, requests=n_docs, metric=_LM_EVAL_METRIC,
                metric_value=float(val) if finite else None, served_requests=served)


def _check_endpoints(server, prompt: Sequence[int]) -> dict:
    """``endpoints``: health, model listing, 4xx for malformed requests, still serving afterwards."""
    eng = server.engine
    url = server.url
    problems = []
    code, h = _http(url, "/health")
    if code != 200 or not isinstance(h, dict) or h.get("status") != "ok" or h.get("arm") != eng.arm:
        problems.append(f"/health {code} {str(h)[:80]}")
    code, m = _http(url, "/v1/models")
    names = [d.get("id") for d in (m.get("data") or [])] if isinstance(m, dict) else []
    if code != 200 or names != [eng.served_model_name]:
        problems.append(f"/v1/models {code} {names}")
    p = [int(t) for t in prompt][:16]
    bad = [
        ("invalid JSON", dict(raw=b"{not json"), 400),
        ("max_tokens 0", dict(body={"prompt": p, "max_tokens": 0}), 400),
        ("temperature 0.7", dict(body={"prompt": p, "max_tokens": 4, "temperature": 0.7}), 400),
        ("unknown model", dict(body={"prompt": p, "max_tokens": 4, "model": "no-such-model"}), 404),
        ("token id out of vocabulary", dict(body={"prompt": [eng.vocab_size + 7], "max_tokens": 4}), 400),
        ("GET /v1/completions", dict(method="GET"), 405),
    ]
    n4 = 0
    for what, kw, want in bad:
        code, body = _http(url, "/v1/completions", **kw)
        good = code == want and isinstance(body, dict) and isinstance(body.get("error"), dict)
        n4 += int(good)
        if not good:
            problems.append(f"{what}: {code} (want {want})")
    code, out = _http(url, "/v1/completions", {"prompt": p, "max_tokens": 4, "ignore_eos": True}, timeout=_TIMEOUT_S)
    served = (code == 200 and isinstance(out, dict)
              and len((out.get("choices") or [{}])[0].get("token_ids") or []) == 4)
    if not served:
        problems.append(f"valid request after the malformed ones: {code}")
    code, _ = _http(url, "/health")
    if code != 200:
        problems.append(f"/health after: {code}")
    if eng.counters["failed"]:
        problems.append(f"{eng.counters['failed']} failed engine requests")
    ok = not problems
    detail = (f"/health and /v1/models OK; {n4}/{len(bad)} malformed requests got their 4xx; "
              f"{'still serving' if served else 'NOT serving'} afterwards"
              + ("" if ok else "; " + "; ".join(problems[:4])))
    return dict(ok=ok, detail=detail, requests=len(bad) + 1)


def _has_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def _check_bench_serving(server, model_dir: Path, bench: BenchServing, dataset: Path, prompts: list[dict], work: Path,
                         seed: int, *, chat_template: bool, prompts_label: str, tokenizer) -> dict:
    """``bench_serving``: SGLang's own streaming benchmark client against the arm
    (:func:`impl.vskipper.bench_serving.bench_serving`) on ``dataset`` (ShareGPT, or a workload suite),
    with the chat template when ``chat_template``; at a Poisson rate without a concurrency cap
    (``request_rate`` set, ``max_concurrency`` null) the project's load generator then replays the same
    prompts at the same rate and the two clients' mean E2E / TTFT / TPOT are compared (:func:`_clients_agree`)."""
    rate = math.inf if bench.request_rate is None else float(bench.request_rate)
    res = bench_serving(server, model_dir, bench.python, dataset, work, num_prompts=bench.num_prompts,
                        output_len=bench.output_len, context_len=bench.context_len,
                        max_concurrency=bench.max_concurrency, request_rate=rate, seed=seed,
                        chat_template=chat_template, prompts_label=prompts_label)
    per = res.pop("per_request", None)
    if not res["ok"]:
        return res
    if math.isinf(rate) or bench.max_concurrency or bench.num_prompts < 2:
        res["detail"] += ("; clients not compared (the load generator is open loop: set request_rate and "
                          "max_concurrency: null, num_prompts >= 2)")
        return res
    agree = _clients_agree(server, tokenizer, prompts, bench, rate, seed, per)
    res["detail"] += "; " + agree.pop("detail")
    res.update(agree)
    return res


def _clients_agree(server, tokenizer, prompts: list[dict], bench: BenchServing, rate: float, seed: int,
                   per: dict | None) -> dict:
    """The project's load generator (:func:`impl.serving.loadgen.run_load`, the token-id OpenAI client,
    ``ignore_eos``) on the prompts ``bench_serving`` sent (the ids the server made of their text), at
    the same Poisson rate (its own seeded schedule), against the same arm; then per metric the Welch
    interval of ``mean(load generator) - mean(bench_serving)`` over requests (:func:`impl.stats.welch_difference`).

    Returns:
        ``clients_agree`` (every interval contains 0), ``loadgen_<m>_ms`` and ``bench_<m>_ms`` for m in
        e2e / ttft / tpot (ms), and a ``detail`` sentence with each difference and its interval.
    """
    if not per or min(len(v) for v in per.values()) < 2:
        return dict(clients_agree=False, detail="clients not compared: bench_serving gave no per-request timings")
    eng = server.engine
    arm = _token_id_client(server.url, eng.served_model_name, tokenizer, f"loadgen-{eng.arm}")
    reqs = [Request(f"loadgen-{eng.arm}-{i}", tuple(p["input_ids"]), int(bench.output_len), ignore_eos=True)
            for i, p in enumerate(prompts)]
    run = run_load(arm, reqs, poisson_arrivals(rate, n=len(reqs), seed=seed), timeout_s=_TIMEOUT_S, keep_ids=False)
    failed = [r.request_id for r in run.records if not r.ok]
    if failed:
        return dict(clients_agree=False, detail=f"clients not compared: the load generator's requests {failed[:3]} failed")
    mine = [request_metrics(r) for r in run.records]
    out, parts, agree = {}, [], True
    for m in ("e2e", "ttft", "tpot"):
        lg = [x[f"{m}_s"] for x in mine if x[f"{m}_s"] is not None]
        w = welch_difference(per[f"{m}_s"], lg)
        agree &= w.agree
        out[f"bench_{m}_ms"], out[f"loadgen_{m}_ms"] = round(w.mean_a * 1e3, 3), round(w.mean_b * 1e3, 3)
        parts.append(f"{m.upper()} {w.mean_b * 1e3:.0f} vs {w.mean_a * 1e3:.0f} ms "
                     f"(diff [{w.ci_low * 1e3:+.0f}, {w.ci_high * 1e3:+.0f}])")
    verdict = "agree" if agree else "DIFFER"
    return dict(clients_agree=agree, **out,
                detail=f"load generator vs bench_serving at {rate:g} req/s, same {len(reqs)} prompts: "
                       + ", ".join(parts) + f": the clients {verdict} within their sampling error (Welch 95%)")


# ======================================================================================================
# Driver
# ======================================================================================================
ReferenceFn = Callable[..., list]


def check_arms(
    model_dir: str | os.PathLike,
    arms: Sequence[str] = ARMS,
    skipper_spec: Any = None,
    prompts: Sequence[Sequence[int]] | str | os.PathLike | None = None,
    *,
    n_prompts: int = 4,
    max_tokens: int = 16,
    data_dir: str | os.PathLike | None = None,
    limit: int = 4,
    num_fewshot: int | None = None,
    max_gen_toks: int = 32,
    switch: ModeSwitch | None = None,
    engine: Engine | None = None,
    label: str | None = None,
    dtype: str = "float32",
    device: str = "cpu",
    seed: int = 1234,
    checks: Sequence[str] = DEFAULT_CHECKS,
    bench: BenchServing | None = None,
    bench_prompts: str | os.PathLike | None = None,
    reference: ReferenceFn | None = None,
    log_fn: Callable[[str], None] | None = None,
) -> list[dict]:
    """Serve each arm of a model directory over HTTP and check it against real clients.

    Args:
        model_dir: the Hugging Face model directory (with its tokenizer).
        arms: arms among :data:`SERVED_ARMS` (default: the paper's three, :data:`ARMS`).
        skipper_spec: the routed arms' policy, a spec or a list of specs
            (:func:`~impl.vskipper.spec.parse_skipper_spec`, e.g. ``"flexidepth:DIR"``,
            ``"randomskip:r=0.5,d=0.5"``); each routed arm runs once per spec, ``upstream`` once.
            Required when a routed arm is asked for.
        prompts: token-id prompts, or a workload suite JSONL file (:func:`load_prompts`); the first
            ``n_prompts`` are used.
        n_prompts: requests per check (``client_stream`` and ``greedy_ids`` each send this many).
        max_tokens: tokens per ``ignore_eos`` request.
        data_dir: the data folder of the offline GSM8K task (``lm_eval`` check; required with it).
        limit: GSM8K documents evaluated by lm-eval.
        num_fewshot: GSM8K few-shot examples (None: the task's 5).
        max_gen_toks: lm-eval's generation budget per document, tokens.
        switch: the hybrid arm's :class:`~impl.vskipper.mode.ModeSwitch` (default :data:`HYBRID_SWITCH`).
        engine: the typed ``vskipper.engine`` section (:class:`~impl.vskipper.schema.Engine`: ``page_size``,
            ``num_blocks``, ``max_batch_tokens``, ``max_requests_per_batch``), the same for every arm and
            the reference (None: transformers' defaults, page size 64).
        label: the ``model`` column (default: the directory's name; also the served model name).
        dtype, device: where the model runs.
        seed: lm-eval's seeds.
        checks: which of :data:`CHECKS` to run (default :data:`DEFAULT_CHECKS`).
        bench: the ``bench_serving`` check's settings (:class:`~impl.vskipper.schema.BenchServing`; its
            ``python`` is required with that check, ``data_dir`` too: the ShareGPT subset is read there).
        bench_prompts: a frozen workload suite JSONL (rows with ``text``) that ``bench_serving`` and the
            load generator send instead of ShareGPT (:func:`impl.vskipper.bench_serving.workload_prompts`),
            e.g. the knee workload's prompts; None: the ShareGPT subset.
        reference: the in-process reference, called like :func:`in_process_reference` (default) with
            the client checks' prompts and request ids in the order the server sees them; tests pass a
            wrong one to see the checks fail.
        log_fn: progress messages (default: the module logger).

    Returns:
        one row per (arm, skipper, check): the :data:`COLUMNS` with ``verdict`` PASS / FAIL and a
        ``detail`` sentence. A check that raises, a failing reference or a server that does not start
        become FAIL rows quoting the error; the other checks and arms still run.

    Raises:
        ValueError: for an unknown arm / check, a routed arm without a skipper, or ``lm_eval`` without
            ``data_dir``, ``bench_serving`` without ``data_dir`` or ``bench.python`` or with a Python that
            cannot run SGLang's client; FileNotFoundError: for a missing model directory, prompt file or
            data file.
    """

    say = log_fn or log.info
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"no model directory at {model_dir} (config.json missing)")
    arms, checks, specs = _checked_arms(arms, checks, skipper_spec)
    _check_requirements(checks, data_dir, bench)
    need_prompts = [c for c in checks if c in (*REFERENCE_CHECKS, "endpoints")]
    if prompts is None and need_prompts:
        raise ValueError(f"the {', '.join(need_prompts)} check(s) need prompts: token-id lists or a workload suite "
                         "JSONL file")
    if isinstance(prompts, (str, os.PathLike)):
        prompts, _ = load_prompts(prompts, n_prompts)
    prompts = [[int(t) for t in p] for p in list(prompts or [])[: int(n_prompts)]]
    if need_prompts and (not prompts or any(not p for p in prompts)):
        raise ValueError("need at least one non-empty prompt")
    label = label or model_dir.name
    in_flight = max(len(prompts), (bench.max_concurrency or bench.num_prompts) if "bench_serving" in checks else 1)
    cb, ctx = _cb_overrides(model_dir, engine, in_flight)
    ctx_ = _CheckContext(model_dir=model_dir, label=label, prompts=prompts, max_tokens=int(max_tokens),
                         switch=HYBRID_SWITCH if switch is None else switch, cb=cb, max_model_len=ctx,
                         dtype=dtype, device=device, tokenizer=load_tokenizer(model_dir), limit=limit, seed=seed,
                         bench=bench, reference=reference or in_process_reference, say=say)
    runs = [(a, None) for a in arms if a == "upstream"] + [(a, s) for s in specs for a in arms if a != "upstream"]

    work = Path(tempfile.mkdtemp(prefix="vskipper_http_"))
    rows: list[dict] = []
    try:
        if "lm_eval" in checks:
            opts = TaskOptions(gsm8k_max_gen_toks=int(max_gen_toks), datasets_cache_dir=str(work / "hf"),
                               **({} if num_fewshot is None else {"gsm8k_num_fewshot": int(num_fewshot)}))
            ts = write_task_yamls(data_dir, work / "tasks", ["gsm8k"], opts)
            with offline():
                ctx_.task_manager = TaskManager(include_path=str(ts.include_path), include_defaults=False)
        if "bench_serving" in checks and bench_prompts is not None:
            ctx_.sharegpt = work / "workload.json"
            ctx_.bench_prompts, ctx_.bench_chat = workload_prompts(
                read_jsonl(bench_prompts), ctx_.tokenizer, bench.num_prompts, bench.output_len, bench.context_len,
                ctx_.sharegpt)
            ctx_.bench_label = f"prompts of {Path(bench_prompts).name}"
        elif "bench_serving" in checks:
            ctx_.sharegpt = work / "sharegpt.json"
            ctx_.bench_chat = _has_template(ctx_.tokenizer)
            ctx_.bench_prompts = sharegpt_prompts(data_dir, ctx_.tokenizer, bench.num_prompts, bench.output_len,
                                                  bench.context_len, ctx_.bench_chat, ctx_.sharegpt)
        ctx_.work = work
        for arm, spec in runs:
            rows += _check_one_arm(ctx_, arm, spec, checks)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return rows


def _checked_arms(arms: Sequence[str], checks: Sequence[str], skipper_spec: Any) -> tuple[list[str], list[str], list]:
    """``(arms, checks, skipper specs)`` as lists, each name checked (:func:`check_arms`' ValueErrors)."""

    arms = list(arms)
    bad = [a for a in arms if a not in SERVED_ARMS]
    if bad:
        raise ValueError(f"unknown arm(s) {bad}; choose from {', '.join(SERVED_ARMS)}")
    bad = [c for c in checks if c not in CHECKS]
    if bad:
        raise ValueError(f"unknown check(s) {bad}; choose from {', '.join(CHECKS)}")
    checks = sorted(set(checks), key=CHECKS.index)  # CHECKS' order: the reference replays the first ones
    specs = [] if skipper_spec is None else ([skipper_spec] if isinstance(skipper_spec, (str, Mapping)) or
                                             not isinstance(skipper_spec, Sequence) else list(skipper_spec))
    if any(a != "upstream" for a in arms) and not specs:
        raise ValueError("the routed arms need a skipper spec (e.g. 'randomskip:r=0.5,d=0.5' or 'flexidepth:DIR')")
    return arms, checks, specs


def _check_requirements(checks: Sequence[str], data_dir, bench: BenchServing | None) -> None:
    """What the ``lm_eval`` and ``bench_serving`` checks need, before any server starts (ValueError)."""

    if "lm_eval" in checks and data_dir is None:
        raise ValueError("the lm_eval check needs data_dir (the folder holding gsm8k/)")
    if "bench_serving" in checks:
        if data_dir is None:
            raise ValueError("the bench_serving check needs data_dir (the folder holding chat/)")
        if bench is None or bench.python is None:
            raise ValueError("the bench_serving check needs vskipper.http.bench_serving.python (--sglang-python): "
                             "a Python with SGLang installed (scripts/setup_sglang.sh)")
        why = sglang_python_ok(bench.python)
        if why:
            raise ValueError(f"vskipper.http.bench_serving.python: {why}")


@dataclass
class _CheckContext:
    """What every arm's checks share within one :func:`check_arms` call (its arguments of the same names;
    ``cb`` / ``max_model_len``: :func:`_cb_overrides`; ``task_manager``, ``sharegpt``, ``work``: set up by
    the call for the ``lm_eval`` and ``bench_serving`` checks)."""

    model_dir: Path
    label: str
    prompts: list[list[int]]
    max_tokens: int
    switch: ModeSwitch
    cb: dict
    max_model_len: int | None
    dtype: str
    device: str
    tokenizer: Any
    limit: int
    seed: int
    bench: BenchServing | None
    reference: ReferenceFn
    say: Callable[[str], None]
    task_manager: Any = None
    sharegpt: Path | None = None
    bench_prompts: list[dict] | None = None
    bench_chat: bool = False
    bench_label: str = "ShareGPT prompts"
    work: Path | None = None


def _arm_references(c: _CheckContext, arm: str, spec: Any, rids: Mapping[str, list[str]], tag: str
                    ) -> tuple[dict[str, list], str | None]:
    """The in-process reference outputs of the client checks (``check -> per prompt``), in the order the
    server will see the requests, and the reference's error (None when it ran)."""

    if not rids:
        return {}, None
    t0 = time.perf_counter()
    refs: dict[str, list] = {}
    err = None
    n = len(c.prompts)
    try:
        flat = c.reference(c.model_dir, arm, spec, c.prompts * len(rids), [r for k in rids for r in rids[k]],
                           c.max_tokens, switch=c.switch, cb_overrides=c.cb, dtype=c.dtype, device=c.device)
        refs = {k: list(flat[j * n:(j + 1) * n]) for j, k in enumerate(rids)}
    except Exception as e:  # noqa: BLE001 - the check rows say why
        err = f"in-process reference failed: {type(e).__name__}: {e}"
    c.say(f"{tag}: in-process reference in {time.perf_counter() - t0:.1f} s")
    return refs, err


def _run_check(c: _CheckContext, server, check: str, rids: Mapping[str, list[str]], refs: Mapping[str, list],
               ref_err: str | None) -> dict:
    """One check against a running server: ``{"ok": bool, "detail": str, **measured columns}``."""

    if check in rids and check not in refs:
        return dict(ok=False, detail=ref_err)
    if check == "client_stream":
        return _check_client(server, c.tokenizer, c.prompts, rids[check], refs[check], c.max_tokens)
    if check == "greedy_ids":
        return _check_ids(server, c.prompts, rids[check], refs[check], c.max_tokens)
    if check == "openai_sdk":
        return _check_openai_sdk(server, c.tokenizer, c.prompts, rids[check], refs[check], c.max_tokens)
    if check == "lm_eval":
        return _check_lm_eval(server, c.model_dir, c.task_manager, c.limit, c.seed)
    if check == "bench_serving":
        return _check_bench_serving(server, c.model_dir, c.bench, c.sharegpt, c.bench_prompts, c.work, c.seed,
                                    chat_template=c.bench_chat, prompts_label=c.bench_label, tokenizer=c.tokenizer)
    return _check_endpoints(server, c.prompts[0])


def _check_one_arm(c: _CheckContext, arm: str, spec: Any, checks: Sequence[str]) -> list[dict]:
    """Every check of one (arm, skipper spec): reference first, then a server, then the checks in turn.
    A server that does not start makes every check a FAIL row; a check that raises is a FAIL row."""

    spec_s = None if spec is None else str(spec)
    tag = f"{c.label}/{arm}" + (f" [{spec_s}]" if spec_s else "")
    # the client checks' request ids, in the order the server will see them (the reference replays
    # that order: the hybrid switch's state carries over between requests)
    rids = {k: [f"{c.label}-{arm}-{i}-{k[0]}" for i in range(len(c.prompts))]
            for k in checks if k in REFERENCE_CHECKS}
    refs, ref_err = _arm_references(c, arm, spec, rids, tag)
    try:
        server = serve(c.model_dir, arm, spec, port=0, block=False, served_model_name=c.label,
                       switch=None if arm in ("upstream", "always-route") else c.switch, cb_overrides=c.cb, dtype=c.dtype,
                       device=c.device, max_model_len=c.max_model_len)
    except Exception as e:  # noqa: BLE001 - every check of this arm fails, the other arms still run
        log.exception("%s: the server did not start", tag)
        return [_row(c.label, arm, spec_s, check, False, f"the server did not start: {type(e).__name__}: {e}")
                for check in checks]
    rows = []
    try:
        for check in checks:
            t0 = time.perf_counter()
            try:
                res = _run_check(c, server, check, rids, refs, ref_err)
            except Exception as e:  # noqa: BLE001 - a broken check is a FAIL row, the others still run
                log.exception("%s: check %s raised", tag, check)
                res = dict(ok=False, detail=f"{type(e).__name__}: {e}")
            routed, skip = _shares(server.url, arm)
            ok = bool(res.pop("ok"))
            row = _row(c.label, arm, spec_s, check, ok, res.pop("detail"), routed_share=routed,
                       skip_share=skip, wall_s=round(time.perf_counter() - t0, 3), **res)
            rows.append(row)
            c.say(f"{tag} {check}: {row['verdict']} - {row['detail']}")
    finally:
        server.close()
    return rows


# ======================================================================================================
# Output
# ======================================================================================================
def _csv_text(rows: Sequence[Mapping[str, Any]]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(COLUMNS), extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in COLUMNS})
    return buf.getvalue()


def write_outputs(rows: Sequence[Mapping[str, Any]], out_csv: str | os.PathLike,
                  summary_json: str | os.PathLike | None = None, extra: Mapping[str, Any] | None = None) -> dict:
    """Write the rows as CSV (:data:`COLUMNS`) and, when asked, a summary JSON (``rows``, per-verdict
    counts, ``all_pass``, plus ``extra``: settings, provenance), each atomically.

    Returns:
        the summary dict.
    """

    counts = {"PASS": sum(r["verdict"] == "PASS" for r in rows), "FAIL": sum(r["verdict"] != "PASS" for r in rows)}
    summary = {**dict(extra or {}), "rows": [dict(r) for r in rows], "counts": counts,
               "all_pass": bool(rows) and counts["FAIL"] == 0,
               "arms": sorted({r["arm"] for r in rows}),
               "checks": [c for c in CHECKS if any(r["check"] == c for r in rows)]}
    text = _csv_text(rows)
    if summary_json is not None:
        write_json(summary_json, copy.deepcopy(summary))
    write_text(out_csv, text)
    return summary
