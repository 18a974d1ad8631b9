"""Paired statistics for arm comparisons.

Conventions (vSkipper paper Sec. 4.1 (paired statistics) / DEX-harness DESIGN.md Statistics):

* a comparison of two arms is paired within a repetition (or within a unit such as a document);
* the reported effect is the mean of the paired differences with a two-sided t-based interval
  (95 % by default), computed with ``scipy.stats.t``;
* an effect is *resolved* only when that interval excludes zero;
* ``n`` (the number of pairs) is always reported;
* ``n == 1`` is never resolved: sd, se, the interval, t and p are NaN and ``resolved`` is False;
* ``n == 0`` raises ``ValueError``.

Degenerate case, n >= 2 with all differences identical (sd == 0): the interval collapses to
``[mean, mean]``, ``resolved`` is ``mean != 0``, ``t_stat`` is ``+inf``/``-inf`` (``nan`` when the
mean is 0) and ``p_value`` is ``0.0`` (``1.0`` when the mean is 0).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
from scipy import stats as _sst
from statsmodels.stats.multitest import multipletests

__all__ = [
    "PairedResult",
    "RatioResult",
    "ratio_estimate",
    "paired_difference",
    "one_sample",
    "percent_change",
    "difference_in_differences",
    "ratio_of_means",
    "WelchResult",
    "welch_difference",
]

@dataclass(frozen=True)
class PairedResult:
    """Summary of a one-sample / paired t analysis of differences.

    Fields (all plain Python scalars; units are those of the differences analysed, e.g. ms,
    tokens/s, or percent for :func:`percent_change`):

    * ``n`` (int): number of pairs / differences.
    * ``mean`` (float): mean difference (treatment minus control).
    * ``sd`` (float): sample standard deviation of the differences (ddof=1); NaN when n == 1.
    * ``se`` (float): standard error ``sd / sqrt(n)``; NaN when n == 1.
    * ``ci_low``, ``ci_high`` (float): two-sided t interval ``mean -/+ t_{(1+c)/2, n-1} * se``;
      NaN when n == 1; both equal ``mean`` when sd == 0.
    * ``t_stat`` (float): ``mean / se``; NaN when n == 1; +/-inf (NaN if mean == 0) when sd == 0.
    * ``p_value`` (float): two-sided p for H0: mean difference == 0; NaN when n == 1;
      0.0 (1.0 if mean == 0) when sd == 0.
    * ``confidence`` (float): confidence level of the interval, in (0, 1).
    * ``resolved`` (bool): True only when the interval excludes zero (never when n == 1).

    Source: vSkipper paper Sec. 4.1 (paired statistics) / DEX-harness DESIGN.md Statistics.
    """

    n: int
    mean: float
    sd: float
    se: float
    ci_low: float
    ci_high: float
    t_stat: float
    p_value: float
    confidence: float
    resolved: bool

    def to_dict(self) -> dict[str, Any]:
        """Return the fields as a plain ``dict`` (str -> int/float/bool), e.g. for a result row.

        Source: vSkipper paper Sec. 4.1 (paired statistics) / DEX-harness DESIGN.md Statistics.
        """
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        """Format as ``"+3.20 [1.10, 5.30] (n=6, resolved)"`` (or ``unresolved``).

        Source: vSkipper paper Sec. 4.1 (paired statistics) / DEX-harness DESIGN.md Statistics.
        """
        state = "resolved" if self.resolved else "unresolved"
        return f"{self.mean:+.2f} [{self.ci_low:.2f}, {self.ci_high:.2f}] (n={self.n}, {state})"


def _as_1d(x: Any, name: str) -> np.ndarray:
    """Convert ``x`` to a finite 1-D float array; ValueError if not 1-D or not all finite."""
    arr = np.asarray(x, dtype=float)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    bad = ~np.isfinite(arr)
    if bad.any():
        idx = int(np.flatnonzero(bad)[0])
        raise ValueError(f"{name} contains a non-finite value ({arr[idx]!r}) at index {idx}")
    return arr


def _check_lengths(**arrays: np.ndarray) -> int:
    lengths = {k: len(v) for k, v in arrays.items()}
    if len(set(lengths.values())) > 1:
        desc = ", ".join(f"len({k})={n}" for k, n in lengths.items())
        raise ValueError(f"paired inputs must have equal lengths, got {desc}")
    return next(iter(lengths.values()))


def _check_confidence(confidence: float) -> float:
    c = float(confidence)
    if not (0.0 < c < 1.0):
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}")
    return c


def one_sample(d: Sequence[float] | np.ndarray, confidence: float = 0.95) -> PairedResult:
    """One-sample t summary of already-computed paired differences.

    Args:
        d: 1-D array-like of n differences (treatment minus control), any unit; the result is in
            the same unit.
        confidence: two-sided confidence level of the interval, in (0, 1); default 0.95.

    Returns:
        :class:`PairedResult`. ``resolved`` is True only when the interval excludes zero.
        n == 1: mean is d[0], sd/se/interval/t/p are NaN, resolved False.
        n >= 2 with all d identical (sd == 0): interval ``[mean, mean]``, resolved ``mean != 0``,
        t_stat ``+/-inf`` (NaN if mean == 0), p_value 0.0 (1.0 if mean == 0).

    Raises:
        ValueError: if ``d`` is empty (n == 0), not 1-D, contains NaN/inf, or ``confidence`` is
            not in (0, 1).

    Source: vSkipper paper Sec. 4.1 (paired statistics) / DEX-harness DESIGN.md Statistics.
    """
    c = _check_confidence(confidence)
    arr = _as_1d(d, "d")
    n = int(arr.size)
    if n == 0:
        raise ValueError("no differences (n = 0): at least one pair is required")
    nan = float("nan")
    if n == 1:
        return PairedResult(n, float(arr[0]), nan, nan, nan, nan, nan, nan, c, False)

    df = n - 1
    if np.all(arr == arr[0]):
        # Degenerate: zero spread. Use the exact common value as the mean (avoids rounding).
        mean = float(arr[0])
        if mean == 0.0:
            t_stat, p_value = nan, 1.0
        else:
            t_stat, p_value = math.copysign(math.inf, mean), 0.0
        return PairedResult(n, mean, 0.0, 0.0, mean, mean, t_stat, p_value, c, mean != 0.0)

    mean = float(np.mean(arr))
    sd = float(np.std(arr, ddof=1))
    se = sd / math.sqrt(n)
    tcrit = float(_sst.t.ppf(0.5 + c / 2.0, df))
    half = tcrit * se
    lo, hi = mean - half, mean + half
    t_stat = mean / se
    p_value = float(2.0 * _sst.t.sf(abs(t_stat), df))
    resolved = bool(lo > 0.0 or hi < 0.0)
    return PairedResult(n, mean, sd, se, lo, hi, float(t_stat), p_value, c, resolved)


def paired_difference(
    a: Sequence[float] | np.ndarray,
    b: Sequence[float] | np.ndarray,
    confidence: float = 0.95,
) -> PairedResult:
    """Paired comparison of two arms: statistics of ``d_i = b_i - a_i``.

    Args:
        a: 1-D array-like, length n: baseline/control arm, one value per repetition.
        b: 1-D array-like, length n: treatment arm, paired with ``a`` by index (same repetition).
            Units are those of the metric (e.g. ms); the result's mean/interval share them.
        confidence: two-sided confidence level in (0, 1); default 0.95.

    Returns:
        :class:`PairedResult` from :func:`one_sample` on the differences (see it for the n == 1
        and sd == 0 conventions).

    Raises:
        ValueError: if the lengths differ (message names both), an input is empty, not 1-D or
            contains NaN/inf, or ``confidence`` is not in (0, 1).

    Source: vSkipper paper Sec. 4.1 (paired statistics) / DEX-harness DESIGN.md Statistics.
    """
    aa = _as_1d(a, "a")
    bb = _as_1d(b, "b")
    _check_lengths(a=aa, b=bb)
    return one_sample(bb - aa, confidence)


def holm_reject(p_values: Sequence[float], alpha: float = 0.05) -> list[bool]:
    """Holm's step-down test over a family of p-values (family-wise error rate ``alpha``): which
    hypotheses are rejected. A NaN p-value (no spread to test, e.g. n == 1) is never rejected and
    does not count towards the family.

    Args:
        p_values: one two-sided p-value per hypothesis, in [0, 1] or NaN.
        alpha: family-wise error rate in (0, 1).

    Returns:
        ``list[bool]`` in input order: True where the hypothesis is rejected.

    Raises:
        ValueError: ``alpha`` outside (0, 1) or a p-value outside [0, 1].

    Source: Holm (1979), through ``statsmodels.stats.multitest.multipletests(method="holm")``; used
    where a report checks that every member of a family passes (TEV exit-law calibration).
    """
    _check_confidence(1.0 - float(alpha))
    p = np.asarray(list(p_values), dtype=float)
    if np.any((p < 0) | (p > 1)):
        raise ValueError(f"p-values must be in [0, 1] or NaN, got {p.tolist()}")
    out = np.zeros(p.shape, dtype=bool)
    ok = ~np.isnan(p)
    if ok.any():
        out[ok] = multipletests(p[ok], alpha=alpha, method="holm")[0]
    return out.tolist()


def percent_change(
    a: Sequence[float] | np.ndarray,
    b: Sequence[float] | np.ndarray,
    confidence: float = 0.95,
) -> PairedResult:
    """Mean of per-pair percentage changes ``100 * (b_i - a_i) / a_i`` with a t interval.

    This is the vSkipper protocol: "mean of per-repetition percentage changes with a t-based 95%
    interval".

    Args:
        a: 1-D array-like, length n: baseline/control arm (nonzero values), one per repetition.
        b: 1-D array-like, length n: treatment arm, paired with ``a`` by index.
        confidence: two-sided confidence level in (0, 1); default 0.95.

    Returns:
        :class:`PairedResult` in percent (mean, sd, se and interval are percentage points).

    Raises:
        ValueError: if the lengths differ (message names both), an input is empty, not 1-D or
            contains NaN/inf, any ``a_i == 0`` (message names the index), or ``confidence`` is not
            in (0, 1).

    Source: vSkipper paper Sec. 4.1 (paired statistics) / DEX-harness DESIGN.md Statistics.
    """
    aa = _as_1d(a, "a")
    bb = _as_1d(b, "b")
    _check_lengths(a=aa, b=bb)
    zeros = np.flatnonzero(aa == 0.0)
    if zeros.size:
        raise ValueError(
            f"percent change undefined: baseline a is zero at index {int(zeros[0])}"
            + (f" (zero indices: {zeros.tolist()})" if zeros.size > 1 else "")
        )
    return one_sample(100.0 * (bb - aa) / aa, confidence)


def difference_in_differences(
    a: Sequence[float] | np.ndarray,
    b: Sequence[float] | np.ndarray,
    c: Sequence[float] | np.ndarray,
    d: Sequence[float] | np.ndarray,
    confidence: float = 0.95,
) -> PairedResult:
    """Per-unit paired difference-in-differences ``(d_i - c_i) - (b_i - a_i)``.

    The 2x2 design of the vSkipper paper: A = base in-process, B = skipper in-process,
    C = base served, D = skipper served; DiD = (D - C) - (B - A), i.e. how much larger the
    treatment effect is in the second setting than in the first.

    Args:
        a, b, c, d: 1-D array-likes of equal length n, paired by index (one value per unit, e.g.
            per document or repetition), all in the same unit (e.g. ms).
        confidence: two-sided confidence level in (0, 1); default 0.95.

    Returns:
        :class:`PairedResult` from :func:`one_sample` on the n per-unit DiD values.

    Raises:
        ValueError: if the lengths differ (message names all four), an input is empty, not 1-D or
            contains NaN/inf, or ``confidence`` is not in (0, 1).

    Source: vSkipper paper Sec. 4.1 (paired statistics) / DEX-harness DESIGN.md Statistics.
    """
    aa = _as_1d(a, "a")
    bb = _as_1d(b, "b")
    cc = _as_1d(c, "c")
    dd = _as_1d(d, "d")
    _check_lengths(a=aa, b=bb, c=cc, d=dd)
    return one_sample((dd - cc) - (bb - aa), confidence)


def ratio_of_means(a: Sequence[float] | np.ndarray, b: Sequence[float] | np.ndarray) -> float:
    """Return ``mean(b) / mean(a)`` as a float (e.g. a speedup ratio; no interval).

    Args:
        a: 1-D non-empty array-like: denominator arm (e.g. baseline throughput or latency).
        b: 1-D non-empty array-like: numerator arm. Lengths may differ (not paired).

    Returns:
        float, unitless ratio.

    Raises:
        ValueError: if either input is empty, not 1-D or contains NaN/inf, or ``mean(a) == 0``.

    Source: vSkipper paper Sec. 4.1 (paired statistics) / DEX-harness DESIGN.md Statistics.
    """
    aa = _as_1d(a, "a")
    bb = _as_1d(b, "b")
    if aa.size == 0 or bb.size == 0:
        raise ValueError(
            f"ratio_of_means needs non-empty inputs, got len(a)={aa.size}, len(b)={bb.size}"
        )
    den = float(np.mean(aa))
    if den == 0.0:
        raise ValueError("ratio_of_means: mean(a) is zero (zero denominator)")
    return float(np.mean(bb)) / den


@dataclass(frozen=True)
class RatioResult:
    """A ratio of totals over clusters with its t-based interval (:func:`ratio_estimate`)."""

    n: int  # clusters (e.g. prompts)
    ratio: float  # sum(num) / sum(den)
    se: float  # linearised standard error; NaN for n == 1
    ci_low: float
    ci_high: float
    confidence: float


def ratio_estimate(num: Sequence[float] | np.ndarray, den: Sequence[float] | np.ndarray,
                   confidence: float = 0.95) -> RatioResult:
    """Ratio of totals ``R = sum(num) / sum(den)`` over n clusters with a t interval from the linearised
    (delta-method) variance of the ratio estimator, clusters independent:
    ``se = sqrt(sum((num_i - R den_i)^2) / (n (n - 1))) / mean(den)``, ``R +/- t_{n-1} se``.

    The interval of a micro average (e.g. tau = committed tokens / verification rounds over a cell's
    prompts, each prompt one cluster): a prompt weighs by its rounds, as in the micro average itself,
    where a per-prompt mean weighs a one-round answer as much as a 64-token one.

    Args:
        num, den: 1-D array-likes of equal length n >= 1 (per cluster totals; e.g. tokens and rounds).
        confidence: two-sided level in (0, 1).

    Returns:
        :class:`RatioResult`; n == 1: se and the interval are NaN. All residuals zero: a zero-width interval.

    Raises:
        ValueError: empty, unequal lengths, NaN/inf, ``sum(den) == 0`` or a bad ``confidence``.

    Source: Cochran, *Sampling Techniques* (3rd ed.), Sec. 6.3-6.4 (variance of the ratio estimator).
    """
    c = _check_confidence(confidence)
    x, y = _as_1d(num, "num"), _as_1d(den, "den")
    n = _check_lengths(num=x, den=y)
    if n == 0:
        raise ValueError("ratio_estimate needs at least one cluster (n = 0)")
    if float(y.sum()) == 0.0:
        raise ValueError("ratio_estimate: sum(den) is zero (zero denominator)")
    r = float(x.sum() / y.sum())
    nan = float("nan")
    if n == 1:
        return RatioResult(1, r, nan, nan, nan, c)
    resid = x - r * y
    se = math.sqrt(float((resid ** 2).sum()) / (n * (n - 1))) / float(y.mean())
    h = float(_sst.t.ppf(0.5 + c / 2, n - 1)) * se
    return RatioResult(n, r, se, r - h, r + h, c)


@dataclass(frozen=True)
class WelchResult:
    """Two independent samples compared: ``mean_a``, ``mean_b``, ``diff = mean_b - mean_a`` and its
    two-sided Welch t interval ``[ci_low, ci_high]`` at ``confidence``; ``agree`` when it contains 0
    (the samples' means agree within their sampling error). Units are the samples'."""

    n_a: int
    n_b: int
    mean_a: float
    mean_b: float
    diff: float
    ci_low: float
    ci_high: float
    confidence: float
    agree: bool


def welch_difference(a: Sequence[float] | np.ndarray, b: Sequence[float] | np.ndarray,
                     confidence: float = 0.95) -> WelchResult:
    """Unpaired comparison of two samples (e.g. per-request latencies measured by two clients):
    ``mean(b) - mean(a)`` with the Welch (unequal-variance) t interval of ``scipy.stats.ttest_ind``.

    Args:
        a, b: 1-D array-likes of at least 2 finite values each (lengths may differ).
        confidence: two-sided level in (0, 1).

    Raises:
        ValueError: a sample with fewer than 2 values, NaN/inf, or a bad ``confidence``.

    Source: Welch (1947); used where pairing is impossible (two clients' requests are not the same
    requests in time), vSkipper harness issue 14 item 5 (SGLang's client vs the project's).
    """
    aa, bb = _as_1d(a, "a"), _as_1d(b, "b")
    c = _check_confidence(confidence)
    if len(aa) < 2 or len(bb) < 2:
        raise ValueError(f"welch_difference needs at least 2 values per sample, got {len(aa)} and {len(bb)}")
    diff = float(np.mean(bb) - np.mean(aa))
    if np.std(aa) == 0 and np.std(bb) == 0:
        lo = hi = diff
    else:
        ci = _sst.ttest_ind(bb, aa, equal_var=False).confidence_interval(c)
        lo, hi = float(ci.low), float(ci.high)
    return WelchResult(len(aa), len(bb), float(np.mean(aa)), float(np.mean(bb)), diff, lo, hi, c,
                       bool(lo <= 0.0 <= hi))
