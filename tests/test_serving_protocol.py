"""Load generator end to end and the paired protocol on deterministic fake arms (vSkipper Sec. 4.1:
order alternation, shared seeded schedules, matched-work gate, percent-change statistics, JSONL rows
with provenance)."""

import numpy as np
import pytest

from impl.provenance import read_jsonl
from impl.serving.arrivals import ArrivalSchedule, poisson_arrivals
from impl.serving.fake import FakeArm
from impl.serving.loadgen import Request, run_load
from impl.serving.matched import MatchedWorkError
from impl.serving.protocol import (CellError, CellSpec, arm_order, format_summary, run_cell, run_protocol,
                                   schedule_seed)
from impl.stats import percent_change


def _requests(n=8, new=6):
    return [Request(f"r{i}", (1, 2, 3 + i), new) for i in range(n)]


class LoggingFake(FakeArm):
    """A fake arm that logs (arm, run, request, arrival, max_new_tokens, ignore_eos) into a shared list."""

    def __init__(self, name, log, **kw):
        super().__init__(name, **kw)
        self.log = log

    def submit(self, request_id, input_ids, max_new_tokens, ignore_eos):
        self.log.append((self.name, self.runs, request_id, self.clock.now() - self.t_start, max_new_tokens, ignore_eos))
        super().submit(request_id, input_ids, max_new_tokens, ignore_eos)

    def start(self, hint=None):
        super().start(hint)
        self.t_start = self.clock.now()


def test_load_generator_fifo_timeline_exact():
    """One server, no client cap: all three requests are submitted on schedule and queue in the arm."""
    arm = FakeArm("a", slots=1, ttft_s=0.1, tpot_s=0.05)
    sched = ArrivalSchedule((0.0, 0.01, 0.02), 100.0, 0, 0.02)
    res = run_load(arm, [Request(f"r{i}", (1, 2), 3) for i in range(3)], sched)
    got = [(r.arrival_s, r.first_token_s, r.finish_s, r.output_tokens) for r in res.records]
    expect = [(0.0, 0.1, 0.2, 3), (0.01, 0.3, 0.4, 3), (0.02, 0.5, 0.6, 3)]
    assert np.allclose(got, expect)
    assert res.records[1].token_times_s == pytest.approx([0.3, 0.35, 0.4])
    assert all(r.arrival_s == r.scheduled_s and r.ok and r.finish_reason == "length" for r in res.records)
    assert res.window_s == 0.02 and res.settings["arm"] == "a"


def test_load_generator_records_failures_and_refuses_ignore_eos_when_unsupported():
    arm = FakeArm("a", fail=["r1"])
    res = run_load(arm, _requests(3), poisson_arrivals(10, n=3, seed=0))
    assert [r.ok for r in res.records] == [True, False, True] and res.records[1].error == "injected failure"
    arm.supports_ignore_eos = False
    with pytest.raises(NotImplementedError):
        run_load(arm, [Request("x", (1,), 2, True), Request("y", (1,), 2)], poisson_arrivals(10, n=2, seed=0))
    with pytest.raises(ValueError, match="duplicate"):
        run_load(FakeArm(), [Request("x", (1,), 2), Request("x", (1,), 2)], poisson_arrivals(10, n=2, seed=0))


def test_arm_order_alternates():
    assert [arm_order(["A", "B"], r) for r in range(4)] == [["A", "B"], ["B", "A"], ["A", "B"], ["B", "A"]]
    assert arm_order(["A", "B", "C"], 1) == ["C", "B", "A"]


def test_pairing_order_and_shared_schedules():
    log = []
    natural = {f"r{i}": 2 + i % 3 for i in range(8)}
    arms = {"upstream": LoggingFake("upstream", log, natural_length=natural),
            "vskipper": LoggingFake("vskipper", log, natural_length={k: 1 for k in natural}, tpot_s=0.004)}
    res = run_cell(arms, _requests(), cell="knee", rate=20.0, repetitions=4, seed=11)
    # the length-recording run of the baseline, then AB BA AB BA
    runs = list(dict.fromkeys((a, r) for a, r, *_ in log))
    assert runs == [("upstream", 1), ("upstream", 2), ("vskipper", 1), ("vskipper", 2), ("upstream", 3),
                    ("upstream", 4), ("vskipper", 3), ("vskipper", 4), ("upstream", 5)]
    assert res.orders == [["upstream", "vskipper"], ["vskipper", "upstream"]] * 2
    # within a repetition both arms replay the same arrivals; repetitions differ
    arrivals = {}
    for a, run, rid, t, *_ in log:
        arrivals.setdefault((a, run), []).append(t)
    up = [arrivals[("upstream", k)] for k in (2, 3, 4, 5)]
    vs = [arrivals[("vskipper", k)] for k in (1, 2, 3, 4)]
    assert all(np.allclose(u, v) for u, v in zip(up, vs))
    assert not np.allclose(up[0], up[1])
    assert np.allclose(up[0], poisson_arrivals(20.0, n=8, seed=schedule_seed(11, 0)).offsets_s)
    # the matched lane replayed upstream's natural lengths, EOS ignored, in both arms
    assert res.lengths == natural
    replays = [(rid, n, ie) for a, run, rid, t, n, ie in log if not (a == "upstream" and run == 1)]
    assert all(ie and n == natural[rid] for rid, n, ie in replays)
    recs = [r for r in res.rows if r["kind"] == "request" and r["phase"] == "measure"]
    assert len(recs) == 4 * 2 * 8 and all(r["output_tokens"] == natural[r["request_id"]] for r in recs)


def test_percent_change_statistics_on_fake_arms():
    arms = {"upstream": FakeArm("upstream", slots=2, tpot_s=0.01, jitter=0.05, seed=1),
            "vskipper": FakeArm("vskipper", slots=2, tpot_s=0.008, jitter=0.05, seed=2)}
    res = run_cell(arms, _requests(10, 8), cell="below", rate=15.0, repetitions=5, seed=3, lane="natural",
                   workload="gsm8k")
    summ = {r["metric"]: r for r in res.rows if r["kind"] == "summary"}
    cells = [r for r in res.rows if r["kind"] == "cell"]
    a = [r["e2e_mean_s"] for r in sorted(cells, key=lambda r: r["repetition"]) if r["arm"] == "upstream"]
    b = [r["e2e_mean_s"] for r in sorted(cells, key=lambda r: r["repetition"]) if r["arm"] == "vskipper"]
    ref = percent_change(a, b)
    s = summ["e2e_mean_s"]
    assert s["n"] == 5 and s["pct_mean"] == pytest.approx(ref.mean) and s["pct_ci_low"] == pytest.approx(ref.ci_low)
    assert s["pct_mean"] < 0 and s["pct_resolved"] and s["improved"] and "n=5" in s["text"]
    assert res.summaries[("vskipper", "e2e_mean_s")] == ref
    assert summ["tps_window"]["better"] == "higher"
    text = format_summary(res.rows)
    assert "gsm8k/below" in text and "vskipper vs upstream e2e_mean_s" in text and "(n=5" in text
    # one repetition is never resolved
    one = run_cell(arms, _requests(10, 8), cell="below", rate=15.0, repetitions=1, seed=3, lane="natural")
    assert all(not r.get("pct_resolved", False) for r in one.rows if r["kind"] == "summary")


def test_gate_rejects_a_cell_with_unequal_counts():
    arms = {"upstream": FakeArm("upstream", natural_length=lambda rid, ids: 3),
            "vskipper": FakeArm("vskipper", miscount={"r5": -1})}
    with pytest.raises(MatchedWorkError, match=r"r5 \(upstream=3, vskipper=2, expected=3\)") as ei:
        run_cell(arms, _requests(), cell="knee", rate=20.0, repetitions=2, seed=0)
    assert list(ei.value.mismatches) == ["r5"] and ei.value.rows
    # the natural lane has no gate
    run_cell(arms, _requests(), cell="knee", rate=20.0, repetitions=2, seed=0, lane="natural")


def test_failed_request_rejects_the_cell():
    arms = {"upstream": FakeArm("upstream"), "vskipper": FakeArm("vskipper", fail=["r2"])}
    with pytest.raises(CellError, match="r2") as ei:
        run_cell(arms, _requests(), cell="knee", rate=20.0, repetitions=2, seed=0)
    assert any(r["kind"] == "cell" for r in ei.value.rows)


def test_run_protocol_writes_rows_with_provenance(tmp_path):
    arms = {"upstream": FakeArm("upstream", natural_length=lambda rid, ids: 1 + len(ids) % 4, jitter=0.02),
            "vskipper": FakeArm("vskipper", tpot_s=0.004, jitter=0.02, seed=9)}
    cells = [CellSpec("gsm8k", "below", 10.0, tuple(_requests(6))), CellSpec("gsm8k", "knee", 12.0, tuple(_requests(6)))]
    lines = []
    out = tmp_path / "serving.jsonl"
    rows = run_protocol(arms, cells, repetitions=2, seed=4, lanes=("matched", "natural"), out=str(out),
                        config={"x": 1}, log=lines.append)
    back = read_jsonl(out)
    assert len(back) == len(rows) and [r["kind"] for r in back] == [r["kind"] for r in rows]  # (NaN != NaN)
    kinds = {}
    for r in back:
        kinds[r["kind"]] = kinds.get(r["kind"], 0) + 1
        assert r["run_id"] == back[0]["run_id"] and "git_sha" in r and r["seed"] == 4 and r["config_hash"]
    # per cell: matched = record run (6) + 2 reps x 2 arms x 6; natural = 2 x 2 x 6
    assert kinds["request"] == 2 * (6 + 24 + 24)
    assert kinds["cell"] == 2 * 2 * 4
    assert kinds["summary"] == 2 * 2 * 12
    assert any("(n=2" in line for line in lines)
    # both lanes of a cell share the schedules
    sched = {(r["lane"], r["repetition"], r["request_id"]): r["scheduled_s"] for r in back
             if r["kind"] == "request" and r["cell"] == "knee" and r["arm"] == "upstream" and r["phase"] == "measure"}
    assert all(sched[("matched", k[1], k[2])] == v for k, v in sched.items() if k[0] == "natural")
