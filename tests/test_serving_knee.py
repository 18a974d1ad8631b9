"""The Q* rule on synthetic TPS curves, refusals at the bottom / top rung, the load points, and a
sweep on the deterministic fake arm (vSkipper Sec. 4.1 "Load", App. M)."""

import pytest

from impl.serving.fake import FakeArm
from impl.serving.knee import capacity_rates, find_knee, knee_sweep, load_points, serial_capacity
from impl.serving.loadgen import Request


def test_first_plateau_is_the_knee():
    k = find_knee([1, 2, 3, 4, 5], [10, 20, 30, 30.2, 30.1], eps=0.02)
    assert k.q_star == 3 and k.index == 2 and k.later_growth == ()
    assert "1 + 0.02" in k.rule


def test_eps_decides_what_counts_as_growth():
    rates, tps = [1, 2, 3, 4, 5], [10, 20, 30, 30.5, 30.5]
    assert find_knee(rates, tps, eps=0.02).q_star == 3  # 30.5 <= 1.02 * 30: no growth
    assert find_knee(rates, tps, eps=0.0).q_star == 4   # 30.5 > 30: growth; 30.5 -> 30.5: none


def test_unsorted_input_is_sorted():
    k = find_knee([4, 1, 3, 2, 5], [30.2, 10, 30, 20, 30.1])
    assert k.q_star == 3 and k.rates == (1, 2, 3, 4, 5)


def test_later_growth_is_reported():
    k = find_knee([1, 2, 3, 4, 5], [10, 20, 20, 25, 25])
    assert k.q_star == 2 and k.later_growth == (4.0, 5.0)


def test_refuses_knee_at_bottom_rung():
    with pytest.raises(ValueError, match="bottom rung"):
        find_knee([1, 2, 3], [10, 10.1, 10.2])


def test_refuses_knee_at_top_rung():
    with pytest.raises(ValueError, match="top rung"):
        find_knee([1, 2, 3], [10, 20, 30])


@pytest.mark.parametrize("rates,tps", [([1, 2], [1, 2]), ([1, 1, 2], [1, 2, 3]), ([0, 1, 2], [1, 2, 3]),
                                       ([1, 2, 3], [1, -2, 3]), ([1, 2, 3], [1, 2])])
def test_rejects_malformed_sweeps(rates, tps):
    with pytest.raises(ValueError):
        find_knee(rates, tps)


def test_load_points():
    assert load_points(10.0) == pytest.approx({"below": 7.5, "knee": 9.5, "overload": 12.5})
    assert load_points(4.0, {"x": 0.5}) == {"x": 2.0}
    with pytest.raises(ValueError):
        load_points(0.0)


def _requests(n=40, new=10):
    return [Request(f"r{i}", (1, 2, 3 + i % 5), new) for i in range(n)]


def test_sweep_on_fake_arm_finds_the_saturation():
    """One server, 0.01 s prefill + 10 tokens at 0.01 s: capacity 10 req/s, 100 tokens/s."""
    arm = FakeArm("upstream", slots=1, ttft_s=0.01, tpot_s=0.01)
    seen = []
    knee, rows = knee_sweep(arm, _requests(), [2, 4, 8, 16, 32], seed=5, on_point=seen.append)
    assert [r["rate"] for r in rows] == [2, 4, 8, 16, 32] and seen == rows
    tps = [r["tps_window"] for r in rows]
    assert tps[0] < tps[1] < tps[2] and tps[-1] <= 101.0
    assert knee.q_star == 16  # deterministic: TPS 23.9, 47.7, 93.3, 98.4, 99.9 tokens/s
    assert all(r["kind"] == "sweep" and r["n_failed"] == 0 for r in rows)
    assert arm.submitted and not any(ie for _, _, ie in arm.submitted)  # natural generation


def test_sweep_refusal_keeps_the_rows():
    arm = FakeArm("upstream", slots=4, ttft_s=0.01, tpot_s=0.01)
    with pytest.raises(ValueError, match="top rung") as ei:
        knee_sweep(arm, _requests(), [0.5, 1, 2], seed=5)
    assert len(ei.value.rows) == 3


@pytest.mark.parametrize("slots", [1, 4])
def test_serial_capacity_serves_one_at_a_time(slots):
    """Service 0.01 s prefill + 10 tokens at 0.01 s = 0.1 s alone, whatever the parallelism: 10 req/s."""
    arm = FakeArm("upstream", slots=slots, ttft_s=0.01, tpot_s=0.01)
    cap = serial_capacity(arm, _requests(), n=3)
    assert cap["n"] == 3 and len(cap["service_s"]) == 3 and arm.runs == 3
    assert cap["capacity_req_s"] == pytest.approx(1.0 / cap["service_s_mean"])
    assert cap["capacity_req_s"] == pytest.approx(10.0, rel=0.1)
    assert not any(ie for _, _, ie in arm.submitted)  # natural generation
    with pytest.raises(ValueError):
        serial_capacity(arm, _requests(), n=0)
    with pytest.raises(RuntimeError, match="r0 failed"):
        serial_capacity(FakeArm("upstream", fail=["r0"]), _requests(), n=1)


def test_capacity_rates_bracket_the_knee_of_the_fake_arm():
    arm = FakeArm("upstream", slots=1, ttft_s=0.01, tpot_s=0.01)
    rates = capacity_rates(serial_capacity(arm, _requests(), n=2)["capacity_req_s"], [0.25, 0.5, 1, 2, 4])
    assert rates == pytest.approx([2.5, 5, 10, 20, 40], rel=0.1) and rates == sorted(rates)
    knee, _ = knee_sweep(arm, _requests(), rates, seed=5)  # bracketed: no refusal at a boundary rung
    assert rates[0] < knee.q_star < rates[-1]
    assert capacity_rates(3.14159, [1, 2]) == [3.14, 6.28]
    for bad_cap, bad_f in ((0, [1, 2]), (1, [2, 1]), (1, [0, 1]), (1, []), (1, [1, 1.0001])):
        with pytest.raises(ValueError):
            capacity_rates(bad_cap, bad_f)
