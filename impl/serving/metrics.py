"""Serving metrics per request and per cell run (vSkipper Sec. 4.1, "Metrics"; App. F).

All times are seconds from the injection start (``t = 0``, see :mod:`impl.serving.loadgen`).

Per request (completed requests only; a failed request has no latency):

* ``E2E = finish - arrival``;
* ``TTFT = first_token - arrival``;
* ``TPOT = (finish - first_token) / (output_tokens - 1)``, the request's mean inter-token interval
  (for the in-process arm ``finish`` is the last token's time, so this is exactly the mean of the
  ``output_tokens - 1`` gaps; it is SGLang ``bench_serving``'s formula). Undefined for requests with
  fewer than 2 output tokens, which are left out of the TPOT statistics.

Per cell run (``W`` = injection window length, seconds):

* ``<m>_mean_s``, ``<m>_p50_s``, ``<m>_p90_s``, ``<m>_p99_s`` for m in e2e, ttft, tpot: mean and
  percentiles over requests; percentiles are ``numpy.percentile`` with linear interpolation (the
  q-th percentile of n sorted values is the value at rank ``q/100 * (n - 1)``, interpolated);
* ``makespan_s``: from the injection start to the last completion, ``max(finish)``;
* ``drain_s``: from the end of the injection window to the last completion, ``max(0, makespan - W)``;
* ``tps_window``: output tokens produced inside the window per second: the number of output tokens
  with a time in ``[0, W]``, divided by ``W`` (tokens/s). A token's time is its timestamp; tokens an
  arm could not time individually (HTTP chunks may carry several; the EOS has no text) are counted
  at their request's finish. Only completed requests count;
* ``rps_window``: requests completed inside the window per second: completed requests with
  ``finish <= W``, divided by ``W`` (requests/s);
* ``cell_tps``: whole-cell output tokens per second, all output tokens / makespan (depends on the
  drain; reported for reference, not the saturated throughput);
* counts: ``n_requests``, ``n_completed``, ``n_failed``, ``output_tokens`` (completed requests).
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence

import numpy as np

from .loadgen import RequestRecord

__all__ = ["request_metrics", "distribution", "cell_metrics", "LATENCIES", "PERCENTILES"]

LATENCIES = ("e2e", "ttft", "tpot")
PERCENTILES = (50, 90, 99)
NAN = float("nan")


def request_metrics(rec: RequestRecord) -> dict[str, float | None]:
    """E2E, TTFT and TPOT of one request, in seconds (module docstring).

    Returns:
        ``{"e2e_s", "ttft_s", "tpot_s"}``; a value is None when undefined (failed request; no
        output token; TPOT with fewer than 2 output tokens).
    """
    if not rec.ok:
        return {"e2e_s": None, "ttft_s": None, "tpot_s": None}
    e2e = rec.finish_s - rec.arrival_s
    ttft = None if rec.first_token_s is None else rec.first_token_s - rec.arrival_s
    tpot = None
    if rec.first_token_s is not None and rec.output_tokens >= 2:
        tpot = (rec.finish_s - rec.first_token_s) / (rec.output_tokens - 1)
    return {"e2e_s": e2e, "ttft_s": ttft, "tpot_s": tpot}


def distribution(values: Iterable[float], prefix: str) -> dict[str, float]:
    """Mean and p50/p90/p99 of ``values`` as ``{prefix}_mean_s``, ``{prefix}_p50_s``, ... (NaN when empty).

    Percentiles use ``numpy.percentile`` (linear interpolation between order statistics).
    """
    arr = np.asarray([v for v in values if v is not None], dtype=float)
    out = {f"{prefix}_mean_s": float(arr.mean()) if arr.size else NAN}
    for q in PERCENTILES:
        out[f"{prefix}_p{q}_s"] = float(np.percentile(arr, q)) if arr.size else NAN
    out[f"{prefix}_n"] = int(arr.size)
    return out


def _tokens_in_window(rec: RequestRecord, window_s: float) -> int:
    timed = sum(1 for t in rec.token_times_s if 0.0 <= t <= window_s)
    untimed = max(0, rec.output_tokens - len(rec.token_times_s))
    return timed + (untimed if rec.finish_s <= window_s else 0)


def cell_metrics(records: Sequence[RequestRecord], window_s: float) -> dict[str, float | int]:
    """Cell-level metrics of one run (definitions in the module docstring).

    Args:
        records: the run's request records (times in seconds from the injection start).
        window_s: injection window length ``W`` in seconds (> 0).

    Returns:
        dict with ``n_requests``, ``n_completed``, ``n_failed``, ``output_tokens``, the e2e / ttft /
        tpot means and percentiles (seconds), ``makespan_s``, ``drain_s``, ``window_s``,
        ``tps_window`` (tokens/s), ``rps_window`` (requests/s) and ``cell_tps`` (tokens/s). Values
        over no completed request are NaN.

    Raises:
        ValueError: if ``records`` is empty or ``window_s`` is not a positive finite number.
    """
    if not records:
        raise ValueError("cell_metrics needs at least one request record")
    w = float(window_s)
    if not math.isfinite(w) or w <= 0:
        raise ValueError(f"the injection window must be a positive number of seconds, got {window_s!r}")
    done = [r for r in records if r.ok]
    per = [request_metrics(r) for r in done]
    out: dict[str, float | int] = {
        "n_requests": len(records),
        "n_completed": len(done),
        "n_failed": len(records) - len(done),
        "output_tokens": int(sum(r.output_tokens for r in done)),
        "window_s": w,
    }
    for m in LATENCIES:
        out.update(distribution((p[f"{m}_s"] for p in per), m))
    makespan = max((r.finish_s for r in done), default=NAN)
    out["makespan_s"] = float(makespan)
    out["drain_s"] = float(max(0.0, makespan - w)) if done else NAN
    out["tps_window"] = sum(_tokens_in_window(r, w) for r in done) / w
    out["rps_window"] = sum(1 for r in done if r.finish_s <= w) / w
    out["cell_tps"] = out["output_tokens"] / makespan if done and makespan > 0 else NAN
    return out
