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

* :class:`ContinuousBatchingArm` - in process, over transformers' continuous-batching manager
  (``model.init_continuous_batching``), optionally in vSkipper's dense or routed mode;
* :class:`HTTPCompletionsArm` - a client of an OpenAI-compatible ``/v1/completions`` endpoint with
  streaming (e.g. ``transformers serve --continuous-batching``), see its docstring for what HTTP
  cannot give;
* :class:`impl.serving.fake.FakeArm` - a deterministic queueing model on a virtual clock (tests).

How the in-process arm gets per-token times from transformers 5.24
-------------------------------------------------------------------
``manager.add_request(..., streaming=True, record_timestamps=True)``: the engine's generation
thread appends ``time.perf_counter()`` to the request's ``_timestamps`` when it appends each
generated token (``RequestState.update_and_check_completion``, called from
``ContinuousBatchProcessor.update_batch`` after the batch's outputs reached the host - a blocking
copy in synchronous batching, so on a GPU the stamp follows the device sync), the first token
included (the scheduler sets DECODING before the batch that ends the prefill). With ``streaming``
every update is delivered as a ``GenerationOutput`` (``generated_tokens``, ``timestamps``,
``status``, ``error``, ``lifespan``) on the manager's output queue, which this arm drains in a
consumer thread (``manager.get_result``). The engine stamps are used as the token times; they are
on the same ``perf_counter`` clock as the arrival stamps. A soft reset (the engine re-queues a
request whose cache it evicted, ``create_equivalent_initial_request``) restarts the timestamp list,
so when the stamps do not cover every token the arm falls back to stamping the new tokens of each
streamed update with that update's latest engine stamp (``timestamp_source = "stream"``).
EOS: ``add_request(eos_token_id=-1)`` disables stopping (``RequestState`` keeps only
non-negative ids; ``None`` would fall back to the generation config's EOS), so ignore-EOS requests
generate exactly ``max_new_tokens`` tokens; a natural request stops at its EOS, which is counted as
an output token (it is in ``generated_tokens``).
"""

from __future__ import annotations

import abc
import copy
import dataclasses
import gc
import json
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
    "ContinuousBatchingArm",
    "HTTPCompletionsArm",
]


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
    """What an arm may size its engine for (same for every arm of a cell).

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


def _resolve_eos(model, eos_token_id) -> int | list[int]:
    if eos_token_id != "model":
        return -1 if eos_token_id is None else eos_token_id
    for cfg in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        eos = getattr(cfg, "eos_token_id", None) if cfg is not None else None
        if eos is not None:
            return eos
    return -1


def _simple(value: Any) -> Any:
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_simple(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _simple(v) for k, v in value.items()}
    return repr(value)


class ContinuousBatchingArm(Arm):
    """In-process arm over transformers' continuous-batching manager (module docstring).

    Every :meth:`start` creates a fresh manager (``model.init_continuous_batching``) with greedy
    decoding and the given engine configuration, starts its generation thread and a consumer thread,
    and runs ``warmup_requests`` short requests to completion before returning; :meth:`stop` stops
    and destroys the manager. Token times are the engine's ``perf_counter`` stamps.

    Args:
        model: a causal LM supporting ``init_continuous_batching``.
        name: arm name used in result rows.
        cb_config: a ``ContinuousBatchingConfig`` (copied per start; default: transformers' defaults).
            Give every arm of a comparison the same one (vSkipper: ``impl.vskipper.routed_cb_config``).
        eos_token_id: the natural lane's stop token(s): ``"model"`` (default: the model's generation
            config, else its config), an int / list of ints, or None (no EOS).
        mode: None (run the model as it is), ``"dense"`` (a bound model with every routed layer dense,
            i.e. upstream on the same engine) or ``"routed"`` (the skipper decides per row); needs
            ``binding``.
        binding: with ``mode``, the engine binding of the bound model (vSkipper:
            ``impl.vskipper.routed_context(model)``): an object with a ``dense_mode(flag)`` context
            manager, a ``planner`` attribute (the per-batch planner, or None) and ``clear()`` (drop
            per-run state). This module imports no method package: the method hands its binding in.
        planner: with ``mode="routed"``, an optional per-batch mode planner (e.g.
            :class:`impl.vskipper.mode.ModeController`) installed for the arm's lifetime. Its state
            carries over from run to run: a :class:`~impl.vskipper.mode.ModeController` keys its
            decisions by request id, and the ids repeat across repetitions, so use
            ``planner_factory`` for the mode switch.
        planner_factory: with ``mode="routed"``, a zero-argument callable returning a fresh planner;
            called at every :meth:`start` *after* the warm-up (the warm-up runs with every row routed),
            so each run starts with a fresh mode switch. The run's planner is ``self.planner`` until the
            next start, and :meth:`describe` records its ``summary()`` when it has one.
        streaming: deliver every token (default True; needed for exact times after a soft reset).
        warmup_requests: requests run to completion inside :meth:`start` (default 1; 0 disables).
        warmup_prompt: prompt token ids of the warm-up requests.
        warmup_new_tokens: tokens each warm-up request generates.
        stop_timeout_s: how long :meth:`stop` waits for the generation thread.
        freeze_gc: after the warm-up, run a full garbage collection and ``gc.freeze()`` until
            :meth:`stop` (default True), so that no full collection of the large heap a
            torch/transformers process holds (~0.4 s here) stalls the engine thread mid-run.

    Raises:
        ValueError: for an unknown ``mode``, or ``mode`` set without a ``binding``.
    """

    def __init__(self, model, name: str = "upstream", *, cb_config=None, eos_token_id: Any = "model",
                 mode: str | None = None, binding=None, planner=None, planner_factory=None, streaming: bool = True,
                 warmup_requests: int = 1,
                 warmup_prompt: Sequence[int] = (1, 2, 3, 4), warmup_new_tokens: int = 2,
                 stop_timeout_s: float = 60.0, freeze_gc: bool = True):
        if mode not in (None, "dense", "routed"):
            raise ValueError(f"mode must be None, 'dense' or 'routed', got {mode!r}")
        if (planner is not None or planner_factory is not None) and mode != "routed":
            raise ValueError("a mode planner needs mode='routed'")
        if planner is not None and planner_factory is not None:
            raise ValueError("pass planner or planner_factory, not both")
        self.model = model
        self.name = str(name)
        self.clock = RealClock()
        self.cb_config = cb_config
        self.eos_token_id = _resolve_eos(model, eos_token_id)
        self.mode = mode
        self.planner = planner
        self.planner_factory = planner_factory
        self.streaming = bool(streaming)
        self.warmup_requests = int(warmup_requests)
        self.warmup_prompt = [int(t) for t in warmup_prompt]
        self.warmup_new_tokens = int(warmup_new_tokens)
        self.stop_timeout_s = float(stop_timeout_s)
        self.freeze_gc = bool(freeze_gc)
        self._frozen = False
        if mode is not None and binding is None:
            raise ValueError(f"mode={mode!r} needs binding= (the bound model's engine binding, e.g. "
                             "impl.vskipper.routed_context(model))")
        self.binding = binding
        self._manager = None
        self._consumer: threading.Thread | None = None
        self._cond = threading.Condition()
        self._traces: dict[str, Trace] = {}
        self._stopping = threading.Event()
        self._dead: str | None = None
        self._mode_cm = None
        self._prev_planner = None
        self._settings: dict[str, Any] = {}
        self._runs = 0

    # ----------------------------------------------------------------------------------- lifecycle
    def _enter_mode(self) -> None:
        if self.mode is None:
            return
        ctx = self.binding
        self._mode_cm = ctx.dense_mode(self.mode == "dense")
        self._mode_cm.__enter__()
        if self.planner_factory is not None:  # the run's planner is installed after the warm-up
            self._prev_planner, ctx.planner = ctx.planner, None
        elif self.planner is not None:
            self._prev_planner, ctx.planner = ctx.planner, self.planner

    def _exit_mode(self) -> None:
        if self._mode_cm is None:
            return
        ctx = self.binding
        if self.planner is not None or self.planner_factory is not None:
            ctx.planner = self._prev_planner
        self._mode_cm.__exit__(None, None, None)
        self._mode_cm = None
        ctx.clear()

    def start(self, hint: WorkloadHint | None = None) -> None:
        """Create and start a fresh manager, then run the warm-up requests (excluded from timing).

        Args:
            hint: sizes passed to the engine as ``WorkloadHints`` (same for every arm of a cell).

        Raises:
            RuntimeError: if the arm is already started or a warm-up request fails.
            ValueError: if the engine refuses the configuration (e.g. routed mode with async batching).
        """
        if self._manager is not None:
            raise RuntimeError(f"arm {self.name!r} is already started")
        from transformers import GenerationConfig
        from transformers.generation.continuous_batching.utils import WorkloadHints

        from transformers import ContinuousBatchingConfig

        max_new = hint.max_new_tokens if hint is not None else 16
        gen_cfg = GenerationConfig(do_sample=False, max_new_tokens=max(1, max_new, self.warmup_new_tokens),
                                   eos_token_id=self.eos_token_id)
        cb = ContinuousBatchingConfig() if self.cb_config is None else copy.deepcopy(self.cb_config)
        hints = None
        if hint is not None:
            hints = WorkloadHints(max_prompt_length=max(hint.max_prompt_tokens, len(self.warmup_prompt)),
                                  max_generated_length=max(hint.max_new_tokens, self.warmup_new_tokens),
                                  num_requests=hint.num_requests)
        self._enter_mode()
        try:
            with self._cond:
                self._traces = {}
                self._dead = None
            self._stopping.clear()
            self._manager = self.model.init_continuous_batching(
                generation_config=gen_cfg, continuous_batching_config=cb, workload_hints=hints)
            self._manager.start()
            self._consumer = threading.Thread(target=self._consume, name=f"serving-arm-{self.name}", daemon=True)
            self._consumer.start()
            self._runs += 1
            warm = [f"__warmup_{self._runs}_{i}__" for i in range(self.warmup_requests)]
            for rid in warm:
                self.submit(rid, self.warmup_prompt, self.warmup_new_tokens, ignore_eos=True)
            if warm:
                traces = self.wait(warm, timeout_s=max(60.0, self.stop_timeout_s))
                bad = {r: t.error for r, t in traces.items() if t.error is not None}
                if bad:
                    raise RuntimeError(f"arm {self.name!r}: warm-up failed: {bad}")
                with self._cond:
                    for rid in warm:
                        self._traces.pop(rid, None)
            if self.planner_factory is not None:  # a fresh planner per run, installed after the warm-up
                self.planner = self.planner_factory()
                self.binding.planner = self.planner
            resolved = self._manager.continuous_batching_config
            self._settings = {f.name: _simple(getattr(resolved, f.name)) for f in dataclasses.fields(resolved)}
            if self.freeze_gc:
                gc.collect()
                gc.freeze()
                self._frozen = True
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Stop the manager (hard stop if requests are still pending), destroy it, join the consumer
        thread and leave the vSkipper mode. Safe to call twice or when never started."""
        mgr = self._manager
        if mgr is None:
            self._exit_mode()
            return
        with self._cond:
            pending = any(not t.done for t in self._traces.values())
        try:
            if mgr.is_running():
                mgr.stop(block=True, timeout=self.stop_timeout_s, hard_stop=pending)
        finally:
            try:
                mgr.destroy()
            finally:
                self._stopping.set()
                if self._consumer is not None:
                    self._consumer.join(timeout=10)
                self._consumer = None
                self._manager = None
                if self._frozen:
                    gc.unfreeze()
                    self._frozen = False
                self._exit_mode()

    # ------------------------------------------------------------------------------------ requests
    def submit(self, request_id: str, input_ids: Sequence[int], max_new_tokens: int, ignore_eos: bool) -> None:
        """Queue one request in the engine (``add_request`` with streaming and timestamps).

        Raises:
            RuntimeError: if the arm is not started.
            ValueError: for a duplicated id, an empty prompt, ``max_new_tokens < 1``, or a prompt plus
                ``max_new_tokens`` longer than the model's context (``max_position_embeddings``; the HTTP
                server refuses the same request with a 400).
        """
        mgr = self._manager
        if mgr is None:
            raise RuntimeError(f"arm {self.name!r} is not started")
        ids = [int(t) for t in input_ids]
        if not ids:
            raise ValueError(f"request {request_id!r}: empty prompt")
        n = int(max_new_tokens)
        if n < 1:
            raise ValueError(f"request {request_id!r}: max_new_tokens must be >= 1, got {max_new_tokens!r}")
        cfg = self.model.config.get_text_config() if hasattr(self.model.config, "get_text_config") else self.model.config
        ctx = getattr(cfg, "max_position_embeddings", None)
        if ctx and len(ids) + n > int(ctx):
            raise ValueError(f"request {request_id!r}: prompt ({len(ids)} tokens) + max_new_tokens ({n}) exceeds the "
                             f"model's context length {ctx}")
        rid = str(request_id)
        with self._cond:
            if rid in self._traces:
                raise ValueError(f"duplicate request id {rid!r}")
            self._traces[rid] = Trace(rid, prompt_tokens=len(ids), max_new_tokens=n)
        eos = -1 if ignore_eos else self.eos_token_id
        got = mgr.add_request(ids, request_id=rid, max_new_tokens=n, streaming=self.streaming,
                              record_timestamps=True, eos_token_id=eos)
        if got is None:
            self._finish_error(rid, "the engine refused the request (manager stopping or not a TP driver)")

    def _finish_error(self, rid: str, msg: str) -> None:
        with self._cond:
            tr = self._traces[rid]
            if not tr.done:
                tr.error, tr.done = msg, True
            self._cond.notify_all()

    def _consume(self) -> None:
        mgr = self._manager
        while True:
            out = mgr.get_result(timeout=0.05)
            if out is not None:
                self._on_output(out, time.perf_counter())
                continue
            if self._stopping.is_set() and mgr.output_router.output_queue.empty():
                return
            if not mgr.is_running() and mgr.output_router.output_queue.empty():
                fatal = mgr.background_thread_status.fatal_error
                with self._cond:
                    self._dead = f"generation thread stopped ({fatal!r})" if fatal is not None else "generation thread stopped"
                    self._cond.notify_all()
                if self._stopping.wait(0.05):
                    return

    def _on_output(self, out, recv: float) -> None:
        with self._cond:
            tr = self._traces.get(out.request_id)
            if tr is None or tr.done:
                return
            ids = [int(t) for t in out.generated_tokens]
            stamps = out.timestamps
            if stamps is not None and len(stamps) == len(ids):
                tr.token_times = [float(s) for s in stamps]
                tr.timestamp_source = "engine"
            else:
                new = len(ids) - len(tr.token_times)
                if new > 0:
                    stamp = float(stamps[-1]) if stamps else recv
                    tr.token_times.extend([stamp] * new)
                tr.timestamp_source = "stream"
            tr.token_ids = ids
            tr.output_tokens = len(ids)
            if out.is_finished():
                tr.done = True
                tr.error = out.error
                tr.prompt_tokens = len(out.prompt_ids) if out.prompt_ids is not None else tr.prompt_tokens
                if out.error is None:
                    tr.finish_time = tr.token_times[-1] if tr.token_times else (
                        float(out.lifespan[1]) if out.lifespan[1] > 0 else recv)
                    tr.finish_reason = "length" if len(ids) >= (tr.max_new_tokens or 0) else "stop"
                self._cond.notify_all()

    def wait(self, request_ids: Sequence[str], timeout_s: float) -> dict[str, Trace]:
        """Block until every listed request finished or failed (or ``timeout_s`` seconds passed, or
        the generation thread died). Returns copies of the traces; unfinished ones get an error.

        Raises:
            KeyError: for an id that was never submitted.
        """
        ids = [str(r) for r in request_ids]
        with self._cond:
            missing = [r for r in ids if r not in self._traces]
            if missing:
                raise KeyError(f"never submitted to arm {self.name!r}: {missing[:10]}")
            self._cond.wait_for(lambda: self._dead is not None or all(self._traces[r].done for r in ids),
                                timeout=timeout_s)
            out = {}
            for r in ids:
                tr = copy.deepcopy(self._traces[r])
                if not tr.done:
                    tr.error = self._dead or f"not finished within {timeout_s:.1f} s"
                out[r] = tr
            return out

    def describe(self) -> dict[str, Any]:
        """Declared settings: arm name, mode, EOS, streaming, the engine's resolved
        ``ContinuousBatchingConfig`` fields (after the last :meth:`start`) and, when the run's planner
        has a ``summary()`` (the mode switch), its ``planner_summary`` (decisions and row counts of the
        last run)."""
        return {"arm": self.name, "kind": type(self).__name__, "mode": self.mode,
                "planner": None if self.planner is None else type(self.planner).__name__,
                **({"planner_summary": _simple(self.planner.summary())}
                   if callable(getattr(self.planner, "summary", None)) else {}),
                "eos_token_id": _simple(self.eos_token_id), "streaming": self.streaming,
                "warmup_requests": self.warmup_requests, "freeze_gc": self.freeze_gc,
                "cb_config": dict(self._settings)}


class HTTPCompletionsArm(Arm):
    """Client arm for an OpenAI-compatible ``POST /v1/completions`` endpoint with ``stream: true``.

    Designed for ``transformers serve --continuous-batching`` (5.24), and usable with any server
    speaking the legacy Completions API (SGLang, vLLM). One thread per request, no concurrency cap.

    What HTTP gives and does not give (record rows are the same shape as the in-process arm's):

    * the request carries ``prompt`` as *text*: transformers' handler rejects non-string prompts
      and re-tokenizes, so ``input_ids`` are turned into text by ``detokenize`` and the server's
      prompt token count (``usage.prompt_tokens``) is recorded; it may differ from
      ``len(input_ids)`` (e.g. a BOS the server adds, vSkipper App. E.1);
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
      real server before relying on matched-work replay over HTTP.

    Args:
        base_url: server root, e.g. ``"http://127.0.0.1:8000"``.
        model: the ``model`` field of every request.
        detokenize: callable turning prompt token ids into the prompt text (e.g.
            ``lambda ids: tokenizer.decode(ids)``).
        name: arm name used in result rows.
        ignore_eos_via: ``"generation_config"``, ``"field"`` or None (see above).
        request_timeout_s: socket timeout of each request, seconds.
        extra_body: fields merged into every request body (e.g. ``{"seed": 0}``).
        include_usage: ask for the final usage chunk (``stream_options.include_usage``, the OpenAI API;
            the project's server, vLLM and SGLang honour it). Off by default: ``transformers serve``
            refuses unknown fields with a 422. Without it the output token count is the number of
            streamed chunks and the prompt token count is unknown (None).
    """

    def __init__(self, base_url: str, model: str, *, detokenize: Callable[[list[int]], str], name: str = "http",
                 ignore_eos_via: str | None = "generation_config", request_timeout_s: float = 600.0,
                 extra_body: Mapping[str, Any] | None = None, include_usage: bool = False):
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
        body: dict[str, Any] = {"model": self.model, "prompt": self.detokenize([int(t) for t in input_ids]),
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
                "model": self.model, "ignore_eos_via": self.ignore_eos_via, "extra_body": _simple(self.extra_body)}
