"""Open-loop load generator: replay an arrival schedule against an arm (vSkipper Sec. 4.1, "Load").

:func:`run_load` starts the arm (warm-up excluded), then for each request in order sleeps until its
scheduled arrival ``t0 + offset`` on the arm's clock and submits it - whether or not earlier requests
have finished: there is no client-side concurrency cap, and a request that is late (because the
client fell behind) is submitted at once, its lateness visible as ``arrival_s - scheduled_s``. After
the injection it waits until every request completed (or failed, or ``timeout_s`` passed), stops the
arm and returns one :class:`RequestRecord` per request with times in seconds from the injection
start ``t0`` (the clock reading just before the first submission is scheduled).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from .arms import Arm, Trace, WorkloadHint
from .arrivals import ArrivalSchedule

__all__ = ["Request", "RequestRecord", "LoadResult", "run_load", "requests_from_prompts", "hint_for"]


@dataclass(frozen=True)
class Request:
    """One request of a cell.

    Attributes:
        request_id: unique id (e.g. the prompt row's ``id``).
        input_ids: prompt token ids.
        max_new_tokens: generation cap in tokens (the replayed length in the matched-work lane).
        ignore_eos: generate exactly ``max_new_tokens`` tokens (matched-work replay).
    """

    request_id: str
    input_ids: tuple[int, ...]
    max_new_tokens: int
    ignore_eos: bool = False


@dataclass
class RequestRecord:
    """Per-request result; every time is in seconds from the injection start ``t0``.

    Attributes:
        request_id, max_new_tokens, ignore_eos: as requested.
        scheduled_s: scheduled arrival offset.
        arrival_s: when the request was actually submitted.
        first_token_s: time of the first output token (None if none).
        token_times_s: time of every output token with a known time (see :class:`~impl.serving.arms.Trace`).
        finish_s: completion time (None if the request did not complete).
        prompt_tokens: prompt length as the engine counted it; ``prompt_tokens_requested``: ``len(input_ids)``.
        output_tokens: output tokens generated (EOS included when the request stopped on it).
        output_ids: output token ids (empty if the arm sees only text or ids were not kept).
        error: None on success, else the error message.
        finish_reason, timestamp_source: see :class:`~impl.serving.arms.Trace`.
    """

    request_id: str
    max_new_tokens: int
    ignore_eos: bool
    scheduled_s: float
    arrival_s: float
    first_token_s: float | None
    token_times_s: list[float]
    finish_s: float | None
    prompt_tokens: int | None
    prompt_tokens_requested: int
    output_tokens: int
    output_ids: list[int] = field(default_factory=list)
    error: str | None = None
    finish_reason: str | None = None
    timestamp_source: str = ""

    @property
    def ok(self) -> bool:
        """True when the request completed without error."""
        return self.error is None and self.finish_s is not None

    def to_row(self) -> dict[str, Any]:
        """Plain dict for a JSONL row (times rounded to the microsecond)."""
        row = asdict(self)
        for k in ("scheduled_s", "arrival_s", "first_token_s", "finish_s"):
            if row[k] is not None:
                row[k] = round(row[k], 6)
        row["token_times_s"] = [round(t, 6) for t in row["token_times_s"]]
        return row

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> "RequestRecord":
        """Rebuild a record from :meth:`to_row` output (extra keys ignored)."""
        names = cls.__dataclass_fields__.keys()
        return cls(**{k: row[k] for k in names if k in row})


@dataclass
class LoadResult:
    """One run of a schedule against one arm.

    Attributes:
        arm: arm name. records: one per request, in submission order. schedule: the schedule.
        t0: clock reading of the injection start (arm clock, seconds). wall_s: clock time from
        ``t0`` to the end of the wait. settings: ``arm.describe()`` after the run.
    """

    arm: str
    records: list[RequestRecord]
    schedule: ArrivalSchedule
    t0: float
    wall_s: float
    settings: dict[str, Any]

    @property
    def window_s(self) -> float:
        """Injection window length in seconds (the schedule's)."""
        return self.schedule.window_s


def hint_for(requests: Sequence[Request]) -> WorkloadHint:
    """The :class:`~impl.serving.arms.WorkloadHint` of a request list (longest prompt, largest cap, count)."""
    return WorkloadHint(max(len(r.input_ids) for r in requests), max(r.max_new_tokens for r in requests),
                        len(requests))


def requests_from_prompts(rows: Iterable[Mapping[str, Any]], max_new_tokens: int, *, n: int | None = None,
                          ignore_eos: bool = False) -> list[Request]:
    """Requests from frozen prompt rows (``impl.workloads`` JSONL: ``id`` and ``input_ids``).

    Args:
        rows: prompt rows; rows with an ``error`` key or no ``input_ids`` are skipped.
        max_new_tokens: generation cap of every request, tokens.
        n: take this many requests, cycling through the rows when there are fewer (a cycled
            request's id gets a ``#k`` suffix); default: one per row.
        ignore_eos: flag of every request.

    Raises:
        ValueError: if no usable row remains, or ``max_new_tokens < 1``.
    """
    if int(max_new_tokens) < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens!r}")
    usable = [r for r in rows if r.get("input_ids") and not r.get("error")]
    if not usable:
        raise ValueError("no usable prompt rows (need non-empty 'input_ids' and no 'error')")
    total = len(usable) if n is None else int(n)
    out = []
    for i in range(total):
        row = usable[i % len(usable)]
        rid = str(row["id"]) if i < len(usable) else f"{row['id']}#{i // len(usable)}"
        out.append(Request(rid, tuple(int(t) for t in row["input_ids"]), int(max_new_tokens), ignore_eos))
    return out


def _record(req: Request, scheduled: float, arrival: float, tr: Trace, t0: float, keep_ids: bool) -> RequestRecord:
    times = [t - t0 for t in tr.token_times]
    ok = tr.error is None and tr.finish_time is not None
    return RequestRecord(
        request_id=req.request_id,
        max_new_tokens=req.max_new_tokens,
        ignore_eos=req.ignore_eos,
        scheduled_s=scheduled,
        arrival_s=arrival - t0,
        first_token_s=times[0] if times else None,
        token_times_s=times,
        finish_s=(tr.finish_time - t0) if ok else None,
        prompt_tokens=tr.prompt_tokens,
        prompt_tokens_requested=len(req.input_ids),
        output_tokens=int(tr.output_tokens),
        output_ids=list(tr.token_ids) if keep_ids else [],
        error=tr.error if tr.error is not None else (None if ok else "no finish time"),
        finish_reason=tr.finish_reason,
        timestamp_source=tr.timestamp_source,
    )


def run_load(arm: Arm, requests: Sequence[Request], schedule: ArrivalSchedule, *, timeout_s: float = 600.0,
             hint: WorkloadHint | None = None, keep_ids: bool = True) -> LoadResult:
    """Drive ``arm`` with ``requests`` at the arrivals of ``schedule`` (module docstring).

    Request ``i`` arrives at ``schedule.offsets_s[i]``. The arm is started before and stopped after
    the run (also on error).

    Args:
        arm: the arm to drive.
        requests: the requests, in arrival order (same length as the schedule, unique ids).
        schedule: arrival offsets in seconds (rate in requests/s).
        timeout_s: seconds to wait after the last submission for the requests to finish; requests
            still running then are recorded with an error (the arm hard-stops them).
        hint: engine sizing hint (default :func:`hint_for` of ``requests``).
        keep_ids: store output token ids in the records.

    Returns:
        :class:`LoadResult`; failed or unfinished requests have ``error`` set (they are not dropped).

    Raises:
        ValueError: if the lengths differ, ids repeat, or the request list is empty.
        NotImplementedError: if a request needs ignore-EOS and the arm does not support it.
    """
    if not requests:
        raise ValueError("run_load needs at least one request")
    if len(requests) != len(schedule):
        raise ValueError(f"{len(requests)} requests but {len(schedule)} scheduled arrivals")
    ids = [r.request_id for r in requests]
    if len(set(ids)) != len(ids):
        dup = sorted({i for i in ids if ids.count(i) > 1})
        raise ValueError(f"duplicate request ids: {dup[:10]}")
    if any(r.ignore_eos for r in requests) and not arm.supports_ignore_eos:
        raise NotImplementedError(f"arm {arm.name!r} cannot ignore EOS, so it cannot replay matched work")
    if not math.isfinite(float(timeout_s)) or timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
    clock = arm.clock
    arm.start(hint if hint is not None else hint_for(requests))
    try:
        t0 = clock.now()
        arrivals: list[float] = []
        for req, off in zip(requests, schedule.offsets_s):
            clock.sleep_until(t0 + off)
            arrivals.append(clock.now())
            arm.submit(req.request_id, list(req.input_ids), req.max_new_tokens, req.ignore_eos)
        traces = arm.wait(ids, timeout_s)
        wall = clock.now() - t0
    finally:
        arm.stop()
    records = [_record(req, off, a, traces[req.request_id], t0, keep_ids)
               for req, off, a in zip(requests, schedule.offsets_s, arrivals)]
    return LoadResult(arm.name, records, schedule, t0, wall, arm.describe())
