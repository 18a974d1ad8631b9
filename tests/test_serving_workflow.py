"""The vSkipper serving workflow (workflows/vskipper.smk, impl/serving/{schema,commands,report}.py):

- the ``vskipper:`` config section: defaults, and one-line errors that name the key;
- the commands on a tiny random Llama (fast): profile-mode (FlexiDepth and RandomSkip), knee, serve-cell
  (upstream vs the served hybrid and an ablation, matched and natural lanes), randomskip-map, and
  train-flexidepth on the local ShareGPT subset;
- the knee at a boundary rung: the knee JSON says so, and cells either run labelled or are skipped;
- tables, figures and the report section from synthetic rows (a rejected lane is a FAIL);
- (slow) the rules on the smoke models through Snakemake.
"""

import copy
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
import yaml

from impl.config import ConfigError, validate_config
from conftest import save_wide_llama

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ROOT = Path(__file__).resolve().parents[1]


def _base_cfg() -> dict:
    return yaml.safe_load((ROOT / "configs" / "smoke.yaml").read_text())


def _with_vsk(section: dict) -> dict:
    cfg = _base_cfg()
    cfg["vskipper"] = section
    return cfg


# ---------------------------------------------------------------------------------------- schema
def test_schema_defaults_fill_in():
    out = validate_config(_with_vsk({}), check_paths=False)
    v = out["vskipper"]
    assert v["model"] == "tiny-std" and v["workloads"] == ["gsm8k"]
    assert v["load_points"] == {"below": 0.75, "knee": 0.95, "overload": 1.25}
    assert v["ablations"] == ["prefill-only", "decode-only", "no-promotion", "always-route"]
    assert v["knee"]["on_boundary"] == "boundary" and len(v["knee"]["rates"]) >= 3
    # a given load_points mapping replaces the default (no merge), nested sections merge
    out = validate_config(_with_vsk({"load_points": {"knee": 0.95}, "knee": {"rates": [1, 2, 3]}}), check_paths=False)
    assert out["vskipper"]["load_points"] == {"knee": 0.95}
    assert out["vskipper"]["knee"]["eps"] == 0.02 and out["vskipper"]["knee"]["rates"] == [1, 2, 3]
    # validating the validated config again (what every command does) is a no-op
    again = validate_config(copy.deepcopy(out), check_paths=False)
    assert again["vskipper"] == out["vskipper"]


def test_default_runs_vskipper_on_smollm2_with_capacity_knee():
    """The embedded default serves the real model, sized for 2 cores: capacity-relative knee grid, 16
    requests per cell, BBH / CoQA prompts capped at 256 tokens, Table 6 pairs smollm2 with tiny-ls."""
    out = validate_config(yaml.safe_load((ROOT / "configs" / "default.yaml").read_text()), check_paths=False)
    v = out["vskipper"]
    assert v["model"] == "smollm2" and v["workloads"] == ["gsm8k", "bbh", "coqa"] and v["requests"] == 16
    assert v["knee"]["scale"] == "capacity" and v["knee"]["probe_requests"] == 4
    assert v["cross_model"]["models"] == ["tiny-ls"] and "tiny-std" not in out["models"]
    assert out["workloads"]["bbh"]["max_prompt_tokens"] == out["workloads"]["coqa"]["max_prompt_tokens"] == 256


@pytest.mark.parametrize("section, key", [
    ({"model": "nope"}, "vskipper.model"),
    ({"workloads": ["coqa"]}, "vskipper.workloads[0]"),
    ({"bogus": 1}, "vskipper.bogus"),
    ({"knee": {"rates": [1, 2]}}, "vskipper.knee.rates"),
    ({"knee": {"on_boundary": "crash"}}, "vskipper.knee.on_boundary"),
    ({"knee": {"scale": "relative"}}, "vskipper.knee.scale"),
    ({"knee": {"scale": "capacity", "probe_requests": 0}}, "vskipper.knee.probe_requests"),
    ({"repetitions": 0}, "vskipper.repetitions"),
    ({"lanes": ["fast"]}, "vskipper.lanes[0]"),
    ({"randomskip": {"point": "peak"}}, "vskipper.randomskip.point"),
    ({"randomskip": {"r": [0.5], "d": []}}, "vskipper.randomskip.r"),
    ({"randomskip": {"r": [1.5]}}, "vskipper.randomskip.r[0]"),
    ({"flexidepth": {"routed_layers": [3, 12]}}, "vskipper.flexidepth.routed_layers[1]"),
    ({"ablations": ["no-switch"]}, "vskipper.ablations[0]"),
    ({"load_points": {"below": 0.75}, "randomskip": {"r": []  , "d": []}}, "vskipper.ablations"),
    ({"profile": {"prefill_tokens": [32], "prefill_prompt_len": 64}}, "vskipper.profile.prefill_tokens[0]"),
    ({"profile": {"decode_context": 600}}, "vskipper.profile.decode_context"),
    ({"max_new_tokens": 400}, "vskipper.max_new_tokens"),
    ({"quality": {"limit": 3}}, "vskipper.quality"),
])
def test_schema_errors_name_the_key(section, key):
    with pytest.raises(ConfigError) as e:
        validate_config(_with_vsk(section), check_paths=False)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("config: ")
    assert key in msg, msg


def test_schema_module_imports_no_torch():
    code = "import sys, impl.vskipper.schema as s; assert s.SECTION and s.DEFAULTS; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ----------------------------------------------------------------------------------------- knee rule
def test_knee_outcome_ok_top_bottom():
    from impl.vskipper.serving_commands import knee_outcome

    ok = knee_outcome([1, 2, 4, 8], [10, 20, 20.1, 20.2], 0.02)
    assert ok["status"] == "ok" and ok["bracketed"] and ok["q_star"] == ok["q_star_used"] == 2
    top = knee_outcome([1, 2, 4], [10, 20, 40], 0.02)
    assert top["status"] == "top" and top["q_star"] is None and top["q_star_used"] == 4 and not top["bracketed"]
    assert "extend the sweep to higher rates" in top["message"]
    bottom = knee_outcome([4, 1, 2], [10, 10, 10], 0.02)
    assert bottom["status"] == "bottom" and bottom["q_star_used"] == 1
    with pytest.raises(ValueError, match="at least 3"):
        knee_outcome([1, 2], [1, 2], 0.02)


def test_cb_config_sizes_the_cache_for_the_run():
    from impl.serving import Request
    from impl.vskipper.schema import Engine
    from impl.vskipper.serving_commands import cb_config_for

    reqs = [Request(f"r{i}", tuple(range(1, 21)), 12) for i in range(5)]  # 33 tokens -> 3 pages of 16
    cb = cb_config_for(Engine(page_size=16, num_blocks=None, max_batch_tokens=64, max_requests_per_batch=8), reqs)
    assert (cb.page_size, cb.num_blocks, cb.max_batch_tokens, cb.max_requests_per_batch) == (16, 5 * 3 + 4, 64, 8)
    assert cb.use_async_batching is False and cb.allow_block_sharing is False
    cb = cb_config_for(Engine(page_size=16, num_blocks=7, max_batch_tokens=64, max_requests_per_batch=8), reqs)
    assert cb.num_blocks == 7


# ------------------------------------------------------------------------- commands on a tiny model
VOCAB = 300


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory, tiny_tokenizer):
    """A seeded random 4-layer Llama with the tiny tokenizer, an untrained FlexiDepth checkpoint on
    layers 2-3 (router biased so that rows skip), a prompt file, and a config with a small vskipper
    section."""

    from impl.vskipper.flexidepth import FlexiDepthSkipper

    root = tmp_path_factory.mktemp("vsk")
    mdir = root / "model"
    model = save_wide_llama(mdir, tiny_tokenizer, 256, vocab_size=VOCAB)
    sk = FlexiDepthSkipper.for_model(model, [2, 3], init_logit=0.0, init_spread=3.0, seed=1)
    ckpt = sk.save(root / "model-flexidepth", extra={"num_hidden_layers": 4})
    g = torch.Generator().manual_seed(3)
    prompts = root / "prompts.jsonl"
    ids = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in (9, 14, 5, 20, 7, 11)]
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "input_ids": x}) + "\n" for i, x in enumerate(ids)))
    c = _with_vsk({
        "model": "tiny-std", "workloads": ["gsm8k"], "max_new_tokens": 4, "requests": 6, "repetitions": 1,
        "lanes": ["matched", "natural"], "load_points": {"knee": 0.95, "overload": 1.25}, "timeout_s": 60,
        "engine": {"page_size": 16, "max_batch_tokens": 64, "max_requests_per_batch": 8},
        "knee": {"rates": [20, 40, 80]},
        "flexidepth": {"steps": 2, "batch_size": 2, "seq_len": 16, "max_chars": 20000, "eval_windows": 2,
                       "routed_layers": [2, 3]},
        "profile": {"prefill_tokens": [16, 32], "prefill_prompt_len": 16, "decode_requests": [2, 4],
                    "decode_context": 16, "repeats": 1, "share_prompts": 2},
        "ablations": ["always-route"], "randomskip": {"r": [0.5], "d": [0.5]},
    })
    conf = root / "config.json"
    conf.write_text(json.dumps(validate_config(c, check_paths=False)))
    return {"root": root, "model": mdir, "ckpt": ckpt, "prompts": prompts, "config": conf}


def _run(d, *argv):
    from impl.cli import main

    main([argv[0], "--config-json", f"@{d['config']}", "--quiet", *argv[1:]])


def _knee_doc(d, status="ok", q=40.0, on_boundary="boundary"):
    doc = {"workload": "gsm8k", "model": "tiny-std", "status": status, "q_star": q if status == "ok" else None,
           "q_star_used": q, "bracketed": status == "ok", "message": "hand-written", "on_boundary": on_boundary,
           "load_factors": {"knee": 0.95, "overload": 1.25}, "load_points": {"knee": 0.95 * q, "overload": 1.25 * q},
           "rows": [], "rates": [20, 40, 80], "eps": 0.02}
    p = d["root"] / f"knee_{status}_{on_boundary}.json"
    p.write_text(json.dumps(doc))
    return p


@pytest.fixture(scope="module")
def thresholds(tiny_dirs):
    d = tiny_dirs
    flexi, rnd = d["root"] / "thr_flexi.json", d["root"] / "thr_random.json"
    _run(d, "profile-mode", "--model-dir", str(d["model"]), "--flexidepth", str(d["ckpt"]), "--prompts",
         str(d["prompts"]), "--out", str(flexi))
    _run(d, "profile-mode", "--model-dir", str(d["model"]), "--flexidepth", str(d["ckpt"]), "--policy", "random",
         "--out", str(rnd))
    return flexi, rnd


def test_profile_mode_writes_share_profile_and_rule(thresholds):
    flexi, rnd = (json.loads(p.read_text()) for p in thresholds)
    assert flexi["policy"] == "flexidepth" and flexi["routed_layers"] == [2, 3]
    assert 0.0 <= flexi["share"]["prefill"] <= 1.0 and 0.0 <= flexi["share"]["decode"] <= 1.0
    thr = flexi["thresholds"]
    assert "ceil(margin * a" in thr["rule"] and set(thr) >= {"min_prefill_tokens", "enter_threshold", "min_skip_share"}
    assert flexi["switch"]["probe_every"] == 64 and flexi["git_sha"] is not None
    for ph in ("prefill", "decode"):
        assert flexi["profile"][ph]["points"] and "fixed_cost_s" in flexi["profile"][ph]
    (g,) = rnd["grid"]
    assert (g["r"], g["d"], g["k"]) == (0.5, 0.5, 1) and g["share"] == pytest.approx(0.25)
    assert g["thresholds"]["skip_share"] == {"prefill": 0.25, "decode": 0.25}


def test_knee_command_on_the_engine(tiny_dirs):
    d = tiny_dirs
    out = d["root"] / "knee.json"
    _run(d, "knee", "--model-dir", str(d["model"]), "--prompts", str(d["prompts"]), "--workload", "gsm8k",
         "--out", str(out))
    k = json.loads(out.read_text())
    assert [r["rate"] for r in k["rows"]] == [20.0, 40.0, 80.0]
    assert all(r["n_failed"] == 0 and r["arm"] == "upstream" for r in k["rows"])
    assert k["status"] in ("ok", "top", "bottom") and k["q_star_used"] in (20.0, 40.0, 80.0)
    assert k["bracketed"] == (k["status"] == "ok")
    assert k["load_points"]["knee"] == pytest.approx(0.95 * k["q_star_used"])


def test_knee_command_with_capacity_scaled_rates(tiny_dirs):
    """knee.scale: capacity: the serial-capacity probe on the upstream arm sets the rates (factors x mu)."""
    d = tiny_dirs
    cfg = json.loads(d["config"].read_text())
    cfg["vskipper"]["knee"].update({"scale": "capacity", "rates": [0.5, 1, 2], "probe_requests": 2})
    conf = d["root"] / "config_capacity.json"
    conf.write_text(json.dumps(validate_config(cfg, check_paths=False)))
    out = d["root"] / "knee_capacity.json"
    _run({**d, "config": conf}, "knee", "--model-dir", str(d["model"]), "--prompts", str(d["prompts"]),
         "--workload", "gsm8k", "--out", str(out))
    k = json.loads(out.read_text())
    cap = k["serial_capacity"]
    assert k["rate_scale"] == "capacity" and k["rate_factors"] == [0.5, 1, 2] and cap["n"] == 2
    assert cap["capacity_req_s"] == pytest.approx(1.0 / cap["service_s_mean"]) and cap["capacity_req_s"] > 0
    assert k["rates"] == pytest.approx([f * cap["capacity_req_s"] for f in (0.5, 1, 2)], rel=1e-2)
    assert [r["rate"] for r in k["rows"]] == k["rates"] and all(r["n_failed"] == 0 for r in k["rows"])
    assert k["q_star_used"] in k["rates"]


def test_knee_command_at_a_boundary_rung_still_writes_its_result(tiny_dirs, monkeypatch):
    """knee_sweep refuses a knee on the top rung (ValueError with the measured rows): the command
    writes status "top", Q* None and the load points of the top rung instead of failing."""
    import impl.serving.knee as knee_mod

    rows = [{"kind": "sweep", "arm": "upstream", "rate": r, "tps_window": 10.0 * r, "e2e_mean_s": 0.1}
            for r in (20.0, 40.0, 80.0)]

    def fake_sweep(*a, **kw):
        e = ValueError("knee at the top rung: the output token rate still grows at every step up to 80 req/s; "
                       "extend the sweep to higher rates")
        e.rows = rows
        raise e

    monkeypatch.setattr(knee_mod, "knee_sweep", fake_sweep)
    d = tiny_dirs
    out = d["root"] / "knee_top.json"
    _run(d, "knee", "--model-dir", str(d["model"]), "--prompts", str(d["prompts"]), "--workload", "gsm8k",
         "--out", str(out))
    k = json.loads(out.read_text())
    assert (k["status"], k["q_star"], k["q_star_used"], k["bracketed"]) == ("top", None, 80.0, False)
    assert k["load_points"] == {"knee": pytest.approx(76.0), "overload": pytest.approx(100.0)}
    assert "higher rates" in k["message"] and k["rows"] == rows


@pytest.fixture(scope="module")
def cell_rows(tiny_dirs, thresholds):
    """serve-cell at the knee of a hand-written knee that was not bracketed (top rung, on_boundary:
    boundary): upstream vs the served hybrid and always-route, matched and natural lanes."""
    d = tiny_dirs
    out = d["root"] / "cell.jsonl"
    _run(d, "serve-cell", "--model-dir", str(d["model"]), "--flexidepth", str(d["ckpt"]), "--thresholds",
         str(thresholds[0]), "--knee", str(_knee_doc(d, "top", 40.0)), "--prompts", str(d["prompts"]),
         "--workload", "gsm8k", "--point", "knee", "--arms", "always-route", "--out", str(out))
    return [json.loads(x) for x in out.read_text().splitlines()]


def test_serve_cell_rows(cell_rows):
    rows = cell_rows
    assert not [r for r in rows if r["kind"] == "rejected"]
    cells = [r for r in rows if r["kind"] == "cell"]
    assert {(r["lane"], r["arm"]) for r in cells} == {(lane, a) for lane in ("matched", "natural")
                                                     for a in ("upstream", "vskipper", "always-route")}
    for r in rows:  # every row is labelled with the knee outcome and the absolute rate
        assert (r["knee_status"], r["q_star"], r["q_star_used"], r["point"]) == ("top", None, 40.0, "knee")
        assert r["rate"] == pytest.approx(38.0) and r["experiment"] == "main" and "git_sha" in r
    routed = [r for r in cells if r["arm"] != "upstream"]
    assert all(r["arm_settings"]["mode"] == "routed" and "planner_summary" in r["arm_settings"] for r in routed)
    always = [r for r in cells if r["arm"] == "always-route"]
    assert all(r["switch"]["always_route"] for r in always)
    # always-route routes every row; the run's planner saw only this run's requests (no warm-up, fresh state)
    assert len(always) == 2  # one run per lane, same arm object: a fresh ModeController each run
    for r in always:
        ps = r["arm_settings"]["planner_summary"]
        assert ps["rows"]["prefill"]["dense"] == 0 and ps["rows"]["decode"]["dense"] == 0
        assert ps["prefill_routed_requests"] == 6
        assert ps["rows"]["prefill"]["routed"] == 9 + 14 + 5 + 20 + 7 + 11  # this run's prompts, no warm-up
    reqs = [r for r in rows if r["kind"] == "request" and r["lane"] == "matched" and r["phase"] == "measure"]
    lengths = {r["request_id"]: r["output_tokens"] for r in reqs if r["arm"] == "upstream"}
    assert all(r["output_tokens"] == lengths[r["request_id"]] for r in reqs)
    summ = [r for r in rows if r["kind"] == "summary"]
    assert {r["treatment"] for r in summ} == {"vskipper", "always-route"} and all(r["n"] == 1 for r in summ)


def test_serve_cell_skips_when_knee_not_bracketed_and_asked_to(tiny_dirs, thresholds):
    d = tiny_dirs
    out = d["root"] / "cell_skip.jsonl"
    _run(d, "serve-cell", "--model-dir", str(d["model"]), "--flexidepth", str(d["ckpt"]), "--thresholds",
         str(thresholds[0]), "--knee", str(_knee_doc(d, "bottom", 20.0, "skip")), "--prompts", str(d["prompts"]),
         "--workload", "gsm8k", "--point", "knee", "--out", str(out))
    (row,) = [json.loads(x) for x in out.read_text().splitlines()]
    assert row["kind"] == "skipped" and row["knee_status"] == "bottom" and "not bracketed" in row["reason"]


def test_serve_cell_rejects_an_unknown_point(tiny_dirs, thresholds):
    d = tiny_dirs
    with pytest.raises(SystemExit):
        _run(d, "serve-cell", "--model-dir", str(d["model"]), "--flexidepth", str(d["ckpt"]), "--thresholds",
             str(thresholds[0]), "--knee", str(_knee_doc(d)), "--prompts", str(d["prompts"]), "--workload", "gsm8k",
             "--point", "below", "--out", str(d["root"] / "x.jsonl"))


@pytest.fixture(scope="module")
def map_rows(tiny_dirs, thresholds):
    d = tiny_dirs
    out = d["root"] / "map.jsonl"
    _run(d, "randomskip-map", "--model-dir", str(d["model"]), "--knee", str(_knee_doc(d)), "--shared-thresholds",
         str(thresholds[0]), "--random-thresholds", str(thresholds[1]), "--prompts", str(d["prompts"]),
         "--workload", "gsm8k", "--out", str(out))
    return [json.loads(x) for x in out.read_text().splitlines()]


def test_randomskip_map_rows(map_rows):
    cells = [r for r in map_rows if r["kind"] == "cell"]
    assert {r["arm"] for r in cells} == {"upstream", "always-route", "shared", "per-policy"}
    assert all((r["r"], r["d"], r["k"], r["experiment"]) == (0.5, 0.5, 1, "randomskip") for r in map_rows)
    ps = {r["arm"]: r["arm_settings"]["planner_summary"] for r in cells if r["arm"] != "upstream"}
    assert ps["always-route"]["rows"]["decode"]["dense"] == 0
    e2e = [r for r in map_rows if r["kind"] == "summary" and r["metric"] == "e2e_mean_s"]
    assert {r["treatment"] for r in e2e} == {"always-route", "shared", "per-policy"}


def test_train_flexidepth_command(tiny_dirs, data_dir):
    d = tiny_dirs
    conf = json.loads(d["config"].read_text())
    conf["data_dir"] = str(data_dir)
    cfile = d["root"] / "config_data.json"
    cfile.write_text(json.dumps(conf))
    out, summ = d["root"] / "trained-flexidepth", d["root"] / "train.json"
    from impl.cli import main

    main(["train-flexidepth", "--config-json", f"@{cfile}", "--quiet", "--model-dir", str(d["model"]),
          "--out", str(out), "--summary", str(summ)])
    s = json.loads(summ.read_text())
    assert s["steps"] == 2 and s["routed_layers"] == [2, 3] and s["data"] == "sharegpt"
    assert 0.0 <= s["eval_skip_ratio"] <= 1.0 and math.isfinite(s["eval_dense_lm_loss"])
    from impl.vskipper.flexidepth import load_flexidepth

    sk = load_flexidepth(out)
    assert sk.routed_layers == (2, 3) and sk.checkpoint_meta["train"]["steps"] == 2


# ------------------------------------------------------------------------------ tables and report
def _fake_cell_rows(rejected=False):
    """Protocol rows of a FakeArm cell (virtual clock): upstream vs a faster 'vskipper' and an ablation."""
    from impl.serving import FakeArm, Request, run_cell

    reqs = [Request(f"q{i}", (1, 2, 3), 8) for i in range(12)]
    arms = {"upstream": FakeArm("upstream", slots=2, tpot_s=0.01, jitter=0.1, seed=1),
            "vskipper": FakeArm("vskipper", slots=2, tpot_s=0.007, jitter=0.1, seed=2),
            "always-route": FakeArm("always-route", slots=2, tpot_s=0.012, jitter=0.1, seed=3)}
    rows = []
    for point, factor in (("knee", 0.95), ("overload", 1.25)):
        for lane in ("matched", "natural"):
            res = run_cell(arms, reqs, cell=point, rate=100 * factor, repetitions=3, seed=4, lane=lane,
                           workload="gsm8k")
            extra = {"experiment": "main", "point": point, "factor": factor, "knee_status": "ok", "q_star": 100.0,
                     "q_star_used": 100.0}
            for r in res.rows:
                r.update(extra)
                if r["kind"] == "cell" and r["arm"] != "upstream":
                    r["arm_settings"]["planner_summary"] = {"rows": {"prefill": {"routed": 3, "dense": 1},
                                                                     "decode": {"routed": 1, "dense": 1}},
                                                            "promotions": 2, "probes": [{}], "share_estimate": 0.5}
            rows += res.rows
    if rejected:
        rows.append({"kind": "rejected", "experiment": "main", "workload": "gsm8k", "point": "below", "lane": "matched",
                     "error": "MatchedWorkError: 1 request differs", "knee_status": "ok"})
    return rows


def _write_inputs(tmp_path, rejected=False):
    cells = tmp_path / "cells.jsonl"
    cells.write_text("".join(json.dumps(r) + "\n" for r in _fake_cell_rows(rejected)))
    abl = tmp_path / "ablation.jsonl"
    abl.write_text("".join(json.dumps({**r, "experiment": "ablation"}) + "\n" for r in _fake_cell_rows()
                           if r.get("point") == "knee" and r.get("lane") == "matched"))
    mp = []
    for r in _fake_cell_rows():
        if r.get("point") == "knee" and r.get("lane") == "matched" and r.get("kind") in ("summary", "cell"):
            for rr, dd in ((0.5, 0.5), (0.25, 0.75)):
                x = {**r, "experiment": "randomskip", "r": rr, "d": dd, "k": 1, "skip_share": rr * dd}
                if x.get("treatment") == "vskipper":
                    x["treatment"] = "per-policy"
                if x.get("arm") == "vskipper":
                    x["arm"] = "per-policy"
                mp.append(x)
    mpf = tmp_path / "map.jsonl"
    mpf.write_text("".join(json.dumps(r) + "\n" for r in mp))
    knee = tmp_path / "knee.json"
    knee.write_text(json.dumps({"workload": "gsm8k", "model": "tiny-std", "status": "ok", "bracketed": True,
                                "q_star": 100.0, "q_star_used": 100.0, "rates": [50, 100, 200], "eps": 0.02,
                                "message": "Q* = r_k ...", "load_points": {"knee": 95.0, "overload": 125.0},
                                "rows": [{"rate": x, "tps_window": t, "e2e_mean_s": 0.1} for x, t in
                                         ((50, 400), (100, 800), (200, 805))]}))
    prof = {"n_routed_layers": 2, "device": "cpu", "threads": 1,
            "prefill": {"fixed_cost_s": 1e-3, "fixed_cost_per_row_s": 1e-6, "saving_per_row_layer_s": 1e-5,
                        "unit": "prompt tokens"},
            "decode": {"fixed_cost_s": 1e-3, "fixed_cost_per_row_s": 1e-5, "saving_per_row_layer_s": 1e-6,
                       "unit": "running decode requests"}}
    from impl.vskipper.mode import derive_thresholds

    thr = tmp_path / "thr.json"
    thr.write_text(json.dumps({"policy": "flexidepth", "profile": prof,
                               "thresholds": derive_thresholds(prof, {"prefill": 0.5, "decode": 0.5})}))
    flexi = tmp_path / "flexi.json"
    flexi.write_text(json.dumps({"model": "tiny-std", "routed_layers": [2, 3], "steps": 5, "seconds": 1.0,
                                 "eval_skip_ratio": 0.4, "eval_lm_loss": 3.1, "eval_dense_lm_loss": 3.0,
                                 "config": {"skip_alpha": 0.1}}))
    return dict(knees=[knee], thresholds=[thr], flexidepth=[flexi], cells=[cells], ablations=[abl], randomskip=[mpf])


def test_tables_from_synthetic_rows(tmp_path):
    from impl.vskipper.serving_report import TABLE_NAMES, vskipper_tables

    tabs = vskipper_tables(**_write_inputs(tmp_path))
    assert set(tabs) == set(TABLE_NAMES)
    t2 = tabs["vskipper_table2"]
    assert len(t2) == 4 and set(t2["lane"]) == {"matched", "natural"} and (t2["n"] == 3).all()
    # the faster fake arm: E2E lower, written as mean [low, high] with * when resolved
    assert all(re.match(r"^[+-]\d+\.\d \[[+-]\d+\.\d, [+-]\d+\.\d\]( \*)?$", x) for x in t2["E2E mean"])
    assert t2["E2E mean"].str.startswith("-").all()
    t4 = tabs["vskipper_table4"]
    assert set(t4["point"]) == {"overload"} and {"TPS (window)", "RPS (window)"} <= set(t4.columns)
    assert list(t4["lane"]) == ["matched", "natural"] and (t4["saturation"] == "1.25 x Q*").all()
    assert (t4["vskipper TPS"] > t4["upstream TPS"]).all()  # the faster fake arm
    abl = tabs["vskipper_ablation"]
    assert set(abl["arm"]) == {"vskipper", "always-route"} and (abl["decode_routed_share"] == 0.5).all()
    rs = tabs["vskipper_randomskip"]
    assert set(rs["setting"]) == {"per-policy", "always-route"} and set(rs["r"]) == {0.5, 0.25}
    th = tabs["vskipper_thresholds"]
    assert list(th["phase"]) == ["prefill", "decode"]
    # the synthetic decode profile saves less per row than routing costs: no size pays, decode stays dense
    assert th["threshold_N"].notna().tolist() == [True, False] and th["profitable"].tolist() == [True, False]
    ks = tabs["vskipper_knee_summary"]
    assert ks.iloc[0]["status"] == "ok" and tabs["vskipper_knee"]["is_q_star_used"].sum() == 1
    fl = tabs["vskipper_flexidepth"]
    assert fl.iloc[0]["loss_delta"] == pytest.approx(0.1)
    gate = tabs["vskipper_gate"]
    assert (gate["status"] == "ok").all() and len(gate) == 4 + 1 + 2


def _sat_summary(workload, point, factor, lane, metric, base, treat, pct, lo, hi, n=3):
    return {"kind": "summary", "experiment": "main", "workload": workload, "point": point, "factor": factor,
            "rate": 8.0 * factor, "knee_status": "ok", "lane": lane, "treatment": "vskipper", "metric": metric,
            "better": "higher", "n": n, "baseline_mean": base, "treatment_mean": treat, "pct_mean": pct,
            "pct_ci_low": lo, "pct_ci_high": hi, "pct_resolved": lo > 0 or hi < 0}


def test_table4_saturation_from_hand_made_rows():
    """Table 4: per workload the largest load point above Q* is saturation (overload 1.25 beats 1.1, the
    knee and below never count); per lane (matched first) the arms' mean TPS / RPS and the paired %
    change; a workload without a point above Q* has no row; one repetition has no interval."""
    from impl.vskipper.serving_report import saturation_points, summary_frame, table4

    rows = []
    for w in ("gsm8k", "bbh"):
        for point, f in (("below", 0.75), ("knee", 0.95), ("high", 1.1), ("overload", 1.25)):
            for lane in ("natural", "matched"):
                rows.append(_sat_summary(w, point, f, lane, "tps_window", 100.0, 110.0 * f, 10.0 * f, 2.0, 18.0))
                rows.append(_sat_summary(w, point, f, lane, "rps_window", 4.0, 4.4, 11.3, -1.0, 23.6))
                rows.append(_sat_summary(w, point, f, lane, "e2e_mean_s", 1.0, 0.9, -10.0, -12.0, -8.0))
    rows.append(_sat_summary("coqa", "knee", 0.95, "matched", "tps_window", 10.0, 11.0, 10.0, 5.0, 15.0))
    rows.append(_sat_summary("xsum", "overload", 1.25, "matched", "rps_window", 2.0, 2.5, 25.0, math.nan, math.nan,
                             n=1))
    rows.append({**_sat_summary("gsm8k", "stress", 2.0, "matched", "tps_window", 1, 1, 0, 0, 0),
                 "experiment": "ablation"})  # not a main cell: ignored
    long = summary_frame(rows)
    assert saturation_points(long) == {"gsm8k": ("overload", 1.25), "bbh": ("overload", 1.25),
                                       "xsum": ("overload", 1.25)}
    t4 = table4(long)
    assert list(zip(t4["workload"], t4["lane"])) == [("gsm8k", "matched"), ("gsm8k", "natural"),
                                                     ("bbh", "matched"), ("bbh", "natural"), ("xsum", "matched")]
    g = t4.iloc[0]
    assert g["point"] == "overload" and g["factor"] == 1.25 and g["rate"] == 10.0 and g["n"] == 3
    assert g["upstream TPS"] == 100.0 and g["vskipper TPS"] == pytest.approx(137.5)
    assert g["TPS (window)"] == "+12.5 [+2.0, +18.0] *" and bool(g["tps_resolved"])
    assert g["upstream RPS"] == 4.0 and g["vskipper RPS"] == 4.4 and g["RPS (window)"] == "+11.3 [-1.0, +23.6]"
    assert not bool(g["rps_resolved"]) and g["rps_pct_mean"] == 11.3
    x = t4.iloc[4]
    assert x["RPS (window)"] == "+25.0 (n=1)" and x["TPS (window)"] == "-" and math.isnan(x["upstream TPS"])
    # no load point above Q*: empty, with the columns
    only_knee = summary_frame([r for r in rows if r["factor"] <= 1.0])
    e = table4(only_knee)
    assert len(e) == 0 and "RPS (window)" in e.columns and saturation_points(only_knee) == {}
    assert len(table4(summary_frame([]))) == 0


def test_report_section_and_figures(tmp_path):
    from impl.report.tables import write_table
    from impl.vskipper.serving_report import report_section, vskipper_figures, vskipper_tables

    for rejected, verdict in ((False, "PASS"), (True, "FAIL")):
        sub = tmp_path / str(rejected)
        sub.mkdir()
        td, fd = sub / "tables", sub / "figures"
        for name, df in vskipper_tables(**_write_inputs(sub, rejected)).items():
            write_table(df, td / name)
        paths = vskipper_figures(td, fd)
        assert all(p.stat().st_size > 1000 for p in paths)
        text = "\n".join(report_section(td, fd, sub))
        assert re.search(rf"matched-work gate .*\*\*{verdict}\*\*", text)
        assert "knee sweep brackets Q* for every workload: **PASS**" in text
        assert "Table 2 shape" in text and "Table 3 shape" in text and "Fig. 3 shape" in text
        assert "### Throughput under saturation (Table 4)" in text and "[vskipper_table4](tables/vskipper_table4.csv)" in text
        assert "Here (matched lane): gsm8k RPS" in text
        assert "](figures/vskipper_fig3.png)" in text and "[vskipper_table2](tables/vskipper_table2.csv)" in text
        if rejected:
            assert "rejected: main/gsm8k/below/matched" in text


def test_tables_and_figures_when_experiments_did_not_run(tmp_path):
    """Only the knee and the thresholds exist (no cells, no map): every table is written (empty with
    its columns), figures are placeholders, the report section still renders."""
    from impl.report.tables import write_table
    from impl.vskipper.serving_report import report_section, vskipper_figures, vskipper_tables

    ins = _write_inputs(tmp_path)
    tabs = vskipper_tables(knees=ins["knees"], thresholds=ins["thresholds"])
    for name, df in tabs.items():
        write_table(df, tmp_path / "t" / name)
        assert len(df.columns) > 0
    assert all(p.stat().st_size > 1000 for p in vskipper_figures(tmp_path / "t", tmp_path / "f"))
    text = "\n".join(report_section(tmp_path / "t", tmp_path / "f", tmp_path))
    assert "vSkipper" in text and "Mode-switch thresholds" in text and "no serving lane was measured" in text


# ------------------------------------------------------------------------------- the rules (slow)
@pytest.mark.slow
def test_rules_on_smoke_models(smoke_run):
    """The vSkipper rules on the smoke models, through Snakemake (the session's smoke DAG run, whose
    vskipper section is this experiment's): every table and figure, rows of every experiment, and a
    report section with the checks."""
    out = smoke_run
    td, fd = out / "results" / "tables" / "vskipper", out / "figures"
    gate = pd.read_csv(td / "vskipper_gate.csv")
    assert set(gate["experiment"]) >= {"main", "ablation", "randomskip"} and (gate["status"] == "ok").all()
    t2 = pd.read_csv(td / "vskipper_table2.csv")
    assert set(t2["lane"]) == {"matched", "natural"} and (t2["n"] == 2).all()
    knee = json.loads((out / "results" / "vskipper" / "knee" / "gsm8k.json").read_text())
    import yaml

    rungs = yaml.safe_load((Path(__file__).parents[1] / "configs" / "smoke.yaml").read_text())["vskipper"]["knee"]["rates"]
    assert knee["status"] in ("ok", "top", "bottom") and len(knee["rows"]) == len(rungs) >= 3  # one row per rung
    assert (out / "models" / "tiny-std-flexidepth" / "flexidepth.safetensors").is_file()
    text = "\n".join(__import__("impl.vskipper.serving_report", fromlist=["x"]).report_section(td, fd, out / "results"))
    assert re.search(r"matched-work gate .*\*\*PASS\*\*", text)
    assert (fd / "vskipper_fig3.png").stat().st_size > 1000
