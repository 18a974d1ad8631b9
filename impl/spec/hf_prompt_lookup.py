"""transformers' prompt-lookup decoding (``generate(prompt_lookup_num_tokens=N)``): a library-provided
speculative arm with a draft that costs no model pass (DEX Sec. 5, Fig. 5's speculative comparisons;
harness issue 18, item 1).

The draft is the continuation of the latest n-gram of the context (up to ``max_matching_ngram_size``
tokens) where it occurred before, at most N tokens (``PromptLookupCandidateGenerator``); one full-depth
pass verifies it. Greedy verification is lossless, so the ids must equal AR's. The library returns only
the ids, so the accounting comes from a forward hook on the first decoder layer: every pass is a
full-depth pass (L layers; the first one reads the prompt too), so the critical path is ``L * passes``
against AR's ``L`` per token (DEX Prop. 7 accounting), and ``tokens / passes`` is the mean accepted
length per verification (plus the bonus token).

Source: Saxena, "Prompt Lookup Decoding" (2023); transformers 5.24 ``GenerationConfig
.prompt_lookup_num_tokens`` / ``max_matching_ngram_size``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models.depth import decoder_layers, num_layers
from .hf_generate import count_passes, greedy_generate
from .result import DecodeResult


@dataclass(kw_only=True)
class HFPromptLookupResult(DecodeResult):
    """Output of :func:`hf_prompt_lookup_decode`: the :class:`~impl.spec.result.DecodeResult` fields
    (``prefill_seconds`` stays 0: ``generate`` has no separate prefill to time) plus

    Attributes:
        verify_passes: full-depth forward passes, the prefill included.
        critical_layers: ``L * verify_passes``.
        seconds: wall time of ``generate``.
    """

    verify_passes: int
    critical_layers: int
    seconds: float


def check_hf_prompt_lookup_params(num_tokens: int, max_matching_ngram_size: int) -> None:
    """Raises ValueError unless both are integers >= 1 (transformers raises the same, later)."""
    for name, v in (("num_tokens", num_tokens), ("max_matching_ngram_size", max_matching_ngram_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"hf_prompt_lookup: {name}={v!r} must be an integer >= 1")


@torch.no_grad()
def hf_prompt_lookup_decode(model, input_ids: list[int], max_new_tokens: int, *, num_tokens: int,
                            max_matching_ngram_size: int = 2, eos_token_id: int | None) -> HFPromptLookupResult:
    """Greedy ``model.generate`` with prompt-lookup drafting (batch 1).

    Args:
        model: Hugging Face causal LM.
        input_ids: prompt ids.
        max_new_tokens: generation budget.
        num_tokens: N, the most draft tokens per verification (``prompt_lookup_num_tokens``).
        max_matching_ngram_size: the longest n-gram looked up in the context.
        eos_token_id: stop token, or None to generate exactly ``max_new_tokens`` tokens.

    Returns:
        the ids (equal to AR's under greedy decoding) and the pass accounting.

    Raises:
        ValueError: bad parameters (see :func:`check_hf_prompt_lookup_params`), empty prompt.
    """
    check_hf_prompt_lookup_params(num_tokens, max_matching_ngram_size)
    L = num_layers(model)
    with count_passes({"all": decoder_layers(model)[0]}) as n:
        tokens, stopped, seconds = greedy_generate(model, input_ids, max_new_tokens, eos_token_id,
                                                   prompt_lookup_num_tokens=num_tokens,
                                                   max_matching_ngram_size=max_matching_ngram_size)
    return HFPromptLookupResult(tokens=tokens, stopped_at_eos=stopped, verify_passes=n["all"],
                                critical_layers=L * n["all"], seconds=seconds)
