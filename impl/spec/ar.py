"""Autoregressive (AR) decoding with a KV cache: the exactness reference and the speed baseline.

It uses the model's own ``forward`` (not the layer runner of ``impl.models.depth``), so agreement
between a method built on the layer runner and this decoder is an independent check.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from .result import DecodeResult


@dataclass(kw_only=True)
class ARResult(DecodeResult):
    """Output of :func:`ar_decode`: the :class:`~impl.spec.result.DecodeResult` fields (here
    ``prefill_seconds`` is the prompt forward and the first token) plus

    Attributes:
        token_seconds: wall time of each later token's forward + selection (seconds), one per token
            after the first.
    """

    token_seconds: list[float] = field(default_factory=list)


def check_prompt_ids(model, input_ids) -> None:
    """Reject a prompt that no method can decode.

    Raises:
        ValueError: empty prompt, or ids that are not ints in [0, vocab_size).
    """
    if not input_ids:
        raise ValueError("empty prompt: input_ids has no tokens")
    V = model.config.vocab_size
    bad = [t for t in input_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < V]
    if bad:
        raise ValueError(f"prompt has token ids outside [0, {V}): {bad[:5]}")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def ar_decode(
    model,
    input_ids: list[int],
    max_new_tokens: int,
    *,
    eos_token_id: int | None = None,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    rule=None,
) -> ARResult:
    """Decode up to ``max_new_tokens`` tokens autoregressively, batch 1.

    Args:
        model: Hugging Face causal LM (eval mode).
        input_ids: prompt token ids (non-empty list of int).
        max_new_tokens: maximum number of generated tokens (>= 1).
        eos_token_id: stop after generating this id (None: never stop early).
        temperature: 0 for greedy (argmax, ties to the lowest id); > 0 samples from
            softmax(logits / temperature) with ``generator``.
        generator: torch.Generator for sampling (required when temperature > 0).
        rule: a :class:`impl.spec.sampling.DecodeRule`; when given it replaces temperature and
            generator, and token i is decoded with the noise of its absolute position
            ``len(input_ids) + i`` (the convention every lossless method shares).

    Returns:
        :class:`ARResult` with token ids and per-token wall times (seconds; CUDA synchronised
        before each clock read).

    Raises:
        ValueError: on an empty prompt, max_new_tokens < 1, or a prompt plus max_new_tokens longer
            than the model's context (config.max_position_embeddings).
    """

    check_prompt_ids(model, input_ids)
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    ctx = getattr(model.config, "max_position_embeddings", None)
    if ctx is not None and len(input_ids) + max_new_tokens > ctx:
        raise ValueError(
            f"prompt of {len(input_ids)} tokens + {max_new_tokens} new tokens exceeds the context of {ctx}")
    if rule is None and temperature > 0 and generator is None:
        raise ValueError("sampling (temperature > 0) needs a torch.Generator")
    device = next(model.parameters()).device
    cache = DynamicCache(config=model.config)
    x = torch.tensor([input_ids], dtype=torch.long, device=device)
    out = ARResult(tokens=[])
    for i in range(max_new_tokens):
        _sync(device)
        t0 = time.perf_counter()
        logits = model(input_ids=x, cache=cache, use_cache=True, logits_to_keep=1).logits[0, -1]
        if rule is not None:
            tok = rule.decode(logits, len(input_ids) + i)
        elif temperature > 0:
            probs = torch.softmax(logits.float() / temperature, dim=-1)
            tok = int(torch.multinomial(probs.cpu(), 1, generator=generator))
        else:
            tok = int(torch.argmax(logits))
        _sync(device)
        dt = time.perf_counter() - t0
        if i == 0:
            out.prefill_seconds = dt
        else:
            out.token_seconds.append(dt)
        out.tokens.append(tok)
        if eos_token_id is not None and tok == eos_token_id:
            out.stopped_at_eos = True
            break
        x = torch.tensor([[tok]], dtype=torch.long, device=device)
    return out
