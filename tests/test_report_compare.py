"""compare-tables (impl/report/compare.py): two runs' tables agree on every column but the timings;
a changed count, verdict or row set is named with its file, column and first row; exit status 1."""

import pandas as pd
import pytest

from impl.report.compare import compare_dirs, compare_tables, is_timing


def test_timing_columns_are_reported_not_compared():
    for c in ("seconds", "train_seconds", "tokens_per_s", "wall_speedup", "projected_speedup", "speedup_mean",
              "ci_low", "ci_high", "above_ar", "comm_ms_per_round", "expansion_s", "ar_seconds"):
        assert is_timing(c), c
    for c in ("depth_speedup", "tokens", "ar_match_all", "rounds", "n_prompts", "kl_after", "chain_tau_after",
              "arm", "params", "stable_ead"):
        assert not is_timing(c), c


def _t(**over):
    d = {"arm": ["ar", "dex"], "tokens": [10, 10], "ar_match_all": [True, True], "depth_speedup": [1.0, 1.5],
         "seconds": [1.0, 0.5]}
    d.update(over)
    return pd.DataFrame(d)


def test_same_tables_but_timings_are_the_same():
    d = compare_tables(_t(), _t(seconds=[9.0, 9.0]))
    assert d.problems == [] and d.timing_columns == ["seconds"] and "depth_speedup" in d.compared_columns


def test_a_changed_count_or_verdict_is_named():
    d = compare_tables(_t(), _t(ar_match_all=[True, False], depth_speedup=[1.0, 1.5 + 1e-6]))
    assert any("'ar_match_all' differs in 1 rows; first at row 1: True vs False" in p for p in d.problems)
    assert any("'depth_speedup'" in p for p in d.problems)
    assert compare_tables(_t(), _t(depth_speedup=[1.0, 1.5 * (1 + 1e-12)])).problems == []  # within rtol
    assert compare_tables(_t(), _t(depth_speedup=[1.0, float("nan")])).problems  # NaN vs a number
    assert not compare_tables(_t(depth_speedup=[1.0, float("nan")]), _t(depth_speedup=[1.0, float("nan")])).problems
    assert "2 rows in A, 1 in B" in compare_tables(_t(), _t().iloc[:1]).problems[0]
    assert "only in B ['extra']" in compare_tables(_t(), _t(extra=[1, 2])).problems[0]


def test_directories_and_the_command(tmp_path, capsys):
    from impl.cli import main

    for side in ("a", "b"):
        (tmp_path / side / "dex").mkdir(parents=True)
        _t().to_csv(tmp_path / side / "dex" / "arms.csv", index=False)
    _t().to_csv(tmp_path / "a" / "only_a.csv", index=False)
    diffs = {d.path: d for d in compare_dirs(tmp_path / "a", tmp_path / "b")}
    assert diffs["dex/arms.csv"].problems == [] and diffs["only_a.csv"].problems == ["only in A"]
    with pytest.raises(SystemExit) as e:
        main(["compare-tables", str(tmp_path / "a"), str(tmp_path / "b")])
    assert e.value.code == 1
    out = capsys.readouterr().out
    assert "DIFFERS only_a.csv" in out and "same    dex/arms.csv" in out and "2 tables: 1 the same, 1 differ" in out
    (tmp_path / "a" / "only_a.csv").unlink()
    main(["compare-tables", str(tmp_path / "a"), str(tmp_path / "b")])  # all the same: exit 0
    with pytest.raises(SystemExit, match="no such tables directory"):
        main(["compare-tables", str(tmp_path / "a"), str(tmp_path / "none")])
