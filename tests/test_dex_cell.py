"""DEX benchmark cell: arms, AR verdicts, rounds identity in the rows, and the DEX tables."""

import json

import numpy as np
import pandas as pd
import pytest

from impl.dex.schema import DexSection
from impl.dex.cell import Arm, adapter_depths, dex_arms, exploration_sets, predicted_match_index, run_cell, set_name
from impl.report.dex import dex_tables


def _cfg(**kw) -> DexSection:
    """A typed dex section with the defaults, as a validated config gives it."""
    return DexSection.model_validate({"models": ["m"], "workloads": ["gsm8k"], **kw})


def test_arms_and_sets():
    d = _cfg(explorers=[2, 4], exploration_sets=[[2, 5, 12]])
    sets = exploration_sets(d, 12)
    assert sets == [(6, 12), (3, 6, 9, 12), (2, 5, 12)]
    assert set_name((3, 6, 9, 12), 12) == "dex-1/4" and set_name((2, 5, 12), 12) == "dex[2,5,12]"
    names = [a.name for a in dex_arms(d, 12)]
    assert names[0] == "ar" and "ar@T1" in names
    assert "dex-1/4-single" in names and "dex-1/2-single" not in names  # K = 2 single exit == full
    assert {"dex-1/4-decs", "dex-1/4@T1", "dex-1/4-decs@T1"} <= set(names)
    assert adapter_depths(d, 12) == [2, 3, 5, 6, 9]
    every = exploration_sets(_cfg(explorers=[]), 12)  # [] = every K dividing L
    assert [len(X) for X in every] == [2, 3, 4, 6, 12] and all(X[-1] == 12 for X in every)
    with pytest.raises(ValueError):
        exploration_sets(_cfg(explorers=[5]), 12)


def test_predicted_match_index():
    rows = [{"token_id": 7, "candidates": [1, 7, 2, 7]}, {"token_id": 3, "candidates": [3, 3, 3, 3]},
            {"token_id": 9, "candidates": [9, 1, 1, 9]}]
    assert predicted_match_index(rows, (2, 4)) == [0, 0, 1]
    assert predicted_match_index(rows, (1, 2, 3, 4)) == [1, 0, 0]


def test_run_cell_checks_itself(tiny_model):
    d = _cfg(explorers=[3, 4], decs={"explorers": [4], "temperatures": [0.0, 1.0]})
    arms = dex_arms(d, 12)
    prompts = [{"id": "p0", "suite": "gsm8k", "input_ids": [5, 17, 42, 8]},
               {"id": "p1", "suite": "gsm8k", "input_ids": [1, 2, 3]},
               {"id": "bad", "suite": "gsm8k", "input_ids": [500]}]
    rows = run_cell(tiny_model, prompts, arms, max_new_tokens=12, eos=None, seed=3)
    ok = [r for r in rows if "error" not in r]
    assert {r["prompt_id"] for r in rows if "error" in r} == {"bad"}
    assert all(r["ar_match"] for r in ok)
    ident = [r for r in ok if "rounds_identity" in r]
    assert len(ident) == 2 * 2 and all(r["rounds_identity"] for r in ident)
    for r in ok:
        if r["method"] == "ar":
            assert r["critical_layers_total"] == 12 * r["n_new_tokens"]
    # the EAD oracle bounds every DEX arm on the layer accounting (first match over X >= EAD)
    for pid in ("p0", "p1"):
        oracle = next(r for r in ok if r["prompt_id"] == pid and r["arm"] == "ead_oracle")
        for r in ok:
            if r["prompt_id"] == pid and r["method"] == "dex" and r["temperature"] == 0:
                assert r["critical_layers_total"] >= oracle["critical_layers_total"]
    for r in rows:
        r.update(kind="decode", variant="m", num_layers=12)
    t = dex_tables(rows, [])
    arms_t = t["dex_arms"]
    assert arms_t["ar_match_all"].all()
    assert set(t["dex_claims"]["claim"]) == {"full exploration above single exit", "DECS above vanilla"}
    assert set(t["dex_overhead"]["K"]) == {3, 4}
    assert not t["dex_walltime_model"].empty


def test_missing_ar_arm_is_an_error(tiny_model):
    with pytest.raises(ValueError, match="no AR arm"):
        run_cell(tiny_model, [], [Arm("x", "dex", {"exploration_set": [6, 12]}, 1.0)], max_new_tokens=2,
                 eos=None, seed=0)


def test_tuned_baselines_add_the_transformers_reference_arm(tiny_model):
    from impl.dex.cell import tune_baselines

    base = {"tune_prompts": 1, "self_spec": {"exit_layers": [2, 4], "num_speculations": [2]},
            "adadecode": {"num_speculations": [2], "thresholds": [0.5]}, "dynamic_exit": False, "hf_early_exit": True}
    d = _cfg(baselines=base)
    arms, tuning = tune_baselines(tiny_model, [{"id": "t", "input_ids": [5, 17, 42]}], d, 12, 8, None)
    by = {a.name: a for a in arms}
    assert set(by) == {"self_spec", "hf_early_exit", "adadecode"} and by["hf_early_exit"].params == by["self_spec"].params
    assert {r["method"] for r in tuning} == {"self_spec", "adadecode"}  # dynamic_exit: false -> no DEL grid
    rows = run_cell(tiny_model, [{"id": "p", "suite": "gsm8k", "input_ids": [1, 2, 3]}],
                    [Arm("ar", "ar", {}, 0.0, "ar")] + arms, max_new_tokens=10, eos=None, seed=0)
    hf = next(r for r in rows if r["arm"] == "hf_early_exit")
    assert hf["ar_match"] and hf["verify_passes"] >= 1
    d = _cfg(baselines={**base, "hf_early_exit": False})
    assert [a.name for a in tune_baselines(tiny_model, [{"id": "t", "input_ids": [5]}], d, 12, 4, None)[0]] == [
        "self_spec", "adadecode"]


def test_adapter_ead_table_pairs_base_and_adapted():
    from impl.report.dex import adapter_ead_table

    rows = []
    for pid, (b, a) in enumerate([([20, 22], [10, 12]), ([25, 27], [15, 15]), ([24, 24], [11, 13])]):
        for variant, se in (("m", b), ("m+ad", a)):
            rows.append({"arm": "stable_ead_oracle", "variant": variant, "suite": "gsm8k", "prompt_id": str(pid),
                         "stable_ead": se, "num_layers": 30})
    t = adapter_ead_table(rows + [{"arm": "ar", "variant": "m", "suite": "gsm8k", "prompt_id": "0"}])
    assert len(t) == 1
    r = t.iloc[0]
    assert r["base_mean_stable_ead"] == pytest.approx((21 + 26 + 24) / 3)
    assert r["adapted_mean_stable_ead"] == pytest.approx((11 + 15 + 12) / 3)
    assert r["diff"] < 0 and r["resolved"] and r["earlier"] and r["L"] == 30
    assert adapter_ead_table(rows[::2]).empty  # no adapted variant: no row


def test_adapted_variant_is_compared_with_the_base_models_best_baseline():
    from impl.report.dex import claims_table, _frame, arms_table

    rows = []
    for pid, (ss, dex_plain, dex_ad) in enumerate([(20, 16, 14), (22, 17, 15), (21, 18, 13)]):
        def row(variant, arm, method, crit, params=None):
            return {"kind": "decode", "variant": variant, "suite": "gsm8k", "arm": arm, "method": method,
                    "figure": "ar" if method == "ar" else "fig3", "temperature": 0.0, "prompt_id": str(pid),
                    "num_layers": 12, "n_new_tokens": 2, "critical_layers_total": crit, "params": params or {},
                    "ar_match": True}
        rows += [row("m", "ar", "ar", 24), row("m", "self_spec", "self_spec", ss),
                 row("m", "dex-1/2", "dex", dex_plain, {"exploration_set": [6, 12]}),
                 row("m+ad", "ar", "ar", 24), row("m+ad", "dex-1/2", "dex", dex_ad, {"exploration_set": [6, 12]})]
    df = _frame(rows)
    claims = claims_table(df, arms_table(df))
    ad = claims[(claims.variant == "m+ad") & (claims.claim == "DEX above best selection baseline")]
    assert len(ad) == 1 and ad.iloc[0]["arm_a"] == "m:self_spec" and ad.iloc[0]["n"] == 3
    assert ad.iloc[0]["mean_b"] == pytest.approx(np.mean([24 / 14, 24 / 15, 24 / 13]))
    assert ad.iloc[0]["mean_a"] == pytest.approx(np.mean([24 / 20, 24 / 22, 24 / 21]))


def test_projected_speedup_counts_the_prefill():
    from impl.report.dex import _frame, arms_table

    base = {"kind": "decode", "variant": "m", "suite": "gsm8k", "temperature": 0.0, "prompt_id": "0",
            "num_layers": 12, "n_new_tokens": 4, "ar_match": True}
    rows = [{**base, "arm": "ar", "method": "ar", "figure": "ar", "critical_layers_total": 48, "params": {},
             "seconds": 3.0},
            {**base, "arm": "dex-1/2", "method": "dex", "figure": "fig3", "critical_layers_total": 36,
             "params": {"exploration_set": [6, 12]}, "seconds": 4.0, "critical_path_seconds": 1.0,
             "prefill_seconds": 0.5}]
    t = arms_table(_frame(rows)).set_index("arm")
    assert t.loc["dex-1/2", "projected_speedup"] == pytest.approx(3.0 / 1.5)
    assert t.loc["dex-1/2", "wall_speedup"] == pytest.approx(3.0 / 4.0)


def test_speculative_arms_run_in_the_cell_and_fill_the_fig5_table(tiny_model, tmp_path):
    """dex.speculative adds Fig. 5's arms (prompt lookup, Lookahead, assisted decoding with a draft
    directory) to a cell: each equals AR, and the Fig. 5 table holds AR, the best DEX arm and each of
    them with tokens/s and a per-prompt speedup interval."""
    from impl.dex.cell import speculative_arms
    from impl.report.figures import dex_fig5

    draft = tmp_path / "draft"
    tiny_model.save_pretrained(draft)  # the model itself as its draft: every draft is accepted
    d = _cfg(explorers=[4], single_exit=False, decs={"explorers": [], "temperatures": [0.0]},
             speculative={"prompt_lookup": {"num_tokens": 3}, "lookahead": {"window": 3, "ngram": 3},
                          "assisted": {"num_assistant_tokens": 2}, "pearl": {"gamma": 2}})
    spec = speculative_arms(d, str(draft))
    assert [(a.name, a.method, a.figure) for a in spec] == [
        ("prompt_lookup", "hf_prompt_lookup", "fig5"), ("lookahead", "lookahead", "fig5"),
        ("assisted", "hf_assisted", "fig5"), ("pearl", "pearl", "fig5")]
    with pytest.raises(ValueError, match="draft"):
        speculative_arms(d, None)
    assert speculative_arms(_cfg()) == []  # off by default
    prompts = [{"id": f"p{i}", "suite": "gsm8k", "input_ids": ids} for i, ids in
               enumerate([[5, 17, 42, 8], [1, 2, 3], [9, 9, 4, 4, 9, 9]])]
    rows = run_cell(tiny_model, prompts, dex_arms(d, 12) + spec, max_new_tokens=10, eos=None, seed=0)
    assert all(r["ar_match"] for r in rows if r["figure"] == "fig5") and sum(r["figure"] == "fig5" for r in rows) == 12
    for r in rows:
        r.update(kind="decode", variant="m", num_layers=12)
    f5 = dex_tables(rows, [])["dex_fig5"]
    assert list(f5["arm"]) == ["ar", "dex-1/4", "prompt_lookup", "lookahead", "assisted", "pearl"]
    # PEARL's two-device time and DEX's K-device time give a projected speedup; the one-device arms none
    proj = f5.set_index("arm")["projected_speedup"]
    assert proj["pearl"] > 0 and proj["dex-1/4"] > 0 and proj[["prompt_lookup", "lookahead", "assisted"]].isna().all()
    assert f5["ar_match_all"].all() and (f5["tokens_per_s"] > 0).all() and f5["n_prompts"].eq(3).all()
    ar = f5[f5.arm == "ar"].iloc[0]
    assert ar["wall_speedup"] == 1.0 and ar["speedup_mean"] == pytest.approx(1.0)
    assert (f5["ci_low"] <= f5["speedup_mean"]).all() and (f5["speedup_mean"] <= f5["ci_high"]).all()
    dex_fig5(f5, tmp_path / "f5.png")
    assert (tmp_path / "f5.png").stat().st_size > 1000
    # the report section: the PASS line, the table, one line per cell and the figure
    from impl.report.dex import report_section
    from impl.report.tables import write_table

    td, fd = tmp_path / "tables", tmp_path / "figures"
    for name, df in dex_tables(rows, []).items():
        write_table(df, td / name)
    fd.mkdir()
    dex_fig5(f5, fd / "dex_fig5.png")
    text = "\n".join(report_section(td, fd, tmp_path))
    assert "(Fig. 5 shape)\n\n- every arm below equals AR token for token on every prompt: **PASS**" in text
    assert "- m / gsm8k: fastest `" in text and "![Fig. 5 shape](figures/dex_fig5.png)" in text
    # without speculative arms there is no Fig. 5 table, and the figure says so
    plain = [r for r in rows if r["figure"] != "fig5"]
    assert dex_tables(plain, [])["dex_fig5"].empty
    import pandas as pd

    dex_fig5(pd.DataFrame(), tmp_path / "none.png")
    assert (tmp_path / "none.png").stat().st_size > 500


def test_multiprocess_arms_join_the_fig5_table():
    """Rows of the two-rank PEARL and TP runs become dex_fig5 rows of their model's cells (speedup = rank 0's
    AR seconds over the arm's, per prompt) and a detail table; an AR mismatch or a rounds mismatch shows."""
    from impl.report.dex import _fig5_standing, fig5_multiprocess_rows, multiprocess_table

    def row(method, suite, pid, secs, ar, **kw):
        return {"method": method, "suite": suite, "prompt_id": pid, "seconds": secs, "ar_seconds": ar,
                "n_new_tokens": 10, "world_size": 2 if method == "pearl" else 3, "variant": "m",
                "ar_match": True, "model_dir": "models/m", **kw}
    mp = [row("pearl", "gsm8k", "p0", 2.0, 1.0, gamma=4, rounds=5, comm_seconds=0.05, rounds_match=True),
          row("pearl", "gsm8k", "p1", 1.0, 1.0, gamma=4, rounds=5, comm_seconds=0.05, rounds_match=True),
          row("tensor_parallel", "gsm8k", "p0", 0.5, 1.0), row("tensor_parallel", "gsm8k", "p1", 0.5, 1.0),
          {"method": "pearl", "suite": "gsm8k", "prompt_id": "bad", "error": "empty prompt"}]
    f5 = pd.DataFrame(fig5_multiprocess_rows(mp)).set_index("arm")
    assert list(f5.index) == ["pearl-2ranks", "tensor_parallel-3"] and (f5["variant"] == "m").all()
    assert f5.loc["pearl-2ranks", "wall_speedup"] == pytest.approx(2.0 / 3.0)
    assert f5.loc["pearl-2ranks", "speedup_mean"] == pytest.approx(0.75)
    assert f5.loc["tensor_parallel-3", "speedup_mean"] == pytest.approx(2.0) and f5.loc["tensor_parallel-3", "above_ar"]
    assert f5["ar_match_all"].all() and json.loads(f5.loc["pearl-2ranks", "params"]) == {"world_size": 2, "gamma": 4}
    t = multiprocess_table(mp).set_index("arm")
    assert t.loc["pearl-2ranks", "rounds"] == 10 and t.loc["pearl-2ranks", "comm_ms_per_round"] == pytest.approx(10.0)
    assert t.loc["pearl-2ranks", "tokens_per_round"] == pytest.approx(2.0) and t["ar_match_all"].all()
    assert bool(t.loc["pearl-2ranks", "rounds_match_all"]) and t.loc["pearl-2ranks", "rounds"] == 10
    assert pd.isna(t.loc["tensor_parallel-3", "rounds_match_all"])  # TP has no rounds to compare
    assert pd.isna(t.loc["tensor_parallel-3", "rounds"])
    mp[1]["rounds_match"] = False  # a rounds mismatch shows in the detail table, not as an AR mismatch
    t = multiprocess_table(mp).set_index("arm")
    assert t.loc["pearl-2ranks", "ar_match_all"] and not t.loc["pearl-2ranks", "rounds_match_all"]
    mp[0]["ar_match"] = False
    assert not pd.DataFrame(fig5_multiprocess_rows(mp)).set_index("arm").loc["pearl-2ranks", "ar_match_all"]
    mp.append({**mp[0], "ar_seconds": None, "prompt_id": "p9"})  # without AR timing (--no-check): left out of dex_fig5
    assert pd.DataFrame(fig5_multiprocess_rows(mp)).set_index("arm").loc["pearl-2ranks", "n_prompts"] == 2
    lines = "\n".join(_fig5_standing(pd.DataFrame(fig5_multiprocess_rows(mp)), [(2, 2)], 1))
    assert "ranks 2/2" in lines and "`tensor_parallel-3` (1 cells)" in lines


def test_speculative_arms_check_their_sources_in_the_config():
    from impl.config import ConfigError
    from conftest import smoke_config

    with pytest.raises(ConfigError, match="dex.speculative.assisted"):
        smoke_config(dex={"draft": None, "speculative": {"assisted": {"num_assistant_tokens": 2}}})
    with pytest.raises(ConfigError, match="dflash.depth"):
        smoke_config(dex={"speculative": {"dflash": {"depth": 5}}})  # smoke's tev.drafter.block_size is 4
    with pytest.raises(ConfigError, match="needs a model of 'dex.models' in 'tev.models'"):
        smoke_config(dex={"models": ["tiny-std"], "speculative": {"dflash": {"depth": 2}}})  # tev.models: tiny-ls
    with pytest.raises(ConfigError, match="lookahead window"):
        smoke_config(dex={"speculative": {"lookahead": {"window": 300}}})
    with pytest.raises(ConfigError, match=r"tensor_parallel.ranks' = 3 does not divide tiny_arch.num_heads = 4"):
        smoke_config(dex={"speculative": {"tensor_parallel": {"ranks": 3}}})
    with pytest.raises(ConfigError, match="tensor_parallel.ranks"):
        smoke_config(dex={"speculative": {"tensor_parallel": {"ranks": 1}}})



def test_tensor_parallel_ranks_checked_against_a_pretrained_models_config(tmp_path):
    from impl.config import ConfigError
    from conftest import smoke_config

    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 9, "num_key_value_heads": 3,
                                                      "intermediate_size": 1536}))
    over = {"models": {"pre": {"kind": "pretrained", "path": str(tmp_path)}}}
    dex = {"models": ["pre"], "adapters": {"models": []}}
    with pytest.raises(ConfigError, match=r"ranks' = 2 does not divide num_attention_heads = 9 .*num_key_value_heads = 3"):
        smoke_config(**over, dex={**dex, "speculative": {"dflash": None, "tensor_parallel": {"ranks": 2}}})
    cfg = smoke_config(**over, dex={**dex, "speculative": {"dflash": None, "tensor_parallel": {"ranks": 3}}})
    assert cfg["dex"]["speculative"]["tensor_parallel"] == {"ranks": 3}
    # a model TEV does not train gets a drafter trained for DEX (dflash.drafter): base only, depth within its block
    head = {"objective": "base", "depth": 2, "drafter": {"block_size": 2}}
    cfg = smoke_config(dex={"models": ["tiny-std"], "speculative": {"dflash": head}})
    assert cfg["dex"]["speculative"]["dflash"]["drafter"]["block_size"] == 2
    with pytest.raises(ConfigError, match="have only 'base'"):
        smoke_config(dex={"models": ["tiny-std"], "speculative": {"dflash": {**head, "objective": "exit"}}})
    with pytest.raises(ConfigError, match="dflash.drafter.block_size' = 2"):
        smoke_config(dex={"models": ["tiny-std"], "speculative": {"dflash": {**head, "depth": 3}}})
    cfg = smoke_config(dex={"speculative": {"dflash": {"objective": "base", "depth": 2}}})
    assert cfg["dex"]["speculative"]["dflash"] == {"objective": "base", "depth": 2}
