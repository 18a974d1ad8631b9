"""What the library arms on transformers' ``generate`` share (:mod:`.hf_early_exit`,
:mod:`.hf_prompt_lookup`, :mod:`.hf_assisted`): one greedy batch-1 call with a stop rule that compares
with AR, the draft settings the library reads from the drafting model's generation config, forward-pass
counts from hooks (the library returns only the ids), and silence for the one warning transformers
raises against its own draft call.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Iterator, Mapping

import torch
from transformers import GenerationConfig

__all__ = ["greedy_generate", "draft_settings", "count_passes", "own_draft_call_quiet"]


class _OwnDraftCallWarning(logging.Filter):
    """Drops the one deprecation warning transformers raises against its own draft call: its
    candidate generator passes ``generation_config`` together with ``min_new_tokens`` /
    ``max_new_tokens`` to the assistant's ``generate`` (transformers 5.24,
    ``candidate_generator.AssistedCandidateGenerator._prepare_generation_args``); these arms pass
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


@contextlib.contextmanager
def draft_settings(drafter, num_tokens: int) -> Iterator[None]:
    """While inside, ``drafter.generation_config`` drafts a constant ``num_tokens`` tokens per round
    with no confidence stop (transformers' defaults: 20 tokens, a heuristic schedule, stop below
    confidence 0.4), as the project's LSSD; the previous values are restored afterwards. transformers
    reads these from the model that drafts: the assistant, or the target itself under early exit."""
    draft = {"num_assistant_tokens": num_tokens, "num_assistant_tokens_schedule": "constant",
             "assistant_confidence_threshold": 0.0}
    saved = {k: getattr(drafter.generation_config, k, None) for k in draft}
    try:
        for k, v in draft.items():
            setattr(drafter.generation_config, k, v)
        yield
    finally:
        for k, v in saved.items():
            setattr(drafter.generation_config, k, v)


@contextlib.contextmanager
def count_passes(layers: Mapping[str, torch.nn.Module]) -> Iterator[dict[str, int]]:
    """While inside, ``counts[name]`` is the number of forward calls of ``layers[name]`` (pre-hooks,
    removed afterwards)."""
    counts = {name: 0 for name in layers}

    def hook(name):
        def inc(_mod, _args):
            counts[name] += 1
        return inc

    handles = [m.register_forward_pre_hook(hook(name)) for name, m in layers.items()]
    try:
        yield counts
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def greedy_generate(model, input_ids: list[int], max_new_tokens: int, eos_token_id: int | None,
                    **options) -> tuple[list[int], bool, float]:
    """One greedy batch-1 ``model.generate`` with generation ``options`` (e.g.
    ``assistant_early_exit``, ``prompt_lookup_num_tokens``; ``assistant_model`` goes to ``generate``).

    ``eos_token_id`` None means no stop token at all (None in an explicit config would fall back to the
    model's), so the budget is reached and the ids compare with AR run to the same length.

    Returns:
        ``(tokens, stopped_at_eos, seconds)``: the new ids, whether EOS ended the run, wall time.

    Raises:
        ValueError: an empty prompt.
    """
    if not input_ids:
        raise ValueError("empty prompt")
    assistant = options.pop("assistant_model", None)
    gen = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False,
                           eos_token_id=eos_token_id if eos_token_id is not None else [],
                           pad_token_id=eos_token_id if eos_token_id is not None else 0, **options)
    x = torch.tensor([input_ids], dtype=torch.long, device=next(model.parameters()).device)  # [1, P] int64
    extra = {"assistant_model": assistant} if assistant is not None else {}
    with own_draft_call_quiet():
        t0 = time.perf_counter()
        out = model.generate(x, attention_mask=torch.ones_like(x), generation_config=gen, **extra)  # [1, P + n]
        seconds = time.perf_counter() - t0
    tokens = [int(t) for t in out[0, len(input_ids):]]
    return tokens, eos_token_id is not None and bool(tokens) and tokens[-1] == eos_token_id, seconds
