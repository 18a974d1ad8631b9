"""Depth-side accounting against the DEX paper's worked examples (App. A.2, A.3) and Prop. 7."""

import numpy as np
import pytest

from impl.ead import (
    depth_ceiling,
    ead_from_omega,
    exploration_workload,
    resolution,
    s_ead,
    s_x,
    s_x_lower_bound,
    selection_overhead,
    selection_trace,
    selection_workload,
    stable_ead_from_omega,
    uniform_exploration_set,
    validate_exploration_set,
)


def test_app_a3_exploration_example():
    # L = 20, EAD = 8, X = {5, 10, 15, 20}: ceiling 10, overhead 2, resolution 4.
    X = (5, 10, 15, 20)
    assert depth_ceiling([8], X).tolist() == [10]
    assert exploration_workload([8], X).tolist() == [10]
    assert exploration_workload([8], X)[0] - 8 == 2
    assert resolution(X, 20) == 4


def test_app_a2_selection_example():
    L, ead = 20, 8
    # conservative exit s = 15 is accepted: overhead 15 - 8 = 7
    assert selection_overhead([1.0], [15], L, [15], [ead]).tolist() == [7.0]
    # aggressive s = 4 fails with two discarded descendants: 20 + 4 + s_{t+1} + s_{t+2}
    w = selection_workload([0.0], [4], L, [4 + 5 + 6])
    assert w.tolist() == [20 + 4 + 5 + 6]
    assert w[0] > L  # worse than AR for this position
    # the same through the draft-round trace: 3 drafted tokens at s = 4, the first fails
    assert selection_trace([8, 1, 1], 4, L, 3).tolist() == [20 + 3 * 4, 4.0, 4.0]


def test_selection_trace_rounds():
    # s = 5, 2 speculations: [acc, fail | acc, acc | fail]
    e = [3, 9, 2, 5, 12]
    w = selection_trace(e, 5, 12, 2)
    # token 0 accepted (5); token 1 fails, v = 1 (last in round): 12 + 5; next round starts at 2
    assert w.tolist() == [5, 17, 5, 5, 12 + 5]
    # one speculation: fail costs L + s
    assert selection_trace([12], 3, 12, 1).tolist() == [15]
    with pytest.raises(ValueError):
        selection_trace(e, 12, 12, 1)
    with pytest.raises(ValueError):
        selection_trace(e, 3, 12, 0)


def test_ead_and_stable_ead_hand_built():
    # L = 5; rows: always accepted; match at 2 then diverge at 4; only final; match 3..5
    om = np.array([
        [1, 1, 1, 1, 1],
        [0, 1, 1, 0, 1],
        [0, 0, 0, 0, 0],  # final forced to 1
        [0, 0, 1, 1, 1],
    ], dtype=bool)
    assert ead_from_omega(om).tolist() == [1, 2, 5, 3]
    assert stable_ead_from_omega(om).tolist() == [1, 5, 5, 3]


def test_uniform_sets_and_validation():
    assert uniform_exploration_set(12, 3) == (4, 8, 12)
    assert uniform_exploration_set(12, 12) == tuple(range(1, 13))
    assert uniform_exploration_set(12, 1) == (12,)
    for K in (5, 13, 0):
        with pytest.raises(ValueError):
            uniform_exploration_set(12, K)
    for bad in ([4, 4, 12], [4, 8], [0, 12], [4, 13], []):
        with pytest.raises(ValueError):
            validate_exploration_set(bad, 12)


def test_prop7_bounds_and_monotonicity_random():
    rng = np.random.default_rng(0)
    L = 12
    chains = [[(12,), (6, 12), (3, 6, 9, 12), tuple(range(1, 13))],
              [(12,), (4, 8, 12), (2, 4, 6, 8, 10, 12), tuple(range(1, 13))]]
    for _ in range(50):
        e = rng.integers(1, L + 1, size=rng.integers(1, 200))
        for chain in chains:
            vals = [s_x(e, X, L) for X in chain]
            assert all(b >= a - 1e-12 for a, b in zip(vals, vals[1:]))
            assert vals[-1] == pytest.approx(s_ead(e, L))
            for X in chain:
                assert 1.0 <= s_x_lower_bound(e, X, L) <= s_x(e, X, L) + 1e-12
        assert s_x(e, (L,), L) == pytest.approx(1.0)


def test_speedup_hand_computed():
    # L = 4, EADs [1, 2, 4]: S_EAD = 12 / 7; X = {2, 4}: work [2, 2, 4] -> 12 / 8
    assert s_ead([1, 2, 4], 4) == pytest.approx(12 / 7)
    assert s_x([1, 2, 4], (2, 4), 4) == pytest.approx(1.5)
    with pytest.raises(ValueError):
        s_ead([], 4)
