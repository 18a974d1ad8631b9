"""Repetitions, pairing and result rows of the serving comparison (vSkipper Sec. 4.1, "Statistics",
"Testbed", "Matched work"; Tables 2 and 4).

A *cell* is one (workload, offered rate) pair; an *arm* one measured configuration. For a cell,
:func:`run_cell` runs ``n`` repetitions; in every repetition

* both (all) arms run, one after the other, in an order that alternates between repetitions:
  repetition ``r`` runs the arms in the given order when ``r`` is even and reversed when ``r`` is odd
  (two arms: AB, BA, AB, ... - the ABBA sequence);
* every arm replays the same seeded Poisson schedule (seed :func:`schedule_seed` of the cell seed and
  ``r``), the same prompts and, in the matched-work lane, the same output lengths, recorded once per
  cell from the baseline's natural generation at the cell's rate on repetition 0's schedule (that
  recording run is not a measured repetition) and gated per request after every repetition
  (:func:`impl.serving.matched.check_matched`).

Per metric and treatment arm the summary is the mean of the per-repetition percentage changes
against the baseline, ``100 * (treatment_r - baseline_r) / baseline_r``, with a t-based 95% interval
and the resolved flag (:func:`impl.stats.percent_change`; one repetition is never resolved), n
printed. Latency metrics improve when negative, throughput (``tps_window``, ``rps_window``) when
positive (``better`` in the summary rows).

Rows (one JSONL file, every row stamped with :func:`impl.provenance.provenance`):

* ``kind="request"``: one per (cell, lane, arm, repetition, request): the
  :class:`~impl.serving.loadgen.RequestRecord` fields (arrival, first token, every token time,
  finish, token counts, error) and its E2E / TTFT / TPOT; the length-recording run has
  ``phase="record"`` and ``repetition=-1``;
* ``kind="cell"``: one per (cell, lane, arm, repetition): :func:`impl.serving.metrics.cell_metrics`
  and the arm's declared settings;
* ``kind="summary"``: one per (cell, lane, treatment arm, metric): the paired percentage change.
"""

from __future__ import annotations

import logging
import math
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from impl.provenance import provenance, write_jsonl
from impl.stats import PairedResult, percent_change

from .arms import Arm
from .arrivals import ArrivalSchedule, poisson_arrivals
from .loadgen import LoadResult, Request, run_load
from .matched import check_matched, natural_requests, record_lengths, replay_requests
from .metrics import cell_metrics, request_metrics

__all__ = [
    "COMPARED_METRICS",
    "LANES",
    "CellSpec",
    "CellResult",
    "CellError",
    "arm_order",
    "schedule_seed",
    "cell_seed",
    "run_cell",
    "summarize",
    "format_summary",
    "stamp_rows",
    "run_protocol",
]

_LOG = logging.getLogger("impl.serving")

LANES = ("matched", "natural")

#: metric -> direction of improvement, compared by default (units: seconds, tokens/s, requests/s)
COMPARED_METRICS: dict[str, str] = {
    "e2e_mean_s": "lower", "e2e_p50_s": "lower", "e2e_p90_s": "lower", "e2e_p99_s": "lower",
    "ttft_mean_s": "lower", "ttft_p99_s": "lower",
    "tpot_mean_s": "lower", "tpot_p99_s": "lower",
    "makespan_s": "lower", "drain_s": "lower",
    "tps_window": "higher", "rps_window": "higher",
}


class CellError(RuntimeError):
    """A cell that could not be measured (a request failed). ``rows`` holds the rows measured so far."""

    def __init__(self, message: str, rows: list[dict]):
        super().__init__(message)
        self.rows = rows


def arm_order(names: Sequence[str], repetition: int) -> list[str]:
    """Arm order of a repetition: ``names`` for even ``repetition``, reversed for odd (ABBA...)."""
    names = list(names)
    return names if int(repetition) % 2 == 0 else names[::-1]


def schedule_seed(seed: int, repetition: int) -> int:
    """Seed of repetition ``repetition``'s arrival schedule (shared by every arm of the repetition):
    ``numpy.random.SeedSequence([seed, repetition]).generate_state(1)[0]``."""
    return int(np.random.SeedSequence([int(seed), int(repetition)]).generate_state(1)[0])


def cell_seed(seed: int, workload: str, cell: str) -> int:
    """A cell's seed from the run seed and its name (independent of the order cells run in):
    ``SeedSequence([seed, crc32("workload/cell")])``."""
    key = zlib.crc32(f"{workload}/{cell}".encode())
    return int(np.random.SeedSequence([int(seed), key]).generate_state(1)[0])


@dataclass
class CellResult:
    """Everything :func:`run_cell` measured for one cell and lane.

    Attributes:
        workload, cell, rate (requests/s), lane, baseline: identify the comparison.
        rows: request, cell and summary rows (not yet stamped with provenance).
        metrics: ``arm -> [cell metrics of repetition 0, 1, ...]``.
        summaries: ``(treatment, metric) -> PairedResult`` in percent (missing where undefined).
        lengths: the replayed output lengths (matched lane) or None.
        orders: the arm order of each repetition.
    """

    workload: str
    cell: str
    rate: float
    lane: str
    baseline: str
    rows: list[dict] = field(default_factory=list)
    metrics: dict[str, list[dict]] = field(default_factory=dict)
    summaries: dict[tuple[str, str], PairedResult] = field(default_factory=dict)
    lengths: dict[str, int] | None = None
    orders: list[list[str]] = field(default_factory=list)


def _request_rows(res: LoadResult, base: dict) -> list[dict]:
    return [{"kind": "request", **base, "arm": res.arm, **rec.to_row(), **request_metrics(rec)} for rec in res.records]


def _failed(res: LoadResult) -> list[str]:
    return [r.request_id for r in res.records if not r.ok]


def summarize(metrics: Mapping[str, Sequence[Mapping[str, float]]], baseline: str,
              compared: Mapping[str, str] | None = None, confidence: float = 0.95
              ) -> tuple[dict[tuple[str, str], PairedResult], list[dict]]:
    """Paired percentage changes of every treatment arm against ``baseline``.

    Args:
        metrics: ``arm -> per-repetition cell metrics`` (index r = repetition r; all arms equally long).
        baseline: the baseline arm's name.
        compared: ``metric -> "lower" | "higher"`` (default :data:`COMPARED_METRICS`).
        confidence: interval level (default 0.95).

    Returns:
        ``(summaries, rows)``: ``{(treatment, metric): PairedResult}`` (percent) and one row per
        (treatment, metric) with ``n``, the arms' means, the ``pct_*`` fields of the PairedResult,
        ``improved`` (resolved and in the better direction) and ``text`` (e.g.
        ``"-4.60 [-6.10, -3.10] (n=6, resolved)"``); a metric whose percentage change is undefined
        (a zero or NaN baseline value) gets ``error`` instead.

    Raises:
        ValueError: if ``baseline`` is missing or the arms have different repetition counts.
    """
    compared = dict(COMPARED_METRICS if compared is None else compared)
    if baseline not in metrics:
        raise ValueError(f"baseline arm {baseline!r} not among {list(metrics)}")
    n = {arm: len(v) for arm, v in metrics.items()}
    if len(set(n.values())) != 1:
        raise ValueError(f"arms have different repetition counts: {n}")
    out: dict[tuple[str, str], PairedResult] = {}
    rows = []
    for arm in metrics:
        if arm == baseline:
            continue
        for m, better in compared.items():
            a = [float(rep[m]) for rep in metrics[baseline]]
            b = [float(rep[m]) for rep in metrics[arm]]
            row: dict[str, Any] = {"kind": "summary", "metric": m, "better": better, "baseline": baseline,
                                   "treatment": arm, "n": len(a),
                                   "baseline_mean": float(np.mean(a)) if a else math.nan,
                                   "treatment_mean": float(np.mean(b)) if b else math.nan}
            try:
                res = percent_change(a, b, confidence)
            except ValueError as e:
                row["error"] = f"percent change undefined: {e}"
                row["text"] = f"undefined (n={len(a)}): {e}"
            else:
                out[(arm, m)] = res
                row.update({f"pct_{k}": v for k, v in res.to_dict().items() if k != "n"})
                direction = res.mean < 0 if better == "lower" else res.mean > 0
                row["improved"] = bool(res.resolved and direction)
                row["text"] = str(res)
            rows.append(row)
    return out, rows


def run_cell(arms: Mapping[str, Arm], requests: Sequence[Request], *, cell: str, rate: float, repetitions: int,
             seed: int, baseline: str | None = None, lane: str = "matched", lengths: Mapping[str, int] | None = None,
             workload: str = "", timeout_s: float = 600.0, compared: Mapping[str, str] | None = None,
             keep_ids: bool = True, on_run: Callable[[dict], None] | None = None) -> CellResult:
    """Measure one cell in one lane: ``repetitions`` paired repetitions of every arm (module docstring).

    Args:
        arms: ``name -> arm`` in the order of even repetitions (names are used in the rows).
        requests: the cell's requests (ids, prompts, natural caps ``max_new_tokens``).
        cell: cell label (e.g. ``"knee"``); rate: offered rate in requests/s; workload: suite name.
        repetitions: n >= 1 (the paper uses 6; n = 1 is never resolved).
        seed: the cell's seed (:func:`cell_seed`); repetition r uses ``schedule_seed(seed, r)``.
        baseline: the baseline arm (default: the first).
        lane: ``"matched"`` (replay recorded lengths with EOS ignored, gated) or ``"natural"``.
        lengths: output lengths to replay (matched lane); default: recorded here from the
            baseline's natural run on repetition 0's schedule.
        timeout_s: per-run completion timeout, seconds.
        compared: metrics to compare (default :data:`COMPARED_METRICS`).
        keep_ids: keep output token ids in the request rows.
        on_run: called with each run's cell row as soon as it is measured (progress / logging).

    Returns:
        :class:`CellResult`.

    Raises:
        ValueError: for an unknown lane, no arms, an unknown baseline, ``repetitions < 1``, or
            arrival-schedule errors.
        CellError: if a request failed in any run (every request must be served to completion);
            ``.rows`` has the rows measured so far.
        impl.serving.matched.MatchedWorkError: if the matched-work gate rejects a repetition
            (names the requests); ``.rows`` has the rows measured so far.
    """
    if lane not in LANES:
        raise ValueError(f"lane must be one of {LANES}, got {lane!r}")
    if not arms:
        raise ValueError("run_cell needs at least one arm")
    names = list(arms)
    baseline = names[0] if baseline is None else baseline
    if baseline not in arms:
        raise ValueError(f"baseline arm {baseline!r} not among {names}")
    if int(repetitions) < 1:
        raise ValueError(f"repetitions must be >= 1, got {repetitions!r}")
    n_req = len(requests)
    schedules: list[ArrivalSchedule] = [poisson_arrivals(rate, n=n_req, seed=schedule_seed(seed, r))
                                        for r in range(int(repetitions))]
    result = CellResult(workload, cell, float(rate), lane, baseline)
    key = {"workload": workload, "cell": cell, "rate": float(rate), "lane": lane}

    if lane == "matched":
        if lengths is None:
            base = {**key, "phase": "record", "repetition": -1, "order_position": 0,
                    "schedule_seed": schedule_seed(seed, 0), "window_s": schedules[0].window_s}
            rec = run_load(arms[baseline], natural_requests(requests), schedules[0], timeout_s=timeout_s,
                           keep_ids=keep_ids)
            result.rows.extend(_request_rows(rec, base))
            bad = _failed(rec)
            if bad:
                raise CellError(f"{workload}/{cell}: length-recording run of {baseline!r}: {len(bad)} requests "
                                f"failed: {bad[:20]}", result.rows)
            lengths = record_lengths(rec.records)
        result.lengths = {k: int(v) for k, v in lengths.items()}
        work = replay_requests(requests, result.lengths)
    else:
        work = natural_requests(requests)

    result.metrics = {name: [] for name in names}
    for r, sched in enumerate(schedules):
        order = arm_order(names, r)
        result.orders.append(order)
        per_arm = {}
        for pos, name in enumerate(order):
            base = {**key, "phase": "measure", "repetition": r, "order_position": pos,
                    "schedule_seed": sched.seed, "window_s": sched.window_s}
            res = run_load(arms[name], work, sched, timeout_s=timeout_s, keep_ids=keep_ids)
            res.arm = name
            result.rows.extend(_request_rows(res, base))
            m = cell_metrics(res.records, sched.window_s)
            row = {"kind": "cell", **base, "arm": name, **m, "wall_s": res.wall_s, "arm_settings": res.settings}
            result.rows.append(row)
            if on_run is not None:
                on_run(row)
            bad = _failed(res)
            if bad:
                raise CellError(f"{workload}/{cell} repetition {r}, arm {name!r}: {len(bad)} requests failed: "
                                f"{bad[:20]}", result.rows)
            per_arm[name] = res.records
            result.metrics[name].append(m)
        if lane == "matched":
            try:
                check_matched(per_arm, result.lengths)
            except Exception as e:
                e.rows = result.rows
                raise

    summaries, rows = summarize(result.metrics, baseline, compared)
    result.summaries = summaries
    result.rows.extend({**key, **row} for row in rows)
    return result


def format_summary(rows: Sequence[Mapping[str, Any]]) -> str:
    """One line per summary row: ``workload/cell (rate req/s) lane: treatment vs baseline metric:
    mean [low, high] (n=..., resolved|unresolved)`` (percent; ``better`` says which sign is good)."""
    lines = []
    for r in rows:
        if r.get("kind") != "summary":
            continue
        lines.append(f"{r.get('workload', '')}/{r.get('cell', '')} ({r.get('rate', math.nan):.4g} req/s) "
                     f"{r.get('lane', '')}: {r['treatment']} vs {r['baseline']} {r['metric']} "
                     f"({r['better']} is better): {r['text']} %")
    return "\n".join(lines)


def stamp_rows(rows: Sequence[Mapping[str, Any]], prov: Mapping[str, Any]) -> list[dict]:
    """Rows with the provenance fields (:func:`impl.provenance.provenance`) added to each."""
    return [{**row, **prov} for row in rows]


@dataclass(frozen=True)
class CellSpec:
    """A cell of the protocol: workload name, label (e.g. ``"knee"``), absolute offered rate
    (requests/s) and its requests (natural caps)."""

    workload: str
    cell: str
    rate: float
    requests: tuple[Request, ...]


def run_protocol(arms: Mapping[str, Arm], cells: Sequence[CellSpec], *, repetitions: int, seed: int,
                 baseline: str | None = None, lanes: Sequence[str] = ("matched",), out: str | None = None,
                 config: Mapping[str, Any] | None = None, device: str = "cpu", dtype: str = "float32",
                 run_id: str | None = None, timeout_s: float = 600.0, keep_ids: bool = True,
                 log: Callable[[str], None] | None = None) -> list[dict]:
    """Run every cell in every lane with paired repetitions; write one JSONL file with provenance.

    Args:
        arms: ``name -> arm`` (first = baseline unless ``baseline`` is given).
        cells: the cells (e.g. 0.75 / 0.95 / 1.25 x Q* from :func:`impl.serving.knee.load_points`).
        repetitions: n per cell (>= 1).
        seed: run seed; each cell's seed is :func:`cell_seed` (same schedules in every lane).
        baseline: baseline arm name.
        lanes: any of ``"matched"``, ``"natural"``.
        out: JSONL path (written atomically), or None to only return the rows.
        config: the configuration, hashed into the provenance.
        device, dtype, run_id: provenance fields.
        timeout_s: per-run completion timeout, seconds.
        keep_ids: keep output token ids in request rows.
        log: where progress and the summary lines go (default: the ``impl.serving`` logger).

    Returns:
        all rows, stamped with provenance.

    Raises:
        as :func:`run_cell`; nothing is written when a cell fails.
    """
    say = log or _LOG.info
    prov = provenance(config or {}, seed=seed, device=device, dtype=dtype, run_id=run_id)
    rows: list[dict] = []
    for spec in cells:
        cs = cell_seed(seed, spec.workload, spec.cell)
        for lane in lanes:
            say(f"cell {spec.workload}/{spec.cell} at {spec.rate:.4g} req/s, lane {lane}, n={repetitions}")
            res = run_cell(arms, spec.requests, cell=spec.cell, rate=spec.rate, repetitions=repetitions, seed=cs,
                           baseline=baseline, lane=lane, workload=spec.workload, timeout_s=timeout_s,
                           keep_ids=keep_ids,
                           on_run=lambda row: say(f"  rep {row['repetition']} {row['arm']}: "
                                                  f"E2E mean {row['e2e_mean_s']:.4f} s, TPS {row['tps_window']:.2f}"))
            text = format_summary(res.rows)
            if text:
                say(text)
            rows.extend(res.rows)
    stamped = stamp_rows(rows, prov)
    if out is not None:
        write_jsonl(out, stamped)
    return stamped
