"""transformers' assisted decoding with a separate draft model (``generate(assistant_model=...)``): the
library's two-model speculative arm (DEX Sec. 5, Fig. 5: speculative decoding with a small draft model;
harness issue 18, item 1).

The assistant drafts up to ``num_assistant_tokens`` tokens greedily (``AssistedCandidateGenerator``,
constant schedule, no confidence stop, as the project's LSSD); one full-depth pass of the target
verifies them. Greedy verification is lossless, so the ids must equal AR's. The library returns only the
ids, so the accounting comes from forward hooks on the first decoder layer of each model: the target's
passes cost ``L`` layers each (its prefill is one of them), the critical path in target layers is
``L * target_passes`` (DEX Prop. 7 accounting: AR charges ``L`` per token), and the assistant's passes
and layers are recorded beside it (a different model: its layers are not the target's unit of work).

Both models must share one vocabulary (a draft trained with the target's tokenizer); transformers'
universal assisted decoding across tokenizers is not used here.

Source: Leviathan et al., "Fast Inference from Transformers via Speculative Decoding" (2023);
transformers 5.24 ``generate(assistant_model=...)``, ``GenerationConfig.num_assistant_tokens``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models.depth import decoder_layers, num_layers
from .hf_generate import count_passes, draft_settings, greedy_generate
from .result import DecodeResult


@dataclass(kw_only=True)
class HFAssistedResult(DecodeResult):
    """Output of :func:`hf_assisted_decode`: the :class:`~impl.spec.result.DecodeResult` fields
    (``prefill_seconds`` stays 0: ``generate`` has no separate prefill to time) plus

    Attributes:
        target_passes: full-depth passes of the target, the prefill included.
        draft_passes: forward passes of the assistant.
        critical_layers: ``L * target_passes`` (target layers).
        draft_layers: ``L_draft * draft_passes`` (assistant layers).
        seconds: wall time of ``generate``.
    """

    target_passes: int
    draft_passes: int
    critical_layers: int
    draft_layers: int
    seconds: float


def check_hf_assisted(model, assistant, num_assistant_tokens: int) -> None:
    """Raises ValueError unless ``assistant`` is a separate model over the target's vocabulary and
    ``num_assistant_tokens`` is an integer >= 1."""
    if assistant is model:
        raise ValueError("hf_assisted: the assistant must be a separate model (transformers' early exit of "
                         "the target itself is method hf_early_exit)")
    v_t = model.get_output_embeddings().weight.shape[0]
    v_a = assistant.get_output_embeddings().weight.shape[0]
    if v_t != v_a:
        raise ValueError(f"hf_assisted: the assistant's vocabulary ({v_a} ids) is not the target's ({v_t}); "
                         "train the draft with the target's tokenizer")
    if isinstance(num_assistant_tokens, bool) or not isinstance(num_assistant_tokens, int) or num_assistant_tokens < 1:
        raise ValueError(f"hf_assisted: num_assistant_tokens={num_assistant_tokens!r} must be an integer >= 1")


@torch.no_grad()
def hf_assisted_decode(model, assistant, input_ids: list[int], max_new_tokens: int, *, num_assistant_tokens: int,
                       eos_token_id: int | None) -> HFAssistedResult:
    """Greedy ``model.generate`` with a draft model (batch 1).

    Args:
        model: the target, a Hugging Face causal LM.
        assistant: the draft model, same vocabulary, on the target's device.
        input_ids: prompt ids.
        max_new_tokens: generation budget.
        num_assistant_tokens: draft tokens per verification (constant schedule).
        eos_token_id: stop token, or None to generate exactly ``max_new_tokens`` tokens.

    Returns:
        the ids (equal to AR's under greedy decoding) and the pass accounting of both models.

    Raises:
        ValueError: see :func:`check_hf_assisted`; an empty prompt.
    """
    check_hf_assisted(model, assistant, num_assistant_tokens)
    L, L_draft = num_layers(model), num_layers(assistant)
    layers = {"target": decoder_layers(model)[0], "draft": decoder_layers(assistant)[0]}
    with draft_settings(assistant, num_assistant_tokens), count_passes(layers) as n:
        tokens, stopped, seconds = greedy_generate(model, input_ids, max_new_tokens, eos_token_id,
                                                   assistant_model=assistant)
    return HFAssistedResult(tokens=tokens, stopped_at_eos=stopped, target_passes=n["target"],
                            draft_passes=n["draft"], critical_layers=L * n["target"],
                            draft_layers=L_draft * n["draft"], seconds=seconds)
