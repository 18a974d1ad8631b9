"""Read a prompt file (JSON Lines) and check the keys every decoding command relies on.

A prompt row is ``{"id": str, "input_ids": [int, ...], ...}`` as written by ``tokenize_suite``
(text suites may lack ``input_ids`` before tokenization). Commands call :func:`read_prompts` at the
boundary so a hand-made file with a missing or repeated ``id`` fails before any decoding, naming the
file and line, instead of midway through a run.

Source: DEX-harness issue 2 ("bad input gets a clear error").
"""

from __future__ import annotations

import os
from typing import Any

from impl.provenance import read_jsonl

__all__ = ["read_prompts"]


def read_prompts(path: str | os.PathLike, require_input_ids: bool = False) -> list[dict[str, Any]]:
    """Read prompt rows and validate their ids (and token ids when asked).

    Args:
        path: a JSON Lines prompt file.
        require_input_ids: also require ``input_ids`` to be a list of ints (tokens) on every row.

    Returns:
        the rows, unchanged, in file order.

    Raises:
        FileNotFoundError: the file does not exist (naming it).
        ValueError: malformed JSON, a row that is not an object, a missing / non-string / repeated
            ``id``, or (with ``require_input_ids``) missing or non-integer ``input_ids``; the message
            names the file and the 1-based row number.
    """
    rows = read_jsonl(path)
    seen: dict[str, int] = {}
    for k, row in enumerate(rows, 1):
        where = f"{path}: prompt row {k}"
        if not isinstance(row, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
        pid = row.get("id")
        if not isinstance(pid, str) or not pid:
            raise ValueError(f"{where}: missing or non-string 'id' (got {pid!r}); every prompt needs a unique id")
        if pid in seen:
            raise ValueError(f"{where}: id {pid!r} repeats row {seen[pid]}")
        seen[pid] = k
        if require_input_ids:
            ids = row.get("input_ids")
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise ValueError(f"{where} (id {pid!r}): 'input_ids' must be a list of token ids (ints)")
    return rows
