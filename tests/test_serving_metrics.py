"""Serving metrics on hand-built timelines (vSkipper Sec. 4.1, "Metrics"): exact E2E, TTFT, TPOT,
percentiles, makespan, drain, TPS and RPS inside the injection window."""

import math

import pytest

from impl.serving.loadgen import RequestRecord
from impl.serving.metrics import cell_metrics, distribution, request_metrics


def rec(rid, arrival, times, finish=None, n=None, error=None):
    times = list(times)
    finish = (times[-1] if times else None) if finish is None and error is None else finish
    return RequestRecord(rid, 16, False, arrival, arrival, times[0] if times else None, times, finish,
                         3, 3, len(times) if n is None else n, [], error)


TIMELINE = [
    rec("a", 0.0, [0.5, 0.7, 0.9, 1.1]),           # E2E 1.1, TTFT 0.5, TPOT 0.2
    rec("b", 1.0, [1.2, 1.5]),                     # E2E 0.5, TTFT 0.2, TPOT 0.3
    rec("c", 2.0, [3.0]),                          # E2E 1.0, TTFT 1.0, TPOT undefined
    rec("d", 2.5, [2.6, 2.8, 3.0, 3.2, 4.0]),      # E2E 1.5, TTFT 0.1, TPOT 0.35
    rec("e", 2.8, [], error="boom"),               # failed: no latency, no tokens
]
W = 2.8


def test_request_metrics():
    assert request_metrics(TIMELINE[0]) == pytest.approx({"e2e_s": 1.1, "ttft_s": 0.5, "tpot_s": 0.2})
    assert request_metrics(TIMELINE[3]) == pytest.approx({"e2e_s": 1.5, "ttft_s": 0.1, "tpot_s": 0.35})
    m = request_metrics(TIMELINE[2])
    assert m["tpot_s"] is None and m["e2e_s"] == pytest.approx(1.0)
    assert request_metrics(TIMELINE[4]) == {"e2e_s": None, "ttft_s": None, "tpot_s": None}


def test_cell_metrics_exact():
    m = cell_metrics(TIMELINE, W)
    assert (m["n_requests"], m["n_completed"], m["n_failed"], m["output_tokens"]) == (5, 4, 1, 12)
    expect = {
        # E2E [1.1, 0.5, 1.0, 1.5]: sorted [0.5, 1.0, 1.1, 1.5], ranks q/100 * 3
        "e2e_mean_s": 1.025, "e2e_p50_s": 1.05, "e2e_p90_s": 1.1 + 0.7 * 0.4, "e2e_p99_s": 1.1 + 0.97 * 0.4,
        # TTFT sorted [0.1, 0.2, 0.5, 1.0]
        "ttft_mean_s": 0.45, "ttft_p50_s": 0.35, "ttft_p90_s": 0.5 + 0.7 * 0.5, "ttft_p99_s": 0.5 + 0.97 * 0.5,
        # TPOT sorted [0.2, 0.3, 0.35], ranks q/100 * 2
        "tpot_mean_s": 0.85 / 3, "tpot_p50_s": 0.3, "tpot_p90_s": 0.3 + 0.8 * 0.05, "tpot_p99_s": 0.3 + 0.98 * 0.05,
        "makespan_s": 4.0, "drain_s": 4.0 - W,
        # tokens with time in [0, 2.8]: a 4, b 2, c 0, d 2 (2.6 and 2.8, the end is inclusive)
        "tps_window": 8 / W,
        # completed by 2.8: a (1.1), b (1.5)
        "rps_window": 2 / W,
        "cell_tps": 12 / 4.0,
        "window_s": W,
    }
    for k, v in expect.items():
        assert m[k] == pytest.approx(v, abs=1e-12), k
    assert (m["e2e_n"], m["ttft_n"], m["tpot_n"]) == (4, 4, 3)


def test_drain_is_zero_when_everything_finished_inside_the_window():
    m = cell_metrics(TIMELINE[:2], 5.0)
    assert m["makespan_s"] == pytest.approx(1.5) and m["drain_s"] == 0.0
    assert m["rps_window"] == pytest.approx(2 / 5.0) and m["tps_window"] == pytest.approx(6 / 5.0)


def test_untimed_tokens_count_at_finish():
    """HTTP chunks may carry several tokens: tokens without their own time count at the finish."""
    r = rec("h", 0.0, [0.3], finish=0.4, n=3)
    assert cell_metrics([r], 1.0)["tps_window"] == pytest.approx(3.0)
    assert cell_metrics([r], 0.35)["tps_window"] == pytest.approx(1 / 0.35)
    assert request_metrics(r)["tpot_s"] == pytest.approx(0.05)


def test_distribution_and_empty():
    d = distribution([1.0, 2.0, 3.0, 4.0, None], "x")
    assert d["x_mean_s"] == 2.5 and d["x_p50_s"] == 2.5 and d["x_n"] == 4
    assert math.isnan(distribution([], "x")["x_p99_s"])
    m = cell_metrics([TIMELINE[4]], 1.0)
    assert m["n_completed"] == 0 and math.isnan(m["e2e_mean_s"]) and m["tps_window"] == 0.0


def test_cell_metrics_rejects_bad_input():
    with pytest.raises(ValueError):
        cell_metrics([], 1.0)
    with pytest.raises(ValueError):
        cell_metrics(TIMELINE, 0.0)
