"""Serving arms: the measured configurations a load generator drives (vSkipper Sec. 4.1, "Arms").

An *arm* is one measured configuration (e.g. upstream, or vSkipper hybrid / always-route). The load
generator (:func:`impl.serving.loadgen.run_load`) talks to every arm through the small interface of
:class:`Arm`:

``arm.start(hint)``
    bring the engine up (fresh state: a new continuous-batching manager, an empty cache) and run
    the warm-up, which is excluded from the measurement;
``arm.submit(request_id, input_ids, max_new_tokens, ignore_eos)``
    hand one request to the engine and return at once (no client-side concurrency cap);
``arm.wait(request_ids, timeout_s)``
    block until those requests finished (or failed, or the timeout passed) and return one
    :class:`Trace` per request: every output token's time, the finish time, token counts, errors;
``arm.stop()``
    shut the engine down (pending requests are flushed, or failed after a timeout).

All times an arm reports are readings of ``arm.clock`` (seconds); the load generator reads the same
clock for arrivals and converts everything to offsets from the injection start.

Arms here:

* :class:`impl.serving.inprocess.ContinuousBatchingArm` - in process, over transformers' continuous-batching
  manager through the shared engine driver (:mod:`impl.serving.engine`), optionally in vSkipper's
  dense or routed mode;
* :class:`HTTPCompletionsArm` - a client of an OpenAI-compatible ``/v1/completions`` endpoint with
  streaming (e.g. ``transformers serve --continuous-batching``), see its docstring for what HTTP
  cannot give;
* :class:`impl.serving.fake.FakeArm` - a deterministic queueing model on a virtual clock (tests).
"""

from __future__ import annotations

import abc
import copy
import json
import math
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

__all__ = [
    "Clock",
    "RealClock",
    "WorkloadHint",
    "Trace",
    "Arm",
    "HTTPCompletionsArm",
    "simple",
]


def simple(value: Any) -> Any:
    """A JSON-safe copy of ``value`` for result rows and stats: scalars kept (a non-finite float becomes
    None), lists / tuples / sets as lists, mappings with string keys, anything else as its ``repr``."""
    if isinstance(value, float) and (math.isinf(value) or math.isnan(value)):
        return None
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple, set)):
        return [simple(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): simple(v) for k, v in value.items()}
    return repr(value)



class Clock:
    """Time source of an arm: ``now()`` in seconds and ``sleep_until(t)``."""

    def now(self) -> float:  # pragma: no cover - interface
        """Current time in seconds (monotonic)."""
        raise NotImplementedError

    def sleep_until(self, t: float) -> None:  # pragma: no cover - interface
        """Return once ``now() >= t`` (at once if ``t`` is past)."""
        raise NotImplementedError


class RealClock(Clock):
    """Wall clock: ``time.perf_counter`` (the clock transformers' engine stamps tokens with)."""

    def now(self) -> float:
        """``time.perf_counter()`` in seconds."""
        return time.perf_counter()

    def sleep_until(self, t: float) -> None:
        """Sleep until ``perf_counter() >= t`` (in slices of at most 50 ms; never early)."""
        while True:
            d = t - time.perf_counter()
            if d <= 0:
                return
            time.sleep(min(d, 0.05))


@dataclass(frozen=True)
class WorkloadHint:
    """What an engine may size itself for (the same for every arm of a cell).

    Attributes:
        max_prompt_tokens: longest prompt, in tokens.
        max_new_tokens: largest ``max_new_tokens`` of the cell's requests.
        num_requests: requests in the cell run.
    """

    max_prompt_tokens: int
    max_new_tokens: int
    num_requests: int


@dataclass
class Trace:
    """What an arm observed for one request (times are ``arm.clock`` readings, seconds).

    Attributes:
        request_id: the request's id.
        token_times: one time per output token whose time is known, in order (the in-process arm
            knows every token's time; the HTTP arm knows one per streamed text chunk).
        token_ids: output token ids (empty when the arm only sees text).
        output_tokens: number of output tokens generated (the EOS included when the request
            stopped on it).
        finish_time: when the request completed (the last token's time for the in-process arm, the
            final stream chunk for HTTP); None if it did not complete.
        prompt_tokens: prompt length as the engine counted it (None if unknown).
        error: None on success, else the engine's or client's error message.
        finish_reason: ``"length"`` (hit ``max_new_tokens``), ``"stop"`` (EOS) or None.
        timestamp_source: ``"engine"`` (engine stamps for every token), ``"stream"`` (per streamed
            update), ``"chunk"`` (client receive time of each HTTP chunk) or ``"model"`` (fake arm).
        output_text: generated text (HTTP arm only).
        max_new_tokens: the request's cap, tokens.
        done: True once the request finished or failed.
    """

    request_id: str
    token_times: list[float] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    output_tokens: int = 0
    finish_time: float | None = None
    prompt_tokens: int | None = None
    error: str | None = None
    finish_reason: str | None = None
    timestamp_source: str = ""
    output_text: str | None = None
    max_new_tokens: int | None = None
    done: bool = False


class Arm(abc.ABC):
    """A measured configuration driven by the load generator (module docstring).

    Subclasses set ``name`` (str) and ``clock`` (:class:`Clock`) and implement the four methods.
    ``supports_ignore_eos`` says whether ``submit(..., ignore_eos=True)`` is honoured; the load
    generator refuses to replay matched work on an arm that does not support it.
    """

    name: str = "arm"
    clock: Clock = RealClock()
    supports_ignore_eos: bool = True

    @abc.abstractmethod
    def start(self, hint: WorkloadHint | None = None) -> None:
        """Bring the engine up with fresh state and warm it up (warm-up excluded from timing)."""

    @abc.abstractmethod
    def submit(self, request_id: str, input_ids: Sequence[int], max_new_tokens: int, ignore_eos: bool) -> None:
        """Hand one request to the engine and return without waiting for it.

        Args:
            request_id: unique id within the run.
            input_ids: prompt token ids.
            max_new_tokens: generation cap in tokens (>= 1).
            ignore_eos: when True generate exactly ``max_new_tokens`` tokens (matched-work replay).
        """

    @abc.abstractmethod
    def wait(self, request_ids: Sequence[str], timeout_s: float) -> dict[str, Trace]:
        """Block until the requests completed or failed, at most ``timeout_s`` seconds; return a
        :class:`Trace` per id (requests not done by then carry an ``error``)."""

    @abc.abstractmethod
    def stop(self) -> None:
        """Shut the engine down; safe to call when not started."""

    def describe(self) -> dict[str, Any]:
        """The arm's declared settings, recorded in the cell rows (JSON-serialisable)."""
        return {"arm": self.name, "kind": type(self).__name__}


class HTTPCompletionsArm(Arm):
    """Client arm for an OpenAI-compatible ``POST /v1/completions`` endpoint with ``stream: true``.

    Designed for ``transformers serve --continuous-batching`` (5.24), and usable with any server
    speaking the legacy Completions API (SGLang, vLLM). One thread per request, no concurrency cap.

    What HTTP gives and does not give (record rows are the same shape as the in-process arm's):

    * the request carries ``prompt`` as *text* when ``detokenize`` is given: transformers' handler
      rejects non-string prompts and re-tokenizes, so ``input_ids`` are turned into text by
      ``detokenize`` and the server's prompt token count (``usage.prompt_tokens``) is recorded; it may
      differ from ``len(input_ids)`` (e.g. a BOS the server adds, vSkipper App. E.1). With
      ``detokenize=None`` the prompt is sent as the token-id list itself (the OpenAI API's
      ``prompt: list[int]``, which SGLang, vLLM and the project's server accept), so the engine sees
      exactly ``input_ids``;
    * token times are the client's receive times of the streamed text chunks
      (``timestamp_source="chunk"``): one per chunk, and a chunk may carry several tokens or none
      (the EOS has no text); the output token count comes from the final chunk's
      ``usage.completion_tokens``, the finish time is the receive time of the final chunk;
    * ``ignore_eos``: transformers' schema rejects unknown fields (HTTP 422 on ``ignore_eos``),
      but its handler accepts a ``generation_config`` JSON string, and its continuous-batching path
      passes that config's ``eos_token_id`` to ``add_request``, where -1 disables stopping. With
      ``ignore_eos_via="generation_config"`` (default) the request sends
      ``generation_config = {"eos_token_id": -1, "do_sample": false, "max_new_tokens": n}``;
      with ``"field"`` it sends ``"ignore_eos": true`` (SGLang / vLLM); with None the arm refuses
      ignore-EOS requests (``NotImplementedError``). The generation-config route follows the
      5.24 server source and is tested here against a stand-in server only (``fastapi`` is not
      installed in this environment, so ``transformers serve`` cannot start): check it against a
      real server before relying on matched-work replay over HTTP;
    * a stream whose ``finish_reason`` is ``"abort"`` (SGLang's and vLLM's mark of a request the server
      aborted, sent without an ``error`` field) is a failed request (``error`` set), never a short
      completion.

    Args:
        base_url: server root, e.g. ``"http://127.0.0.1:8000"``.
        model: the ``model`` field of every request.
        detokenize: callable turning prompt token ids into the prompt text (e.g.
            ``lambda ids: tokenizer.decode(ids)``), or None to send the token ids.
        name: arm name used in result rows.
        ignore_eos_via: ``"generation_config"``, ``"field"`` or None (see above).
        request_timeout_s: socket timeout of each request, seconds.
        extra_body: fields merged into every request body (e.g. ``{"seed": 0}``).
        include_usage: ask for the final usage chunk (``stream_options.include_usage``, the OpenAI API;
            the project's server, vLLM and SGLang honour it). Off by default: ``transformers serve``
            refuses unknown fields with a 422. Without it the output token count is the number of
            streamed chunks and the prompt token count is unknown (None).
        send_rid: put the request id in the body as ``rid`` (SGLang's request id, which its scheduler
            and a server-side model see; request-hash skip policies hash it). Off by default: the
            OpenAI API has no such field.
    """

    def __init__(self, base_url: str, model: str, *, detokenize: Callable[[list[int]], str] | None,
                 name: str = "http",
                 ignore_eos_via: str | None = "generation_config", request_timeout_s: float = 600.0,
                 extra_body: Mapping[str, Any] | None = None, include_usage: bool = False,
                 send_rid: bool = False):
        if ignore_eos_via not in ("generation_config", "field", None):
            raise ValueError(f"ignore_eos_via must be 'generation_config', 'field' or None, got {ignore_eos_via!r}")
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.detokenize = detokenize
        self.name = str(name)
        self.clock = RealClock()
        self.ignore_eos_via = ignore_eos_via
        self.supports_ignore_eos = ignore_eos_via is not None
        self.request_timeout_s = float(request_timeout_s)
        self.extra_body = dict(extra_body or {})
        self.include_usage = bool(include_usage)
        self.send_rid = bool(send_rid)
        self._cond = threading.Condition()
        self._traces: dict[str, Trace] = {}
        self._threads: list[threading.Thread] = []
        self._started = False

    def start(self, hint: WorkloadHint | None = None) -> None:
        """Reset the client state (the server is started and warmed up outside this arm)."""
        with self._cond:
            self._traces = {}
        self._threads = []
        self._started = True

    def stop(self) -> None:
        """Join the request threads (each bounded by ``request_timeout_s``)."""
        for t in self._threads:
            t.join(timeout=self.request_timeout_s)
        self._threads = []
        self._started = False

    def body(self, input_ids: Sequence[int], max_new_tokens: int, ignore_eos: bool) -> dict[str, Any]:
        """The JSON body sent for one request (greedy, streaming, with usage in the final chunk).

        Raises:
            NotImplementedError: for ``ignore_eos`` when ``ignore_eos_via`` is None.
        """
        n = int(max_new_tokens)
        ids = [int(t) for t in input_ids]
        body: dict[str, Any] = {"model": self.model, "prompt": ids if self.detokenize is None else self.detokenize(ids),
                                "max_tokens": n, "temperature": 0.0, "stream": True}
        if self.include_usage:
            body["stream_options"] = {"include_usage": True}
        if ignore_eos:
            if self.ignore_eos_via is None:
                raise NotImplementedError(
                    f"arm {self.name!r}: ignore_eos over HTTP is not supported with ignore_eos_via=None "
                    "(transformers serve rejects an 'ignore_eos' field with HTTP 422)")
            if self.ignore_eos_via == "field":
                body["ignore_eos"] = True
            else:
                body["generation_config"] = json.dumps({"eos_token_id": -1, "do_sample": False, "max_new_tokens": n})
        body.update(self.extra_body)
        return body

    def submit(self, request_id: str, input_ids: Sequence[int], max_new_tokens: int, ignore_eos: bool) -> None:
        """Start one streaming request in its own thread and return.

        Raises:
            RuntimeError: if not started; ValueError: for a duplicated id or ``max_new_tokens < 1``;
            NotImplementedError: see :meth:`body`.
        """
        if not self._started:
            raise RuntimeError(f"arm {self.name!r} is not started")
        if int(max_new_tokens) < 1:
            raise ValueError(f"request {request_id!r}: max_new_tokens must be >= 1")
        body = self.body(input_ids, max_new_tokens, ignore_eos)
        rid = str(request_id)
        if self.send_rid:
            body["rid"] = rid
        with self._cond:
            if rid in self._traces:
                raise ValueError(f"duplicate request id {rid!r}")
            self._traces[rid] = Trace(rid, max_new_tokens=int(max_new_tokens), timestamp_source="chunk")
        t = threading.Thread(target=self._run, args=(rid, body), daemon=True)
        self._threads.append(t)
        t.start()

    def _run(self, rid: str, body: dict) -> None:
        tr = Trace(rid, max_new_tokens=body["max_tokens"], timestamp_source="chunk")
        text: list[str] = []
        usage = None
        try:
            req = urllib.request.Request(f"{self.base_url}/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json", "X-Request-ID": rid},
                                         method="POST")
            with urllib.request.urlopen(req, timeout=self.request_timeout_s) as resp:
                for raw in resp:
                    now = self.clock.now()
                    line = raw.decode("utf-8", "replace").strip()
                    if not line.startswith("data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == "[DONE]":
                        break
                    obj = json.loads(payload)
                    if "error" in obj:
                        tr.error = str(obj["error"])
                        break
                    for ch in obj.get("choices") or []:
                        piece = ch.get("text") or ""
                        if piece:
                            text.append(piece)
                            tr.token_times.append(now)
                        if ch.get("finish_reason"):
                            tr.finish_reason = ch["finish_reason"]
                            tr.finish_time = now
                    if obj.get("usage"):
                        usage = obj["usage"]
                        tr.finish_time = now
            if tr.error is None and tr.finish_reason == "abort":
                # SGLang (and vLLM) end a request the server aborted with finish_reason "abort" and no error
                # field: its tokens are not a completion, so the request failed
                tr.error = "the server aborted the request (finish_reason 'abort')"
            if tr.error is None:
                if tr.finish_time is None:
                    tr.finish_time = self.clock.now()
                tr.output_tokens = int(usage["completion_tokens"]) if usage else len(tr.token_times)
                tr.prompt_tokens = int(usage["prompt_tokens"]) if usage and "prompt_tokens" in usage else None
        except urllib.error.HTTPError as e:
            detail = e.read().decode("utf-8", "replace")[:500]
            tr.error = f"HTTP {e.code}: {detail}"
        except Exception as e:  # connection errors, malformed stream
            tr.error = f"{type(e).__name__}: {e}"
        tr.output_text = "".join(text)
        if tr.error is not None:
            tr.finish_time = None
        tr.done = True
        with self._cond:
            self._traces[rid] = tr
            self._cond.notify_all()

    def wait(self, request_ids: Sequence[str], timeout_s: float) -> dict[str, Trace]:
        """Block until the listed requests' streams ended (or ``timeout_s`` passed); copies of the
        traces, unfinished ones with an error.

        Raises:
            KeyError: for an id never submitted.
        """
        ids = [str(r) for r in request_ids]
        with self._cond:
            missing = [r for r in ids if r not in self._traces]
            if missing:
                raise KeyError(f"never submitted to arm {self.name!r}: {missing[:10]}")
            self._cond.wait_for(lambda: all(self._traces[r].done for r in ids), timeout=timeout_s)
            out = {}
            for r in ids:
                tr = copy.deepcopy(self._traces[r])
                if not tr.done:
                    tr.error = f"not finished within {timeout_s:.1f} s"
                out[r] = tr
            return out

    def describe(self) -> dict[str, Any]:
        """Declared settings: endpoint, model, ignore-EOS route, extra body fields."""
        return {"arm": self.name, "kind": type(self).__name__, "endpoint": f"{self.base_url}/v1/completions",
                "model": self.model, "ignore_eos_via": self.ignore_eos_via, "extra_body": simple(self.extra_body),
                "prompt_as": "token_ids" if self.detokenize is None else "text"}
