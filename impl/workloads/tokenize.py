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

    *Plain* rows: the text is encoded with ``tokenizer(text, add_special_tokens=False)["input_ids"]``,
    with ``tokenizer.bos_token_id`` prepended when it is not None. *Chat* rows (a row with a ``chat``
    user message, and a tokenizer with a chat template): the model's own template renders the message
    as one user turn with the generation prompt (:func:`chat_ids`); no BOS is added. A prompt longer than
    ``max_prompt_tokens`` is handled by ``overlong``: ``"truncate_left"`` keeps the BOS (plain) or the
    template's header and trailer (chat) and the last tokens of the content; ``"skip"`` drops the row.
    A row with no content tokens is dropped. Truncations and drops are logged (logger ``"impl.workloads"``).

    Args:
        rows (list[dict]): rows with ``id``, ``suite``, ``source_id``, ``text`` (as made by
            ``build_text_suite``).
        tokenizer: a Hugging Face tokenizer.
        max_prompt_tokens (int): the most tokens a prompt may have, >= 2.
        overlong (str): ``"truncate_left"`` or ``"skip"``.
        logger (logging.Logger | None): where to log; ``logging.getLogger("impl.workloads")`` if None.

    Returns:
        ``(out_rows, summary)``: out_rows copy id/suite/source_id/text (and chat) and add ``format``
        (``"chat"`` or ``"plain"``), ``input_ids`` (list[int]), ``n_tokens``, ``truncated`` (bool),
        ``original_n_tokens``; summary is ``{"n_in", "n_out", "n_truncated", "n_skipped_overlong",
        "n_skipped_empty", "n_chat", "format", "rule", "max_prompt_tokens"}``.

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
    has_chat = bool(getattr(tokenizer, "chat_template", None))
    out: list[dict] = []
    n_trunc = n_skip_long = n_skip_empty = n_chat = 0
    for row in rows:
        chat = has_chat and row.get("chat") is not None
        if chat:
            body = [int(t) for t in tokenizer(row["chat"], add_special_tokens=False)["input_ids"]]
            ids = chat_ids(tokenizer, row["chat"]) if body else []
        else:
            prefix, suffix = ([int(bos)] if bos is not None else []), []
            body = [int(t) for t in tokenizer(row["text"], add_special_tokens=False)["input_ids"]]
            ids = prefix + body
        if not body:
            n_skip_empty += 1
            log.warning("workloads: skipped empty prompt %s (no tokens apart from BOS)", row["id"])
            continue
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
            if chat:  # header and trailer tokenized apart only when the message must be cut
                prefix, body, suffix = chat_pieces(tokenizer, row["chat"])
            keep = max_prompt_tokens - len(prefix) - len(suffix)
            if keep < 1:
                raise ValueError(f"max_prompt_tokens={max_prompt_tokens} leaves no room for the content of "
                                 f"prompt {row['id']} beside its {len(prefix) + len(suffix)} chat-template tokens")
            ids = prefix + body[-keep:] + suffix
            truncated = True
            n_trunc += 1
            log.info(
                "workloads: truncated prompt %s from the left, %d -> %d tokens "
                "(rule=truncate_left, BOS kept=%s)", row["id"], original, len(ids), bos is not None,
            )
        n_chat += chat
        out.append(
            {
                "id": row["id"],
                "suite": row.get("suite"),
                "source_id": row.get("source_id"),
                "text": row["text"],
                **({"chat": row["chat"]} if "chat" in row else {}),
                "format": "chat" if chat else "plain",
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
        "n_chat": n_chat,
        "format": "chat" if n_chat else "plain",
        "rule": overlong,
        "max_prompt_tokens": max_prompt_tokens,
    }
    log.info("workloads: tokenized %s", summary)
    return out, summary


def chat_ids(tokenizer: Any, message: str) -> list[int]:
    """Token ids of ``message`` as one user turn through the tokenizer's own chat template, ending
    with the generation prompt (the assistant header).

    Raises:
        ValueError: the tokenizer has no chat template.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("tokenizer has no chat template")
    text = tokenizer.apply_chat_template([{"role": "user", "content": message}], tokenize=False,
                                         add_generation_prompt=True)
    return [int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]]


_SENTINEL = "\u2063SPLIT\u2063"


def chat_pieces(tokenizer: Any, message: str) -> tuple[list[int], list[int], list[int]]:
    """``(header, content, trailer)`` ids of a chat-rendered user turn, for left truncation of the
    content alone: the template is rendered around a sentinel and the two sides are tokenized apart.

    Raises:
        ValueError: the tokenizer has no chat template, or the template does not place the message
            verbatim (no sentinel in its output).
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("tokenizer has no chat template")
    text = tokenizer.apply_chat_template([{"role": "user", "content": _SENTINEL}], tokenize=False,
                                         add_generation_prompt=True)
    if text.count(_SENTINEL) != 1:
        raise ValueError("the chat template does not place the user message verbatim")
    head, tail = text.split(_SENTINEL)
    enc = lambda s: [int(t) for t in tokenizer(s, add_special_tokens=False)["input_ids"]] if s else []  # noqa: E731
    return enc(head), enc(message), enc(tail)
