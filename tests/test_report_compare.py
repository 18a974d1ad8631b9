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


def test_time_derived_values_under_plain_names_by_table_and_row():
    assert is_timing("SR", "tev/tev_arms.csv") and not is_timing("SR", "dex/dex_arms.csv")
    assert is_timing("expansion_share", "dex/dex_overhead.csv") and not is_timing("expansion_share", "dex/dex_arms.csv")
    assert is_timing("E2E mean", "vskipper/vskipper_table2.csv") and is_timing("threshold_N", "vskipper/vskipper_thresholds.csv")
    assert not is_timing("tau", "tev/tev_arms.csv") and not is_timing("skip_share", "vskipper/vskipper_cells.csv")
    # a cell whose metric is a latency or a throughput: its effect is timing; a count metric is compared
    a = pd.DataFrame({"metric": ["e2e_mean_s", "tps_window", "output_tokens"], "mean": [1.0, 2.0, 3.0]})
    d = compare_tables(a, a.assign(mean=[5.0, 6.0, 3.0]), "vskipper/vskipper_cells.csv")
    assert d.problems == [] and "mean" in d.compared_columns
    d = compare_tables(a, a.assign(mean=[5.0, 6.0, 4.0]), "vskipper/vskipper_cells.csv")
    assert len(d.problems) == 1 and "first at row 2: 3.0 vs 4.0" in d.problems[0]
    # the DEX arm picked as fastest may be another K in another run; the other rows are compared
    f = pd.DataFrame({"kind": ["AR", "DEX (best K by wall)"], "arm": ["ar", "dex-1/2"]})
    assert compare_tables(f, f.assign(arm=["ar", "dex-1/4"]), "dex/dex_fig5.csv").problems == []
    assert compare_tables(f, f.assign(arm=["ar2", "dex-1/2"]), "dex/dex_fig5.csv").problems


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
