"""Matched-work and natural lanes (vSkipper Sec. 4.1, "Matched work"; App. G).

Matched-work lane: record each request's output length from the baseline's natural generation at the
cell's rate (:func:`record_lengths`), replay those lengths in every arm with EOS ignored
(:func:`replay_requests`), and reject a cell whose per-request token counts differ between arms or
from the recorded lengths (:func:`check_matched`). The arms then do the same work and differ only in
how fast they execute it.

Natural lane: every arm stops on its own EOS, within the requests' caps (:func:`natural_requests`);
no gate.

Output lengths count every generated token, the EOS included when a request stopped on it, so the
replayed request (EOS ignored) generates exactly as many tokens as the natural one.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from .loadgen import Request, RequestRecord

__all__ = ["MatchedWorkError", "record_lengths", "replay_requests", "natural_requests", "check_matched"]


class MatchedWorkError(ValueError):
    """A cell rejected by the matched-work gate.

    Attributes:
        mismatches: ``request_id -> {arm or "expected": output tokens (None if failed/missing)}``
            for every offending request.
    """

    def __init__(self, message: str, mismatches: Mapping[str, Mapping[str, int | None]]):
        super().__init__(message)
        self.mismatches = {k: dict(v) for k, v in mismatches.items()}


def record_lengths(records: Sequence[RequestRecord]) -> dict[str, int]:
    """Output lengths (tokens) of a natural run, per request id, to replay in every arm.

    Args:
        records: the baseline's records from its natural generation at the cell's rate.

    Returns:
        ``{request_id: output_tokens}``.

    Raises:
        ValueError: naming the requests, if any failed, produced no token (nothing to replay),
            or ran with ``ignore_eos`` (not a natural run).
    """
    failed = [r.request_id for r in records if not r.ok]
    if failed:
        raise ValueError(f"cannot record lengths: {len(failed)} requests did not complete: {failed[:20]}")
    forced = [r.request_id for r in records if r.ignore_eos]
    if forced:
        raise ValueError(f"cannot record lengths from ignore-EOS requests (not natural generation): {forced[:20]}")
    empty = [r.request_id for r in records if r.output_tokens < 1]
    if empty:
        raise ValueError(f"cannot replay zero-length outputs: {empty[:20]}")
    return {r.request_id: int(r.output_tokens) for r in records}


def replay_requests(requests: Sequence[Request], lengths: Mapping[str, int]) -> list[Request]:
    """The matched-work requests: same ids and prompts, ``max_new_tokens = lengths[id]``, EOS ignored.

    Raises:
        ValueError: naming the requests without a recorded length or with a length < 1.
    """
    missing = [r.request_id for r in requests if r.request_id not in lengths]
    if missing:
        raise ValueError(f"no recorded output length for {len(missing)} requests: {missing[:20]}")
    bad = [r.request_id for r in requests if int(lengths[r.request_id]) < 1]
    if bad:
        raise ValueError(f"recorded output lengths must be >= 1 token: {bad[:20]}")
    return [Request(r.request_id, r.input_ids, int(lengths[r.request_id]), True) for r in requests]


def natural_requests(requests: Sequence[Request]) -> list[Request]:
    """The natural-lane requests: same ids, prompts and caps, each arm stopping on its own EOS."""
    return [Request(r.request_id, r.input_ids, r.max_new_tokens, False) for r in requests]


def check_matched(records_by_arm: Mapping[str, Sequence[RequestRecord]],
                  expected: Mapping[str, int] | None = None) -> None:
    """The per-request matched-work gate: every arm generated the same number of tokens per request.

    A request fails the gate when its output token count differs between arms, differs from
    ``expected`` (the recorded lengths, when given), or it failed / is missing in some arm.

    Args:
        records_by_arm: ``arm name -> records`` of one repetition (or of several, concatenated with
            distinct ids).
        expected: ``request_id -> recorded output tokens`` (optional).

    Raises:
        MatchedWorkError: naming every offending request with each arm's count (first 20 in the
            message, all in ``.mismatches``).
        ValueError: if fewer than one arm is given.
    """
    if not records_by_arm:
        raise ValueError("check_matched needs at least one arm")
    counts: dict[str, dict[str, int | None]] = {}
    for arm, recs in records_by_arm.items():
        for r in recs:
            counts.setdefault(r.request_id, {})[arm] = r.output_tokens if r.ok else None
    ids = list(counts) if expected is None else list(dict.fromkeys([*expected, *counts]))
    mismatches: dict[str, dict[str, int | None]] = {}
    for rid in ids:
        row = {arm: counts.get(rid, {}).get(arm) for arm in records_by_arm}
        values = set(row.values())
        if expected is not None:
            row["expected"] = expected.get(rid)
            values.add(row["expected"])
        if None in values or len(values) != 1:
            mismatches[rid] = row
    if mismatches:
        shown = "; ".join(
            f"{rid} (" + ", ".join(f"{k}={'failed/missing' if v is None else v}" for k, v in row.items()) + ")"
            for rid, row in list(mismatches.items())[:20])
        more = f" and {len(mismatches) - 20} more" if len(mismatches) > 20 else ""
        raise MatchedWorkError(
            f"matched-work gate rejected the cell: {len(mismatches)} of {len(ids)} requests differ in output "
            f"token counts between arms: {shown}{more}", mismatches)
