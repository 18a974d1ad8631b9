"""The TEV report's real-model lines (impl.tev.report): training wall times per objective, the base
drafter's learning curve and its projection to the tau target, the tau-target verdict per model, and
the verifier-latency verdicts per model with its vocabulary size."""

import math

import numpy as np
import pandas as pd
import pytest

from impl.tev.report import curve_table, report_section, steps_to_reach, tev_tables, training_table


def _summary(model_dir="models/smollm2", curve=((0, 1.0), (100, 1.2), (200, 1.3), (400, 1.4), (800, 1.5))):
    base = {"losses": [1.0] * 800, "seconds": {"train": 400.0, "total": 450.0},
            "heldout_after": {"loss": 3.0, "chain_tau": 1.3},
            "curve": [{"step": s, "loss": 3.0, "chain_tau": 1.0 + t / 10, "tree_tau": t, "tree_budget": 64,
                       "n_contexts": 64} for s, t in curve]}
    exit_ = {"losses": {"total": [1.0] * 100, "token": [1.0] * 100, "exit": [0.1] * 100, "opd": []},
             "seconds": {"train": 200.0, "total": 260.0}, "after": {"teacher_forced": {"loss": 2.9, "chain_tau": 1.31}}}
    return {"model_dir": model_dir, "rollout_seconds": {"rollouts": 420.0, "features": 6.0},
            "summaries": {"base": base, "exit": exit_}}


def test_training_table_has_wall_time_per_objective():
    t = training_table([_summary()]).set_index("drafter")
    assert t.at["base", "model"] == "smollm2" and t.at["base", "steps"] == 800
    assert t.at["base", "per_step_s"] == pytest.approx(0.5) and t.at["base", "rollout_seconds"] == 420.0
    assert t.at["exit", "steps"] == 100 and t.at["exit", "train_seconds"] == 200.0
    assert math.isnan(t.at["exit", "rollout_seconds"]) and t.at["exit", "heldout_chain_tau"] == 1.31


def test_steps_to_reach_extrapolates_in_log_steps():
    c = curve_table([_summary()])
    assert list(c["step"]) == [0, 100, 200, 400, 800] and set(c["model"]) == {"smollm2"}
    pr = steps_to_reach(c, 2.0)
    # the second half (200, 400, 800) gains 0.1 per doubling: tau = 1.3 + 0.1 log2(step / 200)
    assert pr["slope_per_e"] == pytest.approx(0.1 / math.log(2), rel=1e-6)
    assert pr["steps"] == pytest.approx(200 * 2 ** 7, rel=1e-3) and pr["last_step"] == 800
    assert steps_to_reach(c, 1.35)["steps"] == 400  # already measured: the first step that reached it
    flat = curve_table([_summary(curve=((0, 1.0), (100, 1.3), (200, 1.3), (400, 1.29), (800, 1.28)))])
    assert steps_to_reach(flat, 2.0)["steps"] is None
    assert steps_to_reach(curve_table([_summary(curve=((0, 1.0),))]), 2.0)["steps"] is None


def _arm_rows(model, taus):
    rows = []
    for suite, tau in taus.items():
        for arm, t in (("ar", 1.0), ("exittrain+tev", tau)):
            rows.append({"model": model, "suite": suite, "arm": arm, "temperature": 0.0, "budget": 0 if arm == "ar" else 64,
                         "tables": ["main"], "prompt_id": "p0", "n_new_tokens": 8, "rounds": 4,
                         "taus": [t] * 4, "seconds": 1.0, "ar_match": True, "cell": "target",
                         **({"coverages": [t - 1] * 4, "committed": [t] * 4} if arm != "ar" else {})})
    return rows


def test_report_tau_target_and_latency_per_model(tmp_path):
    rows = _arm_rows("smollm2", {"gsm8k": 2.1, "math500": 1.6, "humaneval": 1.9}) + \
        _arm_rows("tiny-ls", {"gsm8k": 2.2, "math500": 2.5})
    lat = [{"model": m, "vocab_size": v, "budget": 64, "verifier": ver, "median_us": us, "baseline": "predraw_follow",
            "ratio_median": us / base}
           for m, v, base in (("smollm2", 49152, 100.0), ("tiny-ls", 4096, 10.0), ("smollm2", 4096, 10.0))
           for ver, us in (("predraw_follow", base), ("tev", (0.7 if v > 4096 or m == "tiny-ls" else 0.9) * base))]
    tables = tev_tables(rows, lat, [_summary(), _summary("models/tiny-ls")])
    out = tmp_path / "tables"
    out.mkdir()
    for name, df in tables.items():
        df.to_csv(out / f"{name}.csv", index=False)
    text = "\n".join(report_section(out, tmp_path, tmp_path))
    assert "tau target on smollm2" in text and "gsm8k 2.10 (8 tokens)" in text
    smol = next(line for line in text.splitlines() if line.startswith("- tau target on smollm2"))
    assert "**FAIL**" in smol and "reaches 2 at ~25,600 steps" in smol  # one workload of three reached 2.0
    assert "overfits" not in smol  # the held-out loss is flat in this curve
    assert "32.0x this budget" in smol and "ShareGPT" not in smol  # no DDTree rows here: no distribution clause
    tiny = next(line for line in text.splitlines() if line.startswith("- tau target on tiny-ls"))
    assert "**PASS**" in tiny and "learning curve" not in tiny
    assert "verifier latency on smollm2 (V = 49,152)" in text and "verifier latency on tiny-ls (V = 4,096)" in text
    assert text.count("median per-tree ratio 0.70") == 2 and "ratio 0.90" not in text  # verdicts at the full V
    assert "restricted to V = 4,096 / 49,152 columns: B = 64: 0.90 / 0.70" in text  # smollm2's V sweep
    assert "Base drafter learning curve" in text
    assert isinstance(tables["tev_curve"], pd.DataFrame) and len(tables["tev_curve"]) == 10


def test_the_tau_line_names_overfitting_when_the_held_out_loss_rises():
    from impl.tev.report import _tau_target_lines

    s = _summary()
    for pt, loss in zip(s["summaries"]["base"]["curve"], (9.0, 6.9, 6.7, 6.8, 7.5)):
        pt["loss"] = loss
    arms = pd.DataFrame([{"model": "smollm2", "suite": "gsm8k", "arm": "exittrain+tev", "temperature": 0.0,
                          "budget": 64, "tau": 1.8}])
    arms = pd.concat([arms, arms.assign(arm="ddtree", tau=1.7)])
    line = _tau_target_lines(arms, curve_table([s]))[0]
    assert "**FAIL**" in line and "lowest at step 200 (6.70)" in line and "rose to 7.50 by step 800" in line
    assert "DDTree tau at T = 0 averages 1.70 on these workloads against 1.50 there" in line
    assert "training prompts (sharegpt)" in line  # a summary from before the mixture: ShareGPT alone
    s["prompt_sources"] = {"sharegpt": 320, "gsm8k": 320}
    assert "training prompts (sharegpt 320 + gsm8k 320)" in _tau_target_lines(arms, curve_table([s]))[0]


def _calibration_rows(diffs_by_arm):
    """Per arm, 16 prompts whose walk - (1 + C_p) are the given differences (one round each)."""
    return pd.DataFrame([{"model": "smollm2", "temperature": 1.0, "arm": arm, "rounds": 1, "expected_tau": 1.5,
                          "walk_sum": 1.5 + d, "tau_sum": 1.5 + d, "expected_tau_sum": 1.5}
                         for arm, ds in diffs_by_arm.items() for d in ds])


def test_calibration_is_a_familywise_check():
    """One exact pair outside its own 95% interval (p ~ 0.014) fails the per-pair column but passes
    Holm's family-wise check over 13 pairs; a real miscalibration (a 0.3-token gap, p ~ 1e-12)
    fails both; a tiny gap passes whatever its interval."""
    from impl.tev.report import calibration_table

    noise = [0.1, -0.1] * 8  # mean 0, sd ~ 0.103
    shifted = [d - 0.072 for d in noise]  # t ~ -2.8 over 16 prompts: p ~ 0.014, x 13 (Holm) > 0.05
    cal = calibration_table(_calibration_rows({**{f"arm{i}": noise for i in range(12)}, "shifted": shifted}))
    row = cal.set_index("arm").loc["shifted"]
    assert row["p_value"] < 0.05 and not row["calibrated_per_pair"] and row["calibrated"]
    assert cal["calibrated"].all() and cal["calibrated_per_pair"].sum() == 12
    bad = calibration_table(_calibration_rows({**{f"arm{i}": noise for i in range(12)},
                                               "broken": [d / 10 + 0.3 for d in noise]}))
    assert not bad.set_index("arm").loc["broken", "calibrated"] and bad["calibrated"].sum() == 12
    tiny = calibration_table(_calibration_rows({"tiny": [d / 100 + 0.01 for d in noise]}))
    assert tiny["p_value"].iloc[0] < 1e-6 and tiny["calibrated"].iloc[0]  # |0.01| < 0.05 tokens


def test_a_pair_of_one_prompt_is_untestable_not_calibrated(tmp_path):
    """One prompt gives no interval and no p-value: such a pair passes only within the tolerance, and the
    report's calibration line reads UNCHECKED (not PASS, which it used to read for a 0.6-token gap), while a
    testable failing pair still makes it FAIL."""
    from impl.tev.report import calibration_table

    noise = [0.1, -0.1] * 8
    one = calibration_table(_calibration_rows({**{f"arm{i}": noise for i in range(3)}, "chain": [0.61],
                                               "close": [0.02]})).set_index("arm")
    assert not one.at["chain", "testable"] and not one.at["chain", "calibrated"]
    assert not one.at["chain", "calibrated_per_pair"]
    assert one.at["close", "calibrated"] and one.at["arm0", "testable"] and one.at["arm0", "calibrated"]
    line = next(x for x in report_section_of({"tev_calibration": one.reset_index()}, tmp_path / "one")
                if x.startswith("- exit-law calibration"))
    assert "**UNCHECKED**" in line and "4/5 pairs pass" in line
    assert "untestable (fewer than 2 prompts): chain at T = 1" in line and "failing" not in line
    both = calibration_table(_calibration_rows({"chain": [0.61], "broken": [d / 10 + 0.3 for d in noise]}))
    line = next(x for x in report_section_of({"tev_calibration": both}, tmp_path / "both")
                if x.startswith("- exit-law calibration"))
    assert "**FAIL**" in line and "failing: broken at T = 1" in line


def _target_rows(model, suite, per_prompt):
    """Tau-target cell rows: for each prompt, AR, DDTree and ExitTrain + TEV with the given taus."""
    rows = []
    for i, (t_dd, t_ex) in enumerate(per_prompt):
        for arm, t in (("ar", 1.0), ("ddtree", t_dd), ("exittrain+tev", t_ex)):
            rows.append({"model": model, "suite": suite, "arm": arm, "temperature": 0.0, "budget": 0 if arm == "ar" else 64,
                         "tables": ["target"], "prompt_id": f"p{i}", "n_new_tokens": 12, "rounds": 4,
                         "taus": [t] * 4, "seconds": 1.0, "ar_match": True, "cell": "target",
                         **({"coverages": [t - 1] * 4, "committed": [t] * 4} if arm != "ar" else {})})
    return rows


def test_the_tau_target_cell_reads_more_prompts_with_intervals(tmp_path):
    """With the tau-target cell the line reads it (prompts, tokens, per-prompt interval) instead of the
    full cells; the rule is still the micro tau on two workloads."""
    full = _arm_rows("smollm2", {"gsm8k": 1.5, "math500": 1.5})  # the full cells' few prompts: FAIL alone
    target = (_target_rows("smollm2", "gsm8k", [(1.6, 2.4), (1.7, 2.6), (1.5, 2.5)])
              + _target_rows("smollm2", "math500", [(1.5, 1.8), (1.8, 2.6), (1.6, 2.2)])
              + _target_rows("smollm2", "humaneval", [(1.2, 1.4), (1.3, 1.5), (1.1, 1.3)]))
    tables = tev_tables(full, [], [], target)
    t = tables["tev_target"].set_index(["suite", "arm"])
    assert t.at[("gsm8k", "exittrain+tev"), "n_prompts"] == 3 and t.at[("gsm8k", "exittrain+tev"), "tokens"] == 36
    assert t.at[("gsm8k", "exittrain+tev"), "tau"] == pytest.approx(2.5)
    assert t.at[("gsm8k", "exittrain+tev"), "ci_low"] < 2.5 < t.at[("gsm8k", "exittrain+tev"), "ci_high"]
    assert t.at[("gsm8k", "exittrain+tev"), "diff_vs_ddtree"] == pytest.approx(0.9)
    assert math.isnan(t.at[("gsm8k", "ddtree"), "diff_vs_ddtree"])
    for name, df in tables.items():
        df.to_csv(tmp_path / f"{name}.csv", index=False)
    text = "\n".join(report_section(tmp_path, tmp_path, tmp_path))
    line = next(x for x in text.splitlines() if x.startswith("- tau target on smollm2"))
    # every prompt 4 rounds: the micro tau's interval is the per-prompt mean's
    assert "**PASS**" in line and "gsm8k 2.50 [2.25, 2.75] (3 prompts, 36 tokens; per-prompt mean 2.50 [2.25, 2.75])" in line
    assert "lies at or above 2 on 1 of 3 workloads, the per-prompt mean's on 1" in line  # gsm8k clears 2.0; math500 not
    assert "**PASS** by the micro tau, **not resolved**: 1 workload(s) clear 2 at 95%, 2 needed" in line
    # a curve already above the target says that steps are not what is missing
    curve = curve_table([_summary(curve=((0, 1.0), (100, 2.2), (200, 2.4)))])
    from impl.tev.report import _tau_target_lines
    line = _tau_target_lines(tables["tev_arms"], curve, tables["tev_target"])[0]
    assert "is already 2.40 after 200 steps (first >= 2 at 100 steps): steps are not what the workloads lack" in line
    assert "DDTree tau at T = 0 averages 1.48 on these workloads" in line  # the target cell's DDTree: (1.6 + 1.63 + 1.2) / 3
    assert "- tau-target cell equals AR token for token: **PASS** (9 arm-cells)" in text
    # without the target cell the line reads the full cells, as before
    assert "**FAIL**" in next(x for x in report_section_of(tev_tables(full, [], []), tmp_path / "full")
                              if x.startswith("- tau target on smollm2"))


def report_section_of(tables, d):
    d.mkdir()
    for name, df in tables.items():
        df.to_csv(d / f"{name}.csv", index=False)
    return report_section(d, d, d)


def test_the_tau_line_covers_every_model_when_the_first_falls_short():
    """Two models, the first FAILs with a learning curve: the second gets its line too (a variable of the
    first model's curve clause once shadowed the table the loop reads)."""
    from impl.tev.report import _tau_target_lines

    arms = pd.DataFrame([{"model": m, "suite": s, "arm": a, "temperature": 0.0, "budget": 64, "tau": t, "tokens": 64}
                         for m, tau in (("tiny-ls", 1.2), ("smollm2", 1.5)) for s in ("gsm8k", "math500")
                         for a, t in (("exittrain+tev", tau), ("ddtree", tau - 0.1))])
    curve = pd.concat([curve_table([_summary("models/tiny-ls")]), curve_table([_summary()])])
    lines = _tau_target_lines(arms, curve)
    assert len(lines) == 2 and "**FAIL**" in lines[0] and "**FAIL**" in lines[1]
    assert "DDTree tau at T = 0 averages 1.10" in lines[0] and "DDTree tau at T = 0 averages 1.40" in lines[1]


def test_a_run_of_the_tau_target_cell_alone_tabulates(tmp_path):
    """No full-cell or latency rows (an overlay that runs only the tau-target cell): every table made
    from them is empty with its columns, the target table and its tau line are made, and the command
    takes no --cells."""
    from impl.cli import main
    from impl.provenance import write_jsonl
    from impl.tev.report import ARMS_COLUMNS

    target = (_target_rows("smollm2", "gsm8k", [(1.6, 2.4), (1.7, 2.6), (1.5, 2.5)])
              + _target_rows("smollm2", "math500", [(1.5, 1.8), (1.8, 2.6), (1.6, 2.2)]))
    tables = tev_tables([], [], [_summary()], target)
    for name in ("tev_arms", "tev_main", "tev_objective", "tev_crossed", "tev_budget"):
        assert len(tables[name]) == 0 and list(tables[name].columns) == list(ARMS_COLUMNS), name
    assert len(tables["tev_claims"]) == 0 and len(tables["tev_calibration"]) == 0
    assert len(tables["tev_target"]) == 6 and len(tables["tev_curve"]) == 5
    write_jsonl(tmp_path / "target.jsonl", target)
    (tmp_path / "train.json").write_text(__import__("json").dumps(_summary()))
    out = tmp_path / "tables"
    main(["tev-tables", "--train", str(tmp_path / "train.json"), "--target-cells", str(tmp_path / "target.jsonl"),
          "--out-dir", str(out)])
    text = "\n".join(report_section(out, out, out))
    assert "- tau target on smollm2" in text and "- tau-target cell equals AR token for token: **PASS** (6 arm-cells)" in text
    assert "every arm equals AR" not in text and "### Main table" not in text  # no full cells, no claim about them
    assert "### Tau-target cell" in text and "### Base drafter learning curve" in text


def test_tau_counts_committed_tokens_and_calibration_the_uncut_walk():
    """An answer that ends (EOS) inside a round's accepted walk: tau counts the tokens committed (the
    rows' ``committed``), not the walk past the end (``taus``), which the exit law predicts and the
    calibration check keeps reading. AR rows, with no ``committed``, count their taus."""
    from impl.tev.report import _frame, arms_table, calibration_table

    def row(arm, T, pid, taus, committed, cov=None):
        return {"model": "smollm2", "suite": "gsm8k", "arm": arm, "temperature": T, "budget": 64, "tables": ["main"],
                "prompt_id": pid, "n_new_tokens": sum(committed), "rounds": len(taus), "taus": taus,
                "committed": committed, "seconds": 1.0, "ar_match": True,
                **({"coverages": cov} if cov is not None else {})}

    rows = [row("exittrain+tev", 0.0, "p0", [3], [1]),  # EOS first: 1 token committed, a walk of 3
            row("exittrain+tev", 0.0, "p1", [4, 5], [4, 2]),  # EOS 2 tokens into the second walk
            {**row("ar", 0.0, "p0", [1], [1]), "committed": None, "budget": 0},
            {**row("ar", 0.0, "p1", [1] * 6, [1] * 6), "committed": None, "budget": 0}]
    t = arms_table(_frame(rows)).set_index("arm")
    assert t.at["exittrain+tev", "tau"] == pytest.approx(7 / 3) and t.at["exittrain+tev", "tokens"] == 7
    assert t.at["ar", "tau"] == 1.0 and t.at["ar", "tokens"] == 7
    # calibration at T > 0: the walk (3 + 5 per prompt) against 1 + C_p, not the cut tokens
    sampled = [row("exittrain+tev", 1.0, f"p{i}", [3, 5], [3, 1], cov=[2.0, 4.0]) for i in range(4)]
    cal = calibration_table(_frame(sampled))
    assert cal["tau"].iloc[0] == pytest.approx(4.0) and cal["diff"].iloc[0] == pytest.approx(0.0)
    assert bool(cal["calibrated"].iloc[0])


def test_the_micro_tau_interval_weighs_prompts_by_rounds():
    """Answers that end at once (one round, tau 1 whatever the drafter) weigh one round each in the
    micro tau and its interval, but a whole prompt each in the per-prompt mean: with half the prompts
    such, the per-prompt interval reaches below 2 while the micro tau's clears it."""
    def rows(pid, rounds, tau):
        return [{"model": "smollm2", "suite": "math500", "arm": arm, "temperature": 0.0, "budget": 0 if arm == "ar" else 64,
                 "tables": ["target"], "prompt_id": pid, "n_new_tokens": rounds * tau, "rounds": rounds if arm != "ar" else rounds * tau,
                 "taus": [tau if arm != "ar" else 1] * (rounds if arm != "ar" else rounds * tau), "seconds": 1.0, "ar_match": True}
                for arm in ("ar", "ddtree", "exittrain+tev")]

    target = [r for i in range(4) for r in rows(f"one{i}", 1, 1)]
    target += [r for i, t in enumerate((3, 3, 4, 3)) for r in rows(f"long{i}", 16, t)]
    t = tev_tables([], [], [], target)["tev_target"].set_index("arm").loc["exittrain+tev"]
    assert t["tau"] == pytest.approx((4 + 16 * 13) / (4 + 64))
    assert t["tau_ci_low"] > 2.0 > t["ci_low"] and t["tau_prompt_mean"] == pytest.approx((4 + 13) / 8)


def test_ratio_estimate_matches_the_linearised_variance():
    from impl.stats import ratio_estimate

    num, den = np.array([3.0, 40.0, 20.0, 1.0]), np.array([1.0, 16.0, 10.0, 1.0])
    r = ratio_estimate(num, den)
    R = num.sum() / den.sum()
    se = math.sqrt(((num - R * den) ** 2).sum() / (4 * 3)) / den.mean()
    from scipy import stats

    assert r.ratio == pytest.approx(R) and r.se == pytest.approx(se)
    assert r.ci_high - r.ratio == pytest.approx(stats.t.ppf(0.975, 3) * se)
    assert math.isnan(ratio_estimate([2.0], [1.0]).ci_low)
    assert ratio_estimate([2.0, 4.0], [1.0, 2.0]).ci_low == pytest.approx(2.0)  # proportional: zero width
    for bad in (([], []), ([1.0], [1.0, 2.0]), ([1.0], [0.0]), ([float("nan")], [1.0])):
        with pytest.raises(ValueError):
            ratio_estimate(*bad)


def _target_file_rows() -> list[dict]:
    return _target_rows("smollm2", "gsm8k", [(1.6, 2.4), (1.7, 2.6), (1.5, 2.5)])


@pytest.mark.parametrize("case, needle", [
    ("empty", "no rows"),
    ("twice", "already in"),
    ("array", "row 1: not a JSON object"),
    ("no_arm", "missing column(s) 'arm'"),
    ("no_committed", "missing column(s) 'committed'"),
    ("full_as_target", "a row of the full cells given as --target-cells"),
])
def test_tev_tables_rejects_bad_rows_naming_file_and_row(tmp_path, capsys, case, needle):
    """Bad rows fail with one line naming the file (and row) before any table is written; a file given
    twice is refused (its prompts would count twice and narrow the tau target's interval)."""
    import json

    from impl.cli import main
    from impl.provenance import write_jsonl

    rows = _target_file_rows()
    f = tmp_path / "target.jsonl"
    files = [str(f)]
    if case == "empty":
        f.write_text("")
    elif case == "array":
        f.write_text("[1, 2]\n" + "\n".join(json.dumps(r) for r in rows) + "\n")
    else:
        if case == "no_arm":
            rows[0].pop("arm")
        elif case == "no_committed":
            rows = [r for r in rows if r["arm"] != "ar"]
            rows[0].pop("committed")
        elif case == "full_as_target":
            rows = [{k: v for k, v in r.items() if k != "cell"} for r in rows]
        elif case == "twice":
            files = [str(f), str(f)]
        write_jsonl(f, rows)
    out = tmp_path / "tables"
    with pytest.raises(SystemExit) as e:
        main(["tev-tables", "--target-cells", *files, "--out-dir", str(out)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert needle in err and str(f) in err and "Traceback" not in err, err
    assert not out.exists()  # nothing written


def test_tev_tables_bad_train_and_out_dir_name_the_flag(tmp_path, capsys):
    """A --train file that is missing, not JSON, or not a summary, two summaries of one model, and an
    --out-dir that is a file each fail with one line naming the flag or file; target rows given as
    --cells are refused."""
    import json

    from impl.cli import main
    from impl.provenance import write_jsonl

    write_jsonl(tmp_path / "target.jsonl", _target_file_rows())
    (tmp_path / "bad.json").write_text("{oops")
    (tmp_path / "list.json").write_text("[]")
    (tmp_path / "s.json").write_text(json.dumps(_summary()))
    (tmp_path / "file").write_text("x")
    cases = [(["--train", str(tmp_path / "missing.json")], "--train"),
             (["--train", str(tmp_path / "bad.json")], "not a JSON document"),
             (["--train", str(tmp_path / "list.json")], "not a tev-train summary"),
             (["--train", str(tmp_path / "s.json"), str(tmp_path / "s.json")], "a second training summary"),
             (["--cells", str(tmp_path / "target.jsonl")], "given as --cells")]
    for args, needle in cases:
        with pytest.raises(SystemExit):
            main(["tev-tables", *args, "--out-dir", str(tmp_path / "out")])
        err = capsys.readouterr().err
        assert needle in err and "Traceback" not in err, (args, err)
        assert not (tmp_path / "out").exists()
    with pytest.raises(SystemExit):
        main(["tev-tables", "--target-cells", str(tmp_path / "target.jsonl"), "--out-dir", str(tmp_path / "file")])
    assert "--out-dir" in capsys.readouterr().err


def test_the_tau_line_names_the_missing_rollout_sources():
    """The projection's caveat names the workloads whose prompt source the drafter's rollouts lack, and
    says none is lacking for a drafter trained on every workload's source."""
    from impl.tev.report import _missing_sources

    suites = ["mt_bench", "humaneval", "gsm8k", "math500"]
    assert _missing_sources("sharegpt 320 + gsm8k 320", suites) == "rollouts like humaneval, math500 are the missing data"
    assert "not a missing source" in _missing_sources("sharegpt 192 + gsm8k 128 + math500 192 + humaneval 128", suites)
    assert "mt_bench" in _missing_sources("gsm8k 10", ["mt_bench", "gsm8k"])


def _fingerprinted(rows, fps, target_fp="t0"):
    """Rows as tev-cell writes them: the drafter key of each tree arm and the fingerprints of what ran."""
    out = []
    for r in rows:
        key = {"ddtree": "base", "exittrain+tev": "exit"}.get(r["arm"])
        out.append({**r, "drafter": key, "target_fingerprint": target_fp,
                    **({"drafter_fingerprint": fps[key]} if key else {})})
    return out


@pytest.mark.parametrize("case, needle", [
    ("ok", None),
    ("retrained", "drafter 'exit' of model 'smollm2' has fingerprint e2, but"),
    ("reconverted", "the target model of model 'smollm2' has fingerprint t1, but"),
    ("old_row", "no drafter_fingerprint, while other rows name their drafter's"),
])
def test_cells_of_two_sessions_must_name_one_training(tmp_path, capsys, case, needle):
    """The cells of one run may come from two sessions (a CPU session cannot hold TEV on smollm2 whole): the
    tables are made only when every row ran the drafters (and target) that the training summary saved, bit
    for bit, and the report says so; a retrain that differs, a reconverted target or an older row fails with
    one line naming the file and row, and nothing is written."""
    import json

    from impl.cli import main
    from impl.provenance import write_jsonl
    from impl.tev.report import check_one_training

    fps = {"base": "b1", "exit": "e1"}
    gsm = _fingerprinted(_target_rows("smollm2", "gsm8k", [(1.6, 2.4), (1.7, 2.6)]), fps)
    math = _fingerprinted(_target_rows("smollm2", "math500", [(1.5, 1.8), (1.8, 2.6)]), fps)  # the second session
    if case == "retrained":
        math = _fingerprinted(_target_rows("smollm2", "math500", [(1.5, 1.8), (1.8, 2.6)]), {"base": "b1", "exit": "e2"})
    elif case == "reconverted":
        math[0]["target_fingerprint"] = "t1"
    elif case == "old_row":
        math[1].pop("drafter_fingerprint")
    summary = {**_summary(), "fingerprints": {"base": "b1", "exit": "e1"}, "target_fingerprint": "t0"}
    write_jsonl(tmp_path / "gsm8k.jsonl", gsm)
    write_jsonl(tmp_path / "math500.jsonl", math)
    (tmp_path / "train.json").write_text(json.dumps(summary))
    out = tmp_path / "tables"
    args = ["tev-tables", "--train", str(tmp_path / "train.json"), "--target-cells", str(tmp_path / "gsm8k.jsonl"),
            str(tmp_path / "math500.jsonl"), "--out-dir", str(out)]
    if needle is not None:
        with pytest.raises(SystemExit) as e:
            main(args)
        err = capsys.readouterr().err
        assert e.value.code == 2 and needle in err and "math500.jsonl: row" in err and "Traceback" not in err, err
        assert not out.exists()
        return
    main(args)
    t = pd.read_csv(out / "tev_drafters.csv").set_index("drafter")
    assert sorted(t.index) == ["base", "exit"] and t.at["exit", "fingerprint"] == "e1"
    assert t.at["exit", "target_rows"] == 4 and t.at["base", "cell_rows"] == 0 and t.at["exit", "target_fingerprint"] == "t0"
    assert t.at["base", "trained_in"] == str(tmp_path / "train.json")
    text = "\n".join(report_section(out, out, out))
    assert "- one training per drafter" in text and "(2 drafters), each the one its training summary saved: **PASS**" in text
    # without the summary the rows still agree among themselves, but nothing says they are the saved ones
    unchecked = check_one_training([("target", "g", gsm), ("target", "m", math)], [])
    assert list(unchecked["trained_in"]) == ["", ""]
    # rows from before fingerprints were recorded: no table, no line (recorded runs regenerate unchanged)
    assert len(check_one_training([("target", "g", _target_file_rows())], [("s", _summary())])) == 0
