"""Tables from synthetic raw rows: hand-checkable summaries, S_X, paired comparison, AR table."""

import pytest

from impl.report.tables import ar_table, best_selection, ead_tables, paired_model_comparison


def _rows(model, suite, eads_by_prompt, L=4):
    rows = []
    for pid, eads in eads_by_prompt.items():
        for t, e in enumerate(eads):
            omega = [0] * (e - 1) + [1] * (L - e + 1)
            rows.append({"model": model, "suite": suite, "prompt_id": pid, "t": t, "token_id": 10 + t,
                         "omega": omega, "ead": e, "stable_ead": e, "ar_match": True})
    return rows


def test_ead_tables_hand_computed():
    rows = _rows("m", "w", {"p0": [1, 2], "p1": [4, 4]})
    tabs = ead_tables(rows, [1], [[2, 4]])
    s = tabs["ead_summary"].iloc[0]
    assert s["mean_stable_ead"] == pytest.approx(11 / 4)
    assert s["macro_mean_stable_ead"] == pytest.approx((1.5 + 4) / 2)
    assert s["s_ead"] == pytest.approx(16 / 11)
    sx = tabs["s_x"].set_index("K")
    # K = 2: X = {2, 4}: work [2, 2, 4, 4] -> 16/12
    assert sx.loc[2, "s_x"] == pytest.approx(16 / 12)
    assert sx.loc[1, "s_x"] == pytest.approx(1.0)
    assert sx.loc[4, "s_x"] == pytest.approx(16 / 11)
    assert tabs["nested_chains"]["monotone"].all()
    hist = tabs["ead_hist"]
    assert hist["count"].tolist() == [1, 1, 0, 2]
    sel = tabs["selection"]
    # s = 1, one speculation: p0 = [acc, fail(4+1)], p1 = [fail(5), fail(5)] -> total 1+5+5+5
    r = sel[(sel.exit_depth == 1) & (sel.num_speculations == 1)].iloc[0]
    assert r["s_sel"] == pytest.approx(16 / 16)
    assert len(best_selection(sel)) == 1


def test_paired_comparison_and_ar_table():
    a = _rows("std", "w", {f"p{i}": [4, 4, 3] for i in range(5)})
    b = _rows("ls", "w", {f"p{i}": [1, 2 + (i % 2), 1] for i in range(5)})
    comp = paired_model_comparison(a + b, "std", "ls")
    r = comp.iloc[0]
    assert r["n"] == 5 and r["diff"] < 0 and r["resolved"]
    assert r["ci_high"] < 0
    ar = [{"model": "std", "suite": "w", "prompt_id": "p0", "repetition": 0, "n_new_tokens": 3,
           "token_ids": [10, 11, 12], "prefill_seconds": 0.01, "token_seconds": [0.002, 0.004]}]
    t = ar_table(ar, a)
    assert t.iloc[0]["decode_tokens_per_s"] == pytest.approx(2 / 0.006)
    assert t.iloc[0]["token_latency_ms_mean"] == pytest.approx(3.0)
    assert bool(t.iloc[0]["ids_equal_ead_run"])
    ar[0]["token_ids"] = [10, 11, 99]
    assert not bool(ar_table(ar, a).iloc[0]["ids_equal_ead_run"])
