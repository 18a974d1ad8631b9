"""Tests for impl.stats against hand-computed values (plus one statsmodels cross-check)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from impl.stats import (
    holm_reject,
    PairedResult,
    difference_in_differences,
    one_sample,
    paired_difference,
    percent_change,
    ratio_of_means,
)

# Student t quantiles from tables / closed forms (not scipy re-calls).
T975_DF3 = 3.182446305284263
T95_DF3 = 2.353363434801823
# df = 2 closed form: t_p = (2p - 1) * sqrt(2 / (4 p (1 - p))).
T975_DF2 = 0.95 * math.sqrt(2.0 / (4 * 0.975 * 0.025))  # 4.302652729911275


def test_t_constants_sane():
    assert T975_DF2 == pytest.approx(4.30265273, abs=1e-7)


def test_paired_difference_hand_example():
    a = [1, 2, 3, 4]
    b = [2, 4, 5, 7]  # d = [1, 2, 2, 3]
    r = paired_difference(a, b)
    sd = math.sqrt(2.0 / 3.0)
    se = sd / 2.0
    assert r.n == 4
    assert r.mean == pytest.approx(2.0)
    assert r.sd == pytest.approx(0.8164966, abs=1e-6)
    assert r.sd == pytest.approx(sd)
    assert r.se == pytest.approx(0.4082483, abs=1e-6)
    assert r.se == pytest.approx(se)
    assert r.ci_low == pytest.approx(0.70077, abs=1e-5)
    assert r.ci_high == pytest.approx(3.29923, abs=1e-5)
    assert r.ci_low == pytest.approx(2 - T975_DF3 * se, abs=1e-9)
    assert r.ci_high == pytest.approx(2 + T975_DF3 * se, abs=1e-9)
    # t = 2 / se = sqrt(24); two-sided p from the closed-form df=3 t CDF.
    t = math.sqrt(24.0)
    assert r.t_stat == pytest.approx(t)
    x = t / math.sqrt(3.0)
    # df = 3: F(t) = 1/2 + (x / (1 + x^2) + atan(x)) / pi with x = t / sqrt(3).
    cdf = 0.5 + (x / (1 + x * x) + math.atan(x)) / math.pi
    assert r.p_value == pytest.approx(2 * (1 - cdf), rel=1e-9)
    assert r.p_value == pytest.approx(0.0162766, abs=1e-7)
    assert r.confidence == 0.95
    assert r.resolved is True
    assert str(r) == "+2.00 [0.70, 3.30] (n=4, resolved)"


def test_direction_is_b_minus_a():
    r = paired_difference([2, 4, 5, 7], [1, 2, 3, 4])
    assert r.mean == pytest.approx(-2.0)
    assert r.ci_high == pytest.approx(-0.70077, abs=1e-5)
    assert r.t_stat < 0
    assert r.resolved is True
    assert str(r).startswith("-2.00 [")


def test_other_confidence_level():
    r = paired_difference([1, 2, 3, 4], [2, 4, 5, 7], confidence=0.90)
    se = math.sqrt(2.0 / 3.0) / 2.0
    assert r.ci_low == pytest.approx(2 - T95_DF3 * se, abs=1e-9)
    assert r.ci_high == pytest.approx(2 + T95_DF3 * se, abs=1e-9)
    assert r.confidence == 0.90


def test_interval_straddles_zero_unresolved():
    r = one_sample([1, -2, 3])
    mean = 2.0 / 3.0
    sd = math.sqrt(114.0 / 18.0)  # deviations 1/3, -8/3, 7/3
    se = sd / math.sqrt(3.0)
    assert r.mean == pytest.approx(mean)
    assert r.sd == pytest.approx(sd)
    assert r.ci_low == pytest.approx(mean - T975_DF2 * se, abs=1e-9)
    assert r.ci_high == pytest.approx(mean + T975_DF2 * se, abs=1e-9)
    assert r.ci_low < 0 < r.ci_high
    assert r.resolved is False
    assert str(r).endswith("(n=3, unresolved)")


def test_n1_never_resolved():
    r = paired_difference([10.0], [15.0])
    assert r.n == 1
    assert r.mean == 5.0
    for v in (r.sd, r.se, r.ci_low, r.ci_high, r.t_stat, r.p_value):
        assert math.isnan(v)
    assert r.resolved is False


def test_n0_raises():
    with pytest.raises(ValueError):
        paired_difference([], [])
    with pytest.raises(ValueError):
        one_sample([])


def test_length_mismatch_names_lengths():
    with pytest.raises(ValueError) as ei:
        paired_difference([1, 2, 3], [1, 2, 3, 4, 5])
    msg = str(ei.value)
    assert "3" in msg and "5" in msg
    with pytest.raises(ValueError, match="len"):
        percent_change([1, 2], [1])


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_raises(bad):
    with pytest.raises(ValueError):
        paired_difference([1, 2, bad], [1, 2, 3])
    with pytest.raises(ValueError):
        paired_difference([1, 2, 3], [bad, 2, 3])
    with pytest.raises(ValueError):
        one_sample([1, bad])


def test_bad_shape_and_confidence():
    with pytest.raises(ValueError):
        one_sample([[1, 2], [3, 4]])
    for c in (0, 1, 1.5, -0.1):
        with pytest.raises(ValueError):
            one_sample([1, 2, 3], confidence=c)


def test_percent_change_hand():
    r = percent_change([100, 200, 50], [110, 190, 60])  # changes [10, -5, 20]
    mean = 25.0 / 3.0
    sd = math.sqrt(((10 - mean) ** 2 + (-5 - mean) ** 2 + (20 - mean) ** 2) / 2)
    assert r.n == 3
    assert r.mean == pytest.approx(8.333333, abs=1e-6)
    assert r.sd == pytest.approx(sd)
    assert sd == pytest.approx(12.583057, abs=1e-6)
    se = sd / math.sqrt(3)
    assert r.ci_low == pytest.approx(mean - T975_DF2 * se, abs=1e-9)
    assert r.ci_high == pytest.approx(mean + T975_DF2 * se, abs=1e-9)
    assert r.resolved is False


def test_percent_change_zero_baseline_names_index():
    with pytest.raises(ValueError, match="index 1"):
        percent_change([1, 0, 2], [1, 1, 1])


def test_difference_in_differences_hand():
    a = [10, 20, 30]  # base in-process
    b = [8, 17, 27]  # skipper in-process: B - A = [-2, -3, -3]
    c = [12, 22, 33]  # base served
    d = [7, 16, 26]  # skipper served: D - C = [-5, -6, -7]
    r = difference_in_differences(a, b, c, d)  # DiD = [-3, -3, -4]
    assert r.n == 3
    assert r.mean == pytest.approx(-10.0 / 3.0)
    assert r.sd == pytest.approx(math.sqrt(1.0 / 3.0))
    assert r.se == pytest.approx(1.0 / 3.0)
    assert r.ci_low == pytest.approx(-10.0 / 3.0 - T975_DF2 / 3.0, abs=1e-9)
    assert r.ci_high == pytest.approx(-10.0 / 3.0 + T975_DF2 / 3.0, abs=1e-9)
    assert r.ci_high == pytest.approx(-1.89912, abs=1e-5)
    assert r.resolved is True


def test_did_length_mismatch_names_lengths():
    with pytest.raises(ValueError) as ei:
        difference_in_differences([1, 2], [1, 2], [1, 2, 3], [1, 2])
    assert "3" in str(ei.value) and "2" in str(ei.value)


def test_identical_differences_sd_zero():
    r = paired_difference([1, 2, 3], [3, 4, 5])  # d = [2, 2, 2]
    assert (r.n, r.mean, r.sd, r.se) == (3, 2.0, 0.0, 0.0)
    assert (r.ci_low, r.ci_high) == (2.0, 2.0)
    assert r.t_stat == math.inf and r.p_value == 0.0
    assert r.resolved is True

    r = one_sample([-0.5, -0.5])
    assert r.t_stat == -math.inf and r.p_value == 0.0 and r.resolved is True

    r = paired_difference([1, 2, 3], [1, 2, 3])  # d = 0
    assert (r.mean, r.ci_low, r.ci_high) == (0.0, 0.0, 0.0)
    assert math.isnan(r.t_stat) and r.p_value == 1.0
    assert r.resolved is False

    r = one_sample([0.1, 0.1, 0.1])  # exact common value, no rounding drift
    assert r.mean == 0.1 and r.sd == 0.0


def test_result_dict_str_frozen():
    r = paired_difference([1, 2, 3, 4], [2, 4, 5, 7])
    d = r.to_dict()
    assert type(d) is dict
    assert set(d) == {f.name for f in dataclasses.fields(PairedResult)}
    assert d["n"] == 4 and type(d["n"]) is int
    assert type(d["resolved"]) is bool and type(d["mean"]) is float
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.mean = 0.0  # type: ignore[misc]
    s = PairedResult(6, 3.2, 1.0, 0.5, 1.1, 5.3, 6.4, 0.001, 0.95, True)
    assert str(s) == "+3.20 [1.10, 5.30] (n=6, resolved)"


def test_ratio_of_means():
    assert ratio_of_means([2, 4], [6, 6]) == pytest.approx(2.0)
    assert ratio_of_means([10, 10, 10], [5]) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        ratio_of_means([1, -1], [3, 3])
    with pytest.raises(ValueError):
        ratio_of_means([], [1])


def test_cross_check_statsmodels():
    wst = pytest.importorskip("statsmodels.stats.weightstats")
    import numpy as np

    d = np.array([0.3, -1.2, 2.5, 4.1, 0.9, 1.7, -0.4])
    r = one_sample(d)
    lo, hi = wst.DescrStatsW(d).tconfint_mean(alpha=0.05)
    assert r.ci_low == pytest.approx(lo, rel=1e-12, abs=1e-12)
    assert r.ci_high == pytest.approx(hi, rel=1e-12, abs=1e-12)
    tstat, pval, _ = wst.DescrStatsW(d).ttest_mean(0.0)
    assert r.t_stat == pytest.approx(tstat)
    assert r.p_value == pytest.approx(pval)


def test_welch_difference_agrees_only_within_sampling_error():
    from impl.stats import welch_difference

    w = welch_difference([1.0, 2.0, 3.0, 4.0], [1.5, 2.5, 3.5, 4.5])
    assert w.diff == pytest.approx(0.5) and w.ci_low < 0 < w.ci_high and w.agree and (w.n_a, w.n_b) == (4, 4)
    from scipy import stats as sst
    ci = sst.ttest_ind([1.5, 2.5, 3.5, 4.5], [1.0, 2.0, 3.0, 4.0], equal_var=False).confidence_interval(0.95)
    assert (w.ci_low, w.ci_high) == pytest.approx((ci.low, ci.high))
    far = welch_difference([1.0, 2.0, 3.0], [11.0, 12.0, 13.0, 14.0, 12.5])
    assert not far.agree and far.ci_low > 0 and far.mean_b == pytest.approx(12.5)
    assert welch_difference([2.0, 2.0], [2.0, 2.0]).agree and not welch_difference([2.0, 2.0], [3.0, 3.0]).agree
    with pytest.raises(ValueError, match="at least 2 values"):
        welch_difference([1.0], [1.0, 2.0])


def test_holm_hand_example():
    """Holm at 5%: sorted p 0.005 (x4 = 0.02), 0.01 (x3 = 0.03) rejected, 0.03 (x2 = 0.06) stops the
    step-down, so 0.04 is kept too; NaN is never rejected and not counted in the family."""
    assert holm_reject([0.01, 0.04, 0.03, 0.005]) == [True, False, False, True]
    assert holm_reject([float("nan"), 0.03]) == [False, True]  # a family of one: 0.03 < 0.05
    assert holm_reject([0.03, 0.03]) == [False, False]  # 0.03 x 2 = 0.06
    assert holm_reject([]) == []
    with pytest.raises(ValueError, match="p-values"):
        holm_reject([1.5])
    with pytest.raises(ValueError, match="confidence"):
        holm_reject([0.1], alpha=1.0)
