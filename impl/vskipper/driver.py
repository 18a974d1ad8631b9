"""The engine driver: ONE vSkipper engine arm on transformers' continuous-batching manager, fed by many
concurrent requests (vSkipper Sec. 4.1, "Arms").

**Arms** (:data:`ARMS`), all on the same engine settings (:func:`~impl.vskipper.engine.routed_cb_config`):

- ``upstream``: the unmodified engine (no skipper bound; dense);
- ``hybrid``: vSkipper with the profitability-aware mode switch (a
  :class:`~impl.vskipper.mode.ModeController` of the given :class:`~impl.vskipper.mode.ModeSwitch`
  as the engine's per-batch planner, Sec. 3.3);
- ``always-route``: vSkipper with the switch disabled (every row of every request routed);
- the mechanism ablations of Table 3 (``prefill-only``, ``decode-only``, ``no-promotion``,
  ``never-route``): the switch under :meth:`ModeSwitch.ablation`.

**One shared engine.** Every request is added to ONE continuous-batching manager
(``model.init_continuous_batching``), so concurrent requests are batched together by the engine's
scheduler. The manager runs its own generation thread; a dispatcher thread drains the manager's
output queue (``manager.get_result``) and routes every streamed ``GenerationOutput`` to its request:
a thread queue (read with :meth:`CompletionEngine.events`) or, for requests submitted from an asyncio
event loop (the HTTP server, :mod:`impl.vskipper.api_server`), an asyncio queue on that loop (read
with :meth:`CompletionEngine.aevents`). Requests are added with ``streaming=True`` so every generated
token is delivered as soon as the engine appended it.

**Top-k log-probabilities.** The engine only returns the chosen token's log-probability (and only
when the whole manager runs with ``return_logprobs``). For requests that ask for ``logprobs``, the
driver wraps the batch processor's sampling step (``model_runner._sample``, on the instance only):
after the engine sampled, it takes ``log_softmax`` of the rows of those requests and records the
chosen token's log-probability and the top k, keyed by request and completion index. Batches without
such requests pay one dictionary check. The values are computed from the same fp32 scores the engine
sampled from (for greedy the top-1 is the emitted token).

**Text.** :class:`TextAssembler` turns a request's tokens into its completion text: incremental
detokenization (vLLM's window scheme) cut at the first stop string, holding back text that may begin
a stop string until it cannot.

Limitations: greedy decoding only; no prompt log-probabilities; the mode switch's state (share
estimate, probe schedule, routed-row counts) lives as long as the engine, while each request's own
mode entries are dropped when it finishes so that request ids can be reused; a mode switch's decisions
depend on arrival timing, so hybrid outputs are only reproducible when the switch's decisions are.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import gc
import logging
import math
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Iterator, Mapping, NoReturn, Sequence

import torch

from .engine import bind_skipper, routed_cb_config, unbind_skipper
from .mode import ModeController, ModeSwitch
from .routed import routed_context
from .skipper import Phase
from .spec import describe_skipper, parse_skipper_spec

__all__ = ["ARMS", "CompletionEngine", "EngineError", "LiveRequest", "TextAssembler", "TokenEvent"]

logger = logging.getLogger(__name__)

#: arm names: the paper's three serving arms, then the mode-switch mechanism ablations (Table 3)
ARMS = ("upstream", "hybrid", "always-route", "prefill-only", "decode-only", "no-promotion", "never-route")
_SWITCH_ARMS = {"hybrid": "served", "prefill-only": "prefill-only", "decode-only": "decode-only",
                "no-promotion": "no-promotion", "never-route": "never-route"}
_WARMUP_ID = "__vskipper_server_warmup__"
_GC_LOCK = threading.Lock()
_GC_FREEZES = [0]  # engines holding gc.freeze() in this process (unfreeze when the last one stops)


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




class EngineError(RuntimeError):
    """A request could not be served by the engine. ``status`` is the HTTP status to answer with."""

    def __init__(self, message: str, status: int = 500, kind: str = "server_error"):
        super().__init__(message)
        self.status = int(status)
        self.kind = kind


class _LogprobTap:
    """Records the chosen token's log-probability and the top k per generated token, for the requests
    that asked (module docstring). Written by the engine thread, read by the request threads."""

    def __init__(self):
        self.want: dict[str, int] = {}
        self.store: dict[str, dict[int, tuple[float, list[tuple[int, float]]]]] = {}

    def install(self, bp) -> None:
        runner = bp.model_runner
        if getattr(runner, "_vskipper_tap", False):
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
        runner._vskipper_tap = True

    @torch.no_grad()
    def _record(self, requests_in_batch, scores: torch.Tensor, output_ids: torch.Tensor) -> None:
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
        lp = torch.log_softmax(scores[0].index_select(0, idx).float(), dim=-1)
        chosen = output_ids[0].index_select(0, idx.to(output_ids.device)).long().to(lp.device)
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
    """One request in flight (the engine side)."""

    rid: str
    prompt_ids: list[int]
    max_new: int
    eos: set
    top_k: int | None
    queue: "queue.Queue" = field(default_factory=queue.Queue)
    logprobs: dict = field(default_factory=dict)
    cancelled: bool = False
    modes: dict | None = None
    loop: "asyncio.AbstractEventLoop | None" = None
    aqueue: "asyncio.Queue | None" = None

    def put(self, item) -> None:
        """Deliver an engine output (or a failure) to the request: its thread queue, or its asyncio
        queue on the event loop that submitted it (thread-safe)."""
        if self.loop is None:
            self.queue.put(item)
            return
        try:
            self.loop.call_soon_threadsafe(self.aqueue.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass


@dataclass
class TokenEvent:
    """One generated token as a request thread sees it.

    Attributes:
        index: position in the completion (0-based).
        token_id: the token.
        logprob: its log-probability (None unless the request asked for logprobs).
        top: the top-k ``(id, logprob)`` pairs (None unless asked).
        final: True for the last token the engine will produce for the request.
        finish_reason: for the final token, ``"stop"`` (EOS) or ``"length"``.
    """

    index: int
    token_id: int
    logprob: float | None = None
    top: list | None = None
    final: bool = False
    finish_reason: str | None = None


class _Failure:
    def __init__(self, message: str, status: int = 500):
        self.message, self.status = message, status


def _retry(fn, attempts: int = 5):
    """Call ``fn`` again when another thread resized a dict it iterates."""
    for i in range(attempts):
        try:
            return fn()
        except RuntimeError as exc:
            if "changed size" not in str(exc) or i == attempts - 1:
                raise
            time.sleep(0.001)


def _simple(value: Any) -> Any:
    if isinstance(value, float) and (math.isinf(value) or math.isnan(value)):
        return None
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple, set)):
        return [_simple(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _simple(v) for k, v in value.items()}
    return repr(value)


class CompletionEngine:
    """One engine arm behind a shared continuous-batching manager, fed by many request threads.

    Args:
        model: a Llama / Qwen3-family causal LM, *unbound* (the engine binds ``skipper`` for the
            vSkipper arms and unbinds it at :meth:`stop`).
        tokenizer: the model's tokenizer (prompt strings, output text).
        arm: one of :data:`ARMS`.
        skipper: the policy (a :class:`Skipper` or a spec for :func:`parse_skipper_spec`); required by
            every arm but ``upstream``, which validates and records it but runs the unmodified engine.
        switch: the :class:`ModeSwitch` of the switch arms (default ``ModeSwitch()``: the paper's
            prefill profile and a placeholder ``enter_threshold``; derive it per device with
            :func:`~impl.vskipper.mode.derive_thresholds`). The arm name applies its ablation.
        cb_config: a ``ContinuousBatchingConfig`` (default :func:`routed_cb_config`; copied).
        served_model_name: the name ``/v1/models`` lists and requests' ``model`` must match.
        model_aliases: further accepted ``model`` values (e.g. the model directory).
        eos_token_id: natural stop token(s): ``"model"`` (the model's generation config, else its
            config), an int / list, or None (no EOS).
        max_model_len: longest prompt + completion accepted (default: the model's
            ``max_position_embeddings``, capped by the engine's cache capacity after start).
        max_logprobs: the largest ``logprobs`` a request may ask for (0 refuses logprobs).
        add_special_tokens: tokenizer flag for string prompts (default True).
        request_timeout_s: a request still unfinished after this long is cancelled (504).
        warmup: run one short request before serving (excluded from any measurement).
        freeze_gc: after the warm-up, ``gc.collect(); gc.freeze()`` until :meth:`stop` (as
            :class:`~impl.serving.arms.ContinuousBatchingArm`: no full collection of the big heap
            stalls the engine thread mid-run).

    Raises:
        ValueError: for an unknown arm, a missing skipper, or a configuration routed mode refuses.
    """

    def __init__(self, model, tokenizer, arm: str = "upstream", *, skipper: Any = None,
                 switch: ModeSwitch | None = None, cb_config=None, served_model_name: str = "model",
                 model_aliases: Sequence[str] = (), eos_token_id: Any = "model", max_model_len: int | None = None,
                 max_logprobs: int = 5, add_special_tokens: bool = True, request_timeout_s: float = 600.0,
                 warmup: bool = True, freeze_gc: bool = True):
        if arm not in ARMS:
            raise ValueError(f"unknown arm {arm!r}; choose from {', '.join(ARMS)}")
        if arm != "upstream" and skipper is None:
            raise ValueError(f"arm {arm!r} needs a skipper (e.g. 'randomskip:r=0.5,d=0.5' or 'flexidepth:DIR')")
        if routed_context(model) is not None:
            raise ValueError("pass an unbound model: the engine binds the skipper itself")
        self.model = model
        self.tokenizer = tokenizer
        self.arm = arm
        self.skipper = parse_skipper_spec(skipper, model) if skipper is not None else None
        self.switch = (switch if switch is not None else ModeSwitch()) if arm in _SWITCH_ARMS else None
        if self.switch is not None:
            self.switch = self.switch.ablation(_SWITCH_ARMS[arm])
        self.cb_config = routed_cb_config() if cb_config is None else copy.deepcopy(cb_config)
        if self.switch is not None and self.cb_config.allow_block_sharing:
            raise ValueError("the mode switch needs allow_block_sharing=False (a request's mode keys its prefix reuse)")
        self.served_model_name = str(served_model_name)
        self.model_names = {self.served_model_name, *map(str, model_aliases)}
        self.eos_token_id = _resolve_eos(model, eos_token_id)
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.vocab_size = int(cfg.vocab_size)
        self.max_model_len = int(max_model_len or getattr(cfg, "max_position_embeddings", 0) or 4096)
        self.max_logprobs = int(max_logprobs)
        self.add_special_tokens = bool(add_special_tokens)
        self.request_timeout_s = float(request_timeout_s)
        self.warmup = bool(warmup)
        self.freeze_gc = bool(freeze_gc)
        self.controller: ModeController | None = None
        self.created = int(time.time())
        self._manager = None
        self._bound = False
        self._tap = _LogprobTap()
        self._cond = threading.Condition()
        self._live: dict[str, LiveRequest] = {}
        self._cancelling: set[str] = set()
        self._ready = False
        self._dead: str | None = None
        self._stop = threading.Event()
        self._shutting = False
        self._dispatcher: threading.Thread | None = None
        self._tok_lock = threading.Lock()
        self._frozen = False
        self._settings: dict = {}
        self.counters = {"requests": 0, "finished": 0, "failed": 0, "cancelled": 0, "prompt_tokens": 0,
                         "completion_tokens": 0, "prefill_routed_requests": 0, "decode_routed_requests": 0,
                         "promotions": 0}

    # ----------------------------------------------------------------------------------- lifecycle
    @property
    def error(self) -> str | None:
        """Why the engine stopped serving (its generation thread died), else None."""
        return self._dead

    @property
    def healthy(self) -> bool:
        """True while the engine is started, warmed up and its generation thread alive."""
        mgr = self._manager
        return self._ready and self._dead is None and not self._stop.is_set() and mgr is not None and mgr.is_running()

    def start(self) -> None:
        """Bind the skipper (vSkipper arms), create and start the manager, the dispatcher thread and
        the warm-up request; install the mode switch's controller after the warm-up.

        Raises:
            RuntimeError: if already started or the warm-up fails; ValueError: see the class.
        """
        if self._manager is not None:
            raise RuntimeError("engine already started")
        from transformers import GenerationConfig

        if self.arm != "upstream":
            bind_skipper(self.model, self.skipper)
            self._bound = True
        try:
            gen_cfg = GenerationConfig(do_sample=False, max_new_tokens=16, eos_token_id=self.eos_token_id)
            mgr = self.model.init_continuous_batching(generation_config=gen_cfg,
                                                      continuous_batching_config=copy.deepcopy(self.cb_config))
            tap = self._tap
            original = mgr._create_batch_processor

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
            self._dispatcher = threading.Thread(target=self._dispatch, name=f"vskipper-server-{self.arm}",
                                                daemon=True)
            self._dispatcher.start()
            if self.warmup:
                self._ready = True  # let the warm-up through submit()
                live = self.submit([1, 2, 3, 4][: max(1, min(4, self.vocab_size))], 2, ignore_eos=True,
                                   request_id=_WARMUP_ID)
                try:
                    for _ in self.events(live, timeout_s=120.0):
                        pass
                finally:
                    self._ready = False
            if self.switch is not None:
                self.controller = ModeController(self.switch)
                routed_context(self.model).planner = self.controller
            resolved = mgr.continuous_batching_config
            self._settings = {f.name: _simple(getattr(resolved, f.name)) for f in dataclasses.fields(resolved)}
            nb, ps = self._settings.get("num_blocks"), self._settings.get("page_size")
            if isinstance(nb, int) and isinstance(ps, int) and nb * ps > 0 and nb * ps < self.max_model_len:
                logger.warning("max_model_len %d exceeds the engine cache (%d blocks x %d tokens): capped",
                               self.max_model_len, nb, ps)
                self.max_model_len = nb * ps
            if self.freeze_gc:
                _gc_freeze()
                self._frozen = True
            self._ready = True
        except BaseException:
            self.stop()
            raise

    def stop(self, grace_s: float = 0.0) -> None:
        """Stop the engine: refuse new requests, let in-flight ones finish for ``grace_s`` seconds,
        then hard-stop, fail what is left, join the threads and unbind the skipper. Safe to call twice."""
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
                        mgr.stop(block=True, timeout=30, hard_stop=True)
            except Exception:
                logger.exception("stopping the manager failed")
            finally:
                try:
                    mgr.destroy()
                except Exception:
                    logger.exception("destroying the manager failed")
        self._stop.set()
        if self._dispatcher is not None:
            self._dispatcher.join(timeout=10)
            self._dispatcher = None
        self._fail_all("the server is shutting down", 503)
        self._manager = None
        if self._frozen:
            _gc_unfreeze()
            self._frozen = False
        if self._bound:
            ctx = routed_context(self.model)
            if ctx is not None:
                ctx.planner = None
            unbind_skipper(self.model)
            self._bound = False

    # ----------------------------------------------------------------------------------- requests
    def tokenize(self, text: str) -> list[int]:
        """Token ids of a prompt string (``add_special_tokens`` as configured)."""
        with self._tok_lock:
            return list(self.tokenizer(text, add_special_tokens=self.add_special_tokens)["input_ids"])

    def render_chat(self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True,
                    continue_final_message: bool = False) -> list[int]:
        """Token ids of chat messages rendered with the tokenizer's chat template (the template adds any
        BOS itself, so the rendered text is tokenized without special tokens).

        Raises:
            ValueError: the tokenizer has no chat template, or the template refuses the messages.
        """
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template: use /v1/completions")
        with self._tok_lock:
            try:
                text = self.tokenizer.apply_chat_template(
                    [dict(m) for m in messages], tokenize=False, add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final_message)
            except Exception as exc:  # jinja2 TemplateError and the tokenizer's own checks
                raise ValueError(f"the chat template refused the messages: {exc}") from None
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of token ids (no lock: decoding does not touch the tokenizer's mutable settings, unlike
        encoding, which may reset truncation / padding)."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def submit(self, prompt_ids: Sequence[int], max_new_tokens: int, *, ignore_eos: bool = False,
               eos_token_id: Any = None, request_id: str | None = None, top_logprobs: int | None = None,
               reuse_wait_s: float = 5.0, loop: "asyncio.AbstractEventLoop | None" = None) -> LiveRequest:
        """Add one request to the shared manager and return its handle (iterate :meth:`events`).

        Args:
            prompt_ids: prompt token ids (non-empty).
            max_new_tokens: tokens to generate at most (>= 1).
            ignore_eos: generate exactly ``max_new_tokens`` tokens.
            eos_token_id: this request's stop token(s) (default: the engine's).
            request_id: the engine request id (default: a fresh ``cmpl-...``); RandomSkip hashes it.
            top_logprobs: None, or k >= 0 to record log-probabilities with the top k.
            reuse_wait_s: how long to wait for a cancelled request with the same id to be released.
            loop: the asyncio event loop that will read the request with :meth:`aevents` (None: a
                thread reads it with :meth:`events`). Outputs are handed to it thread-safely.

        Raises:
            EngineError: 503 when the engine is not serving, 409 for an id still in flight.
        """
        rid = str(request_id) if request_id is not None else f"cmpl-{uuid.uuid4().hex[:24]}"
        ids = [int(t) for t in prompt_ids]
        if not ids:
            raise EngineError("empty prompt", 400, "invalid_request_error")
        eos = -1 if ignore_eos else (self.eos_token_id if eos_token_id is None else eos_token_id)
        eos_set = {eos} if isinstance(eos, int) else set(eos)
        eos_set = {int(e) for e in eos_set if int(e) >= 0}
        live = LiveRequest(rid, ids, int(max_new_tokens), eos_set, top_logprobs, loop=loop,
                           aqueue=asyncio.Queue() if loop is not None else None)
        mgr = self._manager
        with self._cond:
            if not self._ready or mgr is None or self._dead is not None:
                raise EngineError(self._dead or "the engine is not ready", 503, "service_unavailable")
            if rid in self._cancelling:  # a stop-string / disconnect cancellation the engine has not dropped yet
                self._cond.wait_for(lambda: rid not in self._live, timeout=reuse_wait_s)
            if rid in self._live:
                    raise EngineError(f"request id {rid!r} is already in flight", 409, "conflict")
            self._live[rid] = live
            if top_logprobs is not None:
                self._tap.store[rid] = live.logprobs
                self._tap.want[rid] = int(top_logprobs)
            if rid != _WARMUP_ID:
                self.counters["requests"] += 1
                self.counters["prompt_tokens"] += len(ids)
        try:
            got = mgr.add_request(ids, request_id=rid, max_new_tokens=live.max_new, streaming=True,
                                  eos_token_id=eos)
        except queue.Full:
            got = None
        if got is None:
            self._release(rid)
            raise EngineError("the engine refused the request (queue full or stopping)", 503, "service_unavailable")
        return live

    def cancel(self, live: LiveRequest) -> None:
        """Cancel a request in the engine (stop string hit, client gone, timeout). Its id stays
        reserved until the engine has dropped it."""
        with self._cond:
            if live.cancelled or self._live.get(live.rid) is not live:
                return
            live.cancelled = True
            self._cancelling.add(live.rid)
            self.counters["cancelled"] += 1
        if live.modes is None:
            live.modes = self._mode_info(live, count=True)
        self._tap.want.pop(live.rid, None)
        mgr = self._manager
        if mgr is not None:
            mgr.cancel_request(live.rid)

    def events(self, live: LiveRequest, timeout_s: float | None = None) -> Iterator[TokenEvent]:
        """Yield the request's tokens as the engine produces them (a request read by a thread).

        Raises:
            EngineError: if the engine failed the request (500), stopped (503), or ``timeout_s``
                (default ``request_timeout_s``) passed (504; the request is cancelled).
        """
        deadline = time.monotonic() + (self.request_timeout_s if timeout_s is None else float(timeout_s))
        seen = 0
        while True:
            left = deadline - time.monotonic()
            try:
                out = live.queue.get(timeout=max(0.0, left)) if left > 0 else live.queue.get_nowait()
            except queue.Empty:
                self._timed_out(live)
            evs, seen, done = self._unpack(live, out, seen)
            yield from evs
            if done:
                return

    async def aevents(self, live: LiveRequest, timeout_s: float | None = None) -> AsyncIterator[TokenEvent]:
        """:meth:`events` for a request submitted with ``loop=`` (read on that event loop).

        Raises:
            EngineError: as :meth:`events`.
        """
        deadline = time.monotonic() + (self.request_timeout_s if timeout_s is None else float(timeout_s))
        seen = 0
        while True:
            left = deadline - time.monotonic()
            try:
                out = await asyncio.wait_for(live.aqueue.get(), timeout=max(0.0, left))
            except asyncio.TimeoutError:
                self._timed_out(live)
            evs, seen, done = self._unpack(live, out, seen)
            for ev in evs:
                yield ev
            if done:
                return

    def _timed_out(self, live: LiveRequest) -> NoReturn:
        self.cancel(live)
        raise EngineError(f"request {live.rid!r} did not finish within the server's timeout", 504, "timeout")

    def _unpack(self, live: LiveRequest, out, seen: int) -> tuple[list[TokenEvent], int, bool]:
        """The new tokens of one engine output: (events, tokens seen so far, finished?)."""
        if isinstance(out, _Failure):
            raise EngineError(out.message, out.status)
        ids = list(out.generated_tokens)
        done = out.is_finished()
        if done and out.error is not None:
            raise EngineError(f"the engine failed request {live.rid!r}: {out.error}", 500)
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
            evs.append(TokenEvent(j, int(ids[j]), lp, top, last, reason))
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
            live.modes = self._mode_info(live, count=True)
            self._forget(live.rid)
            with self._cond:
                self._live.pop(live.rid, None)
                self._tap.want.pop(live.rid, None)
                self._tap.store.pop(live.rid, None)
                if live.rid != _WARMUP_ID:
                    if out.error is None:
                        self.counters["finished"] += 1
                        self.counters["completion_tokens"] += len(out.generated_tokens)
                    else:
                        self.counters["failed"] += 1
                self._cond.notify_all()
        live.put(out)

    def _mode_info(self, live: LiveRequest, count: bool = False) -> dict:
        """The request's modes: ``prefill_routed``, ``decode_routed_from`` (absolute token index of its
        first routed decode row, None: decode stayed dense) and ``promoted``."""
        rid = live.rid
        if self.arm == "upstream":
            return {"prefill_routed": False, "decode_routed_from": None, "promoted": False}
        if self.controller is None:  # always-route, or the warm-up
            return {"prefill_routed": True, "decode_routed_from": len(live.prompt_ids), "promoted": False}
        c = self.controller
        info = {"prefill_routed": bool(c.prefill_mode.get(rid, False)), "decode_routed_from": c.routed_from.get(rid),
                "promoted": rid in c.promoted}
        if count and rid != _WARMUP_ID:
            self.counters["prefill_routed_requests"] += int(info["prefill_routed"])
            self.counters["decode_routed_requests"] += int(info["decode_routed_from"] is not None)
            self.counters["promotions"] += int(info["promoted"])
        return info

    def _forget(self, rid: str) -> None:
        c = self.controller
        if c is None:
            return
        for d in (c.prefill_mode, c.decode_mode, c.routed_from, c.promoted):
            d.pop(rid, None)
        if len(c.events) > 20000:
            del c.events[:-10000]

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
            self._tap.want.pop(rid, None)
            self._tap.store.pop(rid, None)
            self._cond.notify_all()
        self._forget(rid)

    def _fail_all(self, message: str, status: int) -> None:
        with self._cond:
            lives = list(self._live.values())
            self._live.clear()
            self._cancelling.clear()
            self._tap.want.clear()
            self._tap.store.clear()
            self._cond.notify_all()
        for lv in lives:
            lv.put(_Failure(message, status))

    # ----------------------------------------------------------------------------------- describe
    def describe(self) -> dict:
        """The arm's declared settings and running statistics (JSON-able), for ``/v1/vskipper/stats``."""
        out = {
            "arm": self.arm,
            "served_model_name": self.served_model_name,
            "healthy": self.healthy,
            "skipper": describe_skipper(self.skipper),
            "skipper_bound": self._bound,
            "switch": None if self.switch is None else self.switch.to_dict(),
            "eos_token_id": _simple(self.eos_token_id),
            "max_model_len": self.max_model_len,
            "max_logprobs": self.max_logprobs,
            "add_special_tokens": self.add_special_tokens,
            "cb_config": dict(self._settings),
            "counters": dict(self.counters),
            "in_flight": len(self._live),
            "torch_threads": torch.get_num_threads(),
        }
        ctx = routed_context(self.model)
        if ctx is not None:
            out["project_only_share"] = {
                "all": _simple(_retry(lambda: ctx.skip_ratio())),
                "prefill": _simple(_retry(lambda: ctx.skip_ratio(Phase.PREFILL))),
                "decode": _simple(_retry(lambda: ctx.skip_ratio(Phase.DECODE))),
            }
            out["batches"] = ctx.batches
        if self.controller is not None:
            out["mode_switch"] = _simple(_retry(self.controller.summary))
        return out


def _resolve_eos(model, eos_token_id) -> int | list[int]:
    if eos_token_id != "model":
        return -1 if eos_token_id is None else eos_token_id
    for cfg in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        eos = getattr(cfg, "eos_token_id", None) if cfg is not None else None
        if eos is not None:
            return eos
    return -1


# ======================================================================================================
# Text: incremental detokenization and stop strings
# ======================================================================================================
class Detokenizer:
    """Incremental detokenization (vLLM's window scheme): a token's text is released once it decodes
    to more characters than the window before it and does not end in an incomplete UTF-8 sequence."""

    def __init__(self, engine: CompletionEngine, prompt_tail: Sequence[int], skip_special: bool):
        self.engine = engine
        self.ids = list(prompt_tail)
        self.prefix = 0
        self.read = len(self.ids)
        self.skip = skip_special

    def _texts(self) -> tuple[str, str]:
        return (self.engine.decode(self.ids[self.prefix:self.read], self.skip),
                self.engine.decode(self.ids[self.prefix:], self.skip))

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        before, now = self._texts()
        if len(now) > len(before) and not now.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return now[len(before):]
        return ""

    def flush(self) -> str:
        if self.read >= len(self.ids):
            return ""
        before, now = self._texts()
        self.prefix = self.read = len(self.ids)
        return now[len(before):] if len(now) > len(before) else ""


class TextAssembler:
    """Completion text of one choice: detokenized deltas, cut at the first stop string; text that may
    begin a stop string is held back until it cannot."""

    def __init__(self, engine: CompletionEngine, prompt_ids: Sequence[int], stops: Sequence[str],
                 skip_special: bool):
        self.detok = Detokenizer(engine, list(prompt_ids)[-6:], skip_special)
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""
        self.sent = 0
        self.stopped = False

    def _scan(self, start: int) -> int:
        best = -1
        for s in self.stops:
            p = self.text.find(s, start)
            if p >= 0 and (best < 0 or p < best):
                best = p
        return best

    def push(self, token_id: int, final: bool) -> str:
        """Add a token; returns the text released by it (sets ``stopped`` when a stop string completed)."""
        old = len(self.text)
        self.text += self.detok.push(token_id)
        if final:
            self.text += self.detok.flush()
        if self.stops:
            p = self._scan(max(0, old - self.hold))
            if p >= 0:
                self.text = self.text[:p]
                self.stopped = True
                final = True
        upto = len(self.text) if final or not self.stops else max(self.sent, len(self.text) - self.hold)
        out = self.text[self.sent:upto]
        self.sent = max(self.sent, upto)
        return out


