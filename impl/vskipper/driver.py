"""The vSkipper engine arm: ONE arm (:data:`ARMS`) on the shared engine driver
(:class:`impl.serving.engine.EngineDriver`, the one the in-process serving arms use), fed by many
concurrent requests (vSkipper Sec. 4.1, "Arms").

**Arms** (:data:`ARMS`), all on the same engine settings (:func:`~impl.vskipper.engine.routed_cb_config`):

- ``upstream``: the unmodified engine (no skipper bound; dense);
- ``hybrid``: vSkipper with the profitability-aware mode switch (a
  :class:`~impl.vskipper.mode.ModeController` of the given :class:`~impl.vskipper.mode.ModeSwitch`
  as the engine's per-batch planner, Sec. 3.3);
- ``always-route``: vSkipper with the switch disabled (every row of every request routed);
- the mechanism ablations of Table 3 (``prefill-only``, ``decode-only``, ``no-promotion``,
  ``never-route``): the switch under :meth:`ModeSwitch.ablation`.

**One shared engine.** Every request is added to ONE continuous-batching manager, so concurrent
requests are batched together by the engine's scheduler; the driver streams each request's tokens to
a thread (:meth:`CompletionEngine.events`) or, for requests submitted from an asyncio event loop (the
HTTP server, :mod:`impl.vskipper.api_server`), to an asyncio queue on that loop
(:meth:`CompletionEngine.aevents`), with the top-k log-probabilities the driver's tap records. This
class adds what is vSkipper's: it binds the skipper before the manager starts (and unbinds it at
:meth:`~CompletionEngine.stop`), installs the mode switch after the warm-up, records each request's
modes when it ends (``live.info``: ``prefill_routed``, ``decode_routed_from``, ``promoted``), and the
tokenizer side (prompts, chat template, text).

**Text.** :class:`TextAssembler` turns a request's tokens into its completion text: incremental
detokenization (vLLM's window scheme) cut at the first stop string, holding back text that may begin
a stop string until it cannot.

Limitations: greedy decoding only; no prompt log-probabilities; the mode switch's state (share
estimate, probe schedule, routed-row counts) lives as long as the engine, while each request's own
mode entries are dropped when it finishes so that request ids can be reused; a mode switch's decisions
depend on arrival timing, so hybrid outputs are only reproducible when the switch's decisions are.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from typing import Any, AsyncIterator, Iterator, Mapping, Sequence

import torch

from ..serving.engine import EngineDriver, LiveRequest, TokenEvent, retry_resized, simple
from .engine import bind_skipper, routed_cb_config, unbind_skipper
from .mode import ModeController, ModeSwitch
from .routed import routed_context
from .schema import SERVED_ARMS
from .skipper import Phase
from .spec import describe_skipper, parse_skipper_spec

__all__ = ["ARMS", "CompletionEngine", "TextAssembler"]

logger = logging.getLogger(__name__)

#: arm names: the paper's three serving arms, then the mode-switch mechanism ablations (Table 3)
ARMS = SERVED_ARMS
_SWITCH_ARMS = {"hybrid": "served", "prefill-only": "prefill-only", "decode-only": "decode-only",
                "no-promotion": "no-promotion", "never-route": "never-route"}


class CompletionEngine(EngineDriver):
    """One vSkipper engine arm on the shared driver, fed by many request threads or an event loop.

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
        warmup: run one short request before serving (excluded from the request counters and the mode
            switch's counts; the top-level ``batches`` of :meth:`describe` includes its batches).
        freeze_gc: after the warm-up, ``gc.collect(); gc.freeze()`` until :meth:`stop` (as the
            in-process arms: no full collection of the big heap stalls the engine thread mid-run).

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
        cb = routed_cb_config() if cb_config is None else copy.deepcopy(cb_config)
        super().__init__(model, f"vskipper-server-{arm}", cb_config=cb, eos_token_id=eos_token_id, logprobs=True,
                         warmup_requests=1 if warmup else 0, warmup_prompt=(1, 2, 3, 4), warmup_new_tokens=2,
                         stop_timeout_s=30.0, freeze_gc=freeze_gc)
        self.tokenizer = tokenizer
        self.arm = arm
        self.skipper = parse_skipper_spec(skipper, model) if skipper is not None else None
        self.switch = (switch if switch is not None else ModeSwitch()) if arm in _SWITCH_ARMS else None
        if self.switch is not None:
            self.switch = self.switch.ablation(_SWITCH_ARMS[arm])
        if self.switch is not None and self.cb_config.allow_block_sharing:
            raise ValueError("the mode switch needs allow_block_sharing=False (a request's mode keys its prefix reuse)")
        self.served_model_name = str(served_model_name)
        self.model_names = {self.served_model_name, *map(str, model_aliases)}
        self.max_model_len = int(max_model_len or self.context_length or 4096)
        self.max_logprobs = int(max_logprobs)
        self.add_special_tokens = bool(add_special_tokens)
        self.request_timeout_s = float(request_timeout_s)
        self.warmup = bool(warmup)
        self.controller: ModeController | None = None
        self.created = int(time.time())
        self._bound = False
        self._tok_lock = threading.Lock()
        self.counters.update({"prefill_routed_requests": 0, "decode_routed_requests": 0, "promotions": 0})

    # ----------------------------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Bind the skipper (vSkipper arms), start the driver (manager, dispatcher, warm-up), install the
        mode switch's controller after the warm-up, and cap ``max_model_len`` by the engine's cache.

        Raises:
            RuntimeError: if already started or the warm-up fails; ValueError: see the class.
        """
        if self.started:
            raise RuntimeError("engine already started")
        if self.arm != "upstream":
            bind_skipper(self.model, self.skipper)
            self._bound = True
        try:
            super().start(None, after_warmup=self._install_controller)
        except BaseException:
            self._unbind()
            raise
        nb, ps = self.settings.get("num_blocks"), self.settings.get("page_size")
        if isinstance(nb, int) and isinstance(ps, int) and nb * ps > 0 and nb * ps < self.max_model_len:
            logger.warning("max_model_len %d exceeds the engine cache (%d blocks x %d tokens): capped",
                           self.max_model_len, nb, ps)
            self.max_model_len = nb * ps

    def _install_controller(self) -> None:
        if self.switch is not None:
            self.controller = ModeController(self.switch)
            routed_context(self.model).planner = self.controller

    def _unbind(self) -> None:
        if self._bound:
            ctx = routed_context(self.model)
            if ctx is not None:
                ctx.planner = None
            unbind_skipper(self.model)
            self._bound = False

    def stop(self, grace_s: float = 0.0) -> None:
        """Stop the engine: refuse new requests, let in-flight ones finish for ``grace_s`` seconds,
        then hard-stop, fail what is left, join the threads and unbind the skipper. Safe to call twice."""
        try:
            super().stop(grace_s)
        finally:
            self._unbind()

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

    def events(self, live: LiveRequest, timeout_s: float | None = None) -> Iterator[TokenEvent]:
        """The driver's :meth:`~impl.serving.engine.EngineDriver.events`, with the server's request
        timeout as the default ``timeout_s`` (504 and cancelled after it)."""
        return super().events(live, self.request_timeout_s if timeout_s is None else timeout_s)

    def aevents(self, live: LiveRequest, timeout_s: float | None = None) -> AsyncIterator[TokenEvent]:
        """The driver's :meth:`~impl.serving.engine.EngineDriver.aevents`, with the server's request
        timeout as the default ``timeout_s``."""
        return super().aevents(live, self.request_timeout_s if timeout_s is None else timeout_s)

    # ------------------------------------------------------------------------------ driver hooks
    def on_finished(self, live: LiveRequest, error: str | None) -> None:
        """Record the request's modes in ``live.info`` (``prefill_routed``, ``decode_routed_from``: the
        absolute token index of its first routed decode row, None when decode stayed dense;
        ``promoted``) and count them."""
        live.info = info = self._mode_info(live)
        if not live.warmup:
            self.counters["prefill_routed_requests"] += int(info["prefill_routed"])
            self.counters["decode_routed_requests"] += int(info["decode_routed_from"] is not None)
            self.counters["promotions"] += int(info["promoted"])

    def _mode_info(self, live: LiveRequest) -> dict:
        rid = live.rid
        if self.arm == "upstream":
            return {"prefill_routed": False, "decode_routed_from": None, "promoted": False}
        if self.controller is None:  # always-route, or the warm-up
            return {"prefill_routed": True, "decode_routed_from": len(live.prompt_ids), "promoted": False}
        c = self.controller
        return {"prefill_routed": bool(c.prefill_mode.get(rid, False)), "decode_routed_from": c.routed_from.get(rid),
                "promoted": rid in c.promoted}

    def on_released(self, rid: str) -> None:
        """Drop the request's entries from the mode switch, so that its id can be reused."""
        c = self.controller
        if c is None:
            return
        for d in (c.prefill_mode, c.decode_mode, c.routed_from, c.promoted):
            d.pop(rid, None)
        if len(c.events) > 20000:
            del c.events[:-10000]

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
            "eos_token_id": simple(self.eos_token_id),
            "max_model_len": self.max_model_len,
            "max_logprobs": self.max_logprobs,
            "add_special_tokens": self.add_special_tokens,
            "cb_config": dict(self.settings),
            "counters": dict(self.counters),
            "in_flight": self.in_flight,
            "torch_threads": torch.get_num_threads(),
        }
        ctx = routed_context(self.model)
        if ctx is not None:
            out["project_only_share"] = {
                "all": simple(retry_resized(lambda: ctx.skip_ratio())),
                "prefill": simple(retry_resized(lambda: ctx.skip_ratio(Phase.PREFILL))),
                "decode": simple(retry_resized(lambda: ctx.skip_ratio(Phase.DECODE))),
            }
            out["batches"] = ctx.batches
        if self.controller is not None:
            out["mode_switch"] = simple(retry_resized(self.controller.summary))
        return out


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


