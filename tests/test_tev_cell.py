"""TEV benchmark cell: arms, AR verdicts at T = 0, calibration at T > 0, and the TEV tables."""

import pytest
import torch

from impl.tev.cell import run_tev_cell, tev_arms
from impl.tev.report import tev_tables


def test_arms_cover_the_tables():
    names = [a.name for a in tev_arms(64, (32, 64, 128))]
    assert names[0] == "ar"
    assert {"chain", "ddtree", "exittrain+tev", "token+tev", "prefix+tev", "opd+tev", "draft-opd", "base+tev",
            "exit+predraw", "ddtree@B32", "exittrain+tev@B128"} <= set(names)
    arms = {a.name: a for a in tev_arms(64, (32, 64, 128))}
    # Draft-OPD: DDTree with only the drafter replaced (main table), and one more objective under TEV (Table 2)
    assert (arms["draft-opd"].drafter, arms["draft-opd"].verifier, arms["draft-opd"].tables) == ("opd", "predraw_follow", ("main",))
    assert (arms["opd+tev"].drafter, arms["opd+tev"].verifier, arms["opd+tev"].tables) == ("opd", "tev", ("objective",))
    assert "ddtree@B64" not in names  # the main budget is not repeated
    only_base = [a.name for a in tev_arms(16, (), ("base",))]
    assert only_base == ["ar", "chain", "ddtree", "base+tev"]


@pytest.fixture(scope="module")
def cell_rows(tiny_model):
    from impl.tev.drafter import BlockDrafter, DrafterConfig

    torch.manual_seed(0)
    d = BlockDrafter(tiny_model, DrafterConfig(block_size=4, n_layers=1)).eval()
    drafters = {"base": d, "exit": d}
    prompts = [{"id": "p0", "suite": "gsm8k", "input_ids": [3, 9, 27, 4]},
               {"id": "p1", "suite": "gsm8k", "input_ids": [5, 6]},
               {"id": "bad", "suite": "gsm8k", "input_ids": [1000]}]
    arms = tev_arms(8, (4,), tuple(drafters))
    with torch.no_grad():
        rows = run_tev_cell(tiny_model, drafters, prompts, arms, temperatures=(0.0, 1.0), depth=4,
                            max_new_tokens=10, eos=None, seed=1)
    for r in rows:
        r["model"] = "m"
    return rows


def test_cell_checks_itself(cell_rows):
    ok = [r for r in cell_rows if "error" not in r]
    assert {r["prompt_id"] for r in cell_rows if "error" in r} == {"bad"}
    greedy = [r for r in ok if r["temperature"] == 0]
    assert greedy and all(r["ar_match"] for r in greedy)
    for r in ok:
        assert len(r["token_ids"]) == 10
        if r["arm"] != "ar":
            assert all(1 <= t <= 5 for t in r["taus"])
            if r["temperature"] > 0:
                assert set(r["calibration"]) == {"mean_tau", "mean_expected_tau"}


def test_tables_from_cell_rows(cell_rows):
    t = tev_tables(cell_rows, [], [])
    arms = t["tev_arms"]
    assert arms[arms.temperature == 0]["ar_match_all"].all()
    assert (arms[arms.arm == "ar"]["tau"] == 1.0).all()
    claims = t["tev_claims"]
    assert "ExitTrain+TEV above DDTree" in set(claims["claim"])
    assert set(t["tev_crossed"]["temperature"]) == {1.0}
    assert len(t["tev_calibration"]) > 0


def test_cell_needs_ar_and_drafters(tiny_model):
    from impl.tev.cell import TEVArm

    with pytest.raises(ValueError, match="'ar' arm"):
        run_tev_cell(tiny_model, {}, [], [TEVArm("x", "base", "tev")], depth=2, max_new_tokens=2, eos=None, seed=0)
    with pytest.raises(ValueError, match="need drafters"):
        run_tev_cell(tiny_model, {}, [], [TEVArm("ar"), TEVArm("x", "base", "tev")], depth=2, max_new_tokens=2,
                     eos=None, seed=0)


def test_target_arms_are_the_full_cells_configurations():
    from impl.tev.cell import TARGET_ARMS, target_arms, tev_arms

    got = target_arms(64, ("base", "token", "exit"))
    assert tuple(a.name for a in got) == TARGET_ARMS and all(a.tables == ("target",) for a in got)
    full = {a.name: a for a in tev_arms(64, (32,), ("base", "token", "exit"))}
    for a in got:
        f = full[a.name]
        assert (a.drafter, a.verifier, a.tree_mode, a.budget) == (f.drafter, f.verifier, f.tree_mode, f.budget)
    with pytest.raises(ValueError, match="base and exit drafters"):
        target_arms(64, ("base",))
