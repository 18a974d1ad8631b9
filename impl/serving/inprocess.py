"""The in-process serving arm: transformers' continuous-batching manager driven through the shared
engine driver (:class:`impl.serving.engine.EngineDriver`, the one the vSkipper HTTP server uses),
optionally in vSkipper's dense or routed mode (vSkipper Sec. 4.1, "Arms").

Per-token times are the engine's own ``perf_counter`` stamps (the driver adds every request with
``record_timestamps=True``; :mod:`impl.serving.engine` says where transformers 5.24 takes them), on the
same clock as the arrival stamps. A soft reset (the engine re-queues a request whose cache it evicted,
``create_equivalent_initial_request``) restarts the timestamp list, so when the stamps do not cover
every token the arm falls back to stamping the new tokens of each streamed update with that update's
latest engine stamp (``timestamp_source = "stream"``). Ignore-EOS requests generate exactly
``max_new_tokens`` tokens; a natural request stops at its EOS, which is counted as an output token (it
is in ``generated_tokens``).
"""

from __future__ import annotations

import copy
import threading
import time
from typing import Any, Sequence

from .arms import Arm, RealClock, Trace, WorkloadHint, simple
from .engine import EngineDriver, EngineError, Failure

__all__ = ["ContinuousBatchingArm"]


class ContinuousBatchingArm(Arm):
    """In-process arm over transformers' continuous-batching manager, through the shared
    :class:`~impl.serving.engine.EngineDriver` (module docstring).

    Every :meth:`start` starts the driver afresh (a new manager with greedy decoding and the given
    engine configuration, its warm-up requests run to completion before returning); :meth:`stop` stops
    it. Token times are the engine's ``perf_counter`` stamps.

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
        streaming: recorded in :meth:`describe`; the driver always streams (every token delivered, needed
            for exact times after a soft reset), so only True is accepted.
        warmup_requests: requests run to completion inside :meth:`start` (default 1; 0 disables).
        warmup_prompt: prompt token ids of the warm-up requests.
        warmup_new_tokens: tokens each warm-up request generates.
        stop_timeout_s: how long :meth:`stop` waits for the generation thread.
        freeze_gc: after the warm-up, run a full garbage collection and ``gc.freeze()`` until
            :meth:`stop` (default True), so that no full collection of the large heap a
            torch/transformers process holds (~0.4 s here) stalls the engine thread mid-run.

    Raises:
        ValueError: for an unknown ``mode``, ``mode`` set without a ``binding``, a planner without
            ``mode="routed"``, or ``streaming=False``.
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
        if not streaming:
            raise ValueError("streaming=False is not supported: the engine driver streams every token")
        if mode is not None and binding is None:
            raise ValueError(f"mode={mode!r} needs binding= (the bound model's engine binding, e.g. "
                             "impl.vskipper.routed_context(model))")
        self.model = model
        self.name = str(name)
        self.clock = RealClock()
        self.mode = mode
        self.binding = binding
        self.planner = planner
        self.planner_factory = planner_factory
        self.streaming = True
        self.driver = EngineDriver(model, self.name, cb_config=cb_config, eos_token_id=eos_token_id,
                                   warmup_requests=warmup_requests, warmup_prompt=warmup_prompt,
                                   warmup_new_tokens=warmup_new_tokens, stop_timeout_s=stop_timeout_s,
                                   freeze_gc=freeze_gc)
        self.cb_config = cb_config
        self.eos_token_id = self.driver.eos_token_id
        self._cond = threading.Condition()
        self._traces: dict[str, Trace] = {}
        self._mode_cm = None
        self._prev_planner = None

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

    def _install_planner(self) -> None:
        if self.planner_factory is not None:  # a fresh planner per run, installed after the warm-up
            self.planner = self.planner_factory()
            self.binding.planner = self.planner

    def start(self, hint: WorkloadHint | None = None) -> None:
        """Enter the arm's mode and start the driver (a fresh manager, the warm-up excluded from timing).

        Args:
            hint: sizes passed to the engine as ``WorkloadHints`` (same for every arm of a cell).

        Raises:
            RuntimeError: if the arm is already started or a warm-up request fails.
            ValueError: if the engine refuses the configuration (e.g. routed mode with async batching).
        """
        if self.driver.started:
            raise RuntimeError(f"arm {self.name!r} is already started")
        with self._cond:
            self._traces = {}
        self._enter_mode()
        try:
            self.driver.start(hint, after_warmup=self._install_planner)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Stop the driver (hard stop if requests are still pending) and leave the vSkipper mode. Safe
        to call twice or when never started."""
        try:
            self.driver.stop()
        finally:
            self._exit_mode()

    # ------------------------------------------------------------------------------------ requests
    def submit(self, request_id: str, input_ids: Sequence[int], max_new_tokens: int, ignore_eos: bool) -> None:
        """Queue one request in the engine (the driver adds it with streaming and timestamps).

        Raises:
            RuntimeError: if the arm is not started.
            ValueError: for a duplicated id, an empty prompt, ``max_new_tokens < 1``, or a prompt plus
                ``max_new_tokens`` longer than the model's context (``max_position_embeddings``; the HTTP
                server refuses the same request with a 400).
        """
        if not self.driver.started:
            raise RuntimeError(f"arm {self.name!r} is not started")
        ids = [int(t) for t in input_ids]
        if not ids:
            raise ValueError(f"request {request_id!r}: empty prompt")
        n = int(max_new_tokens)
        if n < 1:
            raise ValueError(f"request {request_id!r}: max_new_tokens must be >= 1, got {max_new_tokens!r}")
        ctx = self.driver.context_length
        if ctx and len(ids) + n > ctx:
            raise ValueError(f"request {request_id!r}: prompt ({len(ids)} tokens) + max_new_tokens ({n}) exceeds the "
                             f"model's context length {ctx}")
        rid = str(request_id)
        with self._cond:
            if rid in self._traces:
                raise ValueError(f"duplicate request id {rid!r}")
            self._traces[rid] = Trace(rid, prompt_tokens=len(ids), max_new_tokens=n)
        try:
            self.driver.submit(ids, n, ignore_eos=ignore_eos, request_id=rid,
                               sink=lambda out, rid=rid: self._on_output(rid, out, time.perf_counter()))
        except EngineError as exc:
            self._finish_error(rid, str(exc))

    def _finish_error(self, rid: str, msg: str) -> None:
        with self._cond:
            tr = self._traces[rid]
            if not tr.done:
                tr.error, tr.done = msg, True
            self._cond.notify_all()

    def _on_output(self, rid: str, out, recv: float) -> None:
        """One engine output (or :class:`~impl.serving.engine.Failure`) of request ``rid``, on the
        driver's dispatcher thread: engine stamps when they cover every token, else the latest stamp of
        the update for its new tokens (``timestamp_source = "stream"``)."""
        if isinstance(out, Failure):
            self._finish_error(rid, out.message)
            return
        with self._cond:
            tr = self._traces.get(rid)
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
        """Block until every listed request finished or failed (or ``timeout_s`` seconds passed; a dead
        generation thread fails every request in flight). Returns copies of the traces; unfinished ones
        get an error.

        Raises:
            KeyError: for an id that was never submitted.
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
                    tr.error = self.driver.error or f"not finished within {timeout_s:.1f} s"
                out[r] = tr
            return out

    def describe(self) -> dict[str, Any]:
        """Declared settings: arm name, engine (``transformers``) and its attention (``paged <impl>``: the
        model's attention implementation over the engine's paged cache), mode, EOS, streaming, the engine's resolved
        ``ContinuousBatchingConfig`` fields (after the last :meth:`start`) and, when the run's planner
        has a ``summary()`` (the mode switch), its ``planner_summary`` (decisions and row counts of the
        last run)."""
        d = self.driver
        impl_name = getattr(getattr(self.model, "config", None), "_attn_implementation", None)
        return {"arm": self.name, "kind": type(self).__name__, "engine": "transformers",
                "attention_backend": None if impl_name is None else f"paged {impl_name}", "mode": self.mode,
                "planner": None if self.planner is None else type(self.planner).__name__,
                **({"planner_summary": simple(self.planner.summary())}
                   if callable(getattr(self.planner, "summary", None)) else {}),
                "eos_token_id": simple(self.eos_token_id), "streaming": self.streaming,
                "warmup_requests": d.warmup_requests, "freeze_gc": d.freeze_gc,
                "cb_config": dict(d.settings)}
