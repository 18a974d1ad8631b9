"""Depth-side accounting: EAD, exploration sets, depth ceilings, and speedups under the idealised
uniform per-layer cost model of the DEX paper (Sec. 2, Def. 1-5, Prop. 3, 6, 7; App. A.2-A.4).

Depths are 1-based layer counts in [1, L]. Workloads are in layers per token. Speedups are the
micro (token-pooled) form of Eq. (12): L*T / sum_t W(t) over all T tokens of a measurement.
Every later method's depth-side numbers are computed with these functions.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def _omega(omega) -> np.ndarray:
    om = np.asarray(omega, dtype=bool)
    if om.ndim != 2 or om.shape[1] < 1:
        raise ValueError(f"omega must be [T, L] booleans, got shape {om.shape}")
    return om


def ead_from_omega(omega) -> np.ndarray:
    """Earliest available depth, Eq. (1): EAD(t) = min{l : Omega(t, l) = 1}.

    Args:
        omega: ``[T, L]`` bool, acceptance of the depth-l candidate for token t (column l-1).
            Omega(t, L) is forced to 1 (Def. 1).

    Returns:
        ``[T]`` int64 depths in [1, L].
    """
    om = _omega(omega).copy()
    om[:, -1] = True
    return om.argmax(axis=1).astype(np.int64) + 1


def stable_ead_from_omega(omega) -> np.ndarray:
    """Stable EAD, Eq. (2)-(3): min{l : Omega(t, n) = 1 for all n in [l, L]}.

    Args:
        omega: ``[T, L]`` bool (Omega(t, L) forced to 1).

    Returns:
        ``[T]`` int64 depths in [1, L].
    """
    om = _omega(omega).copy()
    om[:, -1] = True
    L = om.shape[1]
    # index of the last rejection; the stable EAD is one past it.
    rev_reject = (~om)[:, ::-1]
    has_reject = rev_reject.any(axis=1)
    last_reject = L - 1 - rev_reject.argmax(axis=1)  # 0-based column of the last False
    return np.where(has_reject, last_reject + 2, 1).astype(np.int64)


def validate_exploration_set(X: Sequence[int], L: int) -> tuple[int, ...]:
    """Check an exploration set (Def. 4): strictly increasing depths in [1, L] ending at L.

    Returns:
        the set as a tuple of ints.

    Raises:
        ValueError: naming the violated condition.
    """
    xs = tuple(int(d) for d in X)
    if not xs:
        raise ValueError("exploration set is empty")
    if any(b <= a for a, b in zip(xs, xs[1:])):
        raise ValueError(f"exploration set {list(xs)} is not strictly increasing")
    if xs[0] < 1 or xs[-1] > L:
        raise ValueError(f"exploration set {list(xs)} names a depth outside [1, {L}]")
    if xs[-1] != L:
        raise ValueError(f"exploration set {list(xs)} does not end at the final depth L={L}")
    return xs


def uniform_exploration_set(L: int, K: int) -> tuple[int, ...]:
    """DEX-1/K's uniform exploration set {L/K, 2L/K, ..., L}.

    Raises:
        ValueError: if K < 1, K > L or K does not divide L.
    """
    if K < 1 or K > L:
        raise ValueError(f"K={K} explorers must be in [1, L={L}]")
    if L % K:
        raise ValueError(f"K={K} does not divide L={L}: no uniform exploration set")
    return tuple(L // K * (k + 1) for k in range(K))


def depth_ceiling(ell, X: Sequence[int]) -> np.ndarray:
    """Depth ceiling, Eq. (6): min{d in X : d >= l}, elementwise over ``ell`` (int array, in [1, L])."""
    xs = np.asarray(X, dtype=np.int64)
    ell = np.asarray(ell, dtype=np.int64)
    idx = np.searchsorted(xs, ell, side="left")
    if np.any(idx >= len(xs)):
        raise ValueError(f"depth above the largest explored depth {xs[-1]}")
    return xs[idx]


def resolution(X: Sequence[int], L: int) -> int:
    """Resolution Delta(X), Eq. (7): the largest upward rounding error over depths 1..L."""
    xs = validate_exploration_set(X, L)
    ells = np.arange(1, L + 1)
    return int((depth_ceiling(ells, xs) - ells).max())


def exploration_workload(ead, X: Sequence[int]) -> np.ndarray:
    """W_X(t) = ceil(EAD(t))_X, Eq. (8)-(9): layers charged to each token under exploration."""
    return depth_ceiling(ead, X)


def depth_side_speedup(work, L: int) -> float:
    """Depth-side speedup over AR, Eq. (12): S = L*T / sum_t W(t) (micro, token-pooled).

    Raises:
        ValueError: on an empty workload or non-positive total.
    """
    w = np.asarray(work, dtype=np.float64)
    if w.size == 0 or w.sum() <= 0:
        raise ValueError("depth-side speedup needs a non-empty, positive workload")
    return float(L * w.size / w.sum())


def s_ead(ead, L: int) -> float:
    """Oracle speedup S_EAD = L*T / sum_t EAD(t) (Eq. 14, right)."""
    return depth_side_speedup(ead, L)


def s_x(ead, X: Sequence[int], L: int) -> float:
    """Exploration speedup S_X, Eq. (13), for stable EADs ``ead`` and exploration set X."""
    xs = validate_exploration_set(X, L)
    return depth_side_speedup(exploration_workload(ead, xs), L)


def s_x_lower_bound(ead, X: Sequence[int], L: int) -> float:
    """Resolution lower bound of Eq. (14): L*T / sum_t min(EAD(t) + Delta(X), L)."""
    d = resolution(X, L)
    return depth_side_speedup(np.minimum(np.asarray(ead) + d, L), L)


def selection_workload(p_acc, s_t, L: int, discarded_exits) -> np.ndarray:
    """Expected layer cost of depth selection per token, Eq. (4):

    W_t = p_t s_t + (1 - p_t) (L + sum_{i=t}^{t+v_t-1} s_i).

    Args:
        p_acc: ``[T]`` acceptance probabilities of the selected exits (floats in [0, 1]).
        s_t: ``[T]`` selected exit depths in [1, L-1].
        L: number of layers.
        discarded_exits: ``[T]`` the sums sum_{i=t}^{t+v_t-1} s_i of the discarded selected-exit
            tokens (layers), including token t itself.

    Returns:
        ``[T]`` float64 layers per token.
    """
    p = np.asarray(p_acc, dtype=np.float64)
    s = np.asarray(s_t, dtype=np.float64)
    return p * s + (1.0 - p) * (L + np.asarray(discarded_exits, dtype=np.float64))


def selection_overhead(p_acc, s_t, L: int, discarded_exits, ead) -> np.ndarray:
    """Selection overhead over the EAD oracle, Eq. (5): c_t = W_t^sel - EAD(t)."""
    return selection_workload(p_acc, s_t, L, discarded_exits) - np.asarray(ead, dtype=np.float64)


def selection_trace(ead, s: int, L: int, num_speculations: int) -> np.ndarray:
    """Per-token selection workload (Eq. 4) of a fixed exit depth on a measured token sequence.

    The sequence is drafted in rounds of ``num_speculations`` tokens at exit depth ``s``; under the
    stable-readiness convention a drafted token is accepted iff EAD(t) <= s (p_acc in {0, 1},
    Def. 2). Accepted tokens are charged s. The first failed token of a round is charged
    L + v_t * s, where v_t counts the drafted tokens of the round from t on (t included) that are
    discarded; the next round starts after it (its final-depth token replaces it). With
    ``num_speculations = 1``, v_t = 1. This reproduces App. A.2's example (L=20, s=4, v_t=3:
    20 + 4 + 4 + 4).

    Args:
        ead: ``[T]`` stable EADs of one generated sequence, in order.
        s: exit depth in [1, L-1].
        L: number of layers.
        num_speculations: drafted tokens per round (>= 1).

    Returns:
        ``[T]`` float64 layers charged per token.

    Raises:
        ValueError: on s outside [1, L-1] or num_speculations < 1.
    """
    if not 1 <= s <= L - 1:
        raise ValueError(f"exit depth s={s} must be in [1, L-1={L - 1}]")
    if num_speculations < 1:
        raise ValueError("num_speculations must be >= 1")
    e = np.asarray(ead, dtype=np.int64)
    T = len(e)
    work = np.zeros(T, dtype=np.float64)
    t = 0
    while t < T:
        block = range(t, min(t + num_speculations, T))
        for j, i in enumerate(block):
            if e[i] <= s:
                work[i] = s
                continue
            v = len(block) - j  # drafted tokens of this round discarded from t on, t included
            work[i] = selection_workload([0.0], [s], L, [v * s])[0]
            t = i + 1
            break
        else:
            t = block.stop
    return work
