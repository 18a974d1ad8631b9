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

from dataclasses import dataclass

import torch

from ..models.depth import decoder_layers, num_layers
from .hf_generate import count_passes, draft_settings, greedy_generate
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
    layers = decoder_layers(model)
    # the target drafts (its first exit_layer layers): it holds the draft settings
    with draft_settings(model, num_speculations), count_passes({"all": layers[0], "deep": layers[exit_layer]}) as n:
        tokens, stopped, seconds = greedy_generate(model, input_ids, max_new_tokens, eos_token_id,
                                                   assistant_early_exit=exit_layer)
    verify = n["deep"]
    draft = n["all"] - verify
    return HFEarlyExitResult(tokens=tokens, stopped_at_eos=stopped, draft_passes=draft, verify_passes=verify,
                             critical_layers=exit_layer * draft + L * verify, seconds=seconds)
