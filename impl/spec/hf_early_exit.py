"""transformers' own LayerSkip-style self-speculation (``generate(assistant_early_exit=E)``): a
library-provided reference arm beside the project's :mod:`impl.spec.self_spec`.

transformers drafts with the first ``E`` layers of the same model (``EarlyExitCandidateGenerator``:
the shared final norm and LM head read the state after layer E) and verifies the draft with the full
model; greedy decoding is lossless, so its ids must equal AR's. The library returns only the ids, so
the layer accounting (DEX Prop. 7, critical path in decoder layers) is taken from forward hooks: a
pass that reaches layer E+1 is a verification pass (L layers), any other pass is one draft step
(E layers).

Source: DEX paper Sec. 4 (LayerSkip self-speculation baseline); harness issue 12, item 4;
transformers 5.24 ``GenerationConfig.assistant_early_exit``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Iterator

import torch
from transformers import GenerationConfig

from ..models.depth import decoder_layers, num_layers
from .result import DecodeResult


@dataclass(kw_only=True)
class HFEarlyExitResult(DecodeResult):
    """Output of :func:`hf_early_exit_decode`: the :class:`~impl.spec.result.DecodeResult` fields
    (``prefill_seconds`` stays 0: transformers' ``generate`` has no separate prefill to time) plus

    Attributes:
        draft_passes: forward passes that stopped at the exit layer (one drafted token each).
        verify_passes: full-depth passes (prefill included).
        critical_layers: ``E * draft_passes + L * verify_passes``. transformers has no separate
            prefill: the assistant's first pass reads the prompt at depth E and the first
            verification reads prompt + draft at depth L, so every pass counts (AR charges L per
            token, its prefill included; on an all-accepting model this equals LSSD's sum of
            ``k E + L`` per round).
        seconds: wall time of ``generate``.
    """

    draft_passes: int
    verify_passes: int
    critical_layers: int
    seconds: float


def check_hf_early_exit_params(L: int, exit_layer: int, num_speculations: int) -> None:
    """Raises ValueError unless ``1 <= exit_layer < L`` and ``num_speculations >= 1`` (ints)."""
    for name, v in (("exit_layer", exit_layer), ("num_speculations", num_speculations)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"hf_early_exit: {name} must be an int, got {v!r}")
    if not 1 <= exit_layer < L:
        raise ValueError(f"hf_early_exit: exit_layer={exit_layer} is outside [1, {L - 1}]")
    if num_speculations < 1:
        raise ValueError(f"hf_early_exit: num_speculations={num_speculations} must be >= 1")


class _OwnDraftCallWarning(logging.Filter):
    """Drops the one deprecation warning transformers raises against its own draft call: its
    candidate generator passes ``generation_config`` together with ``min_new_tokens`` /
    ``max_new_tokens`` to the assistant's ``generate`` (transformers 5.24,
    ``candidate_generator.AssistedCandidateGenerator._prepare_generation_args``); this arm passes
    only a ``generation_config``."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not ("Passing `generation_config` together with generation-related" in msg and "new_tokens" in msg)


_GENERATE_LOGGER = logging.getLogger("transformers.generation.utils")


@contextlib.contextmanager
def own_draft_call_quiet() -> Iterator[None]:
    """While inside, transformers' warning against its own draft call (:class:`_OwnDraftCallWarning`)
    is dropped; every other message of ``generate`` still gets through."""
    quiet = _OwnDraftCallWarning()
    _GENERATE_LOGGER.addFilter(quiet)
    try:
        yield
    finally:
        _GENERATE_LOGGER.removeFilter(quiet)


@torch.no_grad()
def hf_early_exit_decode(model, input_ids: list[int], max_new_tokens: int, *, exit_layer: int,
                         num_speculations: int, eos_token_id: int | None) -> HFEarlyExitResult:
    """Greedy ``model.generate`` with ``assistant_early_exit=exit_layer`` (batch 1).

    Args:
        model: Hugging Face causal LM whose intermediate states the final norm + LM head can read.
        input_ids: prompt ids.
        max_new_tokens: generation budget.
        exit_layer: E, the draft depth (1-based, < L).
        num_speculations: draft tokens per round (constant schedule).
        eos_token_id: stop token, or None to generate exactly ``max_new_tokens`` tokens.

    Raises:
        ValueError: bad parameters (see :func:`check_hf_early_exit_params`), empty prompt.
    """

    L = num_layers(model)
    check_hf_early_exit_params(L, exit_layer, num_speculations)
    if not input_ids:
        raise ValueError("empty prompt")
    layers = decoder_layers(model)
    counts = {"all": 0, "deep": 0}

    def count(key):
        def hook(_mod, _args):
            counts[key] += 1
        return hook

    handles = [layers[0].register_forward_pre_hook(count("all")),
               layers[exit_layer].register_forward_pre_hook(count("deep"))]
    device = next(model.parameters()).device
    x = torch.tensor([input_ids], dtype=torch.long, device=device)
    # eos None: no stop token at all (eos_token_id=None in an explicit config would fall back to the
    # model's), so the budget is reached and the ids compare with AR run to the same length
    gen = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, assistant_early_exit=exit_layer,
                           eos_token_id=eos_token_id if eos_token_id is not None else [],
                           pad_token_id=eos_token_id if eos_token_id is not None else 0)
    # transformers reads the draft settings from the *assistant's* generation config (here the model
    # itself; defaults: 20 tokens, stop drafting below confidence 0.4): a constant draft length of
    # num_speculations and no confidence stop, as the project's LSSD, restored afterwards
    draft = {"num_assistant_tokens": num_speculations, "num_assistant_tokens_schedule": "constant",
             "assistant_confidence_threshold": 0.0}
    saved = {k: getattr(model.generation_config, k, None) for k in draft}
    try:
        for k, v in draft.items():
            setattr(model.generation_config, k, v)
        with own_draft_call_quiet():
            t0 = time.perf_counter()
            out = model.generate(x, attention_mask=torch.ones_like(x), generation_config=gen)
            seconds = time.perf_counter() - t0
    finally:
        for k, v in saved.items():
            setattr(model.generation_config, k, v)
        for h in handles:
            h.remove()
    tokens = [int(t) for t in out[0, len(input_ids):]]
    stopped = eos_token_id is not None and bool(tokens) and tokens[-1] == eos_token_id
    verify = counts["deep"]
    draft = counts["all"] - verify
    return HFEarlyExitResult(tokens=tokens, stopped_at_eos=stopped, draft_passes=draft, verify_passes=verify,
                             critical_layers=exit_layer * draft + L * verify, seconds=seconds)
