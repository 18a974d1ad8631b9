"""The serving evaluation protocol as a library (the vSkipper paper's, Sec. 4.1-4.2; App. F, G, M): arms,
open-loop load, knee, matched work, metrics and paired repetitions. Imports no paper package; the
vSkipper experiments built on it live in :mod:`impl.vskipper` (``serving_commands``, ``serving_report``,
``schema``, ``targets``, ``transfer``).

- :mod:`.arrivals`: seeded Poisson arrival schedules at an absolute offered rate;
- :mod:`.arms`: the arm interface; the in-process continuous-batching arm (transformers 5.24) and
  the OpenAI ``/v1/completions`` streaming client arm;
- :mod:`.fake`: a deterministic queueing arm on a virtual clock (tests, dry runs);
- :mod:`.loadgen`: the open-loop load generator (no client concurrency cap, every request served to
  completion) and per-request records;
- :mod:`.metrics`: E2E / TTFT / TPOT, makespan, drain, TPS and RPS inside the injection window;
- :mod:`.knee`: the Q* rule and the 0.75 / 0.95 / 1.25 x Q* load points;
- :mod:`.matched`: matched-work replay and its per-request gate, the natural lane;
- :mod:`.protocol`: paired, order-alternating repetitions, percent-change summaries, JSONL rows;
"""

from .arms import Arm, Clock, ContinuousBatchingArm, HTTPCompletionsArm, RealClock, Trace, WorkloadHint
from .arrivals import ArrivalSchedule, poisson_arrivals
from .fake import FakeArm, VirtualClock
from .knee import LOAD_FACTORS, KneeResult, find_knee, knee_sweep, load_points
from .loadgen import LoadResult, Request, RequestRecord, hint_for, requests_from_prompts, run_load
from .matched import MatchedWorkError, check_matched, natural_requests, record_lengths, replay_requests
from .metrics import cell_metrics, distribution, request_metrics
from .protocol import (
    COMPARED_METRICS,
    CellError,
    CellResult,
    CellSpec,
    arm_order,
    cell_seed,
    format_summary,
    run_cell,
    run_protocol,
    schedule_seed,
    stamp_rows,
    summarize,
)

__all__ = [
    "Arm", "Clock", "RealClock", "Trace", "WorkloadHint", "ContinuousBatchingArm", "HTTPCompletionsArm",
    "ArrivalSchedule", "poisson_arrivals",
    "FakeArm", "VirtualClock",
    "LOAD_FACTORS", "KneeResult", "find_knee", "knee_sweep", "load_points",
    "LoadResult", "Request", "RequestRecord", "hint_for", "requests_from_prompts", "run_load",
    "MatchedWorkError", "check_matched", "natural_requests", "record_lengths", "replay_requests",
    "cell_metrics", "distribution", "request_metrics",
    "COMPARED_METRICS", "CellError", "CellResult", "CellSpec", "arm_order", "cell_seed", "format_summary",
    "run_cell", "run_protocol", "schedule_seed", "stamp_rows", "summarize",
]
