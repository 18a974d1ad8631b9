"""Knee sweep: Q*, the last offered rate at which the baseline's output token rate still grows
(vSkipper Sec. 4.1, "Load"; App. M), and the load points at 0.75, 0.95 and 1.25 x Q*.

Rule (exact). Sort the sweep by offered rate ``r_0 < r_1 < ... < r_{m-1}`` (requests/s) with output
token rates ``T_i`` (tokens/s, :func:`impl.serving.metrics.cell_metrics` ``tps_window`` of the
baseline under its own natural generation). The step ``i -> i+1`` *grows* when
``T_{i+1} > (1 + eps) * T_i``. Let ``k`` be the smallest index whose next step does not grow
(``T_{k+1} <= (1 + eps) * T_k``): the first plateau. Then ``Q* = r_k``: every step up to ``r_k``
grew and the step after it did not.

The knee is refused (``ValueError``) when it falls on a rung of the sweep that cannot bound it:

* ``k = 0`` (bottom rung): the output token rate does not even grow from the lowest rate, so the
  knee lies at or below it - extend the sweep downwards;
* no plateau (every step grows): the knee lies at or beyond the top rung - extend upwards.

Rungs after the first plateau whose rate still exceeds ``(1 + eps) * T_k`` are reported in
:attr:`KneeResult.later_growth` (a noisy sweep, or a second rise): the rule keeps the first
plateau, and the caller may refine the sweep.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from .arms import Arm
from .arrivals import ArrivalSchedule, poisson_arrivals
from .loadgen import Request, run_load
from .metrics import cell_metrics

__all__ = ["KneeResult", "find_knee", "load_points", "knee_sweep", "serial_capacity", "capacity_rates", "LOAD_FACTORS",
           "DEFAULT_EPS"]

#: the paper's load points relative to Q*: below the knee, the knee, overload
LOAD_FACTORS: dict[str, float] = {"below": 0.75, "knee": 0.95, "overload": 1.25}
#: default relative growth threshold
DEFAULT_EPS = 0.02


@dataclass(frozen=True)
class KneeResult:
    """Outcome of :func:`find_knee`.

    Attributes:
        q_star: Q* in requests/s.
        index: position of Q* in the sorted sweep.
        rates: sorted offered rates (requests/s). tps: their output token rates (tokens/s).
        eps: the growth threshold used.
        later_growth: rates after the plateau whose token rate exceeds ``(1 + eps) * T_k``.
        rule: the rule, in words.
    """

    q_star: float
    index: int
    rates: tuple[float, ...]
    tps: tuple[float, ...]
    eps: float
    later_growth: tuple[float, ...] = ()
    rule: str = field(default="")

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for a result row."""
        return {"q_star": self.q_star, "index": self.index, "rates": list(self.rates), "tps": list(self.tps),
                "eps": self.eps, "later_growth": list(self.later_growth), "rule": self.rule}


def find_knee(rates: Sequence[float], tps: Sequence[float], *, eps: float = DEFAULT_EPS) -> KneeResult:
    """Q* from a sweep of offered rates and output token rates (rule in the module docstring).

    Args:
        rates: offered rates in requests/s (positive, distinct; any order - sorted here).
        tps: output token rate at each rate, tokens/s (finite, >= 0), same length.
        eps: relative growth threshold (>= 0): a step grows when ``T_{i+1} > (1 + eps) T_i``.

    Returns:
        :class:`KneeResult`.

    Raises:
        ValueError: for fewer than 3 rungs, mismatched lengths, repeated / non-positive /
            non-finite rates, negative or non-finite token rates, a negative ``eps``, or a knee at
            the bottom or the top rung (the message says which way to extend the sweep).
    """
    if len(rates) != len(tps):
        raise ValueError(f"{len(rates)} rates but {len(tps)} token rates")
    if len(rates) < 3:
        raise ValueError(f"a knee sweep needs at least 3 rates, got {len(rates)}")
    e = float(eps)
    if not math.isfinite(e) or e < 0:
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    pairs = sorted((float(r), float(t)) for r, t in zip(rates, tps))
    rs = [p[0] for p in pairs]
    ts = [p[1] for p in pairs]
    if any(not math.isfinite(r) or r <= 0 for r in rs):
        raise ValueError(f"rates must be positive and finite, got {rs}")
    if len(set(rs)) != len(rs):
        raise ValueError(f"rates must be distinct, got {rs}")
    if any(not math.isfinite(t) or t < 0 for t in ts):
        raise ValueError(f"token rates must be finite and >= 0, got {ts}")
    rule = (f"Q* = r_k for the smallest k with TPS(r_(k+1)) <= (1 + {e:g}) * TPS(r_k); "
            "refused at the bottom (k = 0) or top (no such k) rung")
    k = next((i for i in range(len(rs) - 1) if not ts[i + 1] > (1.0 + e) * ts[i]), None)
    if k is None:
        raise ValueError(
            f"knee at the top rung: the output token rate still grows at every step up to {rs[-1]:g} req/s "
            f"(TPS {[round(t, 3) for t in ts]}); extend the sweep to higher rates")
    if k == 0:
        raise ValueError(
            f"knee at the bottom rung: the output token rate does not grow from {rs[0]:g} to {rs[1]:g} req/s "
            f"(TPS {ts[0]:.3f} -> {ts[1]:.3f}, eps={e:g}); extend the sweep to lower rates")
    later = tuple(rs[j] for j in range(k + 1, len(rs)) if ts[j] > (1.0 + e) * ts[k])
    return KneeResult(rs[k], k, tuple(rs), tuple(ts), e, later, rule)


def load_points(q_star: float, factors: Mapping[str, float] | None = None) -> dict[str, float]:
    """The cells' absolute offered rates (requests/s): ``{label: factor * Q*}``.

    Args:
        q_star: Q* in requests/s (> 0).
        factors: label -> multiple of Q*; default :data:`LOAD_FACTORS` (0.75 below, 0.95 knee,
            1.25 overload).

    Raises:
        ValueError: for a non-positive Q* or factor.
    """
    q = float(q_star)
    if not math.isfinite(q) or q <= 0:
        raise ValueError(f"Q* must be a positive rate in requests/s, got {q_star!r}")
    facs = dict(LOAD_FACTORS if factors is None else factors)
    bad = {k: v for k, v in facs.items() if not float(v) > 0}
    if bad:
        raise ValueError(f"load factors must be positive, got {bad}")
    return {k: float(v) * q for k, v in facs.items()}


def serial_capacity(arm: Arm, requests: Sequence[Request], *, n: int = 4, timeout_s: float = 600.0) -> dict[str, Any]:
    """The baseline's serial service capacity ``mu = 1 / mean(E2E)`` [requests/s]: the first ``n``
    requests served one at a time under natural generation (nothing else in flight), each on a fresh
    start of the arm. It sets the scale of a capacity-relative sweep (:func:`capacity_rates`), so the
    same rate factors bracket the knee of a 3M-parameter model and of a 135M one on the same CPU
    (the paper sweeps absolute rates chosen per model and GPU, App. M).

    Args:
        arm: the baseline (upstream) arm.
        requests: the workload's requests (natural caps; ``ignore_eos`` forced off).
        n: requests to serve (>= 1; at most ``len(requests)``).
        timeout_s: per-request completion timeout, seconds.

    Returns:
        ``{"capacity_req_s", "service_s_mean", "service_s": [per request], "n"}`` (seconds, requests/s).

    Raises:
        ValueError: for ``n < 1`` or no requests; RuntimeError: if a request fails.
    """
    if n < 1 or not requests:
        raise ValueError(f"serial_capacity needs n >= 1 and at least one request, got n={n}, {len(requests)} requests")
    one = ArrivalSchedule(offsets_s=(0.0,), rate=1.0, seed=0, window_s=1.0)
    service = []
    for r in list(requests)[:n]:
        rec = run_load(arm, [Request(r.request_id, r.input_ids, r.max_new_tokens, False)], one,
                       timeout_s=timeout_s).records[0]
        if not rec.ok:
            raise RuntimeError(f"serial capacity probe: request {rec.request_id} failed: {rec.error}")
        service.append(rec.finish_s - rec.arrival_s)
    mean = sum(service) / len(service)
    return {"capacity_req_s": 1.0 / mean, "service_s_mean": mean, "service_s": service, "n": len(service)}


def capacity_rates(capacity_req_s: float, factors: Sequence[float]) -> list[float]:
    """Absolute sweep rates [requests/s] ``factors x capacity``, rounded to 3 significant digits.

    Raises:
        ValueError: for a non-positive capacity or factor, factors that are not strictly increasing,
            or factors so close that two rates round to the same value.
    """
    c = float(capacity_req_s)
    if not math.isfinite(c) or c <= 0:
        raise ValueError(f"capacity must be a positive number of requests/s, got {capacity_req_s!r}")
    f = [float(x) for x in factors]
    if not f or any(x <= 0 for x in f) or any(b <= a for a, b in zip(f, f[1:])):
        raise ValueError(f"rate factors must be positive and strictly increasing, got {list(factors)}")
    rates = [float(f"{c * x:.3g}") for x in f]
    if len(set(rates)) != len(rates):
        raise ValueError(f"rate factors {f} give repeated rates {rates} at the capacity {c:.4g} requests/s; "
                         "space the factors further apart")
    return rates


def knee_sweep(arm: Arm, requests: Sequence[Request], rates: Sequence[float], *, seed: int, eps: float = DEFAULT_EPS,
               timeout_s: float = 600.0, on_point: Callable[[dict], None] | None = None
               ) -> tuple[KneeResult, list[dict[str, Any]]]:
    """Sweep offered rates on the baseline arm under natural generation and find Q*.

    Every rung replays the same requests (``ignore_eos`` forced off) on a Poisson schedule drawn
    with the same ``seed`` (common random numbers: the schedules differ only by the rate scale).

    Args:
        arm: the baseline (upstream) arm.
        requests: the workload's requests, with their natural caps.
        rates: offered rates to try, requests/s.
        seed: schedule seed.
        eps: growth threshold of :func:`find_knee`.
        timeout_s: per-rung completion timeout, seconds.
        on_point: called with each rung's row as soon as it is measured (progress / logging).

    Returns:
        ``(KneeResult, rows)``: one ``{"kind": "sweep", ...}`` row per rung (rate, window, cell
        metrics, arm settings) in sweep order.

    Raises:
        RuntimeError: if a rung has failed requests (every request must be served to completion).
        ValueError: as :func:`find_knee` (including a knee at the bottom or top rung); the
            exception's ``rows`` attribute holds the measured rungs.
    """
    natural = [Request(r.request_id, r.input_ids, r.max_new_tokens, False) for r in requests]
    rows = []
    for rate in rates:
        sched = poisson_arrivals(rate, n=len(natural), seed=seed)
        res = run_load(arm, natural, sched, timeout_s=timeout_s)
        m = cell_metrics(res.records, sched.window_s)
        if m["n_failed"]:
            bad = [r.request_id for r in res.records if not r.ok]
            raise RuntimeError(f"knee sweep at {rate:g} req/s: {len(bad)} requests failed: {bad[:10]}")
        row = {"kind": "sweep", "arm": arm.name, "rate": float(rate), "schedule_seed": int(seed), **m,
               "arm_settings": res.settings}
        rows.append(row)
        if on_point is not None:
            on_point(row)
    try:
        knee = find_knee([r["rate"] for r in rows], [r["tps_window"] for r in rows], eps=eps)
    except ValueError as e:
        e.rows = rows  # the measured rungs, for the caller to record before extending the sweep
        raise
    return knee, rows
