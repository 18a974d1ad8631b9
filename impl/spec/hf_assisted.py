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

import time
from dataclasses import dataclass

import torch
from transformers import GenerationConfig

from ..models.depth import decoder_layers, num_layers
from .hf_early_exit import own_draft_call_quiet
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
    if not input_ids:
        raise ValueError("empty prompt")
    L, L_draft = num_layers(model), num_layers(assistant)
    counts = {"target": 0, "draft": 0}

    def count(key):
        def hook(_mod, _args):
            counts[key] += 1
        return hook

    handles = [decoder_layers(model)[0].register_forward_pre_hook(count("target")),
               decoder_layers(assistant)[0].register_forward_pre_hook(count("draft"))]
    device = next(model.parameters()).device
    x = torch.tensor([input_ids], dtype=torch.long, device=device)  # [1, P] int64
    # eos None: no stop token at all (eos_token_id=None would fall back to the model's)
    gen = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False,
                           eos_token_id=eos_token_id if eos_token_id is not None else [],
                           pad_token_id=eos_token_id if eos_token_id is not None else 0)
    # transformers reads the draft settings from the assistant's generation config (defaults: 20
    # tokens, heuristic schedule, stop below confidence 0.4): a constant draft length, no confidence
    # stop, restored afterwards
    draft = {"num_assistant_tokens": num_assistant_tokens, "num_assistant_tokens_schedule": "constant",
             "assistant_confidence_threshold": 0.0}
    saved = {k: getattr(assistant.generation_config, k, None) for k in draft}
    try:
        for k, v in draft.items():
            setattr(assistant.generation_config, k, v)
        with own_draft_call_quiet():
            t0 = time.perf_counter()
            out = model.generate(x, attention_mask=torch.ones_like(x), generation_config=gen,
                                 assistant_model=assistant)  # [1, P + n]
            seconds = time.perf_counter() - t0
    finally:
        for k, v in saved.items():
            setattr(assistant.generation_config, k, v)
        for h in handles:
            h.remove()
    tokens = [int(t) for t in out[0, len(input_ids):]]
    stopped = eos_token_id is not None and bool(tokens) and tokens[-1] == eos_token_id
    return HFAssistedResult(tokens=tokens, stopped_at_eos=stopped, target_passes=counts["target"],
                            draft_passes=counts["draft"], critical_layers=L * counts["target"],
                            draft_layers=L_draft * counts["draft"], seconds=seconds)

