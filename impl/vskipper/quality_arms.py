"""The four arms of the quality 2x2 as lm-eval language models (vSkipper Sec. 4.1 "Quality", Table 5 left,
App. E.1).

=====  =====================================  ==========================================================
arm    what                                    class
=====  =====================================  ==========================================================
A      base model, in process                  :class:`RecordingHFLM`: lm-eval's own HF backend
                                               (``HFLM``, ``model.generate``) on the local model dir
B      checkpoint, in process (plain PyTorch)  :class:`PlainRoutedLM`: routed layers installed
                                               (:func:`impl.vskipper.routed.install_routed_layers`),
                                               one plain forward per token; Project-Only rows follow
                                               the skipper
C      base model, served by the upstream      :class:`RecordingCompletionsLM` (lm-eval's
       arm                                     ``local-completions`` client) against a
                                               :class:`ServedEndpoint` ``arm="upstream"``: the vSkipper
                                               HTTP server (:mod:`impl.vskipper.server`) on the
                                               unmodified continuous-batching engine
D      checkpoint, served always-route         the same client against a :class:`ServedEndpoint`
                                               ``arm="always-route"`` with the skipper bound
=====  =====================================  ==========================================================

**Served arms over HTTP (the default, ``served="http"`` in :func:`impl.vskipper.quality_run.run_quality`).** As in
the paper, lm-eval is an API client of the served arms: :class:`RecordingCompletionsLM` is lm-eval's
``LocalCompletionsAPI`` (``local-completions``) with ``tokenized_requests=True``, ``batch_size=1`` and
``num_concurrent`` requests in flight (lm-eval's async path), POSTing token-id prompts to
``/v1/completions`` of a :class:`ServedEndpoint`: the stdlib OpenAI-compatible server of
:mod:`impl.vskipper.server` started in this process on ``127.0.0.1``, port 0, in front of ONE engine
arm (``upstream`` for C, ``always-route`` for D), shut down after the arm. Concurrent requests are
batched by the server's shared continuous-batching manager. The client differs from stock
``local-completions`` in three recorded, documented ways only:

- *tokenization*: lm-eval's TemplateAPI encodes contexts without special tokens unless
  ``add_bos_token``, while its HF backend (arm A) uses the tokenizer's default; the client encodes with
  arm A's rule (:func:`encode_context`, the ``tok_encode`` override) and sets ``max_length`` so that
  its left truncation (``max_length - 1 - max_gen_toks``) equals HFLM's (``max_length -
  max_gen_toks``). The paper controls the same difference by sending token ids (App. E.1);
- *request ids*: each request carries ``request_id = "<task>/<doc_id>"`` (the server's engine request
  id, what request-hashing skippers such as RandomSkip hash), as arm B uses, so B and D take the same
  routes;
- *recording*: the token ids each request carried are recorded client-side (from the payload) and
  server-side (a wrapper on the engine's ``submit``: the ids the engine actually received); the two
  must agree (else ``RuntimeError``) and the server-side ids are what the prompt-hash gate compares.
  The response's ``token_ids`` are cut by :class:`StopRule` (normally a no-op: the server stops at
  the same token) and recorded with the finish reason and the request's modes (``vskipper`` object).

The in-process path (``served="inprocess"``) keeps C and D as :class:`EngineLM` over the same engine
without HTTP (``impl.vskipper.engine.generate_greedy``, all of a task's requests submitted together).

Identical token ids (App. E.1, "All four quality arms receive identical token ids"): every arm turns a
request's context into ids exactly as lm-eval's HF backend does (:func:`encode_context`: the
tokenizer's own special-token rule unless ``add_bos_token`` is set, left truncation to
``max_length - max_gen_toks``) and records, per document, the ids it fed and their hash
(:func:`prompt_hash`); the runner refuses a run whose arms disagree on any document's hash. Arm A records
the ids HFLM actually passed to ``model.generate``; C and D the ids their server's engine received.

Stopping: every arm applies HFLM's rule (:class:`StopRule`): stop after the token at which the decoded
last ``len(stop_ids) + 2`` generated tokens contain a stop string (the EOS string is one) or the token
is an EOS id of the model's generation config, or after ``max_gen_toks`` tokens; the text is decoded
without special tokens and cut at the first stop string. The in-process engine cannot stop on strings,
so :class:`EngineLM` generates to EOS / ``max_gen_toks`` and is cut by the same rule afterwards (greedy
decoding is causal, so the kept prefix is what an early stop would have produced); the HTTP server
stops on the stop strings itself and the rule is applied to its ids as a check. Every record keeps the
request's stop strings (``until``), which the served-at-knee pass (:mod:`impl.vskipper.quality_served`) replays.

First-token log-probabilities (App. E.1): A and B from their own forward (full vocabulary); the
in-process engine from a hook on its LM head; the HTTP arms from the server's ``logprobs`` (the top
``max_logprobs`` per token; every other entry of the returned vector is ``-inf``, so a reference top-5
token outside the served top-k reads as a disagreement).

Request ids are ``"<task>/<doc_id>"`` in B and D, so request-hashing skippers (RandomSkip) take the same
routes in both.
"""

from __future__ import annotations

import copy
import hashlib
import json
import urllib.error
import urllib.request
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import torch
from lm_eval.api.model import LM
from lm_eval.models.huggingface import HFLM
from lm_eval.models.openai_completions import LocalCompletionsAPI
from lm_eval.models.utils import (
    handle_stop_sequences,
    has_bos_prefix,
    normalize_gen_kwargs,
    postprocess_generated_text,
    resolve_max_length,
)
from transformers import AutoConfig, DynamicCache, GenerationConfig

from impl.vskipper.api_server import make_server
from impl.vskipper.driver import CompletionEngine
from impl.vskipper.engine import bind_skipper, generate_greedy
from impl.vskipper.routed import install_routed_layers, plain_forward, routed_context
from impl.vskipper.skipper import validate_skipper

__all__ = [
    "ARMS",
    "GenRecord",
    "prompt_hash",
    "request_id_for",
    "encode_context",
    "eos_ids_in_dir",
    "eos_ids_of",
    "StopRule",
    "RecordingMixin",
    "RecordingHFLM",
    "PlainRoutedLM",
    "EngineLM",
    "ServedEndpoint",
    "RecordingCompletionsLM",
    "SERVER_ARM",
    "default_max_length",
]

#: arm -> (model, execution) as in Table 5 (left).
ARMS: dict[str, str] = {
    "A": "base model, in process (lm-eval HF backend)",
    "B": "checkpoint, in process (plain PyTorch, routed layers)",
    "C": "base model, served by the upstream arm (dense engine)",
    "D": "checkpoint, served by vSkipper always-route",
}
#: served arm -> the server arm (:data:`impl.vskipper.driver.ARMS`) it runs on
SERVER_ARM: dict[str, str] = {"C": "upstream", "D": "always-route"}

#: lm-eval's HF backend default generation budget (``HFLM.max_gen_toks``).
DEFAULT_MAX_GEN_TOKS = 256


def prompt_hash(ids: Sequence[int]) -> str:
    """SHA-256 (first 16 hex digits) of a token-id sequence (its int64 little-endian bytes)."""
    data = torch.as_tensor(list(ids), dtype=torch.int64).numpy().astype("<i8").tobytes()
    return hashlib.sha256(data).hexdigest()[:16]


def request_id_for(task: str, doc_id: int) -> str:
    """The request id of a document, shared by arms B and D (what request-hashing skippers hash)."""
    return f"{task}/{int(doc_id)}"


def default_max_length(model_or_config, tokenizer=None) -> int:
    """The context window lm-eval's HF backend would use (``resolve_max_length``: the config's
    ``n_positions`` / ``max_position_embeddings`` / ``n_ctx``, else the tokenizer's, else 2048)."""
    cfg = getattr(model_or_config, "config", model_or_config)
    return resolve_max_length(cfg, tokenizer, default=2048)


def encode_context(tokenizer, context: str, max_ctx_len: int | None, add_bos_token: bool | None = None) -> list[int]:
    """Token ids of one context exactly as ``HFLM.tok_batch_encode`` (batch of one) makes them.

    No special-token argument is passed (the tokenizer's default, e.g. a BOS for Llama-3) unless the
    text already starts with the BOS string (then none is added) or ``add_bos_token`` is set; then the
    ids are left-truncated to ``max_ctx_len``.
    """
    kwargs: dict[str, Any] = {}
    if has_bos_prefix(context, getattr(tokenizer, "bos_token", None)):
        kwargs = {"add_special_tokens": False}
    elif add_bos_token is not None:
        kwargs = {"add_special_tokens": add_bos_token}
    ids = list(tokenizer([context], truncation=False, **kwargs)["input_ids"][0])
    if max_ctx_len:
        ids = ids[-max_ctx_len:]
    return [int(t) for t in ids]


def eos_ids_of(config, generation_config=None) -> set[int]:
    """EOS ids ``generate`` stops at: the generation config's, else the model config's.

    Args:
        config: the model's ``PretrainedConfig`` (``model.config``).
        generation_config: its ``GenerationConfig`` (``model.generation_config``), or None.

    Returns:
        the EOS token ids (empty when neither config names one).
    """
    eos = getattr(generation_config, "eos_token_id", None) if generation_config is not None else None
    if eos is None:
        eos = getattr(config, "eos_token_id", None)
    if eos is None:
        return set()
    return {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}


def eos_ids_in_dir(model_dir) -> set[int]:
    """:func:`eos_ids_of` for an HF model directory, without loading its weights.

    Args:
        model_dir: HF model directory (``config.json``, optionally ``generation_config.json``).

    Raises:
        OSError: when ``config.json`` is missing or unreadable.
    """
    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    try:
        generation_config = GenerationConfig.from_pretrained(model_dir, local_files_only=True)
    except OSError:  # no generation_config.json: the model config's EOS
        generation_config = None
    return eos_ids_of(config, generation_config)


class StopRule:
    """HFLM's stopping rule on generated ids (``MultiTokenEOSCriteria`` plus the EOS criterion).

    Args:
        tokenizer: the tokenizer.
        until: stop strings (lm-eval's, the EOS string included).
        eos_ids: EOS token ids.
    """

    def __init__(self, tokenizer, until: Sequence[str], eos_ids: Iterable[int] = ()):
        self.tokenizer = tokenizer
        self.until = [s for s in until]
        self.eos_ids = {int(e) for e in eos_ids}
        self._lookback = [len(tokenizer.encode(s, add_special_tokens=False)) + 2 for s in self.until]

    def done(self, gen_ids: Sequence[int]) -> bool:
        """Whether generation stops after the last id of ``gen_ids`` (non-empty)."""
        if gen_ids and int(gen_ids[-1]) in self.eos_ids:
            return True
        for s, n in zip(self.until, self._lookback):
            if s in self.tokenizer.decode(list(gen_ids[-n:]), skip_special_tokens=False):
                return True
        return False

    def cut(self, gen_ids: Sequence[int]) -> list[int]:
        """The ids HFLM would have generated: the shortest prefix after which :meth:`done` holds, or all."""
        ids = [int(t) for t in gen_ids]
        for i in range(1, len(ids) + 1):
            if self.done(ids[:i]):
                return ids[:i]
        return ids

    def text(self, gen_ids: Sequence[int]) -> str:
        """The response lm-eval receives: decoded without special tokens, cut at the first stop string."""
        s = self.tokenizer.decode(list(gen_ids), skip_special_tokens=True)
        return postprocess_generated_text(generation=s, stop=list(self.until), think_end_token=None)


@dataclass
class GenRecord:
    """What one arm fed and produced for one document.

    Attributes:
        arm: "A".."D".
        task: lm-eval task name.
        doc_id: lm-eval document id.
        request_id: the request id (``<task>/<doc_id>``).
        prompt_ids: the token ids fed.
        prompt_hash: :func:`prompt_hash` of ``prompt_ids``.
        gen_ids: the generated ids up to and including the stopping token.
        text: the response returned to lm-eval.
        max_gen_toks: the generation budget.
        until: the request's stop strings as the arm applied them (lm-eval's ``until`` plus the EOS
            string).
        served: for the HTTP arms, what the server reported: ``finish_reason``, ``n_served_tokens``
            (ids in the response before the stop-rule cut), ``vskipper`` (engine request id, arm,
            modes); None for in-process arms.
    """

    arm: str
    task: str
    doc_id: int
    request_id: str
    prompt_ids: list[int]
    prompt_hash: str
    gen_ids: list[int]
    text: str
    max_gen_toks: int = 0
    until: list[str] = field(default_factory=list)
    served: dict | None = None

    def to_row(self, with_ids: bool = True) -> dict[str, Any]:
        """Plain-dict form for result rows (``with_ids=False`` drops the prompt ids)."""
        row = {
            "arm": self.arm, "task": self.task, "doc_id": self.doc_id, "request_id": self.request_id,
            "prompt_hash": self.prompt_hash, "n_prompt_tokens": len(self.prompt_ids),
            "gen_ids": list(self.gen_ids), "n_gen_tokens": len(self.gen_ids), "response": self.text,
            "max_gen_toks": self.max_gen_toks, "until": list(self.until),
        }
        if self.served is not None:
            row["served"] = dict(self.served)
        if with_ids:
            row["prompt_ids"] = list(self.prompt_ids)
        return row


class RecordingMixin:
    """Per-document :class:`GenRecord` store shared by the four arm classes."""

    arm: str = "?"

    def _init_records(self, arm: str) -> None:
        self.arm = arm
        self.records: dict[tuple[str, int], GenRecord] = {}

    def _record(self, req, prompt_ids: Sequence[int], gen_ids: Sequence[int], text: str, max_gen_toks: int, *,
                until: Sequence[str] = (), served: dict | None = None) -> None:
        key = (str(req.task_name), int(req.doc_id))
        if key in self.records:
            prev = self.records[key]
            if prev.prompt_hash != prompt_hash(prompt_ids):
                raise ValueError(f"arm {self.arm}: document {key} was requested twice with different prompts")
            return
        ids = [int(t) for t in prompt_ids]
        self.records[key] = GenRecord(
            arm=self.arm, task=key[0], doc_id=key[1], request_id=request_id_for(*key), prompt_ids=ids,
            prompt_hash=prompt_hash(ids), gen_ids=[int(t) for t in gen_ids], text=text, max_gen_toks=int(max_gen_toks),
            until=[str(u) for u in until], served=served,
        )


# -- arm A: lm-eval's HF backend ----------------------------------------------------------------------
class RecordingHFLM(RecordingMixin, HFLM):
    """Arm A: lm-eval's HF backend (``HFLM``) that records, per document, the token ids it passed to
    ``model.generate`` and the ids it generated (batch size 1, so no padding is involved).

    Args:
        arm: arm label (default "A").
        **kwargs: :class:`lm_eval.models.huggingface.HFLM` arguments (``pretrained`` = the local model
            dir, ``tokenizer``, ``device``, ``dtype``, ``max_length``, ``add_bos_token`` ...).
            ``batch_size`` must be 1.

    Raises:
        ValueError: for a batch size other than 1 (padding would hide the fed ids).
    """

    def __init__(self, arm: str = "A", **kwargs):
        bs = kwargs.setdefault("batch_size", 1)
        if str(bs) != "1":
            raise ValueError(f"RecordingHFLM needs batch_size=1 (got {bs!r}) so the fed ids are recorded unpadded")
        super().__init__(**kwargs)
        self._init_records(arm)
        self._last_strings: list[str] = []
        self._by_context: dict[str, tuple[list[int], list[int]]] = {}

    def tok_batch_encode(self, strings, padding_side="left", left_truncate_len=None, truncation=False):
        """HFLM's batch encoding; remembers the strings of the batch being generated."""
        self._last_strings = list(strings)
        return super().tok_batch_encode(strings, padding_side=padding_side, left_truncate_len=left_truncate_len,
                                        truncation=truncation)

    def _model_generate(self, context, max_length, stop, **generation_kwargs):
        out = super()._model_generate(context, max_length, stop, **generation_kwargs)
        if len(self._last_strings) != context.shape[0]:
            raise RuntimeError("RecordingHFLM lost track of the batch being generated")
        for i, s in enumerate(self._last_strings):
            mask = generation_kwargs.get("attention_mask")
            row = context[i] if mask is None else context[i][mask[i].bool()]
            self._by_context[s] = (row.tolist(), out[i, context.shape[1]:].tolist())
        return out

    def generate_until(self, requests, disable_tqdm: bool = False):
        """HFLM's ``generate_until``, then one :class:`GenRecord` per request."""
        res = super().generate_until(requests, disable_tqdm=disable_tqdm)
        eos = self.tok_decode(self.eot_token_id, skip_special_tokens=False)
        for req, text in zip(requests, res):
            ids, gen = self._by_context[req.args[0]]
            kwargs = normalize_gen_kwargs(req.args[1], self.max_gen_toks)
            until = handle_stop_sequences(copy.copy(kwargs.get("until")), eos=eos)
            self._record(req, ids, gen, text, kwargs["max_gen_toks"], until=until)
        return res

    def first_token_logprobs(self, prompt_ids: Sequence[int], request_id: str | None = None) -> torch.Tensor:
        """``[V]`` float32 log-probabilities of the first generated token after ``prompt_ids``, from
        the backend's own forward (``HFLM._model_call``)."""
        inp = torch.tensor([list(prompt_ids)], dtype=torch.long, device=self.device)
        logits = self._model_call(inp)[0, -1].float()
        return torch.log_softmax(logits, dim=-1).cpu()


# -- arms B, C, D: token-id LMs -----------------------------------------------------------------------
class _TokenIdLM(RecordingMixin, LM):
    """Base of arms B-D: lm-eval LM that tokenizes like HFLM and generates from token ids."""

    def __init__(self, arm: str, model, tokenizer, *, max_length: int | None = None,
                 add_bos_token: bool | None = None, max_gen_toks: int = DEFAULT_MAX_GEN_TOKS):
        super().__init__()
        self._init_records(arm)
        self.model = model
        self.tokenizer = tokenizer
        self.max_length = int(max_length or default_max_length(model, tokenizer))
        self.add_bos_token = add_bos_token
        self.max_gen_toks = int(max_gen_toks)
        self.eos_ids = eos_ids_of(model.config, getattr(model, "generation_config", None))
        eot = tokenizer.eos_token_id
        self.eos_string = None if eot is None else tokenizer.decode(eot, skip_special_tokens=False)

    # lm-eval interface
    def loglikelihood(self, requests, disable_tqdm: bool = False):
        """Not used by the quality tasks (all ``generate_until``)."""
        raise NotImplementedError(f"arm {self.arm}: loglikelihood requests are not supported (generate_until only)")

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        """Not used by the quality tasks (all ``generate_until``)."""
        raise NotImplementedError(f"arm {self.arm}: loglikelihood_rolling requests are not supported")

    def _prepare(self, req) -> dict[str, Any]:
        context, gen_kwargs = req.args[0], req.args[1]
        kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
        if kwargs.get("do_sample"):
            raise ValueError(f"arm {self.arm}: only greedy generation is supported (do_sample=True requested)")
        until = handle_stop_sequences(kwargs.pop("until", None), eos=self.eos_string)
        max_gen_toks = int(kwargs.pop("max_gen_toks"))
        max_ctx_len = self.max_length - max_gen_toks
        if max_ctx_len <= 0:
            raise ValueError(f"arm {self.arm}: max_gen_toks={max_gen_toks} must be below max_length={self.max_length}")
        ids = encode_context(self.tokenizer, context, max_ctx_len, self.add_bos_token)
        return {
            "req": req, "ids": ids, "max_gen_toks": max_gen_toks, "until": list(until),
            "rule": StopRule(self.tokenizer, until, self.eos_ids),
            "request_id": request_id_for(req.task_name, req.doc_id),
        }

    def _generate_ids(self, prepared: list[dict[str, Any]]) -> list[list[int]]:  # pragma: no cover - abstract
        raise NotImplementedError

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy generation for lm-eval requests, recorded per document."""
        prepared = [self._prepare(r) for r in requests]
        gens = self._generate_ids(prepared)
        out = []
        for p, gen in zip(prepared, gens):
            cut = p["rule"].cut(gen[: p["max_gen_toks"]])
            text = p["rule"].text(cut)
            self._record(p["req"], p["ids"], cut, text, p["max_gen_toks"], until=p["until"])
            out.append(text)
        return out


class PlainRoutedLM(_TokenIdLM):
    """Arm B: the checkpoint in process, in plain PyTorch, with routed layers (RUN / Project-Only rows per
    the skipper): one prefill forward and one forward per token with a ``DynamicCache``
    (:func:`impl.vskipper.routed.plain_forward`), the rows described as request ``<task>/<doc_id>``.

    Args:
        model: the checkpoint's causal LM; routed layers are installed from ``skipper`` unless the model
            already has them (``routed_context(model)``).
        tokenizer: its tokenizer.
        skipper: the policy (validated first), or None when the model is already routed or when a
            dense in-process arm is wanted.
        arm, max_length, add_bos_token, max_gen_toks: see :class:`_TokenIdLM` (``max_length`` default:
            as lm-eval's HF backend).
    """

    def __init__(self, model, tokenizer, skipper=None, *, arm: str = "B", max_length: int | None = None,
                 add_bos_token: bool | None = None, max_gen_toks: int = DEFAULT_MAX_GEN_TOKS):
        super().__init__(arm, model, tokenizer, max_length=max_length, add_bos_token=add_bos_token,
                         max_gen_toks=max_gen_toks)
        if skipper is not None:
            if routed_context(model) is not None:
                raise ValueError("the model already has routed layers installed; pass skipper=None")
            cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
            validate_skipper(skipper, cfg.num_hidden_layers, hidden_size=cfg.hidden_size)
            param = next(model.parameters())
            skipper.to(device=param.device, dtype=param.dtype)
            install_routed_layers(model, skipper)
        self.skipper = skipper

    @torch.no_grad()
    def generate_one(self, prompt_ids: Sequence[int], request_id: str, max_gen_toks: int, rule: StopRule) -> list[int]:
        """Greedy ids for one prompt, stopping by ``rule`` or after ``max_gen_toks`` tokens."""

        device = next(self.model.parameters()).device
        cache = DynamicCache(config=self.model.config)
        n = len(prompt_ids)
        ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)
        logits = plain_forward(self.model, ids, cache, request_id=request_id, prompt_len=n)[0, -1]
        out: list[int] = []
        while True:
            tok = int(logits.argmax())
            out.append(tok)
            if len(out) >= max_gen_toks or rule.done(out):
                return out
            step = torch.tensor([[tok]], dtype=torch.long, device=device)
            logits = plain_forward(self.model, step, cache, request_id=request_id, prompt_len=n)[0, -1]

    def _generate_ids(self, prepared):
        return [self.generate_one(p["ids"], p["request_id"], p["max_gen_toks"], p["rule"]) for p in prepared]

    @torch.no_grad()
    def first_token_logprobs(self, prompt_ids: Sequence[int], request_id: str) -> torch.Tensor:
        """``[V]`` float32 first-token log-probabilities from one plain (routed) prefill forward."""

        device = next(self.model.parameters()).device
        cache = DynamicCache(config=self.model.config)
        ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)
        logits = plain_forward(self.model, ids, cache, request_id=request_id, prompt_len=len(prompt_ids))[0, -1]
        return torch.log_softmax(logits.float(), dim=-1).cpu()


class EngineLM(_TokenIdLM):
    """Arms C and D in process (``served="inprocess"``): lm-eval LM over transformers' continuous-batching engine
    (:func:`impl.vskipper.engine.generate_greedy`). All requests of one ``generate_until`` call with
    the same budget are submitted together and batched by the engine.

    Args:
        model: the causal LM; for ``mode="routed"`` bound with :func:`impl.vskipper.engine.bind_skipper`
            (pass ``skipper`` to bind here).
        tokenizer: its tokenizer.
        mode: ``"dense"`` (arm C, the upstream engine) or ``"routed"`` (arm D, always-route).
        skipper: bind this policy first (``mode="routed"`` only).
        cb_config: engine configuration (default :func:`impl.vskipper.engine.routed_cb_config`, the
            same for both arms).
        timeout_s: per engine call.
        arm, max_length, add_bos_token, max_gen_toks: see :class:`_TokenIdLM`.

    Raises:
        ValueError: for an unknown mode, or a skipper with ``mode="dense"``.
    """

    def __init__(self, model, tokenizer, *, mode: str, skipper=None, cb_config=None, timeout_s: float = 3600.0,
                 arm: str | None = None, max_length: int | None = None, add_bos_token: bool | None = None,
                 max_gen_toks: int = DEFAULT_MAX_GEN_TOKS):
        if mode not in ("dense", "routed"):
            raise ValueError(f"mode must be 'dense' or 'routed', got {mode!r}")
        super().__init__(arm or ("C" if mode == "dense" else "D"), model, tokenizer, max_length=max_length,
                         add_bos_token=add_bos_token, max_gen_toks=max_gen_toks)
        if skipper is not None:
            if mode != "routed":
                raise ValueError("a skipper is only bound for mode='routed'")

            bind_skipper(model, skipper)
        self.mode = mode
        self.cb_config = cb_config
        self.timeout_s = float(timeout_s)

    def _engine_eos(self) -> int | None:
        return next(iter(self.eos_ids)) if len(self.eos_ids) == 1 else None

    def _generate_ids(self, prepared):
        out: list[list[int] | None] = [None] * len(prepared)
        groups: dict[int, list[int]] = {}
        for i, p in enumerate(prepared):
            groups.setdefault(p["max_gen_toks"], []).append(i)
        for budget, idx in groups.items():
            ids = generate_greedy(
                self.model, [prepared[i]["ids"] for i in idx], max_new_tokens=budget, mode=self.mode,
                request_ids=[prepared[i]["request_id"] for i in idx], eos_token_id=self._engine_eos(),
                cb_config=self.cb_config, timeout_s=self.timeout_s,
            )
            for i, g in zip(idx, ids):
                out[i] = list(g)
        return out  # type: ignore[return-value]

    @torch.no_grad()
    def first_token_logprobs(self, prompt_ids: Sequence[int], request_id: str) -> torch.Tensor:
        """``[V]`` float32 first-token log-probabilities as the engine computes them: the LM head's output
        for the request's last prompt row in the engine's own forward (a forward hook on
        ``lm_head`` while the engine generates one token), checked against the log-probability the
        engine reports for the token it picked.

        Raises:
            RuntimeError: when the hooked logits do not reproduce the engine's token or its
                log-probability (within 1e-4 nats).
        """

        head = self.model.get_output_embeddings()
        captured: list[torch.Tensor] = []

        def hook(_mod, _inp, output):
            captured.append(output.detach()[0, -1].float().cpu())

        handle = head.register_forward_hook(hook)
        try:
            ids, lps = generate_greedy(
                self.model, [list(prompt_ids)], max_new_tokens=1, mode=self.mode, request_ids=[request_id],
                eos_token_id=None, cb_config=self.cb_config, return_logprobs=True, timeout_s=self.timeout_s,
            )
        finally:
            handle.remove()
        if not captured:
            raise RuntimeError(f"arm {self.arm}: the engine's LM head was not called")
        logprobs = torch.log_softmax(captured[-1], dim=-1)
        tok, lp = int(ids[0][0]), float(lps[0][0])
        if int(logprobs.argmax()) != tok or abs(float(logprobs[tok]) - lp) > 1e-4:
            raise RuntimeError(
                f"arm {self.arm}: hooked LM-head logits (argmax {int(logprobs.argmax())}, logprob "
                f"{float(logprobs[tok]):.6f}) do not reproduce the engine's first token {tok} (logprob {lp:.6f})"
            )
        return logprobs


# -- arms C, D over HTTP ------------------------------------------------------------------------------
class ServedEndpoint:
    """One engine arm of :mod:`impl.vskipper.server` behind its OpenAI-compatible HTTP server, in this
    process, on ``host`` (default 127.0.0.1) and a free port (vSkipper Sec. 4.1 "Arms": the served arms
    of the quality 2x2 and of the served-at-knee pass).

    :meth:`start` starts the engine (binding the skipper for the vSkipper arms, warm-up excluded) and the
    server thread; :meth:`close` (or the context manager) stops both and unbinds the skipper, so the
    model can be served again by another arm. After the start, the engine's ``submit`` is wrapped (on
    the instance; the server module is unchanged) to record, per engine request id, the prompt token
    ids the engine received (:attr:`received`).

    Args:
        model: the causal LM, unbound (see :class:`impl.vskipper.driver.CompletionEngine`).
        tokenizer: its tokenizer.
        arm: a server arm: ``"upstream"``, ``"hybrid"``, ``"always-route"`` (or an ablation).
        skipper: the policy (required by every arm but ``upstream``).
        switch: the :class:`~impl.vskipper.mode.ModeSwitch` of the hybrid / ablation arms.
        cb_config: engine configuration (the same for every arm of a comparison).
        served_model_name: the ``model`` name requests must carry.
        max_logprobs: largest ``logprobs`` a request may ask for.
        request_timeout_s: the server's per-request timeout, seconds.
        host: bind address.

    Raises:
        ValueError: for an unknown arm or a missing skipper (from ``CompletionEngine``).
    """

    def __init__(self, model, tokenizer, arm: str, *, skipper=None, switch=None, cb_config=None,
                 served_model_name: str = "model", max_logprobs: int = 5, request_timeout_s: float = 3600.0,
                 host: str = "127.0.0.1"):
        self.arm = arm
        self.host = host
        self.engine = CompletionEngine(model, tokenizer, arm, skipper=skipper, switch=switch, cb_config=cb_config,
                                       served_model_name=served_model_name, max_logprobs=max_logprobs,
                                       request_timeout_s=request_timeout_s)
        self.served_model_name = str(served_model_name)
        self.received: dict[str, list[int]] = {}
        self.server = None

    def start(self) -> "ServedEndpoint":
        """Start the engine and the HTTP server; returns self.

        Raises:
            RuntimeError: if already started or the engine's warm-up fails.
        """

        if self.server is not None:
            raise RuntimeError("endpoint already started")
        self.engine.start()
        try:
            original = self.engine.submit
            received = self.received

            def submit(prompt_ids, max_new_tokens, **kwargs):
                live = original(prompt_ids, max_new_tokens, **kwargs)
                received[live.rid] = [int(t) for t in prompt_ids]
                return live

            self.engine.submit = submit  # instance attribute: the handler calls engine.submit(...)
            self.server = make_server(self.engine, self.host, 0).start_background()
        except BaseException:
            self.engine.stop()
            raise
        return self

    @property
    def url(self) -> str:
        """``http://host:port`` of the running server."""
        if self.server is None:
            raise RuntimeError("endpoint not started")
        return self.server.url

    @property
    def completions_url(self) -> str:
        """``<url>/v1/completions``."""
        return f"{self.url}/v1/completions"

    def stats(self) -> dict:
        """The engine's ``/v1/vskipper/stats`` object (settings, counters, routed-row statistics)."""
        return self.engine.describe()

    def close(self, grace_s: float = 0.0) -> None:
        """Stop the server and the engine (unbinding the skipper). Safe to call twice."""
        if self.server is not None:
            self.server.close(grace_s=grace_s)
        else:
            self.engine.stop()

    def __enter__(self) -> "ServedEndpoint":
        return self.start() if self.server is None else self

    def __exit__(self, *exc) -> None:
        self.close()


def post_json(url: str, body: Mapping[str, Any], timeout_s: float = 600.0) -> dict:
    """POST a JSON body and return the decoded JSON answer.

    Raises:
        RuntimeError: for an HTTP error status (the message carries the server's error text).
    """
    req = urllib.request.Request(url, data=json.dumps(body).encode("utf-8"), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return json.loads(r.read().decode("utf-8"))
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"HTTP {e.code} from {url}: {e.read().decode('utf-8', 'replace')[:500]}") from None


class RecordingCompletionsLM(RecordingMixin, LocalCompletionsAPI):
    """Arms C and D over HTTP: lm-eval's ``local-completions`` client (``LocalCompletionsAPI``) sending
    token-id prompts to a served arm, recording per document the ids the server received, the ids it
    generated and its modes (module docstring: tokenization, request ids, recording).

    Args:
        arm: arm label ("C" or "D").
        base_url: the completions endpoint (``ServedEndpoint.completions_url``).
        model: the served model name.
        tokenizer: the base model directory (lm-eval loads its HF tokenizer from it).
        max_length: the context window arm A uses (HFLM's ``max_length``); the client is given
            ``max_length + 1`` so that its truncation equals HFLM's.
        eos_ids: EOS ids of the model's generation config (:func:`eos_ids_of`), for :class:`StopRule`.
        add_bos_token: lm-eval's ``add_bos_token`` of arm A (None: the tokenizer's own rule).
        num_concurrent: requests in flight (lm-eval's async path; 1 = one at a time).
        timeout_s: per-request timeout, seconds.
        received: ``engine request id -> prompt ids`` the server's engine received
            (:attr:`ServedEndpoint.received`); None: trust the client-side record.
        vocab_size: size of the vectors :meth:`first_token_logprobs` returns.
        max_logprobs: top-k requested by :meth:`first_token_logprobs` (at most the server's).

    Raises:
        ValueError: for ``num_concurrent < 1``.
    """

    def __init__(self, arm: str, *, base_url: str, model: str, tokenizer, max_length: int, eos_ids: Iterable[int] = (),
                 add_bos_token: bool | None = None, num_concurrent: int = 8, timeout_s: float = 3600.0,
                 received: Mapping[str, Sequence[int]] | None = None, vocab_size: int | None = None,
                 max_logprobs: int = 5):
        if int(num_concurrent) < 1:
            raise ValueError(f"num_concurrent must be >= 1, got {num_concurrent}")
        super().__init__(base_url=base_url, model=model, tokenizer=str(tokenizer), tokenizer_backend="huggingface",
                         tokenized_requests=True, max_length=int(max_length) + 1, max_gen_toks=DEFAULT_MAX_GEN_TOKS,
                         num_concurrent=int(num_concurrent), batch_size=1, max_retries=1, timeout=int(timeout_s))
        self._init_records(arm)
        self.hf_add_bos_token = add_bos_token
        self.eos_ids = {int(e) for e in eos_ids}
        eot = self.tokenizer.eos_token_id
        self.hf_eos_string = None if eot is None else self.tokenizer.decode(eot, skip_special_tokens=False)
        self.received = received
        self.vocab_size = vocab_size
        self.max_logprobs = int(max_logprobs)
        self.timeout_s = float(timeout_s)
        self._rid_queue: dict[tuple, deque] = defaultdict(deque)
        self._sent: dict[str, list[int]] = {}
        self._responses: dict[str, dict] = {}

    # tokenization: arm A's rule (no truncation here; lm-eval truncates afterwards)
    def tok_encode(self, string, left_truncate_len=None, add_special_tokens=False, **kwargs):
        """Token ids of one context (or of each of a list) by :func:`encode_context` (arm A's rule)."""
        if isinstance(string, str):
            return encode_context(self.tokenizer, string, left_truncate_len, self.hf_add_bos_token)
        return [encode_context(self.tokenizer, s, left_truncate_len, self.hf_add_bos_token) for s in string]

    def _create_payload(self, messages, generate=False, gen_kwargs=None, seed=1234, eos=None, **kwargs) -> dict:
        payload = super()._create_payload(messages, generate=generate, gen_kwargs=gen_kwargs, seed=seed, eos=eos,
                                          **kwargs)
        if generate:
            if not (isinstance(messages, list) and len(messages) == 1 and isinstance(messages[0], list)):
                raise RuntimeError(f"arm {self.arm}: expected one token-id prompt per request (batch_size=1)")
            ids = [int(t) for t in messages[0]]
            queue = self._rid_queue.get(tuple(ids))
            if not queue:
                raise RuntimeError(f"arm {self.arm}: lm-eval sent a prompt of {len(ids)} tokens that no prepared "
                                   "document has (tokenization or truncation differs from the plan)")
            rid = queue.popleft()
            payload["request_id"] = rid
            self._sent[rid] = ids
        return payload

    def parse_generations(self, outputs, **kwargs) -> list[str]:
        """lm-eval's parsing, after recording every choice by its engine request id."""
        for out in outputs if isinstance(outputs, list) else [outputs]:
            if not isinstance(out, Mapping):
                continue
            for ch in out.get("choices") or []:
                v = ch.get("vskipper") or {}
                rid = v.get("request_id")
                if rid is not None:
                    self._responses[str(rid)] = {"text": ch.get("text"), "token_ids": list(ch.get("token_ids") or []),
                                                 "finish_reason": ch.get("finish_reason"), "vskipper": dict(v)}
        return LocalCompletionsAPI.parse_generations(outputs, **kwargs)

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """lm-eval's ``local-completions`` generation, then one :class:`GenRecord` per request.

        Raises:
            RuntimeError: when a response is missing, the server's engine received other ids than the
                client sent, or lm-eval's text for a document is not its response's text.
        """
        plan = []
        for req in requests:
            context, gen_kwargs = req.args[0], req.args[1]
            kwargs = normalize_gen_kwargs(gen_kwargs, self._max_gen_toks)
            if kwargs.get("do_sample"):
                raise ValueError(f"arm {self.arm}: only greedy generation is supported (do_sample=True requested)")
            max_gen = int(gen_kwargs.get("max_gen_toks", self._max_gen_toks))
            if self.max_length - max_gen <= 0:
                raise ValueError(f"arm {self.arm}: max_gen_toks={max_gen} must be below max_length={self.max_length}")
            ids = encode_context(self.tokenizer, context, self.max_length - max_gen, self.hf_add_bos_token)
            rid = request_id_for(req.task_name, req.doc_id)
            until = handle_stop_sequences(copy.copy(kwargs.get("until")), eos=self.hf_eos_string)
            self._rid_queue[tuple(ids)].append(rid)
            plan.append((req, rid, ids, int(kwargs["max_gen_toks"]), until))
        texts = super().generate_until(requests, disable_tqdm=disable_tqdm)
        for (req, rid, ids, max_gen, until), text in zip(plan, texts):
            resp = self._responses.get(rid)
            if resp is None or rid not in self._sent:
                raise RuntimeError(f"arm {self.arm}: no response recorded for request {rid!r}")
            sent = self._sent[rid]
            got = list(self.received[rid]) if self.received is not None and rid in self.received else None
            if self.received is not None and got is None:
                raise RuntimeError(f"arm {self.arm}: the server's engine never received request {rid!r}")
            if got is not None and got != sent:
                raise RuntimeError(f"arm {self.arm}: request {rid!r}: the engine received {len(got)} prompt ids, "
                                   f"different from the {len(sent)} the client sent")
            if text != resp["text"]:
                raise RuntimeError(f"arm {self.arm}: lm-eval's text for {rid!r} is not the server's response text")
            rule = StopRule(self.tokenizer, until, self.eos_ids)
            cut = rule.cut(resp["token_ids"][:max_gen])
            served = {"finish_reason": resp["finish_reason"], "n_served_tokens": len(resp["token_ids"]),
                      "vskipper": resp["vskipper"], "ids_source": "engine" if got is not None else "client"}
            self._record(req, got if got is not None else sent, cut, text, max_gen, until=until, served=served)
        return texts

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        """Not used by the quality tasks; the server has no prompt log-probabilities (``echo``)."""
        raise NotImplementedError(f"arm {self.arm}: loglikelihood requests are not supported (generate_until only)")

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        """Not used by the quality tasks."""
        raise NotImplementedError(f"arm {self.arm}: loglikelihood_rolling requests are not supported")

    def first_token_logprobs(self, prompt_ids: Sequence[int], request_id: str) -> torch.Tensor:
        """``[V]`` float32 first-token log-probabilities as served: one request (``max_tokens=1``,
        ``logprobs=max_logprobs``, ``request_id`` = the document's) whose top-k log-probabilities fill
        their entries; every other entry is ``-inf``.

        Raises:
            RuntimeError: for an HTTP error or a response without log-probabilities.
        """
        out = post_json(self.base_url, {"model": self.model, "prompt": [int(t) for t in prompt_ids], "max_tokens": 1,
                                        "temperature": 0, "logprobs": self.max_logprobs, "request_id": request_id,
                                        "ignore_eos": True}, timeout_s=self.timeout_s)
        try:
            lp = out["choices"][0]["logprobs"]
            top = lp["top_logprob_ids"][0]
            chosen = int(out["choices"][0]["token_ids"][0])
            chosen_lp = float(lp["token_logprobs"][0])
        except (KeyError, IndexError, TypeError) as exc:
            raise RuntimeError(f"arm {self.arm}: the server returned no first-token log-probabilities: {out}") from exc
        size = int(self.vocab_size or max(len(self.tokenizer), 1 + max(int(t) for t, _ in top)))
        vec = torch.full((size,), float("-inf"), dtype=torch.float32)
        for t, v in top:
            vec[int(t)] = float(v)
        if vec[chosen] == float("-inf"):
            vec[chosen] = chosen_lp
        return vec
