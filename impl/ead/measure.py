"""Oracle EAD measurement (DEX paper, Def. 1 and App. A.1).

Greedy-generate with the final-depth model; for every generated token record the candidate at every
depth 1..L (intermediate readout: shared final norm + LM head on the hidden state after layer l),
the acceptance Omega(t, l) under the greedy rule (candidate == final-depth token), EAD and stable
EAD. The generated ids are checked against an independent AR decode (the model's own forward) and
the verdict is written into every row.
"""

from __future__ import annotations

from typing import Any

import torch
from tqdm import tqdm
from transformers import DynamicCache

from ..models.depth import hidden_states_by_depth, readout_logits
from ..spec.ar import ar_decode, check_prompt_ids
from .accounting import ead_from_omega, stable_ead_from_omega


@torch.no_grad()
def measure_prompt(
    model,
    input_ids: list[int],
    max_new_tokens: int,
    *,
    eos_token_id: int | None = None,
    adapters: dict[int, torch.nn.Module] | None = None,
) -> list[dict[str, Any]]:
    """Greedy generation with per-depth candidates for one prompt.

    Args:
        model: Hugging Face causal LM with L layers (eval mode).
        input_ids: prompt ids (non-empty).
        max_new_tokens: tokens to generate (stops early at ``eos_token_id`` if given).
        adapters: optional inducing adapters by 1-based depth (DEX App. C.2) used for readout.

    Returns:
        one dict per generated token t (0-based index ``t``) with ``token_id`` (the final-depth
        greedy token), ``candidates`` ([L] ids, depth l at index l-1), ``omega`` ([L] 0/1),
        ``ead`` and ``stable_ead`` (1-based depths), ``final_prob`` (probability of the token at
        depth L).

    Raises:
        ValueError: empty prompt or a prompt + max_new_tokens beyond the model's context.
    """

    check_prompt_ids(model, input_ids)
    ctx = getattr(model.config, "max_position_embeddings", None)
    if ctx is not None and len(input_ids) + max_new_tokens > ctx:
        raise ValueError(
            f"prompt of {len(input_ids)} tokens + {max_new_tokens} new tokens exceeds the context of {ctx}")
    device = next(model.parameters()).device
    adapters = adapters or {}
    cache = DynamicCache(config=model.config)
    x = torch.tensor([input_ids], dtype=torch.long, device=device)
    rows: list[dict[str, Any]] = []
    for t in range(max_new_tokens):
        hs = hidden_states_by_depth(model, x, cache=cache)[:, 0, -1]  # [L, H]
        L = hs.shape[0]
        if adapters:
            hs = torch.stack([adapters[d + 1](hs[d]) if d + 1 in adapters else hs[d] for d in range(L)])
        # one [L, H] x [H, V] product: the LM head is read once per token, not L times
        logits = readout_logits(model, hs)  # [L, V]
        cands = logits.argmax(dim=-1)
        final = int(cands[-1])
        omega = (cands == final).to(torch.int64).tolist()
        rows.append({
            "t": t,
            "token_id": final,
            "candidates": cands.tolist(),
            "omega": omega,
            "final_prob": float(torch.softmax(logits[-1].float(), -1)[final]),
        })
        if eos_token_id is not None and final == eos_token_id:
            break
        x = torch.tensor([[final]], dtype=torch.long, device=device)
    om = [r["omega"] for r in rows]
    for r, e, se in zip(rows, ead_from_omega(om), stable_ead_from_omega(om)):
        r["ead"], r["stable_ead"] = int(e), int(se)
    return rows


def measure_suite(
    model,
    prompts: list[dict[str, Any]],
    max_new_tokens: int,
    *,
    eos_token_id: int | None = None,
    progress: bool = False,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Measure EAD on every prompt of a tokenized suite and check each against AR.

    Args:
        prompts: rows with ``id``, ``suite``, ``source_id``, ``input_ids`` (from
            :func:`impl.workloads.tokenize_suite`).

    Returns:
        ``(token_rows, prompt_errors)``: token rows carry ``prompt_id``, ``suite``, ``source_id``,
        ``n_prompt_tokens``, ``ar_match`` (bool: generated ids equal AR's) and the fields of
        :func:`measure_prompt`; a prompt that cannot be measured (empty, beyond the context) adds a
        ``{"prompt_id", "error"}`` entry instead of crashing the run.
    """

    token_rows: list[dict[str, Any]] = []
    errors: list[dict[str, Any]] = []
    for p in tqdm(prompts, desc="ead", disable=not progress, mininterval=5):
        if "input_ids" not in p:
            errors.append({"prompt_id": p.get("id"), "error": "row has no input_ids (tokenize text prompts first: "
                           "python -m impl tokenize)"})
            continue
        try:
            rows = measure_prompt(model, p["input_ids"], max_new_tokens, eos_token_id=eos_token_id)
            ref = ar_decode(model, p["input_ids"], max_new_tokens, eos_token_id=eos_token_id)
        except ValueError as e:
            errors.append({"prompt_id": p.get("id"), "error": str(e)})
            continue
        ids = [r["token_id"] for r in rows]
        match = ids == ref.tokens
        for r in rows:
            r.update(prompt_id=p["id"], suite=p.get("suite"), source_id=p.get("source_id"),
                     n_prompt_tokens=len(p["input_ids"]), ar_match=match)
        token_rows.extend(rows)
    return token_rows, errors
