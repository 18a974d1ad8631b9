"""Tokenize rendered prompt suites with an explicit, logged rule for overlong prompts.

Source: DEX-harness issue 2, item 4 (workloads).
"""

from __future__ import annotations

import logging
from typing import Any

OVERLONG_RULES: tuple[str, ...] = ("truncate_left", "skip")

_LOG = logging.getLogger("impl.workloads")


def tokenize_suite(
    rows: list[dict],
    tokenizer: Any,
    max_prompt_tokens: int,
    overlong: str = "truncate_left",
    logger: logging.Logger | None = None,
) -> tuple[list[dict], dict]:
    """Tokenize prompt rows, applying the overlong rule.

    Each text is encoded with ``tokenizer(text, add_special_tokens=False)["input_ids"]``, with
    ``tokenizer.bos_token_id`` prepended when it is not None. A prompt longer than
    ``max_prompt_tokens`` (BOS included) is handled by ``overlong``:
    ``"truncate_left"`` keeps the BOS (if any) plus the last ``max_prompt_tokens - 1`` tokens
    (the last ``max_prompt_tokens`` without BOS); ``"skip"`` drops the row. A row with no tokens
    apart from BOS is dropped. Truncations and drops are logged (logger ``"impl.workloads"``).

    Args:
        rows (list[dict]): rows with ``id``, ``suite``, ``source_id``, ``text`` (as made by
            ``build_text_suite``).
        tokenizer: a Hugging Face tokenizer.
        max_prompt_tokens (int): the most tokens a prompt may have, >= 2.
        overlong (str): ``"truncate_left"`` or ``"skip"``.
        logger (logging.Logger | None): where to log; ``logging.getLogger("impl.workloads")`` if None.

    Returns:
        ``(out_rows, summary)``: out_rows copy id/suite/source_id/text and add ``input_ids``
        (list[int]), ``n_tokens``, ``truncated`` (bool), ``original_n_tokens``; summary is
        ``{"n_in", "n_out", "n_truncated", "n_skipped_overlong", "n_skipped_empty", "rule",
        "max_prompt_tokens"}``.

    Raises:
        ValueError: ``max_prompt_tokens < 2``, or ``overlong`` not one of ``OVERLONG_RULES``.

    Source: DEX-harness issue 2, item 4 (workloads).
    """
    if isinstance(max_prompt_tokens, bool) or not isinstance(max_prompt_tokens, int) \
            or max_prompt_tokens < 2:
        raise ValueError(f"max_prompt_tokens must be an int >= 2, got {max_prompt_tokens!r}")
    if overlong not in OVERLONG_RULES:
        raise ValueError(f"overlong={overlong!r} is not one of {', '.join(OVERLONG_RULES)}")
    log = logger or _LOG
    bos = tokenizer.bos_token_id
    out: list[dict] = []
    n_trunc = n_skip_long = n_skip_empty = 0
    for row in rows:
        body = [int(t) for t in tokenizer(row["text"], add_special_tokens=False)["input_ids"]]
        if not body:
            n_skip_empty += 1
            log.warning("workloads: skipped empty prompt %s (no tokens apart from BOS)", row["id"])
            continue
        ids = ([int(bos)] if bos is not None else []) + body
        original = len(ids)
        truncated = False
        if original > max_prompt_tokens:
            if overlong == "skip":
                n_skip_long += 1
                log.warning(
                    "workloads: skipped overlong prompt %s (%d tokens > max_prompt_tokens=%d, "
                    "rule=skip)", row["id"], original, max_prompt_tokens,
                )
                continue
            keep = max_prompt_tokens - 1 if bos is not None else max_prompt_tokens
            ids = ([int(bos)] if bos is not None else []) + body[-keep:]
            truncated = True
            n_trunc += 1
            log.info(
                "workloads: truncated prompt %s from the left, %d -> %d tokens "
                "(rule=truncate_left, BOS kept=%s)", row["id"], original, len(ids), bos is not None,
            )
        out.append(
            {
                "id": row["id"],
                "suite": row.get("suite"),
                "source_id": row.get("source_id"),
                "text": row["text"],
                "input_ids": ids,
                "n_tokens": len(ids),
                "truncated": truncated,
                "original_n_tokens": original,
            }
        )
    summary = {
        "n_in": len(rows),
        "n_out": len(out),
        "n_truncated": n_trunc,
        "n_skipped_overlong": n_skip_long,
        "n_skipped_empty": n_skip_empty,
        "rule": overlong,
        "max_prompt_tokens": max_prompt_tokens,
    }
    log.info("workloads: tokenized %s", summary)
    return out, summary
