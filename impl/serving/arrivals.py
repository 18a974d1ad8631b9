"""Seeded Poisson arrival schedules at an absolute offered rate (vSkipper Sec. 4.1, "Load").

Load is set through the offered arrival rate, not through admission control: arrivals follow a
seeded Poisson process at ``rate`` requests/s, the client has no concurrency cap, and every request
is served to completion (:mod:`impl.serving.loadgen`). Both arms of a repetition replay the *same*
schedule (:func:`impl.serving.protocol.schedule_seed`).

Two ways to build a schedule:

* a fixed number of requests (the paper's cells have a fixed request count, Table 1): the first
  request arrives at offset 0 and each next one after an Exp(rate) gap, as SGLang's
  ``bench_serving`` does (it yields a request, then sleeps an exponential interval). The injection
  window is ``[0, offsets[-1]]``: it ends at the last *scheduled* arrival, so it is identical for
  every arm replaying the schedule.
* a fixed duration ``D``: a homogeneous Poisson process on ``[0, D)`` (first arrival after an
  Exp(rate) gap); the injection window is ``[0, D]``.

The gaps are ``standard_exponential / rate`` drawn from ``numpy.random.default_rng(seed)``, so the
same seed at two rates gives the same schedule scaled by the rate ratio (common random numbers
across the rungs of a knee sweep).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["ArrivalSchedule", "poisson_arrivals"]


@dataclass(frozen=True)
class ArrivalSchedule:
    """Arrival offsets of one cell run.

    Attributes:
        offsets_s: arrival offsets in seconds from the injection start, non-decreasing.
        rate: offered rate in requests/s.
        seed: the seed that drew the gaps.
        window_s: length of the injection window in seconds (see the module docstring).
        mode: ``"count"`` or ``"duration"``.
    """

    offsets_s: tuple[float, ...]
    rate: float
    seed: int
    window_s: float
    mode: str = "count"

    def __len__(self) -> int:
        return len(self.offsets_s)

    def to_dict(self) -> dict:
        """Plain-dict form (rate in requests/s, offsets and window in seconds) for result rows."""
        return {"rate": self.rate, "seed": self.seed, "window_s": self.window_s, "mode": self.mode,
                "offsets_s": list(self.offsets_s)}


def _check_rate(rate: float) -> float:
    r = float(rate)
    if not math.isfinite(r) or r <= 0:
        raise ValueError(f"offered rate must be a positive finite number of requests/s, got {rate!r}")
    return r


def poisson_arrivals(rate: float, n: int | None = None, *, duration_s: float | None = None,
                     seed: int) -> ArrivalSchedule:
    """A seeded Poisson arrival schedule at ``rate`` requests/s (vSkipper Sec. 4.1, "Load").

    Give exactly one of ``n`` (fixed request count) or ``duration_s`` (fixed injection window).

    Args:
        rate: offered arrival rate in requests/s (> 0, finite).
        n: number of requests (>= 2). Offsets are ``0, G_1, G_1 + G_2, ...`` with ``G_i`` i.i.d.
            Exp(rate) gaps in seconds (first request at 0, as SGLang's ``bench_serving``); the
            window is ``[0, offsets[-1]]`` seconds.
        duration_s: injection window length in seconds (> 0): all arrivals of a Poisson process of
            intensity ``rate`` in ``[0, duration_s)``, the first after one gap; the window is
            ``[0, duration_s]``. May give zero arrivals.
        seed: seed of ``numpy.random.default_rng``; the same seed always gives the same schedule.

    Returns:
        :class:`ArrivalSchedule`.

    Raises:
        ValueError: for a non-positive or non-finite rate, both or neither of ``n`` and
            ``duration_s``, ``n < 2`` (a one-request schedule has an empty window), or a
            non-positive duration.
    """
    r = _check_rate(rate)
    if (n is None) == (duration_s is None):
        raise ValueError("give exactly one of n (request count) or duration_s (injection window)")
    rng = np.random.default_rng(int(seed))
    if n is not None:
        n = int(n)
        if n < 2:
            raise ValueError(f"a count schedule needs n >= 2 requests (the window ends at the last arrival), got {n}")
        gaps = rng.standard_exponential(n - 1) / r
        offsets = np.concatenate([[0.0], np.cumsum(gaps)])
        return ArrivalSchedule(tuple(float(x) for x in offsets), r, int(seed), float(offsets[-1]), "count")
    d = float(duration_s)
    if not math.isfinite(d) or d <= 0:
        raise ValueError(f"duration_s must be a positive number of seconds, got {duration_s!r}")
    offsets: list[float] = []
    t = 0.0
    # draw in blocks; the expected count is rate * d
    block = max(16, int(r * d * 1.2) + 16)
    while True:
        gaps = rng.standard_exponential(block) / r
        for g in gaps:
            t += float(g)
            if t >= d:
                return ArrivalSchedule(tuple(offsets), r, int(seed), d, "duration")
            offsets.append(t)
