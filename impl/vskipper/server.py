"""OpenAI-compatible ``/v1/completions`` endpoint in front of ONE vSkipper engine arm (Sec. 4.1, "Arms").

The paper serves every arm behind SGLang's HTTP server and drives it with SGLang's serving benchmark
and lm-eval's ``local-completions`` client. Here the engine is transformers' continuous-batching
manager (DESIGN.md: SGLang / vLLM cannot serve on CPU, ``transformers serve`` needs fastapi, rejects
``ignore_eos`` and ignores ``stop`` under continuous batching), so this module puts a small
standard-library HTTP server (``http.server.ThreadingHTTPServer``) in front of it.

**Arms** (:data:`ARMS`), all on the same engine settings (:func:`~impl.vskipper.engine.routed_cb_config`):

- ``upstream``: the unmodified engine (no skipper bound; dense);
- ``hybrid``: vSkipper with the profitability-aware mode switch (a
  :class:`~impl.vskipper.mode.ModeController` of the given :class:`~impl.vskipper.mode.ModeSwitch`
  as the engine's per-batch planner, Sec. 3.3);
- ``always-route``: vSkipper with the switch disabled (every row of every request routed);
- the mechanism ablations of Table 3 (``prefill-only``, ``decode-only``, ``no-promotion``,
  ``never-route``): the switch under :meth:`ModeSwitch.ablation`.

**One shared engine.** Every HTTP request runs in its own thread (``ThreadingHTTPServer``) and is
added to ONE continuous-batching manager (``model.init_continuous_batching``), so concurrent
requests are batched together by the engine's scheduler. The manager runs its own generation
thread; a dispatcher thread drains the manager's output queue (``manager.get_result``) and routes
every streamed ``GenerationOutput`` to its request's own queue, from which the request's HTTP
thread streams the tokens. Requests are added with ``streaming=True`` so every generated token is
delivered as soon as the engine appended it.

**Requests** (``POST /v1/completions``; unknown fields are ignored, known but unsupported ones get a
400):

- ``prompt``: a string, a list of token ids, or a list of strings / of token-id lists (several
  prompts, one choice each; streaming takes exactly one). Strings are tokenized by the model
  directory's tokenizer (``add_special_tokens`` as configured, default True: a tokenizer that adds a
  BOS adds it here, as vLLM / SGLang do); token ids go to the engine unchanged.
- ``max_tokens`` (default 16, >= 1), ``temperature`` (0 / omitted: greedy; > 0 is refused: the
  shared manager decodes greedily, which is what the paper's serving and quality protocols use),
  ``stream``, ``stop`` (string or list; the text is cut before the first stop string, the request
  is cancelled in the engine, ``finish_reason="stop"``), ``logprobs`` (0..``max_logprobs``: the
  chosen token's log-probability and the top-k per generated token, OpenAI's ``logprobs`` object
  plus ``top_logprob_ids`` with the ids), ``model`` (must be the served name or omitted),
  ``ignore_eos`` (SGLang / vLLM extension: generate exactly ``max_tokens`` tokens),
  ``generation_config`` (transformers-serve style JSON string or object: ``eos_token_id: -1`` means
  ignore EOS, ``max_new_tokens`` is used when ``max_tokens`` is absent), ``skip_special_tokens``
  (default True), ``request_id`` / ``rid`` or the ``X-Request-ID`` header (the engine request id:
  RandomSkip hashes it, so a client can reproduce routes across arms; a list of several prompts uses
  ``<id>-<i>``; an id that is still in flight gets a 409).
- Refused with 400: ``n`` / ``best_of`` > 1, ``echo`` (prompt log-probabilities: the engine does not
  compute them, so lm-eval's loglikelihood requests cannot be served), a non-empty ``suffix``,
  non-zero penalties, ``logit_bias``, ``min_tokens`` > 0.

**Responses.** Non-streaming: ``choices[i]`` with ``text``, ``finish_reason`` (``length`` / ``stop``),
``logprobs`` (or null), ``token_ids`` and a ``vskipper`` object (engine request id, arm, and for
switch arms the request's modes: ``prefill_routed``, ``decode_routed_from`` - the absolute token
index of its first routed decode row, None when decode stayed dense - and ``promoted``), plus
``usage`` {``prompt_tokens``, ``completion_tokens``, ``total_tokens``}; ``completion_tokens`` counts
every generated token, the EOS included (as the engine and the in-process arm count it).
Streaming (server-sent events): one ``data: {...}`` chunk per generated token with
``choices[0].text`` (the text the token completes; "" for a special token or an incomplete UTF-8
byte sequence, and text that may start a stop string is held back until it cannot), ``token_ids``
([the id]) and ``logprobs`` when requested; the last token's chunk carries ``finish_reason``; then a
chunk with ``choices: []`` and ``usage``, then ``data: [DONE]``. Errors are JSON
``{"error": {"message", "type", "param", "code"}}`` with a 4xx / 5xx status (after a stream
started: a ``data: {"error": ...}`` chunk and ``data: [DONE]``).

**Other endpoints**: ``GET /health`` (200 once the engine is up and warmed, 503 otherwise),
``GET /v1/models``, ``GET /v1/vskipper/stats`` (the arm's settings, resolved engine configuration,
routed-row statistics and the mode switch's summary).

**Top-k log-probabilities.** The engine only returns the chosen token's log-probability (and only
when the whole manager runs with ``return_logprobs``). For requests that ask for ``logprobs``, the
server wraps the batch processor's sampling step (``model_runner._sample``, on the instance only):
after the engine sampled, it takes ``log_softmax`` of the rows of those requests and records the
chosen token's log-probability and the top k (k = the request's ``logprobs``), keyed by request
and completion index. Batches without such requests pay one dictionary check. The values are
computed from the same fp32 scores the engine sampled from (for greedy the top-1 is the emitted
token).

Use :func:`serve` (``block=False`` returns a running :class:`CompletionServer`; tests use port 0)
or the command line::

    python -m impl.vskipper.server --model DIR --arm hybrid --skipper randomskip:r=0.5,d=0.5 --port 0

which prints one JSON line ``{"listening": URL, "port": N, ...}`` once the engine is warm and shuts
down cleanly on SIGTERM / SIGINT (stop accepting, let in-flight requests finish for
``--grace-s`` seconds, then stop the engine).

Limitations: greedy decoding only; no prompt log-probabilities (``echo``); the mode switch's state
(share estimate, probe schedule, routed-row counts) lives as long as the server (restart it for a
fresh switch), while each request's own mode entries are dropped when it finishes so that request
ids can be reused; a mode switch's decisions depend on arrival timing, so hybrid outputs are only
reproducible when the switch's decisions are.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import json
import logging
import math
import queue
import signal
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch

from .engine import bind_skipper, routed_cb_config, unbind_skipper
from .mode import ModeController, ModeSwitch
from .random_skip import RandomSkip
from .routed import routed_context
from .skipper import Phase, Skipper, StaticDepthSkipper, build_skipper

__all__ = [
    "ARMS",
    "CompletionEngine",
    "CompletionServer",
    "EngineError",
    "parse_skipper_spec",
    "parse_layers",
    "make_server",
    "serve",
    "main",
]

logger = logging.getLogger(__name__)

#: arm names: the paper's three serving arms, then the mode-switch mechanism ablations (Table 3)
ARMS = ("upstream", "hybrid", "always-route", "prefill-only", "decode-only", "no-promotion", "never-route")
_SWITCH_ARMS = {"hybrid": "served", "prefill-only": "prefill-only", "decode-only": "decode-only",
                "no-promotion": "no-promotion", "never-route": "never-route"}
_WARMUP_ID = "__vskipper_server_warmup__"
_MAX_BODY = 64 << 20
_MAX_PROMPTS = 1024
_MAX_ID_LEN = 256
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


# ======================================================================================================
# Skipper specs
# ======================================================================================================
def parse_layers(text: str, num_layers: int) -> list[int]:
    """Parse a layer list: ``+``-separated items, each an index or an inclusive range ``a-b``
    (e.g. ``"6-11"``, ``"0+2+4-7"``).

    Raises:
        ValueError: for a malformed item, an empty list, or an index outside ``[0, num_layers)``.
    """
    out: list[int] = []
    for item in str(text).replace(" ", "").split("+"):
        if not item:
            continue
        try:
            if "-" in item:
                a, b = item.split("-", 1)
                out.extend(range(int(a), int(b) + 1))
            else:
                out.append(int(item))
        except ValueError:
            raise ValueError(f"bad layer item {item!r} in {text!r} (use e.g. '6-11' or '0+2+4-7')") from None
    if not out:
        raise ValueError(f"empty layer list {text!r}")
    bad = [x for x in out if not 0 <= x < num_layers]
    if bad:
        raise ValueError(f"layers {bad} outside the model's {num_layers} layers")
    return sorted(set(out))


def _literal(v: str):
    low = v.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for cast in (int, float):
        try:
            return cast(v)
        except ValueError:
            pass
    return v


def _kv(rest: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in rest.split(","):
        item = item.strip()
        if not item:
            continue
        if "=" not in item:
            raise ValueError(f"skipper parameter {item!r} is not KEY=VALUE")
        k, v = item.split("=", 1)
        out[k.strip()] = v.strip()
    return out


def _num_layers(model) -> int | None:
    if model is None:
        return None
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return int(cfg.num_hidden_layers)


def parse_skipper_spec(spec: Any, model=None) -> Skipper:
    """Build a skip policy from a compact spec.

    Accepted forms:

    - a :class:`~impl.vskipper.skipper.Skipper` (returned as is);
    - ``"randomskip:r=R,d=D[,seed=S][,layers=L][,layer_choice=per_row|fixed]"`` (also ``random:``):
      :class:`~impl.vskipper.random_skip.RandomSkip`; ``layers`` in :func:`parse_layers` syntax,
      default the second half of the model's layers (FlexiDepth routes the last 16 of 32);
    - ``"flexidepth:DIR"`` / ``"flexidepth:checkpoint=DIR"`` or a bare checkpoint directory: a
      FlexiDepth checkpoint (:func:`~impl.vskipper.flexidepth.load_flexidepth`, checked against
      ``model``);
    - ``"static:n_run=N[,layers=L]"`` (also ``static-depth:``): :class:`~impl.vskipper.skipper.StaticDepthSkipper`;
    - ``"NAME:k=v,..."``: any registered policy (:func:`~impl.vskipper.skipper.build_skipper`), values
      parsed as int / float / bool / None / str;
    - a mapping ``{"name": NAME, **kwargs}`` (same names).

    Args:
        spec: the spec.
        model: the causal LM the policy is for (number of layers for the defaults, device / dtype and
            shape checks for checkpoints); needed for RandomSkip / static without ``layers``.

    Raises:
        ValueError: for an empty or malformed spec, missing parameters, or an unknown name.
        FileNotFoundError: for a missing checkpoint directory.
    """
    if isinstance(spec, Skipper):
        return spec
    if isinstance(spec, Mapping):
        kw = dict(spec)
        name = str(kw.pop("name", "")).lower()
        rest_kw: dict[str, Any] = kw
        rest = None
    else:
        s = str(spec).strip()
        if not s:
            raise ValueError("empty skipper spec")
        if Path(s).is_dir() and (Path(s) / "flexidepth.json").is_file():
            name, rest = "flexidepth", s
        else:
            name, _, rest = s.partition(":")
            name = name.strip().lower()
        rest_kw = None
    L = _num_layers(model)

    def params() -> dict[str, Any]:
        return dict(rest_kw) if rest_kw is not None else _kv(rest or "")

    def layers_of(kw: dict) -> list[int]:
        raw = kw.pop("layers", None)
        if raw is None:
            if L is None:
                raise ValueError(f"skipper {name!r}: pass layers=... or a model (default: the second half)")
            return list(range(L // 2, L))
        if isinstance(raw, (list, tuple)):
            return [int(x) for x in raw]
        if L is None:
            return parse_layers(str(raw), 1 << 30)
        return parse_layers(str(raw), L)

    if name in ("randomskip", "random", "random_skip", "random-skip"):
        kw = params()
        layers = layers_of(kw)
        try:
            r, d = float(kw.pop("r")), float(kw.pop("d"))
        except KeyError as exc:
            raise ValueError(f"randomskip needs r=... and d=... (got {spec!r})") from exc
        seed = int(kw.pop("seed", 0))
        choice = str(kw.pop("layer_choice", "per_row"))
        if kw:
            raise ValueError(f"randomskip: unknown parameters {sorted(kw)}")
        return RandomSkip(layers, r=r, d=d, seed=seed, layer_choice=choice)
    if name == "flexidepth":
        from .flexidepth import load_flexidepth

        if rest_kw is not None:
            kw = dict(rest_kw)
            path = kw.pop("checkpoint", None) or kw.pop("path", None)
        elif rest and "=" not in rest:
            path, kw = rest, {}
        else:
            kw = params()
            path = kw.pop("checkpoint", None) or kw.pop("path", None)
        if not path:
            raise ValueError("flexidepth needs a checkpoint directory: 'flexidepth:DIR'")
        if kw:
            raise ValueError(f"flexidepth: unknown parameters {sorted(kw)}")
        return load_flexidepth(path, model)
    if name in ("static", "static-depth", "static_depth"):
        kw = params()
        layers = layers_of(kw)
        if "n_run" not in kw:
            raise ValueError("static needs n_run=...")
        n_run = int(kw.pop("n_run"))
        if kw:
            raise ValueError(f"static: unknown parameters {sorted(kw)}")
        return StaticDepthSkipper(layers, n_run)
    if not name:
        raise ValueError(f"skipper spec {spec!r} has no name")
    kw = params()
    if rest_kw is None:
        kw = {k: _literal(v) for k, v in kw.items()}
    if "layers" in kw and "routed_layers" not in kw:
        kw["routed_layers"] = layers_of(kw)
    try:
        return build_skipper(name, **kw)
    except TypeError as exc:  # wrong / missing keyword for the registered policy's constructor
        raise ValueError(f"skipper {name!r}: bad parameters {sorted(kw)} ({exc})") from None


def _describe_skipper(sk: Skipper | None) -> dict | None:
    if sk is None:
        return None
    out = {"class": type(sk).__name__, "routed_layers": list(sk.routed_layers), "repr": sk.extra_repr()}
    ratio = getattr(sk, "skip_ratio", None)
    if isinstance(ratio, (int, float)):
        out["skip_ratio"] = float(ratio)
    return out


# ======================================================================================================
# Engine side
# ======================================================================================================
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
class _Live:
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
        self._live: dict[str, _Live] = {}
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

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of token ids (no lock: decoding does not touch the tokenizer's mutable settings, unlike
        encoding, which may reset truncation / padding)."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def submit(self, prompt_ids: Sequence[int], max_new_tokens: int, *, ignore_eos: bool = False,
               eos_token_id: Any = None, request_id: str | None = None, top_logprobs: int | None = None,
               reuse_wait_s: float = 5.0) -> _Live:
        """Add one request to the shared manager and return its handle (iterate :meth:`events`).

        Args:
            prompt_ids: prompt token ids (non-empty).
            max_new_tokens: tokens to generate at most (>= 1).
            ignore_eos: generate exactly ``max_new_tokens`` tokens.
            eos_token_id: this request's stop token(s) (default: the engine's).
            request_id: the engine request id (default: a fresh ``cmpl-...``); RandomSkip hashes it.
            top_logprobs: None, or k >= 0 to record log-probabilities with the top k.
            reuse_wait_s: how long to wait for a cancelled request with the same id to be released.

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
        live = _Live(rid, ids, int(max_new_tokens), eos_set, top_logprobs)
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

    def cancel(self, live: _Live) -> None:
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

    def events(self, live: _Live, timeout_s: float | None = None) -> Iterator[TokenEvent]:
        """Yield the request's tokens as the engine produces them.

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
                self.cancel(live)
                raise EngineError(f"request {live.rid!r} did not finish within the server's timeout", 504,
                                  "timeout") from None
            if isinstance(out, _Failure):
                raise EngineError(out.message, out.status)
            ids = list(out.generated_tokens)
            done = out.is_finished()
            if done and out.error is not None:
                raise EngineError(f"the engine failed request {live.rid!r}: {out.error}", 500)
            for j in range(seen, len(ids)):
                last = done and j == len(ids) - 1
                lp, top = (None, None)
                if live.top_k is not None:
                    rec = live.logprobs.get(j)
                    lp, top = (rec[0], rec[1]) if rec is not None else (None, [])
                reason = None
                if last:
                    reason = "stop" if ids[j] in live.eos else "length"
                yield TokenEvent(j, int(ids[j]), lp, top, last, reason)
            seen = max(seen, len(ids))
            if done:
                return

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
        live.queue.put(out)

    def _mode_info(self, live: _Live, count: bool = False) -> dict:
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
            lv.queue.put(_Failure(message, status))

    # ----------------------------------------------------------------------------------- describe
    def describe(self) -> dict:
        """The arm's declared settings and running statistics (JSON-able), for ``/v1/vskipper/stats``."""
        out = {
            "arm": self.arm,
            "served_model_name": self.served_model_name,
            "healthy": self.healthy,
            "skipper": _describe_skipper(self.skipper),
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
class _Detokenizer:
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


class _Assembler:
    """Completion text of one choice: detokenized deltas, cut at the first stop string; text that may
    begin a stop string is held back until it cannot."""

    def __init__(self, engine: CompletionEngine, prompt_ids: Sequence[int], stops: Sequence[str],
                 skip_special: bool):
        self.detok = _Detokenizer(engine, list(prompt_ids)[-6:], skip_special)
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


# ======================================================================================================
# HTTP side
# ======================================================================================================
class _HTTPError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = int(status), message, param
        self.kind = kind or ("invalid_request_error" if 400 <= status < 500 else "server_error")


@dataclass
class _Parsed:
    prompts: list[list[int]]
    max_tokens: int
    stream: bool
    stops: list[str]
    ignore_eos: bool
    eos_token_id: Any
    logprobs: int | None
    skip_special: bool
    request_id: str | None


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _parse_request(body: dict, engine: CompletionEngine, header_rid: str | None) -> _Parsed:
    """Validate a /v1/completions body (module docstring); raises :class:`_HTTPError` (4xx)."""
    model = body.get("model")
    if model is not None:
        if not isinstance(model, str):
            raise _HTTPError(400, "'model' must be a string", "model")
        if model not in engine.model_names:
            raise _HTTPError(404, f"model {model!r} is not served here; this server serves "
                                  f"{engine.served_model_name!r}", "model", "model_not_found")
    gc_raw = body.get("generation_config")
    gen: dict = {}
    if gc_raw is not None:
        if isinstance(gc_raw, str):
            try:
                gen = json.loads(gc_raw)
            except json.JSONDecodeError:
                raise _HTTPError(400, "'generation_config' is not valid JSON", "generation_config") from None
        elif isinstance(gc_raw, dict):
            gen = gc_raw
        if not isinstance(gen, dict):
            raise _HTTPError(400, "'generation_config' must be a JSON object", "generation_config")
        if gen.get("do_sample"):
            raise _HTTPError(400, "sampling is not supported: this server decodes greedily", "generation_config")
        if gen.get("num_return_sequences", 1) not in (1, None):
            raise _HTTPError(400, "num_return_sequences must be 1", "generation_config")

    # max_tokens
    mt = body.get("max_tokens", None)
    if mt is None:
        mt = gen.get("max_new_tokens", 16)
    if not _is_int(mt):
        raise _HTTPError(400, f"'max_tokens' must be an integer, got {mt!r}", "max_tokens")
    if mt < 1:
        raise _HTTPError(400, f"'max_tokens' must be >= 1, got {mt}", "max_tokens")
    # sampling
    temp = body.get("temperature")
    if temp is not None:
        if isinstance(temp, bool) or not isinstance(temp, (int, float)) or temp < 0:
            raise _HTTPError(400, f"'temperature' must be a number >= 0, got {temp!r}", "temperature")
        if temp > 0:
            raise _HTTPError(400, "only greedy decoding is supported (temperature 0 or omitted): the shared "
                                  "continuous-batching manager of this arm decodes greedily", "temperature")
    for key in ("n", "best_of"):
        v = body.get(key)
        if v is not None and v != 1:
            raise _HTTPError(400, f"'{key}' must be 1 (one completion per prompt)", key)
    if body.get("echo"):
        raise _HTTPError(400, "'echo' (prompt log-probabilities) is not supported: the engine does not compute "
                              "prompt logits, so loglikelihood requests cannot be served", "echo")
    if body.get("suffix"):
        raise _HTTPError(400, "'suffix' is not supported", "suffix")
    for key in ("presence_penalty", "frequency_penalty"):
        v = body.get(key)
        if v not in (None, 0, 0.0):
            raise _HTTPError(400, f"'{key}' is not supported (must be 0)", key)
    if body.get("repetition_penalty") not in (None, 1, 1.0):
        raise _HTTPError(400, "'repetition_penalty' is not supported (must be 1)", "repetition_penalty")
    if body.get("logit_bias"):
        raise _HTTPError(400, "'logit_bias' is not supported", "logit_bias")
    if body.get("min_tokens") not in (None, 0):
        raise _HTTPError(400, "'min_tokens' is not supported", "min_tokens")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise _HTTPError(400, "'stream' must be a boolean", "stream")
    stop = body.get("stop")
    if stop is None:
        stops: list[str] = []
    elif isinstance(stop, str):
        stops = [stop] if stop else []
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = [s for s in stop if s]
    else:
        raise _HTTPError(400, "'stop' must be a string or a list of strings", "stop")
    ign = body.get("ignore_eos", False)
    if ign is None:
        ign = False
    if not isinstance(ign, bool):
        raise _HTTPError(400, "'ignore_eos' must be a boolean", "ignore_eos")
    eos_override = None
    if "eos_token_id" in gen:
        e = gen["eos_token_id"]
        if e is None or e == -1 or e == [-1]:
            ign = True
        elif _is_int(e) or (isinstance(e, list) and all(_is_int(x) for x in e)):
            eos_override = e
        else:
            raise _HTTPError(400, "generation_config.eos_token_id must be an int or a list of ints",
                             "generation_config")
    lp = body.get("logprobs")
    if lp is not None:
        if not _is_int(lp) or lp < 0:
            raise _HTTPError(400, f"'logprobs' must be an integer >= 0, got {lp!r}", "logprobs")
        if engine.max_logprobs <= 0:
            raise _HTTPError(400, "this server was started with max_logprobs=0: logprobs are disabled", "logprobs")
        if lp > engine.max_logprobs:
            raise _HTTPError(400, f"'logprobs' must be <= {engine.max_logprobs} (the server's max_logprobs)",
                             "logprobs")
    skip = body.get("skip_special_tokens", True)
    if not isinstance(skip, bool):
        raise _HTTPError(400, "'skip_special_tokens' must be a boolean", "skip_special_tokens")
    rid = body.get("request_id", body.get("rid", header_rid))
    if rid is not None:
        if not isinstance(rid, str) or not rid or len(rid) > _MAX_ID_LEN:
            raise _HTTPError(400, f"'request_id' must be a non-empty string of at most {_MAX_ID_LEN} characters",
                             "request_id")

    # prompts
    if "prompt" not in body:
        raise _HTTPError(400, "'prompt' is required", "prompt")
    prompts = _parse_prompts(body["prompt"], engine)
    if stream and len(prompts) != 1:
        raise _HTTPError(400, "streaming takes exactly one prompt", "prompt")
    for p in prompts:
        if len(p) + mt > engine.max_model_len:
            raise _HTTPError(400, f"prompt ({len(p)} tokens) + max_tokens ({mt}) exceeds the maximum context "
                                  f"length {engine.max_model_len}", "prompt", "context_length_exceeded")
    return _Parsed(prompts, int(mt), stream, stops, bool(ign), eos_override, lp, skip, rid)


def _parse_prompts(prompt: Any, engine: CompletionEngine) -> list[list[int]]:
    def ids_ok(ids: list) -> list[int]:
        if not ids:
            raise _HTTPError(400, "empty prompt", "prompt")
        bad = [t for t in ids if not _is_int(t) or not 0 <= t < engine.vocab_size]
        if bad:
            raise _HTTPError(400, f"prompt token ids must be integers in [0, {engine.vocab_size}), got "
                                  f"{bad[:5]}", "prompt")
        return [int(t) for t in ids]

    def text_ok(s: str) -> list[int]:
        if not s:
            raise _HTTPError(400, "empty prompt", "prompt")
        ids = engine.tokenize(s)
        if not ids:
            raise _HTTPError(400, "the prompt tokenizes to no tokens", "prompt")
        return ids

    if isinstance(prompt, str):
        return [text_ok(prompt)]
    if not isinstance(prompt, list):
        raise _HTTPError(400, "'prompt' must be a string, a list of token ids, or a list of strings / token-id "
                              "lists", "prompt")
    if not prompt:
        raise _HTTPError(400, "empty prompt", "prompt")
    if len(prompt) > _MAX_PROMPTS and not all(_is_int(x) for x in prompt):
        raise _HTTPError(400, f"at most {_MAX_PROMPTS} prompts per request", "prompt")
    if all(_is_int(x) for x in prompt):
        return [ids_ok(prompt)]
    if all(isinstance(x, str) for x in prompt):
        return [text_ok(x) for x in prompt]
    if all(isinstance(x, list) for x in prompt):
        return [ids_ok(x) for x in prompt]
    raise _HTTPError(400, "'prompt' mixes types: use a string, a list of token ids, or a list of strings / "
                          "token-id lists", "prompt")


def _error_body(status: int, message: str, param: str | None = None, kind: str | None = None) -> dict:
    kind = kind or ("invalid_request_error" if 400 <= status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def _completion_id(rid: str) -> str:
    return rid if rid.startswith("cmpl-") else f"cmpl-{rid}"


class _ClientGone(Exception):
    pass


class _Handler(BaseHTTPRequestHandler):
    """One HTTP request (one thread, ``ThreadingHTTPServer``)."""

    server_version = "vskipper-server/1"
    protocol_version = "HTTP/1.0"

    def log_message(self, fmt, *args):  # noqa: D401 - quiet by default
        logger.debug("%s - %s", self.address_string(), fmt % args)

    @property
    def engine(self) -> CompletionEngine:
        return self.server.engine  # type: ignore[attr-defined]

    # -- plumbing ------------------------------------------------------------------------------------
    def _send_json(self, status: int, obj: dict) -> None:
        data = json.dumps(obj).encode("utf-8")
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            pass

    def _send_error(self, status: int, message: str, param: str | None = None, kind: str | None = None) -> None:
        self._send_json(status, _error_body(status, message, param, kind))

    def _sse(self, obj) -> None:
        payload = obj if isinstance(obj, str) else json.dumps(obj)
        try:
            self.wfile.write(f"data: {payload}\n\n".encode("utf-8"))
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError, OSError) as exc:
            raise _ClientGone() from exc

    def _read_json(self) -> dict:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            raise _HTTPError(411, "chunked request bodies are not supported: send Content-Length")
        raw_len = self.headers.get("Content-Length")
        if raw_len is None:
            raise _HTTPError(411, "Content-Length is required")
        try:
            n = int(raw_len)
        except ValueError:
            raise _HTTPError(400, "bad Content-Length") from None
        if n < 0:
            raise _HTTPError(400, "bad Content-Length")
        if n > _MAX_BODY:
            raise _HTTPError(413, f"request body larger than {_MAX_BODY} bytes")
        raw = self.rfile.read(n)
        try:
            body = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise _HTTPError(400, f"the request body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise _HTTPError(400, "the request body must be a JSON object")
        return body

    # -- routes --------------------------------------------------------------------------------------
    def do_GET(self):  # noqa: N802
        """``/health``, ``/v1/models``, ``/v1/models/<name>``, ``/v1/vskipper/stats``."""
        path = self.path.split("?", 1)[0].rstrip("/") or "/"
        eng = self.engine
        if path == "/health":
            if eng.healthy:
                return self._send_json(200, {"status": "ok", "arm": eng.arm, "model": eng.served_model_name})
            return self._send_error(503, eng.error or "the engine is not ready", kind="service_unavailable")
        if path == "/v1/models":
            return self._send_json(200, {"object": "list", "data": [self._model_card()]})
        if path.startswith("/v1/models/"):
            name = path[len("/v1/models/"):]
            if name in eng.model_names:
                return self._send_json(200, self._model_card())
            return self._send_error(404, f"model {name!r} not found", kind="model_not_found")
        if path == "/v1/vskipper/stats":
            return self._send_json(200, eng.describe())
        if path == "/v1/completions":
            return self._send_error(405, "use POST for /v1/completions", kind="method_not_allowed")
        return self._send_error(404, f"no route {path!r}", kind="not_found")

    def _model_card(self) -> dict:
        eng = self.engine
        return {"id": eng.served_model_name, "object": "model", "created": eng.created, "owned_by": "vskipper",
                "max_model_len": eng.max_model_len, "arm": eng.arm}

    def do_POST(self):  # noqa: N802
        """``/v1/completions``."""
        path = self.path.split("?", 1)[0].rstrip("/")
        if path != "/v1/completions":
            if path in ("/health", "/v1/models", "/v1/vskipper/stats"):
                return self._send_error(405, f"use GET for {path}", kind="method_not_allowed")
            return self._send_error(404, f"no route {path!r}", kind="not_found")
        try:
            body = self._read_json()
            if not self.engine.healthy:
                raise _HTTPError(503, self.engine.error or "the engine is not ready", kind="service_unavailable")
            req = _parse_request(body, self.engine, self.headers.get("X-Request-ID"))
        except _HTTPError as e:
            return self._send_error(e.status, e.message, e.param, e.kind)
        except Exception as e:  # a bug in validation must not kill the server
            logger.exception("request validation failed")
            return self._send_error(500, f"{type(e).__name__}: {e}")
        try:
            if req.stream:
                self._stream(req)
            else:
                self._complete(req)
        except _ClientGone:
            pass
        except Exception as e:
            logger.exception("completion failed")
            self._send_error(500, f"{type(e).__name__}: {e}")

    # -- completions ---------------------------------------------------------------------------------
    def _submit(self, req: _Parsed) -> list[_Live]:
        eng = self.engine
        lives: list[_Live] = []
        try:
            for i, ids in enumerate(req.prompts):
                rid = req.request_id
                if rid is not None and len(req.prompts) > 1:
                    rid = f"{rid}-{i}"
                lives.append(eng.submit(ids, req.max_tokens, ignore_eos=req.ignore_eos, eos_token_id=req.eos_token_id,
                                        request_id=rid, top_logprobs=req.logprobs))
        except EngineError:
            for lv in lives:
                eng.cancel(lv)
            raise
        return lives

    def _logprob_obj(self, events: list[TokenEvent], offsets: list[int]) -> dict:
        eng = self.engine
        return {
            "tokens": [eng.decode([e.token_id], skip_special_tokens=False) for e in events],
            "token_logprobs": [e.logprob for e in events],
            "top_logprobs": [{eng.decode([t], skip_special_tokens=False): v for t, v in (e.top or [])}
                             for e in events],
            "top_logprob_ids": [[[t, v] for t, v in (e.top or [])] for e in events],
            "text_offset": list(offsets),
        }

    def _vsk(self, live: _Live) -> dict:
        return {"request_id": live.rid, "arm": self.engine.arm, **(live.modes or {})}

    def _run_one(self, live: _Live, req: _Parsed, on_token: Callable | None = None):
        """Consume one request's tokens; returns (text, events, text offsets, finish_reason)."""
        eng = self.engine
        asm = _Assembler(eng, live.prompt_ids, req.stops, req.skip_special)
        events: list[TokenEvent] = []
        offsets: list[int] = []
        reason = None
        for ev in eng.events(live):
            offset = len(asm.text)
            piece = asm.push(ev.token_id, ev.final)
            events.append(ev)
            offsets.append(min(offset, len(asm.text)))
            if asm.stopped:
                reason = "stop"
                eng.cancel(live)  # no-op when the engine already finished it
            elif ev.final:
                reason = ev.finish_reason
            if on_token is not None:
                on_token(ev, piece, reason, offsets[-1])
            if asm.stopped:
                break
        return asm.text, events, offsets, reason or "length"

    def _complete(self, req: _Parsed) -> None:
        eng = self.engine
        try:
            lives = self._submit(req)
        except EngineError as e:
            return self._send_error(e.status, str(e), kind=e.kind)
        choices = []
        usage = {"prompt_tokens": 0, "completion_tokens": 0}
        try:
            for i, live in enumerate(lives):
                text, events, offsets, reason = self._run_one(live, req)
                choices.append({
                    "index": i, "text": text, "finish_reason": reason,
                    "logprobs": self._logprob_obj(events, offsets) if req.logprobs is not None else None,
                    "token_ids": [e.token_id for e in events],
                    "vskipper": self._vsk(live),
                })
                usage["prompt_tokens"] += len(live.prompt_ids)
                usage["completion_tokens"] += len(events)
        except EngineError as e:
            for lv in lives:
                eng.cancel(lv)
            return self._send_error(e.status, str(e), kind=e.kind)
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        self._send_json(200, {"id": _completion_id(lives[0].rid), "object": "text_completion",
                              "created": int(time.time()), "model": eng.served_model_name, "choices": choices,
                              "usage": usage})

    def _stream(self, req: _Parsed) -> None:
        eng = self.engine
        try:
            (live,) = self._submit(req)
        except EngineError as e:
            return self._send_error(e.status, str(e), kind=e.kind)
        cid, created = _completion_id(live.rid), int(time.time())
        try:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")
            self.end_headers()
        except (BrokenPipeError, ConnectionResetError, OSError):
            eng.cancel(live)
            return

        def chunk(choices, **extra):
            return {"id": cid, "object": "text_completion", "created": created, "model": eng.served_model_name,
                    "choices": choices, **extra}

        def on_token(ev: TokenEvent, piece: str, reason, offset: int):
            ch = {"index": 0, "text": piece, "token_ids": [ev.token_id], "finish_reason": reason,
                  "logprobs": self._logprob_obj([ev], [offset]) if req.logprobs is not None else None}
            if reason is not None:
                ch["vskipper"] = self._vsk(live)
            self._sse(chunk([ch]))

        try:
            _, events, _, reason = self._run_one(live, req, on_token)
            n = len(events)
            self._sse(chunk([], usage={"prompt_tokens": len(live.prompt_ids), "completion_tokens": n,
                                       "total_tokens": len(live.prompt_ids) + n}))
            self._sse("[DONE]")
        except _ClientGone:
            eng.cancel(live)
        except EngineError as e:
            eng.cancel(live)
            try:
                self._sse(_error_body(e.status, str(e), kind=e.kind))
                self._sse("[DONE]")
            except _ClientGone:
                pass


class CompletionServer(ThreadingHTTPServer):
    """The HTTP server of one :class:`CompletionEngine` (one thread per request).

    Attributes:
        engine: the engine arm.
        host, port, url: the bound address (``url`` is ``http://host:port``).
    """

    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 1024  # open-loop load: no client-side concurrency cap

    def __init__(self, engine: CompletionEngine, host: str = "127.0.0.1", port: int = 0):
        super().__init__((host, int(port)), _Handler)
        self.engine = engine
        self.host = self.server_address[0]
        self.port = int(self.server_address[1])
        self.url = f"http://{self.host}:{self.port}"
        self._thread: threading.Thread | None = None
        self._closed = False

    def start_background(self) -> "CompletionServer":
        """Serve in a daemon thread and return self."""
        self._thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.1},
                                        name="vskipper-http", daemon=True)
        self._thread.start()
        return self

    def close(self, grace_s: float = 0.0) -> None:
        """Stop accepting requests, stop the engine (in-flight requests get ``grace_s`` seconds) and
        release the socket. Safe to call twice; not from the serving thread."""
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            self.shutdown()
            self._thread.join(timeout=10)
        self.engine.stop(grace_s=grace_s)
        self.server_close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def make_server(engine: CompletionEngine, host: str = "127.0.0.1", port: int = 0) -> CompletionServer:
    """Bind a :class:`CompletionServer` for a started engine (port 0: any free port)."""
    return CompletionServer(engine, host, port)


# ======================================================================================================
# serve() and the command line
# ======================================================================================================
def _dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    table = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
             "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
    try:
        return table[str(name).lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose from {sorted(table)}") from None


def serve(model_dir: str | Path, arm: str = "hybrid", skipper_spec: Any = None, host: str = "127.0.0.1",
          port: int = 0, *, served_model_name: str | None = None, switch: ModeSwitch | Mapping | None = None,
          cb_overrides: Mapping[str, Any] | None = None, dtype: str | torch.dtype = "float32", device: str = "cpu",
          max_model_len: int | None = None, max_logprobs: int = 5, add_special_tokens: bool = True,
          request_timeout_s: float = 600.0, threads: int | None = None, warmup: bool = True,
          block: bool = True, grace_s: float = 30.0, on_ready: Callable[[CompletionServer], None] | None = None,
          ) -> CompletionServer:
    """Serve one engine arm of a model directory on an OpenAI-compatible HTTP endpoint.

    Args:
        model_dir: a Hugging Face model directory with its tokenizer.
        arm: one of :data:`ARMS` (``upstream``, ``hybrid``, ``always-route``, ablations).
        skipper_spec: the policy (:func:`parse_skipper_spec`), e.g. ``"randomskip:r=0.5,d=0.5"`` or
            ``"flexidepth:DIR"``; required by every arm but ``upstream`` (which validates and records
            it only).
        host, port: where to listen (port 0: any free port; read ``server.port``).
        served_model_name: the served name (default: the directory's name); the directory path is
            accepted as an alias.
        switch: the mode switch of the switch arms (a :class:`ModeSwitch` or its fields as a mapping;
            default ``ModeSwitch()``).
        cb_overrides: :func:`routed_cb_config` overrides (``page_size``, ``num_blocks``,
            ``max_batch_tokens``, ``max_requests_per_batch``, ...), the same for every arm.
        dtype, device: where the model runs.
        max_model_len, max_logprobs, add_special_tokens, request_timeout_s, warmup: see
            :class:`CompletionEngine`.
        threads: ``torch.set_num_threads`` (None: leave).
        block: True: serve until SIGTERM / SIGINT (signal handlers are installed when called from the
            main thread) or until the engine dies (``server.engine.error`` then says why), then shut
            down cleanly and return the closed server; False: return the
            running server at once (serving in a daemon thread; call ``server.close()``).
        grace_s: on a signal, how long in-flight requests may take to finish.
        on_ready: called with the server once it listens and the engine is warm.

    Returns:
        the :class:`CompletionServer` (running when ``block`` is False).

    Raises:
        FileNotFoundError: for a missing model directory; ValueError: for a bad arm / spec / setting.
    """
    from impl.models.load import load_model, load_tokenizer

    if arm not in ARMS:
        raise ValueError(f"unknown arm {arm!r}; choose from {', '.join(ARMS)}")
    if threads:
        torch.set_num_threads(int(threads))
    model_dir = Path(model_dir)
    model = load_model(model_dir, dtype=_dtype(dtype)).to(device)
    tokenizer = load_tokenizer(model_dir)
    if isinstance(switch, Mapping):
        switch = ModeSwitch(**dict(switch))
    skipper = parse_skipper_spec(skipper_spec, model) if skipper_spec is not None else None
    engine = CompletionEngine(
        model, tokenizer, arm, skipper=skipper, switch=switch, cb_config=routed_cb_config(**dict(cb_overrides or {})),
        served_model_name=served_model_name or model_dir.name,
        model_aliases=(str(model_dir), str(model_dir.resolve())), max_model_len=max_model_len,
        max_logprobs=max_logprobs, add_special_tokens=add_special_tokens, request_timeout_s=request_timeout_s,
        warmup=warmup)
    engine.start()
    try:
        server = make_server(engine, host, port)
    except BaseException:
        engine.stop()
        raise
    server.start_background()
    if on_ready is not None:
        on_ready(server)
    if not block:
        return server
    stop = threading.Event()
    installed = []
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            installed.append((sig, signal.signal(sig, lambda *_: stop.set())))
    try:
        while not stop.wait(0.5):
            if engine.error is not None:
                logger.error("engine died: %s", engine.error)
                break
    finally:
        server.close(grace_s=grace_s)
        for sig, prev in installed:
            signal.signal(sig, prev)
    return server


def _cb_kv(items: Sequence[str]) -> dict:
    out = {}
    for it in items or ():
        if "=" not in it:
            raise SystemExit(f"--cb expects KEY=VALUE, got {it!r}")
        k, v = it.split("=", 1)
        out[k.strip()] = _literal(v.strip())
    return out


def _switch_arg(switch: str | None, thresholds: str | None) -> ModeSwitch | None:
    sw = None
    if thresholds:
        sw = ModeSwitch.from_thresholds(json.loads(Path(thresholds).read_text()))
    if switch:
        text = Path(switch).read_text() if Path(switch).is_file() else switch
        fields = json.loads(text)
        fields = {k: (math.inf if v is None and k in ("min_prefill_tokens", "enter_threshold") else v)
                  for k, v in fields.items()}
        sw = ModeSwitch(**fields) if sw is None else dataclasses.replace(sw, **fields)
    return sw


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: ``python -m impl.vskipper.server --model DIR --arm ARM [--skipper SPEC] [--port N]``.
    Prints one JSON line with the bound URL and port once the engine is warm; SIGTERM / SIGINT shut
    it down cleanly. Returns the exit status (0 after a signal, 1 when the engine died, 2 for a bad
    argument)."""
    ap = argparse.ArgumentParser(prog="python -m impl.vskipper.server", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="Hugging Face model directory (with tokenizer)")
    ap.add_argument("--arm", default="hybrid", choices=ARMS)
    ap.add_argument("--skipper", default=None,
                    help="randomskip:r=R,d=D[,seed=S,layers=A-B] | flexidepth:DIR | static:n_run=N[,layers=A-B] (alias static-depth:) | NAME:k=v,...")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0, help="0: any free port (printed)")
    ap.add_argument("--served-model-name", default=None)
    ap.add_argument("--switch", default=None, help="ModeSwitch fields as a JSON object or a JSON file")
    ap.add_argument("--thresholds", default=None, help="derive_thresholds() output (JSON file) for the switch")
    ap.add_argument("--cb", action="append", default=[], metavar="KEY=VALUE",
                    help="continuous-batching config override (repeatable), e.g. --cb num_blocks=512")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None, help="torch threads")
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--max-logprobs", type=int, default=5)
    ap.add_argument("--no-special-tokens", action="store_true", help="tokenize prompts without special tokens")
    ap.add_argument("--request-timeout-s", type=float, default=600.0)
    ap.add_argument("--grace-s", type=float, default=30.0, help="shutdown grace for in-flight requests")
    ap.add_argument("--ready-file", default=None, help="write the bound port to this file once ready")
    ap.add_argument("--log-level", default="WARNING")
    args = ap.parse_args(argv)
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.WARNING),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    def ready(server: CompletionServer) -> None:
        eng = server.engine
        print(json.dumps({"listening": server.url, "host": server.host, "port": server.port, "arm": eng.arm,
                          "model": eng.served_model_name}), flush=True)
        if args.ready_file:
            tmp = Path(args.ready_file).with_suffix(".tmp")
            tmp.write_text(f"{server.port}\n")
            tmp.replace(args.ready_file)

    try:
        server = serve(args.model, args.arm, args.skipper, args.host, args.port,
                       served_model_name=args.served_model_name, switch=_switch_arg(args.switch, args.thresholds),
                       cb_overrides=_cb_kv(args.cb), dtype=args.dtype, device=args.device,
                       max_model_len=args.max_model_len, max_logprobs=args.max_logprobs,
                       add_special_tokens=not args.no_special_tokens, request_timeout_s=args.request_timeout_s,
                       threads=args.threads, block=True, grace_s=args.grace_s, on_ready=ready)
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if server.engine.error is not None:
        print(f"error: {server.engine.error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
