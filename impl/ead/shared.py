"""Stable EAD on shared contexts: several models measured on the same token sequences.

Greedy EAD (Def. 1) is measured on each model's own generation, so comparing two models also
compares what they generate: a model that loops ("the total of the total ...") gets trivially
shallow EADs. Teacher-forcing every model on the same continuations (here: each compared model's
greedy generation for the prompt) removes that confound. Omega(t, l) is still judged against the
measured model's own final-depth greedy token at that context, as in Def. 1.
"""

from __future__ import annotations

import torch

from ..models.depth import hidden_states_by_depth, readout_logits
from .accounting import ead_from_omega, stable_ead_from_omega


@torch.no_grad()
def teacher_forced_omega(model, prompt_ids: list[int], continuation: list[int]) -> torch.Tensor:
    """Acceptance of every depth's candidate on a fixed continuation, in one forward pass.

    Args:
        model: causal LM with L layers.
        prompt_ids: non-empty prompt ids.
        continuation: the T tokens that follow (any source).

    Returns:
        ``[T, L]`` bool: Omega(t, l) = (depth-l candidate == depth-L candidate) at the context
        ``prompt_ids + continuation[:t]``.

    Raises:
        ValueError: empty prompt or continuation, or the sequence exceeds the model's context.
    """
    if not prompt_ids or not continuation:
        raise ValueError("teacher-forced EAD needs a non-empty prompt and continuation")
    ctx = getattr(model.config, "max_position_embeddings", None)
    if ctx is not None and len(prompt_ids) + len(continuation) > ctx:
        raise ValueError(f"{len(prompt_ids) + len(continuation)} tokens exceed the context of {ctx}")
    device = next(model.parameters()).device
    x = torch.tensor([prompt_ids + continuation[:-1]], device=device)
    p = len(prompt_ids)
    hs = hidden_states_by_depth(model, x)[:, 0, p - 1:]  # [L, T, H]
    cands = readout_logits(model, hs).argmax(-1).T  # [T, L]
    return (cands == cands[:, -1:]).cpu()


def shared_rows(models: dict, prompts: list[dict], generations: dict[tuple[str, str], list[int]]) -> list[dict]:
    """Stable EAD of every model on every compared model's generation of every prompt.

    Args:
        models: name -> model (all sharing one tokenizer).
        prompts: rows with ``id``, ``suite`` and ``input_ids``.
        generations: (model name, prompt id) -> that model's generated ids (from EAD rows).

    Returns:
        one row per (prompt, sequence source, measured model, token): ``prompt_id``, ``suite``,
        ``source`` (whose generation), ``model``, ``t``, ``ead``, ``stable_ead``.
    """
    rows = []
    for p in prompts:
        for src in models:
            cont = generations.get((src, p["id"]))
            if not cont:
                continue
            for name, model in models.items():
                om = teacher_forced_omega(model, p["input_ids"], cont)
                for t, (e, se) in enumerate(zip(ead_from_omega(om), stable_ead_from_omega(om))):
                    rows.append({"prompt_id": p["id"], "suite": p.get("suite"), "source": src, "model": name,
                                 "t": t, "ead": int(e), "stable_ead": int(se)})
    return rows
