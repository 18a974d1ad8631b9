"""vSkipper step benchmark: FLOP accounting, row shapes and shares, the command (no timing assertions)."""

from __future__ import annotations

import json
import sys
import math
import re

import pytest
import torch

from impl.vskipper.bench import (DEFAULT_GRID, arch_of, check_targets, decode_profile, flop_costs, flop_pred_ratio,
                                 step_benchmark, wide_model)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _tiny():
    return wide_model(hidden_size=32, intermediate_size=64, num_layers=4, num_heads=2, vocab_size=64,
                      max_position_embeddings=512, seed=3)


def test_flop_formula_hand_computed():
    # H=4, I=8, L=2, nh=2, kvh=1, hd=2, V=10; T=3 rows, K=5 columns, G=1 logits row
    arch = dict(H=4, I=8, L=2, nh=2, kvh=1, hd=2, V=10)
    c = flop_costs(arch, T=3, K=5, G=1)
    assert c["f_kv"] == 4 * 4 * 1 * 2 == 32
    assert c["f_skip"] == 4 * 4 * 2 * 2 + 4 * 2 * 2 * 5 + 6 * 4 * 8 == 64 + 80 + 192 == 336
    assert c["lm_head"] == 2 * 4 * 10 == 80
    assert c["F_full"] == 3 * 2 * (32 + 336) + 80 == 2288
    assert flop_pred_ratio(arch, T=3, K=5, G=1, n_po=0) == 1.0
    assert flop_pred_ratio(arch, T=3, K=5, G=1, n_po=2) == pytest.approx(1 - 2 * 336 / 2288)


def test_wide_model_deterministic_and_arch():
    a, b = _tiny(), _tiny()
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert arch_of(a) == dict(H=32, I=64, L=4, nh=2, kvh=2, hd=16, V=64)


def test_step_benchmark_rows_and_shares():
    m = _tiny()
    grid = [(0.25, 0.5), (0.5, 0.5), (0.75, 0.75)]
    cells = [dict(phase="prefill", tokens=256, prompt_len=64), dict(phase="decode", requests=64, context=8)]
    prof = dict(prefill_tokens=(64, 128), prefill_prompt_len=64, decode_requests=(4, 8), decode_context=8,
                repeats=1, warmup=0)
    rows = step_benchmark(m, cells, grid=grid, repeats=1, warmup=0, profile_kw=prof, label="t")
    n_arms = 3 + 2 * len(grid)  # upstream, the A/A control, all_run, RandomSkip and hybrid per (r, d)
    assert len(rows) == 2 * n_arms
    assert {r["arm"] for r in rows} >= {"upstream", "all_run", "random_r0.5_d0.5", "hybrid_random_r0.5_d0.5"}
    for r in rows:
        json.dumps(r)  # plain, JSON-able
        assert r["t_step_s"] > 0 and r["measured_ratio"] > 0 and 0 < r["flop_pred_ratio"] <= 1
        assert r["label"] == "t"
        # paired rounds: upstream before the first arm and after every arm
        assert len(r["t_steps_s"]) == (n_arms if r["arm"] == "upstream" else 1)
        assert len(r["paired_ratios"]) == (0 if r["arm"] == "upstream" else 1)
    n_routed = 2  # last half of 4 layers
    for r in rows:
        if r["kind"] == "routed":
            k = math.floor(r["d"] * n_routed + 0.5)
            expect = r["r"] * k / n_routed
            assert r["skip_share"] == pytest.approx(expect, abs=0.12), r
            assert r["routed_rows_share"] == 1.0
            assert r["flop_pred_ratio"] < 1
        if r["arm"] == "all_run":
            assert r["skip_share"] == 0 and r["flop_pred_ratio"] == 1
            assert 0 <= r["route_bookkeeping_s"] and 0 <= r["route_bookkeeping_share"] < 0.5, r
        if r["arm"] == "upstream":
            assert r["measured_ratio"] == 1 and r["n_po"] == 0
        if r["arm"] == "upstream_aa":
            assert r["kind"] == "control" and r["n_po"] == 0 and r["flop_pred_ratio"] == 1
        if r["kind"] == "hybrid":
            assert isinstance(r["hybrid_routed"], bool)
            if not r["hybrid_routed"]:
                assert r["n_po"] == 0 and r["flop_pred_ratio"] == 1
    # the layers are restored
    assert not any(type(x).__name__ == "RoutedDecoderLayer" for x in m.model.layers)
    t = check_targets(rows)
    assert t["all_run"] in ("PASS", "FAIL") and t["prefill_flop"] == "NA"  # no >= 2k-token prefill cell here
    assert t["hybrid_dense"] in ("PASS", "FAIL", "NA")


def test_paired_rounds_cancel_drift(monkeypatch):
    """Every arm costs the same, but the machine slows by 1% per step: the paired ratio (each arm over the
    mean of the upstream steps around it) stays 1, where medians of raw times would drift with position."""
    import types

    import impl.vskipper.bench as bench

    clock = {"t": 0.0, "n": 0}

    def fake_step(model, cell, ctx, planner=None):
        clock["n"] += 1
        clock["t"] += 1.0 + 0.01 * clock["n"]

    monkeypatch.setattr(bench, "_run_step", fake_step)
    monkeypatch.setattr(bench, "time", types.SimpleNamespace(perf_counter=lambda: clock["t"]))
    m = _tiny()
    rows = step_benchmark(m, [dict(phase="decode", requests=4, context=8)], grid=[(0.5, 0.5), (0.25, 0.5)],
                          hybrid=False, repeats=4, warmup=1, label="t")
    assert [r["arm"] for r in rows] == ["upstream", "upstream_aa", "all_run", "random_r0.5_d0.5", "random_r0.25_d0.5"]
    for r in rows[1:]:
        assert len(r["paired_ratios"]) == 4
        assert r["measured_ratio"] == pytest.approx(1.0, abs=1e-9)
        lo, hi = r["ratio_ci95"]
        assert lo == pytest.approx(1.0, abs=1e-9) and hi == pytest.approx(1.0, abs=1e-9)
    # the raw medians do drift: late steps are slower than the upstream median
    assert max(abs(r["t_step_s"] / r["t_upstream_s"] - 1) for r in rows[1:]) > 0.0


def test_default_grid():
    assert len(DEFAULT_GRID) == 9 and (0.25, 0.75) in DEFAULT_GRID


def test_decode_profile_categories():
    m = _tiny()
    out = decode_profile(m, requests=4, context=8, arms=((0.0, 0.0), (0.5, 0.5)), steps=1)
    assert [o["arm"] for o in out] == ["upstream", "all_run", "random_r0.5_d0.5"]
    for o in out:
        assert set(o["shares"]) == {"kv_proj", "qo_proj", "mlp", "cache_update", "attention_other", "lm_head", "other"}
        assert o["total_s"] > 0 and all(v >= 0 for v in o["shares"].values())
    assert not hasattr(m.model.layers[0], "_vskipper_context")


def test_prefill_profile_splits_time_by_operator_and_routed_section():
    from impl.vskipper.bench import OP_CATEGORIES, SECTIONS, prefill_profile

    m = _tiny()
    out = prefill_profile(m, tokens=64, prompt_len=16, arms=((0.5, 1.0),), steps=1)
    assert [o["arm"] for o in out] == ["upstream", "cohort_all_run", "random_r0.5_d1"]
    up, cohort, rs = out
    assert up["sections_ms"] == {} and up["measured_ratio"] == 1 and up["n_po"] == 0
    assert set(up["ops_ms"]) <= set(OP_CATEGORIES) | {"elementwise", "other"} and up["ops_ms"]["matmul"] > 0
    assert up["ops_ms"]["attention"] > 0
    # the cohort path labels its sections; nothing skips, so no Project-Only section and prediction 1
    assert {"kv", "gather", "q_proj", "attention", "mlp", "scatter", "route"} <= set(cohort["sections_ms"])
    assert "project" not in cohort["sections_ms"] and cohort["flop_pred_ratio"] == 1
    assert set(rs["sections_ms"]) <= set(SECTIONS) and rs["n_po"] > 0 and rs["flop_pred_ratio"] < 1
    assert 0.3 < rs["skip_share"] < 0.7  # r * k / n_routed with k = n_routed
    assert "project" not in rs["sections_ms"]  # identity projector: Project-Only rows cost no copy
    assert not any(type(x).__name__ == "RoutedDecoderLayer" for x in m.model.layers)
    json.dumps(out)


def test_command_runs_tiny(tmp_path, monkeypatch):
    import argparse

    from impl.vskipper import commands
    from impl.vskipper.bench_report import bench_tables, report_section

    from conftest import smoke_config

    cfg = smoke_config(seed=0, threads=1, device="cpu", dtype="float32")
    monkeypatch.setattr("impl.runtime.config_from_args", lambda args: cfg)
    monkeypatch.setattr("impl.vskipper.commands.log", commands.log)
    p = argparse.ArgumentParser()
    sub = p.add_subparsers()

    def add(name, fn, help_, config=True):  # impl.cli.build_parser's add; the config comes from the patch
        sp = sub.add_parser(name)
        sp.add_argument("--quiet", action="store_true")
        sp.set_defaults(fn=fn)
        return sp

    commands.register(add)
    out, summ = tmp_path / "w.jsonl", tmp_path / "w.json"
    args = p.parse_args(["vskipper-bench", "--quiet", "--wide", "--wide-hidden", "32", "--wide-intermediate", "64",
                         "--wide-layers", "4", "--wide-heads", "2", "--prefill-tokens", "128", "--prompt-len", "64",
                         "--decode-requests", "4", "--decode-context", "8", "--repeats", "1", "--warmup", "0",
                         "--r", "0.5", "--d", "0.5", "--profile-repeats", "1", "--profile-steps", "1",
                         "--profile-requests", "4", "--out", str(out), "--summary", str(summ)])
    args.fn(args)
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert {r["arm"] for r in rows} == {"upstream", "upstream_aa", "all_run", "random_r0.5_d0.5",
                                        "hybrid_random_r0.5_d0.5"}
    s = json.loads(summ.read_text())
    assert s["label"] == "wide" and s["targets"]["all_run"] in ("PASS", "FAIL")
    if sys.platform == "linux":  # glibc: the timing run fixed malloc's thresholds, and the rows say so
        assert s["allocator"].startswith("pinned mmap=") and all(r["allocator"] == s["allocator"] for r in rows)
    assert {"all_run", "prefill_flop", "hybrid_dense"} <= set(s["targets"])
    # the prefill profile: upstream, cohort all-RUN and the RandomSkip arm with the largest prefill gap
    assert [p["arm"] for p in s["prefill_profile"]] == ["upstream", "cohort_all_run", "random_r0.5_d0.5"]
    gap = next(r["abs_gap"] for r in rows if r["arm"] == "random_r0.5_d0.5" and r["phase"] == "prefill")
    assert s["prefill_profile"][2]["bench_gap"] == gap
    dfs = bench_tables([summ], tmp_path / "tables")
    assert len(dfs["vskipper_bench"]) == len(rows) and len(dfs["vskipper_bench_targets"]) == 1
    pp = dfs["vskipper_bench_prefill_profile"]
    assert list(pp.arm) == ["upstream", "cohort_all_run", "random_r0.5_d0.5"] and pp.routing_ms.isna().tolist() == [True, False, False]
    assert (pp.routing_ms.dropna() > 0).all() and (tmp_path / "tables" / "vskipper_bench_prefill_profile.md").is_file()
    lines = report_section(tmp_path / "tables", tmp_path, tmp_path)
    text = "\n".join(lines)
    assert "all-RUN" in text and "wide" in text and "Where decode time goes" in text
    assert "Where routed prefill time goes" in text


def test_bench_models_config_check_names_the_key():
    import copy
    from pathlib import Path

    from impl.config import ConfigError, read_yaml, validate_config

    base = read_yaml(Path(__file__).resolve().parents[1] / "configs" / "default.yaml")

    def check(models):
        cfg = copy.deepcopy(base)
        cfg["vskipper"]["bench"] = {"models": models}
        return validate_config(cfg, check_paths=False)

    with pytest.raises(ConfigError, match=r"'vskipper.bench.models\[0\]' names 'gpt9'"):
        check(["gpt9"])
    own = base["vskipper"]["model"]
    with pytest.raises(ConfigError, match=rf"'vskipper.bench.models\[0\]' = '{re.escape(own)}' is vskipper.model"):
        check([own])
    other = next(m for m in base["models"] if m != own)
    assert check([other])["vskipper"]["bench"]["models"] == [other]


def test_pin_allocator_fixes_glibc_thresholds():
    import subprocess

    from impl.runtime import pin_allocator

    if sys.platform != "linux":
        assert pin_allocator().startswith("default")
        return
    assert pin_allocator(mmap_threshold=1 << 20, trim_threshold=1 << 21) == "pinned mmap=1048576 trim=2097152"
    # the effect, in a fresh process: a 64 MiB block is mmapped by default (mallinfo2's hblkhd), from
    # the heap once pinned
    code = "\n".join([
        "import ctypes, sys", "sys.path.insert(0, '.')", "from impl.runtime import pin_allocator",
        "class Info(ctypes.Structure): _fields_ = [('f%d' % i, ctypes.c_size_t) for i in range(10)]",
        "libc = ctypes.CDLL('libc.so.6')", "libc.malloc.restype = ctypes.c_void_p", "libc.mallinfo2.restype = Info",
        "{pin}", "p = libc.malloc(64 << 20)", "print(libc.mallinfo2().f4)"])
    mmapped = [int(subprocess.run([sys.executable, "-c", code.format(pin=pin)], capture_output=True, text=True,
                                  check=True).stdout) for pin in ("pass", "pin_allocator()")]
    assert mmapped[0] >= 64 << 20 and mmapped[1] < 64 << 20, mmapped


def test_target_verdicts_say_what_the_intervals_resolve():
    def row(arm, kind, meas, ci, phase="decode", pred=1.0, **kw):
        return dict(arm=arm, kind=kind, measured_ratio=meas, ratio_ci95=ci, phase=phase, flop_pred_ratio=pred,
                    abs_gap=abs(meas - pred), T=2048, r=0.5 if kind == "routed" else None, **kw)

    ok = [row("all_run", "all_run", 1.01, [1.00, 1.015]),
          row("random", "routed", 0.90, [0.88, 0.92], phase="prefill", pred=0.89)]
    t = check_targets(ok)
    assert (t["all_run"], t["all_run_ci"], t["prefill_flop"], t["prefill_flop_ci"]) == ("PASS", "within", "PASS", "within")
    # a median inside the band with an interval across its edge: PASS, unresolved
    t = check_targets([row("all_run", "all_run", 1.01, [0.98, 1.04])])
    assert (t["all_run"], t["all_run_ci"]) == ("PASS", "unresolved")
    # an interval wholly past the band on either side of the prediction: FAIL, outside
    t = check_targets([row("all_run", "all_run", 1.05, [1.03, 1.07]),
                       row("random", "routed", 0.70, [0.66, 0.74], phase="prefill", pred=0.89)])
    assert (t["all_run"], t["all_run_ci"], t["prefill_flop"], t["prefill_flop_ci"]) == ("FAIL", "outside", "FAIL", "outside")
    t = check_targets([row("random", "routed", 0.95, [0.945, 0.96], phase="prefill", pred=0.89)])
    assert (t["prefill_flop"], t["prefill_flop_ci"]) == ("FAIL", "outside")
    # a row without an interval never counts as resolved; no hybrid kept dense: NA
    t = check_targets([row("all_run", "all_run", 1.0, None)])
    assert t["all_run_ci"] == "unresolved" and t["hybrid_dense"] == "NA" and t["hybrid_dense_ci"] is None


@pytest.fixture
def one_second_steps(monkeypatch):
    """The bench's clock advanced by exactly 1 s per measured step (no model runs): round counts
    then follow from the budgets alone."""
    import types

    import impl.vskipper.bench as bench

    clock = {"t": 0.0}

    def fake_step(model, cell, ctx, planner=None):
        clock["t"] += 1.0

    monkeypatch.setattr(bench, "_run_step", fake_step)
    monkeypatch.setattr(bench, "time", types.SimpleNamespace(perf_counter=lambda: clock["t"]))


def test_cell_budget_adds_rounds_until_spent(one_second_steps):
    """Each fake step takes 1 s; 4 arms (upstream, A/A control, all_run, one RandomSkip) -> 6 counted
    steps per round: a 15 s budget after 2 rounds gives 3 rounds (12 s < 15 s after 2), capped by
    max_repeats."""
    m = _tiny()
    cell = [dict(phase="decode", requests=4, context=8)]
    for budget, cap, want in ((0.0, 50, 2), (15.0, 50, 3), (100.0, 4, 4)):
        rows = step_benchmark(m, cell, grid=[(0.5, 0.5)], hybrid=False, repeats=2, warmup=1, cell_budget_s=budget,
                              max_repeats=cap, label="t")
        assert {r["repeats"] for r in rows} == {want}, (budget, cap)
        assert all(len(r["paired_ratios"]) == want for r in rows if r["kind"] != "upstream")


def test_target_rounds_add_pairs_for_the_all_run_arm_and_the_control_only(one_second_steps):
    """Each fake step takes 1 s; a focus round is U A U C U (4 counted steps: A, U, C, U): a 10 s target
    budget gives 3 rounds (8 s < 10 s after 2), capped by target_max_repeats; the RandomSkip arm keeps
    the main rounds' pairs."""
    m = _tiny()
    cell = [dict(phase="decode", requests=4, context=8)]
    for budget, cap, want in ((0.0, 40, 0), (10.0, 40, 3), (100.0, 2, 2)):
        rows = {r["arm"]: r for r in step_benchmark(m, cell, grid=[(0.5, 0.5)], hybrid=False, repeats=2, warmup=1,
                                                    target_budget_s=budget, target_max_repeats=cap, label="t")}
        assert {a: r["focus_repeats"] for a, r in rows.items()} == {
            "upstream": 0, "upstream_aa": want, "all_run": want, "random_r0.5_d0.5": 0}, (budget, cap)
        assert len(rows["all_run"]["paired_ratios"]) == len(rows["upstream_aa"]["paired_ratios"]) == 2 + want
        assert len(rows["random_r0.5_d0.5"]["paired_ratios"]) == 2 and rows["all_run"]["repeats"] == 2


def test_route_bookkeeping_measures_what_the_wrappers_add():
    """A policy whose route tape takes 20 ms: the wrappers' bookkeeping per step is at least that, and
    the layers' own time is not counted (the plain all-RUN tape costs far less)."""
    import time as _time

    from impl.vskipper.bench import _wrap, make_cell, route_bookkeeping
    from impl.vskipper.random_skip import RandomSkip
    from impl.vskipper.routed import RowContext

    class SlowTape(RandomSkip):
        def route_tape(self, meta):
            _time.sleep(0.02)
            return super().route_tape(meta)

    m = _tiny()
    orig = list(m.model.layers)
    cell = make_cell(m, "decode", requests=4, context=8)
    ctx = RowContext(record_stats=False)
    fast = route_bookkeeping(m, cell, _wrap(orig, RandomSkip([2, 3], r=0.0, d=0.0), ctx), ctx, steps=3)
    ctx2 = RowContext(record_stats=False)
    slow = route_bookkeeping(m, cell, _wrap(orig, SlowTape([2, 3], r=0.0, d=0.0), ctx2), ctx2, steps=3)
    assert 0 <= fast < 0.01 and slow >= 0.02 and slow - fast < 0.03, (fast, slow)
    assert route_bookkeeping(m, cell, orig, ctx, steps=1) == 0.0  # no routed layer
    assert not any(type(x).__name__ == "RoutedDecoderLayer" for x in m.model.layers)
