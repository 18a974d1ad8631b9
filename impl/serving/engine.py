"""The engine driver: ONE driver of transformers' continuous-batching manager, shared by every engine
arm of the harness, in process (:class:`impl.serving.arms.ContinuousBatchingArm`) and over HTTP (the
vSkipper server's :class:`impl.vskipper.driver.CompletionEngine`).

The driver owns the manager's life cycle and the path of every request through it:

``start(hint, after_warmup)``
    create a fresh manager (``model.init_continuous_batching``) with greedy decoding, start its
    generation thread and a dispatcher thread, run the warm-up requests to completion (excluded from
    every measurement and counter), call ``after_warmup`` (e.g. install a per-run planner), record the
    engine's resolved ``ContinuousBatchingConfig`` and freeze the garbage collector;
``submit(prompt_ids, max_new_tokens, ...)``
    add one request (``streaming=True, record_timestamps=True``) and return its :class:`LiveRequest`;
``events(live)`` / ``aevents(live)`` / ``sink=``
    the request's tokens as the engine appends them: read by a thread (a thread queue), by an asyncio
    event loop (an asyncio queue on that loop; the HTTP server) or pushed to a callback (the in-process
    arm, which keeps a :class:`~impl.serving.arms.Trace` per request);
``cancel(live)``, ``stop(grace_s)``
    cancel one request (its id stays reserved until the engine dropped it); stop the engine (in-flight
    requests may finish for ``grace_s`` seconds, then a hard stop fails what is left).

How token times come from transformers 5.24: with ``record_timestamps=True`` the engine's generation
thread appends ``time.perf_counter()`` to the request's ``_timestamps`` when it appends each generated
token (``RequestState.update_and_check_completion``, called from ``ContinuousBatchProcessor.update_batch``
after the batch's outputs reached the host), the first token included; every streamed
``GenerationOutput`` carries them (``timestamps``). A soft reset (the engine re-queues a request whose
cache it evicted) restarts that list; readers that need a time for every token fall back to the
latest stamp of each update (see the in-process arm).

EOS: ``add_request(eos_token_id=-1)`` disables stopping (``RequestState`` keeps only non-negative
ids; ``None`` would fall back to the generation config's EOS), so an ignore-EOS request generates exactly
``max_new_tokens`` tokens; a natural request stops at its EOS, which is counted as an output token.

**Top-k log-probabilities** (``logprobs=True``). The engine only returns the chosen token's
log-probability (and only when the whole manager runs with ``return_logprobs``). For requests that ask
for ``top_logprobs``, the driver wraps the batch processor's sampling step (``model_runner._sample``, on
the instance only): after the engine sampled, it takes ``log_softmax`` of the rows of those requests
and records the chosen token's log-probability and the top k, keyed by request and completion index.
Batches without such requests pay one dictionary check. The values come from the same fp32 scores
the engine sampled from (for greedy the top-1 is the emitted token).

This module imports no paper package: a method binds itself to the model before :meth:`start` and
hooks into a request's end through :meth:`EngineDriver.on_finished` / :meth:`EngineDriver.on_released`
(the vSkipper server records each request's routing modes there).
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import gc
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Iterator, NoReturn, Sequence

import torch
from transformers import ContinuousBatchingConfig, GenerationConfig
from transformers.generation.continuous_batching.utils import WorkloadHints

from .arms import WorkloadHint, simple

__all__ = ["EngineDriver", "EngineError", "Failure", "LiveRequest", "TokenEvent", "resolve_eos", "retry_resized", "simple"]

logger = logging.getLogger(__name__)

_GC_LOCK = threading.Lock()
_GC_FREEZES = [0]  # drivers holding gc.freeze() in this process (unfreeze when the last one stops)


def _gc_freeze() -> None:
    with _GC_LOCK:
        gc.collect()
        gc.freeze()
        _GC_FREEZES[0] += 1


def _gc_unfreeze() -> None:
    with _GC_LOCK:
        _GC_FREEZES[0] = max(0, _GC_FREEZES[0] - 1)
        if _GC_FREEZES[0] == 0:
            gc.unfreeze()


def resolve_eos(model, eos_token_id: Any) -> int | list[int]:
    """The natural stop token(s) of an engine arm.

    Args:
        model: the causal LM.
        eos_token_id: ``"model"`` (the model's generation config, else its config), an int / list of
            ints, or None (no EOS).

    Returns:
        An id, a list of ids, or -1 (never stop on a token).
    """
    if eos_token_id != "model":
        return -1 if eos_token_id is None else eos_token_id
    for cfg in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        eos = getattr(cfg, "eos_token_id", None) if cfg is not None else None
        if eos is not None:
            return eos
    return -1


class EngineError(RuntimeError):
    """A request could not be served by the engine. ``status`` is the HTTP status to answer with and
    ``kind`` the OpenAI error type."""

    def __init__(self, message: str, status: int = 500, kind: str = "server_error"):
        super().__init__(message)
        self.status = int(status)
        self.kind = kind


class Failure:
    """What a request receives instead of an engine output when the engine failed or stopped."""

    def __init__(self, message: str, status: int = 500):
        self.message, self.status = message, status


class _LogprobTap:
    """Records the chosen token's log-probability and the top k per generated token, for the requests
    that asked (module docstring). Written by the engine thread, read by the request threads."""

    def __init__(self):
        self.want: dict[str, int] = {}
        self.store: dict[str, dict[int, tuple[float, list[tuple[int, float]]]]] = {}

    def install(self, bp) -> None:
        runner = bp.model_runner
        if getattr(runner, "_logprob_tap", False):
            return
        original = runner._sample
        ios = bp.inputs_and_outputs

        def _sample(scores, output_ids):
            original(scores, output_ids)
            if self.want:
                try:
                    self._record(ios.requests_in_batch, scores, output_ids)
                except Exception:  # never take the engine down for a logprob record
                    logger.exception("top-logprob record failed")

        runner._sample = _sample
        runner._logprob_tap = True

    def forget(self, rid: str) -> None:
        self.want.pop(rid, None)
        self.store.pop(rid, None)

    @torch.no_grad()
    def _record(self, requests_in_batch, scores: torch.Tensor, output_ids: torch.Tensor) -> None:
        """``scores``: [1, rows, V] float logits of the batch's sampled rows; ``output_ids``: [1, rows]."""
        rows, states, ks = [], [], []
        i = 0
        for fs in requests_in_batch:
            if not fs.has_new_token:
                continue
            k = self.want.get(fs.state.request_id)
            if k is not None:
                rows.append(i)
                states.append(fs.state)
                ks.append(k)
            i += 1
        if not rows:
            return
        idx = torch.tensor(rows, device=scores.device)
        lp = torch.log_softmax(scores[0].index_select(0, idx).float(), dim=-1)  # [n, V]
        chosen = output_ids[0].index_select(0, idx.to(output_ids.device)).long().to(lp.device)  # [n]
        ch = lp.gather(1, chosen[:, None]).squeeze(1).tolist()
        kmax = max(ks)
        if kmax > 0:
            top_v, top_i = lp.topk(min(kmax, lp.shape[-1]), dim=-1)
            top_v, top_i = top_v.tolist(), top_i.tolist()
        for n, (st, k) in enumerate(zip(states, ks)):
            prompt_len = st._true_initial_tokens or len(st.initial_tokens)
            j = len(st.initial_tokens) - prompt_len + st.generated_len()
            top = [(int(a), float(b)) for a, b in zip(top_i[n][:k], top_v[n][:k])] if k > 0 else []
            slot = self.store.get(st.request_id)
            if slot is not None:
                slot[j] = (float(ch[n]), top)


@dataclass
class LiveRequest:
    """One request in flight (the engine side).

    Attributes:
        rid: the engine request id.
        prompt_ids: prompt token ids.
        max_new: generation cap, tokens.
        eos: the ids it stops on (empty: ignore EOS).
        top_k: None, or the number of top log-probabilities recorded per token.
        warmup: True for the driver's own warm-up requests (kept out of every counter).
        info: what hooks record about the request when it ends (e.g. vSkipper's routing modes).
    """

    rid: str
    prompt_ids: list[int]
    max_new: int
    eos: set
    top_k: int | None
    warmup: bool = False
    queue: "queue.Queue" = field(default_factory=queue.Queue)
    logprobs: dict = field(default_factory=dict)
    cancelled: bool = False
    info: dict | None = None
    loop: "asyncio.AbstractEventLoop | None" = None
    aqueue: "asyncio.Queue | None" = None
    sink: "Callable[[Any], None] | None" = None

    def put(self, item) -> None:
        """Deliver an engine output (or a :class:`Failure`) to the request: its callback, its thread
        queue, or its asyncio queue on the event loop that submitted it (thread-safe)."""
        if self.sink is not None:
            self.sink(item)
            return
        if self.loop is None:
            self.queue.put(item)
            return
        try:
            self.loop.call_soon_threadsafe(self.aqueue.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass


@dataclass
class TokenEvent:
    """One generated token as a reader sees it.

    Attributes:
        index: position in the completion (0-based).
        token_id: the token.
        time: the engine's ``perf_counter`` stamp of the token (seconds), None when unknown.
        logprob: its log-probability (None unless the request asked for logprobs).
        top: the top-k ``(id, logprob)`` pairs (None unless asked).
        final: True for the last token the engine will produce for the request.
        finish_reason: for the final token, ``"stop"`` (EOS) or ``"length"``.
    """

    index: int
    token_id: int
    time: float | None = None
    logprob: float | None = None
    top: list | None = None
    final: bool = False
    finish_reason: str | None = None


def retry_resized(fn: Callable[[], Any], attempts: int = 5) -> Any:
    """Call ``fn`` again when another thread resized a dict it iterates (``RuntimeError: dictionary
    changed size during iteration``); other errors propagate."""
    for i in range(attempts):
        try:
            return fn()
        except RuntimeError as exc:
            if "changed size" not in str(exc) or i == attempts - 1:
                raise
            time.sleep(0.001)


class EngineDriver:
    """One continuous-batching manager fed by many requests (module docstring).

    Args:
        model: a causal LM supporting ``init_continuous_batching``, bound as the arm needs it.
        name: the arm's name (thread names, error messages).
        cb_config: a ``ContinuousBatchingConfig`` (copied at every start; default: transformers'
            defaults).
        eos_token_id: the natural stop token(s), as :func:`resolve_eos` takes them.
        logprobs: install the top-k log-probability tap (module docstring).
        warmup_requests: warm-up requests run to completion inside :meth:`start` (0 disables).
        warmup_prompt: their prompt token ids (cut to the vocabulary).
        warmup_new_tokens: tokens each warm-up request generates.
        stop_timeout_s: how long :meth:`stop` waits for the generation thread, seconds.
        freeze_gc: after the warm-up, ``gc.collect(); gc.freeze()`` until :meth:`stop`, so that no full
            collection of the large heap a torch/transformers process holds (~0.4 s here) stalls the
            engine thread mid-run.

    The generic counters (``requests``, ``finished``, ``failed``, ``cancelled``, ``refused``,
    ``prompt_tokens``, ``completion_tokens``) leave out the warm-up; every admitted request ends in exactly
    one of the four outcomes, so ``requests == finished + failed + cancelled + refused + in_flight``
    (:attr:`in_flight`).
    """

    def __init__(self, model, name: str = "engine", *, cb_config=None, eos_token_id: Any = "model",
                 logprobs: bool = False, warmup_requests: int = 1, warmup_prompt: Sequence[int] = (1, 2, 3, 4),
                 warmup_new_tokens: int = 2, stop_timeout_s: float = 60.0, freeze_gc: bool = True):
        self.model = model
        self.name = str(name)
        self.cb_config = cb_config
        self.eos_token_id = resolve_eos(model, eos_token_id)
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.vocab_size = int(cfg.vocab_size)
        self.context_length = int(getattr(cfg, "max_position_embeddings", 0) or 0) or None
        self.logprobs = bool(logprobs)
        self.warmup_requests = int(warmup_requests)
        self.warmup_prompt = [int(t) for t in warmup_prompt][: max(1, min(len(warmup_prompt), self.vocab_size))]
        self.warmup_new_tokens = int(warmup_new_tokens)
        self.stop_timeout_s = float(stop_timeout_s)
        self.freeze_gc = bool(freeze_gc)
        self.settings: dict[str, Any] = {}
        # requests: admitted to the engine; refused: the engine's queue said no (503); rejected: answered
        # with a 4xx by the HTTP layer before reaching the engine (note_rejected)
        self.counters = {"requests": 0, "finished": 0, "failed": 0, "cancelled": 0, "refused": 0, "rejected": 0,
                         "prompt_tokens": 0, "completion_tokens": 0}
        self._manager = None
        self._tap = _LogprobTap()
        self._cond = threading.Condition()
        self._live: dict[str, LiveRequest] = {}
        self._cancelling: set[str] = set()
        self._ready = False
        self._dead: str | None = None
        self._stop = threading.Event()
        self._shutting = False
        self._dispatcher: threading.Thread | None = None
        self._frozen = False
        self._runs = 0

    # ------------------------------------------------------------------------------------- hooks
    def on_finished(self, live: LiveRequest, error: str | None) -> None:
        """Called once when a request ends (finished, failed or cancelled), before its id is released
        and before its last output is delivered; ``error`` is the engine's error or None. Default:
        nothing. Subclasses record what they know about the request in ``live.info``."""

    def on_released(self, rid: str) -> None:
        """Called when a request id leaves the engine (finished, cancelled and dropped, or refused).
        Default: nothing."""

    # ----------------------------------------------------------------------------------- lifecycle
    @property
    def in_flight(self) -> int:
        """Admitted requests (warm-up excluded) that have not yet finished, failed or been cancelled."""
        with self._cond:
            return sum(1 for lv in self._live.values() if not lv.warmup and not lv.cancelled)

    @property
    def started(self) -> bool:
        """True between :meth:`start` and :meth:`stop`."""
        return self._manager is not None

    @property
    def error(self) -> str | None:
        """Why the engine stopped serving (its generation thread died), else None."""
        return self._dead

    @property
    def healthy(self) -> bool:
        """True while the engine is started, warmed up and its generation thread alive."""
        mgr = self._manager
        return self._ready and self._dead is None and not self._stop.is_set() and mgr is not None and mgr.is_running()

    def start(self, hint: WorkloadHint | None = None, after_warmup: Callable[[], None] | None = None) -> None:
        """Create and start a fresh manager and the dispatcher, run the warm-up requests, then call
        ``after_warmup``.

        Args:
            hint: sizes passed to the engine as transformers' ``WorkloadHints``; also the generation
                config's ``max_new_tokens`` (default 16).
            after_warmup: called after the warm-up, before the first request is accepted.

        Raises:
            RuntimeError: if already started or a warm-up request fails.
            ValueError: if the engine refuses the configuration.
        """
        if self._manager is not None:
            raise RuntimeError(f"{self.name}: engine already started")

        max_new = hint.max_new_tokens if hint is not None else 16
        gen_cfg = GenerationConfig(do_sample=False, max_new_tokens=max(1, max_new, self.warmup_new_tokens),
                                   eos_token_id=self.eos_token_id)
        cb = ContinuousBatchingConfig() if self.cb_config is None else copy.deepcopy(self.cb_config)
        hints = None
        if hint is not None:
            hints = WorkloadHints(max_prompt_length=max(hint.max_prompt_tokens, len(self.warmup_prompt)),
                                  max_generated_length=max(hint.max_new_tokens, self.warmup_new_tokens),
                                  num_requests=hint.num_requests)
        try:
            mgr = self.model.init_continuous_batching(generation_config=gen_cfg, continuous_batching_config=cb,
                                                      workload_hints=hints)
            if self.logprobs:
                tap, original = self._tap, mgr._create_batch_processor

                def create_batch_processor():
                    bp = original()
                    tap.install(bp)
                    return bp

                mgr._create_batch_processor = create_batch_processor
            self._manager = mgr
            self._stop.clear()
            self._shutting = False
            self._dead = None
            mgr.start()
            self._dispatcher = threading.Thread(target=self._dispatch, name=f"engine-{self.name}", daemon=True)
            self._dispatcher.start()
            self._runs += 1
            self._warm_up()
            if after_warmup is not None:
                after_warmup()
            resolved = mgr.continuous_batching_config
            self.settings = {f.name: simple(getattr(resolved, f.name)) for f in dataclasses.fields(resolved)}
            if self.freeze_gc:
                _gc_freeze()
                self._frozen = True
            self._ready = True
        except BaseException:
            self.stop()
            raise

    def _warm_up(self) -> None:
        if self.warmup_requests <= 0:
            return
        self._ready = True  # let the warm-up through submit()
        try:
            lives = [self.submit(self.warmup_prompt, self.warmup_new_tokens, ignore_eos=True,
                                 request_id=f"__warmup_{self._runs}_{i}__", _warmup=True)
                     for i in range(self.warmup_requests)]
            for live in lives:
                for _ in self.events(live, timeout_s=max(120.0, self.stop_timeout_s)):
                    pass
        except EngineError as exc:
            raise RuntimeError(f"{self.name}: warm-up failed: {exc}") from None
        finally:
            self._ready = False

    def stop(self, grace_s: float = 0.0) -> None:
        """Stop the engine: refuse new requests, let in-flight ones finish for ``grace_s`` seconds, then
        hard-stop, fail what is left (503), join the threads and unfreeze the collector. Safe to call
        twice or when never started."""
        self._ready = False
        self._shutting = True
        mgr = self._manager
        if mgr is not None:
            try:
                if mgr.is_running():
                    with self._cond:
                        pending = any(not lv.cancelled for lv in self._live.values())
                    if pending and grace_s > 0:
                        mgr.stop(block=True, timeout=grace_s)
                    if mgr.is_running():
                        mgr.stop(block=True, timeout=self.stop_timeout_s, hard_stop=pending)
            except Exception:
                logger.exception("%s: stopping the manager failed", self.name)
            finally:
                try:
                    mgr.destroy()
                except Exception:
                    logger.exception("%s: destroying the manager failed", self.name)
        self._stop.set()
        if self._dispatcher is not None:
            self._dispatcher.join(timeout=10)
            self._dispatcher = None
        self._fail_all("the engine is shutting down", 503)
        self._manager = None
        if self._frozen:
            _gc_unfreeze()
            self._frozen = False

    # ------------------------------------------------------------------------------------ requests
    def submit(self, prompt_ids: Sequence[int], max_new_tokens: int, *, ignore_eos: bool = False,
               eos_token_id: Any = None, request_id: str | None = None, top_logprobs: int | None = None,
               reuse_wait_s: float = 5.0, loop: "asyncio.AbstractEventLoop | None" = None,
               sink: Callable[[Any], None] | None = None, _warmup: bool = False) -> LiveRequest:
        """Add one request to the manager and return its handle.

        Args:
            prompt_ids: prompt token ids (non-empty).
            max_new_tokens: tokens to generate at most (>= 1).
            ignore_eos: generate exactly ``max_new_tokens`` tokens.
            eos_token_id: this request's stop token(s) (default: the driver's).
            request_id: the engine request id (default: a fresh ``cmpl-...``).
            top_logprobs: None, or k >= 0 to record log-probabilities with the top k (needs
                ``logprobs=True``).
            reuse_wait_s: how long to wait for a cancelled request with the same id to be released.
            loop: the asyncio event loop that reads the request with :meth:`aevents`.
            sink: a callback that receives every engine output (``GenerationOutput``) or
                :class:`Failure` of the request, on the dispatcher thread (instead of a queue).

        Raises:
            EngineError: 400 for an empty prompt or ``max_new_tokens < 1``, 503 when the engine is not
                serving or refused the request, 409 for an id still in flight.
        """
        rid = str(request_id) if request_id is not None else f"cmpl-{uuid.uuid4().hex[:24]}"
        ids = [int(t) for t in prompt_ids]
        if not ids:
            raise EngineError("empty prompt", 400, "invalid_request_error")
        n = int(max_new_tokens)
        if n < 1:
            raise EngineError(f"max_new_tokens must be >= 1, got {max_new_tokens!r}", 400, "invalid_request_error")
        if top_logprobs is not None and not self.logprobs:
            raise EngineError("this engine records no log-probabilities", 400, "invalid_request_error")
        eos = -1 if ignore_eos else (self.eos_token_id if eos_token_id is None else eos_token_id)
        eos_set = {eos} if isinstance(eos, int) else set(eos)
        eos_set = {int(e) for e in eos_set if int(e) >= 0}
        live = LiveRequest(rid, ids, n, eos_set, top_logprobs, warmup=_warmup, loop=loop,
                           aqueue=asyncio.Queue() if loop is not None else None, sink=sink)
        mgr = self._manager
        with self._cond:
            if not self._ready or mgr is None or self._dead is not None:
                raise EngineError(self._dead or "the engine is not ready", 503, "service_unavailable")
            if rid in self._cancelling:  # a cancellation the engine has not dropped yet
                self._cond.wait_for(lambda: rid not in self._live, timeout=reuse_wait_s)
            if rid in self._live:
                raise EngineError(f"request id {rid!r} is already in flight", 409, "conflict")
            self._live[rid] = live
            if top_logprobs is not None:
                self._tap.store[rid] = live.logprobs
                self._tap.want[rid] = int(top_logprobs)
            if not _warmup:
                self.counters["requests"] += 1
                self.counters["prompt_tokens"] += len(ids)
        try:
            got = mgr.add_request(ids, request_id=rid, max_new_tokens=n, streaming=True, record_timestamps=True,
                                  eos_token_id=eos)
        except queue.Full:
            got = None
        if got is None:
            self._release(rid)
            if not _warmup:
                with self._cond:
                    self.counters["refused"] += 1
            raise EngineError("the engine refused the request (queue full or stopping)", 503, "service_unavailable")
        return live

    def note_rejected(self) -> None:
        """Count a request the HTTP layer refused with a 4xx (bad body, unknown model, prompt too long, ...)
        before it reached the engine: ``counters["rejected"]``, beside ``requests`` (admitted ones)."""
        with self._cond:
            self.counters["rejected"] += 1

    def cancel(self, live: LiveRequest, stopped_after: int | None = None) -> None:
        """Cancel a request in the engine (stop string hit, client gone, timeout). Its id stays reserved
        until the engine has dropped it.

        Args:
            live: the request.
            stopped_after: the request ended normally on a stop string after this many completion tokens
                (the client got ``finish_reason: "stop"``): it counts as ``finished`` with those tokens in
                ``completion_tokens``, not as ``cancelled``; None: a cancellation (client gone, timeout).
        """
        with self._cond:
            if live.cancelled or self._live.get(live.rid) is not live:
                return
            live.cancelled = True
            self._cancelling.add(live.rid)
            if not live.warmup:
                if stopped_after is None:
                    self.counters["cancelled"] += 1
                else:
                    self.counters["finished"] += 1
                    self.counters["completion_tokens"] += int(stopped_after)
        if live.info is None:
            self.on_finished(live, None)
        self._tap.want.pop(live.rid, None)
        mgr = self._manager
        if mgr is not None:
            mgr.cancel_request(live.rid)

    def events(self, live: LiveRequest, timeout_s: float | None = None) -> Iterator[TokenEvent]:
        """Yield the request's tokens as the engine produces them (a request read by a thread).

        Args:
            live: a request submitted without ``loop`` and ``sink``.
            timeout_s: seconds until the request is cancelled (default: none).

        Raises:
            EngineError: if the engine failed the request (500), stopped (503), or ``timeout_s`` passed
                (504; the request is cancelled).
        """
        deadline = None if timeout_s is None else time.monotonic() + float(timeout_s)
        seen = 0
        while True:
            try:
                if deadline is None:
                    out = live.queue.get()
                else:
                    left = deadline - time.monotonic()
                    out = live.queue.get(timeout=left) if left > 0 else live.queue.get_nowait()
            except queue.Empty:
                self._timed_out(live)
            evs, seen, done = self.unpack(live, out, seen)
            yield from evs
            if done:
                return

    async def aevents(self, live: LiveRequest, timeout_s: float | None = None) -> AsyncIterator[TokenEvent]:
        """:meth:`events` for a request submitted with ``loop=`` (read on that event loop).

        Raises:
            EngineError: as :meth:`events`.
        """
        deadline = None if timeout_s is None else time.monotonic() + float(timeout_s)
        seen = 0
        while True:
            try:
                if deadline is None:
                    out = await live.aqueue.get()
                else:
                    out = await asyncio.wait_for(live.aqueue.get(), timeout=max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                self._timed_out(live)
            evs, seen, done = self.unpack(live, out, seen)
            for ev in evs:
                yield ev
            if done:
                return

    def _timed_out(self, live: LiveRequest) -> NoReturn:
        self.cancel(live)
        raise EngineError(f"request {live.rid!r} did not finish within the timeout", 504, "timeout")

    def unpack(self, live: LiveRequest, out, seen: int) -> tuple[list[TokenEvent], int, bool]:
        """The new tokens of one engine output.

        Args:
            live: the request.
            out: a ``GenerationOutput`` or a :class:`Failure`.
            seen: tokens already turned into events.

        Returns:
            ``(events, tokens seen so far, finished?)``.

        Raises:
            EngineError: for a :class:`Failure` (its status) or an engine error (500).
        """
        if isinstance(out, Failure):
            raise EngineError(out.message, out.status)
        ids = list(out.generated_tokens)
        done = out.is_finished()
        if done and out.error is not None:
            raise EngineError(f"the engine failed request {live.rid!r}: {out.error}", 500)
        stamps = out.timestamps if out.timestamps is not None and len(out.timestamps) == len(ids) else None
        evs = []
        for j in range(seen, len(ids)):
            last = done and j == len(ids) - 1
            lp, top = (None, None)
            if live.top_k is not None:
                rec = live.logprobs.get(j)
                lp, top = (rec[0], rec[1]) if rec is not None else (None, [])
            reason = None
            if last:
                reason = "stop" if ids[j] in live.eos else "length"
            evs.append(TokenEvent(j, int(ids[j]), None if stamps is None else float(stamps[j]), lp, top, last, reason))
        return evs, max(seen, len(ids)), done

    # ------------------------------------------------------------------------------- dispatcher
    def _dispatch(self) -> None:
        mgr = self._manager
        last_sweep = 0.0
        while not self._stop.is_set():
            out = mgr.get_result(timeout=0.05)
            if out is not None:
                self._route(out)
            now = time.monotonic()
            if out is None or now - last_sweep > 0.05:
                last_sweep = now
                self._sweep_cancelled()
                if not mgr.is_running() and mgr.output_router.output_queue.empty():
                    if self._stop.is_set() or self._shutting:
                        return
                    fatal = mgr.background_thread_status.fatal_error
                    self._dead = (f"the engine's generation thread stopped ({fatal!r})" if fatal is not None
                                  else "the engine's generation thread stopped")
                    self._fail_all(self._dead, 503)
                    if self._stop.wait(0.05):
                        return

    def _route(self, out) -> None:
        with self._cond:
            live = self._live.get(out.request_id)
        if live is None or live.cancelled:
            return
        if out.is_finished():
            self.on_finished(live, out.error)
            self.on_released(live.rid)
            with self._cond:
                self._live.pop(live.rid, None)
                self._tap.forget(live.rid)
                if not live.warmup:
                    if out.error is None:
                        self.counters["finished"] += 1
                        self.counters["completion_tokens"] += len(out.generated_tokens)
                    else:
                        self.counters["failed"] += 1
                self._cond.notify_all()
        live.put(out)

    def _sweep_cancelled(self) -> None:
        """Release cancelled request ids once the engine has dropped them (so a reused id cannot be
        cancelled by the stale cancellation)."""
        if not self._cancelling:
            return
        mgr = self._manager
        bp = getattr(mgr, "batch_processor", None)
        sched = getattr(bp, "scheduler", None)
        if mgr is None or (sched is not None and not mgr.cancel_queue.empty()):
            return
        for rid in list(self._cancelling):
            if sched is not None:
                pending = getattr(sched, "_requests_to_cancel", set())
                if rid in sched.active_requests or rid in sched.waiting_requests or rid in pending:
                    continue
            self._release(rid)

    def _release(self, rid: str) -> None:
        with self._cond:
            self._cancelling.discard(rid)
            self._live.pop(rid, None)
            self._tap.forget(rid)
            self._cond.notify_all()
        self.on_released(rid)

    def _fail_all(self, message: str, status: int) -> None:
        with self._cond:
            lives = list(self._live.values())
            self.counters["failed"] += sum(1 for lv in lives if not lv.warmup and not lv.cancelled)
            self._live.clear()
            self._cancelling.clear()
            self._tap.want.clear()
            self._tap.store.clear()
            self._cond.notify_all()
        for lv in lives:
            lv.put(Failure(message, status))
