"""Seeded Poisson arrivals at an absolute offered rate (vSkipper Sec. 4.1, "Load")."""

import numpy as np
import pytest
from scipy import stats

from impl.serving.arrivals import poisson_arrivals


def test_seeded_and_deterministic():
    a = poisson_arrivals(4.0, n=50, seed=7)
    b = poisson_arrivals(4.0, n=50, seed=7)
    c = poisson_arrivals(4.0, n=50, seed=8)
    assert a == b
    assert a.offsets_s != c.offsets_s
    assert a.offsets_s[0] == 0.0
    assert all(x <= y for x, y in zip(a.offsets_s, a.offsets_s[1:]))
    assert a.window_s == a.offsets_s[-1] and len(a) == 50 and a.rate == 4.0 and a.seed == 7


def test_same_seed_scales_with_rate():
    """Common random numbers across the rungs of a sweep: doubling the rate halves every offset."""
    a = poisson_arrivals(2.0, n=30, seed=3)
    b = poisson_arrivals(4.0, n=30, seed=3)
    assert np.allclose(np.array(a.offsets_s) / 2.0, b.offsets_s, rtol=1e-12)


def test_mean_rate_and_exponential_gaps():
    rate, n = 5.0, 20001
    s = poisson_arrivals(rate, n=n, seed=123)
    gaps = np.diff(s.offsets_s)
    est = (n - 1) / s.window_s
    # relative sd of the rate estimate is 1/sqrt(n-1) ~ 0.7 %: allow 4 sd
    assert abs(est / rate - 1.0) < 4.0 / np.sqrt(n - 1)
    # gaps are Exp(rate): KS test and coefficient of variation 1
    assert stats.kstest(gaps, "expon", args=(0, 1.0 / rate)).pvalue > 1e-3
    assert abs(gaps.std() / gaps.mean() - 1.0) < 0.05


def test_duration_mode_counts_are_poisson():
    rate, dur = 3.0, 10.0
    counts = []
    for seed in range(300):
        s = poisson_arrivals(rate, duration_s=dur, seed=seed)
        assert s.window_s == dur and s.mode == "duration"
        assert all(0.0 < t < dur for t in s.offsets_s)
        counts.append(len(s))
    counts = np.array(counts)
    mean = rate * dur
    assert abs(counts.mean() - mean) < 4.0 * np.sqrt(mean / len(counts))
    assert 0.75 < counts.var(ddof=1) / counts.mean() < 1.3  # Poisson: variance == mean


@pytest.mark.parametrize("kwargs", [dict(rate=0.0, n=5), dict(rate=-1.0, n=5), dict(rate=float("inf"), n=5),
                                    dict(rate=1.0, n=1), dict(rate=1.0), dict(rate=1.0, n=5, duration_s=2.0),
                                    dict(rate=1.0, duration_s=0.0)])
def test_rejects_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        poisson_arrivals(seed=0, **kwargs)
