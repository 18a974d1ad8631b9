"""OpenAI-compatible HTTP endpoint in front of ONE vSkipper engine arm (Sec. 4.1, "Arms"): FastAPI +
uvicorn with the pydantic types of :mod:`impl.vskipper.protocol`, the stack of vLLM, SGLang and
``transformers serve``.

The paper serves every arm behind SGLang's HTTP server and drives it with SGLang's serving benchmark
and lm-eval's ``local-completions`` client. Here the engine is transformers' continuous-batching
manager (:class:`~impl.vskipper.driver.CompletionEngine`); this module is its HTTP face. Handlers are
``async``: a request is submitted from the event loop and its tokens arrive on an asyncio queue
(:meth:`~impl.vskipper.driver.CompletionEngine.aevents`), so thousands of open streams cost no threads.

**Endpoints**

- ``POST /v1/completions``: ``prompt`` a string, a list of token ids, or a list of strings / of
  token-id lists (several prompts, one choice each; streaming takes exactly one). Strings are
  tokenized by the model directory's tokenizer (``add_special_tokens`` as configured, default True);
  token ids go to the engine unchanged.
- ``POST /v1/chat/completions``: ``messages`` rendered with the model's chat template
  (``add_generation_prompt``); 400 for a model without one. ``max_completion_tokens`` or ``max_tokens``;
  ``logprobs: true`` with ``top_logprobs`` k gives OpenAI's chat ``logprobs.content`` list.
- ``GET /health`` (200 once the engine is up and warmed, 503 otherwise), ``GET /v1/models``,
  ``GET /v1/models/{name}``, ``GET /v1/vskipper/stats`` (the arm's settings, resolved engine
  configuration, routed-row statistics and the mode switch's summary).

**Request fields** (both endpoints): ``max_tokens`` (default 16, >= 1), ``temperature`` (0 / omitted:
greedy; > 0 is refused: the shared manager decodes greedily, which is what the paper's serving and
quality protocols use), ``stream``, ``stream_options.include_usage``, ``stop`` (string or list; the
text is cut before the first stop string, the request is cancelled in the engine,
``finish_reason="stop"``), ``logprobs`` (completions: 0..``max_logprobs``, the chosen token's
log-probability and the top k per generated token plus ``top_logprob_ids``), ``model`` (the served
name, an alias, or omitted), ``ignore_eos`` (generate exactly ``max_tokens`` tokens),
``generation_config`` (transformers-serve style JSON string or object: ``eos_token_id: -1`` means ignore
EOS, ``max_new_tokens`` is used when ``max_tokens`` is absent), ``skip_special_tokens`` (default True),
``request_id`` / ``rid`` or the ``X-Request-ID`` header (the engine request id: RandomSkip hashes it, so
a client can reproduce routes across arms; several prompts use ``<id>-<i>``; an id still in flight gets
a 409). Accepted without effect on a greedy decode (checked): ``top_p`` in (0, 1], ``top_k``, ``min_p``
in [0, 1], ``seed``, ``user``, ``response_format`` ``{"type": "text"}``. Refused with 400: ``n`` /
``best_of`` > 1, ``echo``, a non-empty ``suffix``, non-zero penalties, ``logit_bias``, ``min_tokens`` > 0,
``max_tokens`` >= the context length, structured output (``response_format`` json, ``guided_*``,
``regex``, ``json_schema``, ``ebnf``), tools, a non-finite number, an empty ``model``, and any malformed
field (the message names it). Unknown fields are ignored and their names logged, as vLLM does.

**Responses.** Non-streaming: ``choices[i]`` with ``text`` (chat: ``message.content``),
``finish_reason`` (``length`` / ``stop``), ``logprobs`` (or null), ``token_ids`` and a ``vskipper``
object (:class:`~impl.vskipper.protocol.VSkipperInfo`), plus ``usage``; ``completion_tokens`` counts
every generated token, the EOS included. Streaming (server-sent events): one ``data: {...}`` chunk per
generated token (chat: a first chunk with ``delta.role``), with the text the token completes ("" for
a special token or an incomplete UTF-8 sequence; text that may start a stop string is held back until
it cannot), ``token_ids`` ([the id]) and ``logprobs`` when asked; the last token's chunk carries
``finish_reason`` and ``vskipper``. Only when ``stream_options.include_usage`` is true, every chunk
carries ``"usage": null`` and a last chunk with ``choices: []`` and the ``usage`` follows (the OpenAI
API's rule; clients such as SGLang's ``bench_serving`` index ``choices[0]`` of every chunk). Then
``data: [DONE]``. Errors are :class:`~impl.vskipper.protocol.ErrorResponse` JSON with a 4xx / 5xx
status (after a stream started: a ``data: {"error": ...}`` chunk and ``data: [DONE]``); the server keeps
serving after any of them.

Use :class:`CompletionServer` (``make_server(engine).start_background()``) or
:func:`impl.vskipper.server.serve` / the command line ``python -m impl.vskipper.server``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Sequence

import uvicorn
from fastapi import FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..provenance import strict_json
from . import protocol as P
from ..serving.engine import EngineError, LiveRequest, TokenEvent
from .driver import CompletionEngine, TextAssembler

__all__ = ["CompletionServer", "build_app", "make_server"]

logger = logging.getLogger(__name__)

_MAX_BODY = 64 << 20
_MAX_PROMPTS = 1024
_MAX_ID_LEN = 256


class RequestError(Exception):
    """A request the server refuses: HTTP ``status`` (4xx), message naming the field (``param``)."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = int(status), message, param, kind


@dataclass
class Sampling:
    """A validated request, as the engine runs it."""

    prompts: list[list[int]]
    max_tokens: int
    stream: bool
    include_usage: bool
    stops: list[str]
    ignore_eos: bool
    eos_token_id: Any
    logprobs: int | None
    skip_special: bool
    request_id: str | None


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


# ------------------------------------------------------------------------------------ validation


def _check_sampling(req: P._SamplingRequest, engine: CompletionEngine, header_rid: str | None,
                    max_tokens: int | None, max_tokens_param: str = "max_tokens") -> dict[str, Any]:
    """The checks both endpoints share; returns the Sampling fields except prompts and logprobs.
    ``max_tokens`` came from the field ``max_tokens_param``; when it is None the length comes from
    ``generation_config.max_new_tokens`` (else 16), and errors name the field it came from.

    Raises:
        RequestError: 400 / 404 naming the field.
    """
    if req.model is not None and not req.model:
        raise RequestError(400, "'model' must be a non-empty string (or omitted for the served model)", "model")
    if req.model is not None and req.model not in engine.model_names:
        raise RequestError(404, f"model {req.model!r} is not served here; this server serves "
                                f"{engine.served_model_name!r}", "model", "model_not_found")
    gen: dict = {}
    if req.generation_config is not None:
        if isinstance(req.generation_config, str):
            try:
                gen = json.loads(req.generation_config)
            except json.JSONDecodeError:
                raise RequestError(400, "'generation_config' is not valid JSON", "generation_config") from None
        else:
            gen = dict(req.generation_config)
        if not isinstance(gen, dict):
            raise RequestError(400, "'generation_config' must be a JSON object", "generation_config")
        if gen.get("do_sample"):
            raise RequestError(400, "sampling is not supported: this server decodes greedily", "generation_config")
        if gen.get("num_return_sequences", 1) not in (1, None):
            raise RequestError(400, "num_return_sequences must be 1", "generation_config")
    if max_tokens is not None:
        mt, mname, mparam = max_tokens, max_tokens_param, max_tokens_param
    elif "max_new_tokens" in gen:
        mt, mname, mparam = gen["max_new_tokens"], "generation_config.max_new_tokens", "generation_config"
    else:
        mt, mname, mparam = 16, max_tokens_param, max_tokens_param
    if not _is_int(mt):
        raise RequestError(400, f"'{mname}' must be an integer, got {mt!r}", mparam)
    if mt < 1:
        raise RequestError(400, f"'{mname}' must be >= 1, got {mt}", mparam)
    if mt >= engine.max_model_len:
        raise RequestError(400, f"'{mname}' must be < {engine.max_model_len} (the maximum context length, "
                                f"prompt included), got {mt}", mparam, "context_length_exceeded")
    _check_unsupported(req)
    if req.temperature is not None:
        if req.temperature < 0:
            raise RequestError(400, f"'temperature' must be a number >= 0, got {req.temperature!r}", "temperature")
        if req.temperature > 0:
            raise RequestError(400, "only greedy decoding is supported (temperature 0 or omitted): the shared "
                                    "continuous-batching manager of this arm decodes greedily", "temperature")
    for key in ("n", "best_of"):
        v = getattr(req, key, None)
        if v is not None and v != 1:
            raise RequestError(400, f"'{key}' must be 1 (one completion per prompt)", key)
    for key in ("presence_penalty", "frequency_penalty"):
        if getattr(req, key) not in (None, 0, 0.0):
            raise RequestError(400, f"'{key}' is not supported (must be 0)", key)
    if req.repetition_penalty not in (None, 1, 1.0):
        raise RequestError(400, "'repetition_penalty' is not supported (must be 1)", "repetition_penalty")
    if req.logit_bias:
        raise RequestError(400, "'logit_bias' is not supported", "logit_bias")
    if req.min_tokens not in (None, 0):
        raise RequestError(400, "'min_tokens' is not supported", "min_tokens")
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    ign = bool(req.ignore_eos)
    eos_override = None
    if "eos_token_id" in gen:
        e = gen["eos_token_id"]
        if e is None or e == -1 or e == [-1]:
            ign = True
        elif _is_int(e) or (isinstance(e, list) and e and all(_is_int(x) for x in e)):
            ids = e if isinstance(e, list) else [e]
            bad = [x for x in ids if not 0 <= x < engine.vocab_size]
            if bad:
                raise RequestError(400, f"generation_config.eos_token_id must be token ids in [0, {engine.vocab_size}) "
                                        f"(or -1 / null for no stop), got {bad[:5]}", "generation_config")
            eos_override = e
        else:
            raise RequestError(400, "generation_config.eos_token_id must be an int or a non-empty list of ints",
                               "generation_config")
    for rid, rname in ((req.request_id, "request_id"), (req.rid, "rid"), (header_rid, "X-Request-ID")):
        if rid is not None:
            break
    if rid is not None and (not rid or len(rid) > _MAX_ID_LEN):
        raise RequestError(400, f"'{rname}' must be a non-empty string of at most {_MAX_ID_LEN} characters",
                           rname)
    return dict(max_tokens=int(mt), stream=bool(req.stream), include_usage=req.include_usage,
                stops=[s for s in stops if s], ignore_eos=ign, eos_token_id=eos_override,
                skip_special=req.skip_special_tokens, request_id=rid)


def _check_unsupported(req: P._SamplingRequest) -> None:
    """Refuse what a greedy decode without constraints cannot honour; accept (checked) what does not
    change it; log the names of unknown fields (vLLM's behaviour).

    Raises:
        RequestError: 400 naming the field.
    """
    if req.top_p is not None and not 0 < req.top_p <= 1:
        raise RequestError(400, f"'top_p' must be in (0, 1], got {req.top_p!r}", "top_p")
    if req.top_k is not None and req.top_k < -1:
        raise RequestError(400, f"'top_k' must be -1 (off), 0 (off) or >= 1, got {req.top_k!r}", "top_k")
    if req.min_p is not None and not 0 <= req.min_p <= 1:
        raise RequestError(400, f"'min_p' must be in [0, 1], got {req.min_p!r}", "min_p")
    rf = req.response_format
    if rf is not None and rf.get("type", "text") != "text":
        raise RequestError(400, f"'response_format' {rf.get('type')!r} is not supported: this server cannot "
                                "constrain decoding (only {'type': 'text'})", "response_format")
    for key in P.TOOL_FIELDS:
        v = getattr(req, key)
        if v not in (None, [], "none"):
            raise RequestError(400, f"'{key}' is not supported: this server has no tool calling", key)
    for key in P.STRUCTURED_OUTPUT_FIELDS:
        if getattr(req, key) is not None:
            raise RequestError(400, f"'{key}' (structured output) is not supported: this server cannot "
                                    "constrain decoding", key)
    if req.model_extra:
        logger.warning("ignored unknown request fields: %s", ", ".join(sorted(req.model_extra)))


def _check_logprobs(lp: int | None, engine: CompletionEngine, param: str) -> int | None:
    if lp is None:
        return None
    if lp < 0:
        raise RequestError(400, f"'{param}' must be an integer >= 0, got {lp!r}", param)
    if engine.max_logprobs <= 0:
        raise RequestError(400, "this server was started with max_logprobs=0: logprobs are disabled", param)
    if lp > engine.max_logprobs:
        raise RequestError(400, f"'{param}' must be <= {engine.max_logprobs} (the server's max_logprobs)", param)
    return int(lp)


def _check_context(prompts: list[list[int]], s: dict, engine: CompletionEngine) -> None:
    if s["stream"] and len(prompts) != 1:
        raise RequestError(400, "streaming takes exactly one prompt", "prompt")
    for p in prompts:
        if len(p) + s["max_tokens"] > engine.max_model_len:
            raise RequestError(400, f"prompt ({len(p)} tokens) + max_tokens ({s['max_tokens']}) exceeds the maximum "
                                    f"context length {engine.max_model_len}", "prompt", "context_length_exceeded")


def parse_completion(req: P.CompletionRequest, engine: CompletionEngine, header_rid: str | None) -> Sampling:
    """Validate a ``/v1/completions`` request against the engine.

    Raises:
        RequestError: 4xx naming the field.
    """
    s = _check_sampling(req, engine, header_rid, req.max_tokens)
    if req.echo:
        raise RequestError(400, "'echo' (prompt log-probabilities) is not supported: the engine does not compute "
                                "prompt logits, so loglikelihood requests cannot be served", "echo")
    if req.suffix:
        raise RequestError(400, "'suffix' is not supported", "suffix")
    lp = _check_logprobs(req.logprobs, engine, "logprobs")
    prompts = _parse_prompts(req.prompt, engine)
    _check_context(prompts, s, engine)
    return Sampling(prompts=prompts, logprobs=lp, **s)


def parse_chat(req: P.ChatCompletionRequest, engine: CompletionEngine, header_rid: str | None) -> Sampling:
    """Validate a ``/v1/chat/completions`` request and render its messages with the chat template.

    Raises:
        RequestError: 4xx naming the field (400 for a model without a chat template).
    """
    if req.max_completion_tokens is not None:
        s = _check_sampling(req, engine, header_rid, req.max_completion_tokens, "max_completion_tokens")
    else:
        s = _check_sampling(req, engine, header_rid, req.max_tokens)
    lp = None
    if req.logprobs:
        lp = _check_logprobs(req.top_logprobs if req.top_logprobs is not None else 0, engine, "top_logprobs")
    elif req.top_logprobs is not None:
        raise RequestError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
    for i, m in enumerate(req.messages):
        for j, part in enumerate(m.content if isinstance(m.content, list) else ()):
            if part.get("type") != "text":
                raise RequestError(400, f"messages[{i}].content: only text parts are supported", "messages")
            if not isinstance(part.get("text"), str):
                raise RequestError(400, f"'messages[{i}].content[{j}].text' must be a string, got "
                                        f"{type(part.get('text')).__name__}", "messages")
        _check_unicode(m.text(), f"messages[{i}].content")
    if req.continue_final_message and req.messages[-1].role != "assistant":
        raise RequestError(400, "'continue_final_message' continues the last message, which must be the "
                                f"assistant's (got role {req.messages[-1].role!r})", "continue_final_message")
    try:
        ids = engine.render_chat([{"role": m.role, "content": m.text()} for m in req.messages],
                                 add_generation_prompt=req.add_generation_prompt and not req.continue_final_message,
                                 continue_final_message=req.continue_final_message)
    except ValueError as e:
        raise RequestError(400, str(e), "messages") from None
    if not ids:
        raise RequestError(400, "the messages render to no tokens", "messages")
    _check_context([ids], s, engine)
    return Sampling(prompts=[ids], logprobs=lp, **s)


def _check_unicode(text: str, param: str) -> None:
    """Refuse text the tokenizer cannot take: a lone UTF-16 surrogate (valid JSON ``"\\ud800"``, not
    encodable as UTF-8).

    Raises:
        RequestError: 400 naming ``param``.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestError(400, f"'{param}' is not valid Unicode text ({e.reason} at character {e.start})",
                           param) from None


def _parse_prompts(prompt: Any, engine: CompletionEngine) -> list[list[int]]:
    def ids_ok(ids: list) -> list[int]:
        if not ids:
            raise RequestError(400, "empty prompt", "prompt")
        bad = [t for t in ids if not _is_int(t) or not 0 <= t < engine.vocab_size]
        if bad:
            raise RequestError(400, f"prompt token ids must be integers in [0, {engine.vocab_size}), got "
                                    f"{json.dumps(bad[:5])}", "prompt")
        return [int(t) for t in ids]

    def text_ok(s: str) -> list[int]:
        if not s:
            raise RequestError(400, "empty prompt", "prompt")
        _check_unicode(s, "prompt")
        ids = engine.tokenize(s)
        if not ids:
            raise RequestError(400, "the prompt tokenizes to no tokens", "prompt")
        return ids

    if isinstance(prompt, str):
        return [text_ok(prompt)]
    if not isinstance(prompt, list):
        raise RequestError(400, "'prompt' must be a string, a list of token ids, or a list of strings / token-id "
                                "lists", "prompt")
    if not prompt:
        raise RequestError(400, "empty prompt", "prompt")
    if len(prompt) > _MAX_PROMPTS and not all(_is_int(x) for x in prompt):
        raise RequestError(400, f"at most {_MAX_PROMPTS} prompts per request", "prompt")
    if all(isinstance(x, (int, float)) for x in prompt):  # bool and float included: ids_ok names them
        return [ids_ok(prompt)]
    if all(isinstance(x, str) for x in prompt):
        return [text_ok(x) for x in prompt]
    if all(isinstance(x, list) for x in prompt):
        return [ids_ok(x) for x in prompt]
    raise RequestError(400, "'prompt' mixes types: use a string, a list of token ids, or a list of strings / "
                            "token-id lists", "prompt")


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """One line from pydantic's errors: the first error, naming its field."""
    errs = exc.errors()
    if not errs:
        return "invalid request", None
    e = errs[0]
    loc = [x for x in e.get("loc", ()) if x != "body"]
    kind = e.get("type", "")
    if kind == "json_invalid":
        return f"the request body is not valid JSON: {e.get('ctx', {}).get('error', e.get('msg'))}", None
    if not loc and kind in ("model_attributes_type", "dict_type", "missing", "model_type"):
        return "the request body must be a JSON object", None
    field = str(loc[0]) if loc else None
    path = field
    for x in loc[1:]:
        if isinstance(x, int):
            path += f"[{x}]"
        elif x in ("str", "int", "float", "bool", "list[str]", "dict[str,json-value]") or "[" in str(x):
            break  # a union member's name, not a key
        else:
            path += f".{x}"
    msg = str(e.get("msg", "invalid value")).removeprefix("Value error, ")
    return (f"'{path}': {msg}" if path else msg), field


# ---------------------------------------------------------------------------------------- serving


def _completion_id(rid: str, prefix: str = "cmpl-") -> str:
    """The response id: ``prefix`` + the engine request id (a server-made ``cmpl-`` id loses that prefix
    in a chat response: ``chatcmpl-<hex>``, not ``chatcmpl-cmpl-<hex>``)."""
    if rid.startswith(prefix):
        return rid
    return prefix + (rid.removeprefix("cmpl-") if prefix == "chatcmpl-" else rid)


def _error(status: int, message: str, param: str | None = None, kind: str | None = None) -> JSONResponse:
    return JSONResponse(P.ErrorResponse.of(status, message, param, kind).model_dump(), status_code=status)


def _sse(payload: str) -> str:
    return f"data: {payload}\n\n"


async def _submit(engine: CompletionEngine, s: Sampling) -> list[LiveRequest]:
    """Add the request's prompts to the engine (in a worker thread: ``submit`` may wait briefly for a
    reused request id to be released). Cancels what it added if a later prompt is refused."""
    loop = asyncio.get_running_loop()
    lives: list[LiveRequest] = []
    try:
        for i, ids in enumerate(s.prompts):
            rid = s.request_id
            if rid is not None and len(s.prompts) > 1:
                rid = f"{rid}-{i}"
            lives.append(await asyncio.to_thread(
                engine.submit, ids, s.max_tokens, ignore_eos=s.ignore_eos, eos_token_id=s.eos_token_id,
                request_id=rid, top_logprobs=s.logprobs, loop=loop))
    except BaseException:
        for lv in lives:
            engine.cancel(lv)
        raise
    return lives


async def _pieces(engine: CompletionEngine, live: LiveRequest, s: Sampling
                  ) -> AsyncIterator[tuple[TokenEvent, str, str | None, int, TextAssembler]]:
    """One request's tokens as ``(event, released text, finish_reason or None, text offset, assembler)``;
    cancels the request in the engine when a stop string completes or the reader goes away."""
    asm = TextAssembler(engine, live.prompt_ids, s.stops, s.skip_special)
    finished = False
    n_tokens = 0
    try:
        async for ev in engine.aevents(live):
            n_tokens += 1
            offset = len(asm.text)
            piece = asm.push(ev.token_id, ev.final)
            offset = min(offset, len(asm.text))
            reason = "stop" if asm.stopped else ev.finish_reason
            if asm.stopped or ev.final:
                finished = True
            if asm.stopped:
                engine.cancel(live, stopped_after=n_tokens)  # a normal end; no-op when the engine already finished it
            yield ev, piece, reason, offset, asm
            if asm.stopped:
                return
    finally:
        if not finished:
            engine.cancel(live)


def _vsk(engine: CompletionEngine, live: LiveRequest) -> P.VSkipperInfo:
    return P.VSkipperInfo(request_id=live.rid, arm=engine.arm, **(live.info or {}))


def _completion_logprobs(engine: CompletionEngine, events: Sequence[TokenEvent], offsets: Sequence[int]
                         ) -> P.CompletionLogProbs:
    dec = lambda t: engine.decode([t], skip_special_tokens=False)  # noqa: E731
    return P.CompletionLogProbs(
        tokens=[dec(e.token_id) for e in events], token_logprobs=[e.logprob for e in events],
        top_logprobs=[{dec(t): v for t, v in (e.top or [])} for e in events],
        top_logprob_ids=[[(t, v) for t, v in (e.top or [])] for e in events], text_offset=list(offsets))


def _chat_logprobs(engine: CompletionEngine, events: Sequence[TokenEvent]) -> P.ChatLogprobs:
    def tok(t: int) -> tuple[str, list[int]]:
        text = engine.decode([t], skip_special_tokens=False)
        return text, list(text.encode("utf-8"))

    out = []
    for e in events:
        text, b = tok(e.token_id)
        top = [P.TopLogprob(token=tok(t)[0], logprob=v, bytes=tok(t)[1]) for t, v in (e.top or [])]
        out.append(P.ChatLogprobToken(token=text, logprob=e.logprob if e.logprob is not None else float("nan"),
                                      bytes=b, top_logprobs=top))
    return P.ChatLogprobs(content=out)


def _usage(prompt_tokens: int, completion_tokens: int) -> P.UsageInfo:
    return P.UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                       total_tokens=prompt_tokens + completion_tokens)


async def _complete(engine: CompletionEngine, s: Sampling, chat: bool) -> Response:
    lives = await _submit(engine, s)
    choices, n_prompt, n_out = [], 0, 0
    try:
        for i, live in enumerate(lives):
            events, offsets, reason, asm = [], [], "length", None
            async for ev, _piece, why, offset, asm in _pieces(engine, live, s):
                events.append(ev)
                offsets.append(offset)
                reason = why or reason
            text = asm.text if asm is not None else ""
            ids = [e.token_id for e in events]
            if chat:
                choices.append(P.ChatCompletionChoice(
                    index=i, message=P.ChatMessageOut(content=text), finish_reason=reason, token_ids=ids,
                    logprobs=_chat_logprobs(engine, events) if s.logprobs is not None else None,
                    vskipper=_vsk(engine, live)))
            else:
                choices.append(P.CompletionChoice(
                    index=i, text=text, finish_reason=reason, token_ids=ids,
                    logprobs=_completion_logprobs(engine, events, offsets) if s.logprobs is not None else None,
                    vskipper=_vsk(engine, live)))
            n_prompt += len(live.prompt_ids)
            n_out += len(events)
    except BaseException:
        for lv in lives:
            engine.cancel(lv)
        raise
    if chat:
        resp = P.ChatCompletionResponse(id=_completion_id(lives[0].rid, "chatcmpl-"), model=engine.served_model_name,
                                        choices=choices, usage=_usage(n_prompt, n_out))
    else:
        resp = P.CompletionResponse(id=_completion_id(lives[0].rid), model=engine.served_model_name,
                                    choices=choices, usage=_usage(n_prompt, n_out))
    return Response(resp.model_dump_json(), media_type="application/json")


async def _stream(engine: CompletionEngine, s: Sampling, chat: bool) -> Response:
    (live,) = await _submit(engine, s)  # errors here still get a JSON status response
    cid = _completion_id(live.rid, "chatcmpl-" if chat else "cmpl-")
    created, name = int(time.time()), engine.served_model_name
    exclude = None if s.include_usage else {"usage"}

    def chunk(choices: list, usage: P.UsageInfo | None = None) -> str:
        cls = P.ChatCompletionStreamResponse if chat else P.CompletionStreamResponse
        return _sse(cls(id=cid, created=created, model=name, choices=choices, usage=usage)
                    .model_dump_json(exclude=exclude))

    async def body() -> AsyncIterator[str]:
        n = 0
        try:
            if chat:
                yield chunk([P.ChatCompletionStreamChoice(index=0, delta=P.DeltaMessage(role="assistant", content=""))])
            async for ev, piece, reason, offset, _asm in _pieces(engine, live, s):
                n += 1
                vsk = _vsk(engine, live) if reason is not None else None
                if chat:
                    yield chunk([P.ChatCompletionStreamChoice(
                        index=0, delta=P.DeltaMessage(content=piece), finish_reason=reason, token_ids=[ev.token_id],
                        logprobs=_chat_logprobs(engine, [ev]) if s.logprobs is not None else None, vskipper=vsk)])
                else:
                    yield chunk([P.CompletionChoice(
                        index=0, text=piece, finish_reason=reason, token_ids=[ev.token_id],
                        logprobs=_completion_logprobs(engine, [ev], [offset]) if s.logprobs is not None else None,
                        vskipper=vsk)])
            if s.include_usage:
                yield chunk([], usage=_usage(len(live.prompt_ids), n))
            yield _sse("[DONE]")
        except EngineError as e:
            yield _sse(P.ErrorResponse.of(e.status, str(e), kind=e.kind).model_dump_json())
            yield _sse("[DONE]")

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


class _AnnouncedBodyLimit:
    """Outermost ASGI wrapper: a request whose ``Content-Length`` announces more than ``limit`` bytes gets
    the server's JSON 413 unread. (FastAPI's ``max_body_size`` counts chunked bodies as they arrive, but
    answers an announced oversize body with Starlette's plain-text 413, replacing any response sent from
    inside the app, so this case is answered before it.)"""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, int(limit)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            for k, v in scope.get("headers", ()):
                if k == b"content-length" and v.isdigit() and int(v) > self.limit:
                    await _error(413, f"request body larger than {self.limit} bytes")(scope, receive, send)
                    return
        await self.app(scope, receive, send)


async def _until_disconnect(request: Request) -> None:
    """Return when the client goes away (the ASGI ``http.disconnect`` message; the body is read by then)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _cancel_on_disconnect(request: Request, work: Awaitable[Response]) -> Response:
    """Await a non-streaming completion, cancelled (and its engine requests with it, in ``_complete``) when
    the client disconnects first: a closed connection frees its slots instead of decoding to the end.
    (A streaming response stops on disconnect by itself: Starlette listens while it sends.)"""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the server is shutting down
        task.cancel()
        raise
    finally:
        gone.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    logger.info("client disconnected: request cancelled")
    return Response(status_code=499)  # nobody reads it (nginx's "client closed request")


def build_app(engine: CompletionEngine) -> FastAPI:
    """The FastAPI application of one engine arm (routes in the module docstring)."""
    # max_body_size: FastAPI counts the bytes as they arrive (a chunked body without Content-Length too)
    app = FastAPI(title="vSkipper engine arm", summary="OpenAI-compatible completions in front of one "
                  "continuous-batching engine arm", docs_url="/docs", redoc_url=None, max_body_size=_MAX_BODY)

    def _rejected(request: Request, response: JSONResponse) -> JSONResponse:
        """A 4xx answer to a POST (a request refused before the engine) counts in ``counters["rejected"]``."""
        if request.method == "POST" and 400 <= response.status_code < 500:
            engine.note_rejected()
        return response

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        ctype = request.headers.get("content-type", "")
        if request.method == "POST" and "json" not in ctype.lower():
            return _rejected(request, _error(400, f"the request body must be JSON sent with 'Content-Type: "
                                                  f"application/json' (got {ctype or 'no Content-Type'!r})", "Content-Type"))
        msg, field = _validation_message(exc)
        return _rejected(request, _error(400, msg, field))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        msg = {404: f"no route {request.url.path!r}",
               405: f"method {request.method} not allowed for {request.url.path}"}.get(exc.status_code, str(exc.detail))
        if exc.status_code == 413:
            msg = f"request body larger than {_MAX_BODY} bytes"
        if exc.status_code == 400 and exc.detail == "There was an error parsing the body":
            # FastAPI's answer to a body json.loads cannot decode, e.g. bytes that are not UTF-8
            msg = "the request body is not valid JSON (UTF-8 text expected)"
        return _rejected(request, _error(exc.status_code, msg, kind=kind))

    @app.exception_handler(RequestError)
    async def _refused(request: Request, exc: RequestError):
        return _rejected(request, _error(exc.status, exc.message, exc.param, exc.kind))

    @app.exception_handler(EngineError)
    async def _engine(request: Request, exc: EngineError):
        return _rejected(request, _error(exc.status, str(exc), kind=exc.kind))

    def _ready() -> None:
        if not engine.healthy:
            raise RequestError(503, engine.error or "the engine is not ready", kind="service_unavailable")

    def _card() -> P.ModelCard:
        return P.ModelCard(id=engine.served_model_name, created=engine.created, max_model_len=engine.max_model_len,
                           arm=engine.arm)

    @app.get("/health")
    async def health():
        _ready()
        return {"status": "ok", "arm": engine.arm, "model": engine.served_model_name}

    @app.get("/v1/models", response_model=P.ModelList)
    async def models():
        return P.ModelList(data=[_card()])

    @app.get("/v1/models/{name:path}", response_model=P.ModelCard)
    async def model(name: str):
        if name not in engine.model_names:
            raise RequestError(404, f"model {name!r} not found", kind="model_not_found")
        return _card()

    @app.get("/v1/vskipper/stats")
    async def stats():
        # strict JSON: an infinite switch threshold is written as null (read back as infinity by --switch)
        return Response(strict_json(engine.describe()), media_type="application/json")

    # Parsing tokenizes (under the engine's tokenizer lock): in a worker thread, off the event loop.
    @app.post("/v1/completions", response_model=P.CompletionResponse)
    async def completions(request: Request, req: P.CompletionRequest,
                          x_request_id: str | None = Header(default=None)):
        _ready()
        s = await asyncio.to_thread(parse_completion, req, engine, x_request_id)
        if s.stream:
            return await _stream(engine, s, chat=False)
        return await _cancel_on_disconnect(request, _complete(engine, s, chat=False))

    @app.post("/v1/chat/completions", response_model=P.ChatCompletionResponse)
    async def chat_completions(request: Request, req: P.ChatCompletionRequest,
                               x_request_id: str | None = Header(default=None)):
        _ready()
        s = await asyncio.to_thread(parse_chat, req, engine, x_request_id)
        if s.stream:
            return await _stream(engine, s, chat=True)
        return await _cancel_on_disconnect(request, _complete(engine, s, chat=True))

    return app


class CompletionServer:
    """uvicorn serving :func:`build_app` of one started :class:`~impl.vskipper.driver.CompletionEngine`,
    in a background thread.

    Attributes:
        engine: the engine arm.
        host, port, url: the bound address (``url`` is ``http://host:port``; port 0 binds a free one).
    """

    def __init__(self, engine: CompletionEngine, host: str = "127.0.0.1", port: int = 0):
        self.engine = engine
        self.app = build_app(engine)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((host, int(port)))
        except OSError:
            self._sock.close()
            raise
        self._sock.set_inheritable(True)
        self.host, self.port = self._sock.getsockname()[:2]
        self.port = int(self.port)
        self.url = f"http://{'[' + self.host + ']' if family == socket.AF_INET6 else self.host}:{self.port}"
        # open-loop load: a large backlog and no client-side concurrency cap; no access log per request
        self._server = uvicorn.Server(uvicorn.Config(_AnnouncedBodyLimit(self.app, _MAX_BODY), log_level="warning", access_log=False, lifespan="off",
                                                     backlog=2048, timeout_keep_alive=30))
        self._thread: threading.Thread | None = None
        self._closed = False

    def start_background(self, timeout_s: float = 30.0) -> "CompletionServer":
        """Serve in a daemon thread; return self once uvicorn listens.

        Raises:
            RuntimeError: if uvicorn did not start within ``timeout_s``.
        """
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        name="vskipper-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.01)
        return self

    def close(self, grace_s: float = 0.0) -> None:
        """Stop accepting requests, let in-flight ones finish for ``grace_s`` seconds (then cancel
        them), stop the engine and release the socket. Safe to call twice; not from the serving thread."""
        if self._closed:
            return
        self._closed = True
        if self._thread is not None and self._thread.is_alive():
            self._server.config.timeout_graceful_shutdown = max(float(grace_s), 0.05)
            self._server.should_exit = True
            self._thread.join(timeout=float(grace_s) + 10)
            if self._thread.is_alive():
                self._server.force_exit = True
                self._thread.join(timeout=10)
        self.engine.stop(grace_s=0.0)
        try:
            self._sock.close()
        except OSError:
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def make_server(engine: CompletionEngine, host: str = "127.0.0.1", port: int = 0) -> CompletionServer:
    """Bind a :class:`CompletionServer` for a started engine (port 0: any free port); call
    ``start_background()`` to serve."""
    return CompletionServer(engine, host, port)
