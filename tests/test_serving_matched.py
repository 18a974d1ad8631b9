"""Matched-work lane (vSkipper Sec. 4.1, "Matched work"): recorded lengths, replay requests, and the
per-request gate that accepts equal and rejects unequal token counts, naming the requests."""

import pytest

from impl.serving.loadgen import Request, RequestRecord
from impl.serving.matched import (MatchedWorkError, check_matched, natural_requests, record_lengths,
                                  replay_requests)


def rec(rid, n, *, ok=True, ignore_eos=False):
    times = [0.1 * (k + 1) for k in range(n)]
    return RequestRecord(rid, 32, ignore_eos, 0.0, 0.0, times[0] if times else None, times,
                         (times[-1] if times else 0.0) if ok else None, 3, 3, n, [], None if ok else "failed")


REQS = [Request("q1", (1, 2), 32), Request("q2", (3,), 32), Request("q3", (4, 5, 6), 32)]


def test_record_and_replay():
    lengths = record_lengths([rec("q1", 5), rec("q2", 1), rec("q3", 32)])
    assert lengths == {"q1": 5, "q2": 1, "q3": 32}
    rep = replay_requests(REQS, lengths)
    assert [(r.request_id, r.max_new_tokens, r.ignore_eos, r.input_ids) for r in rep] == [
        ("q1", 5, True, (1, 2)), ("q2", 1, True, (3,)), ("q3", 32, True, (4, 5, 6))]
    assert all(not r.ignore_eos and r.max_new_tokens == 32 for r in natural_requests(REQS))
    assert [r.max_new_tokens for r in natural_requests(rep)] == [5, 1, 32]


def test_record_refuses_failed_forced_or_empty():
    with pytest.raises(ValueError, match="q2"):
        record_lengths([rec("q1", 5), rec("q2", 3, ok=False)])
    with pytest.raises(ValueError, match="q1"):
        record_lengths([rec("q1", 5, ignore_eos=True)])
    with pytest.raises(ValueError, match="q3"):
        record_lengths([rec("q3", 0)])
    with pytest.raises(ValueError, match="q3"):
        replay_requests(REQS, {"q1": 1, "q2": 2})


def test_gate_accepts_equal_counts():
    a = [rec("q1", 5), rec("q2", 1)]
    b = [rec("q2", 1), rec("q1", 5)]
    check_matched({"upstream": a, "vskipper": b})
    check_matched({"upstream": a, "vskipper": b}, {"q1": 5, "q2": 1})


def test_gate_rejects_unequal_counts_naming_requests():
    a = [rec("q1", 5), rec("q2", 1), rec("q3", 7)]
    b = [rec("q1", 5), rec("q2", 2), rec("q3", 6)]
    with pytest.raises(MatchedWorkError) as ei:
        check_matched({"upstream": a, "vskipper": b})
    msg = str(ei.value)
    assert "2 of 3 requests" in msg and "q2 (upstream=1, vskipper=2)" in msg and "q3 (upstream=7, vskipper=6)" in msg
    assert "q1" not in msg
    assert ei.value.mismatches == {"q2": {"upstream": 1, "vskipper": 2}, "q3": {"upstream": 7, "vskipper": 6}}


def test_gate_checks_expected_lengths_failures_and_missing():
    a = [rec("q1", 4), rec("q2", 1)]
    with pytest.raises(MatchedWorkError, match=r"q1 \(upstream=4, vskipper=4, expected=5\)"):
        check_matched({"upstream": a, "vskipper": a}, {"q1": 5, "q2": 1})
    with pytest.raises(MatchedWorkError, match="q2 .*vskipper=failed/missing"):
        check_matched({"upstream": a, "vskipper": [rec("q1", 4), rec("q2", 1, ok=False)]})
    with pytest.raises(MatchedWorkError, match="q3 .*expected=2"):
        check_matched({"upstream": a}, {"q1": 4, "q2": 1, "q3": 2})
    assert issubclass(MatchedWorkError, ValueError)
