"""The quality rules of the vSkipper workflow (rule ``vskipper_quality``, command ``quality-cell``, Table 5
left and App. E.1; rule ``vskipper_quality_served``, command ``quality-served``, Table 5 right; the tables
and report lines in impl/serving/report.py; the ``vskipper.quality`` config section):

- the section's defaults fill in (``served`` included), and bad values fail with one line naming the key;
- ``quality-cell`` on a tiny random Llama with an untrained FlexiDepth checkpoint (limit 1-2) writes
  well-formed rows (documents x four arms, C and D served over HTTP, summaries with the DiD, first-token
  agreement), a summary JSON and the documents' requests; ``quality-served`` replays those requests at
  a knee rate read from a knee JSON to the hybrid and always-route servers; ``vskipper-tables
  --quality --quality-served`` turns them into Table 5 (left, right) / first-token tables;
- the tables and report lines from synthetic rows, including a gate FAIL and a rejected served suite.
"""

import copy
import json
import math
from pathlib import Path

import pandas as pd
import pytest
import yaml

from impl.config import ConfigError, validate_config
from conftest import save_wide_llama

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ROOT = Path(__file__).resolve().parents[1]


def _cfg(quality: dict | None, data_dir=None) -> dict:
    cfg = yaml.safe_load((ROOT / "configs" / "smoke.yaml").read_text())
    cfg["vskipper"] = {} if quality is None else {"quality": quality}
    if data_dir is not None:
        cfg["data_dir"] = str(data_dir)
    return cfg


# ---------------------------------------------------------------------------------------- schema
def test_quality_defaults_fill_in():
    out = validate_config(_cfg(None), check_paths=False)
    assert "quality" not in out["vskipper"]  # absent section: no rule
    out = validate_config(_cfg({"tasks": ["gsm8k", "bbh"], "max_gen_toks": {"bbh": 16}}), check_paths=False)
    q = out["vskipper"]["quality"]
    assert q["limit"] == 8 and q["gsm8k_num_fewshot"] == 5 and q["first_token_docs"] == 1 and q["tol"] == 0.01
    assert q["max_gen_toks"] == {"gsm8k": 64, "bbh": 16, "coqa": 32}
    assert q["bbh_subtasks"] == ["boolean_expressions", "sports_understanding"]
    assert q["served"] == {"point": "knee", "workload": None, "requests": None} and q["http_concurrency"] is None
    again = validate_config(copy.deepcopy(out), check_paths=False)
    assert again["vskipper"]["quality"] == q
    out = validate_config(_cfg({"tasks": ["bbh"], "served": {"requests": 0}}), check_paths=False)
    assert out["vskipper"]["quality"]["served"] == {"point": "knee", "workload": None, "requests": 0}
    assert validate_config(_cfg({"tasks": ["bbh"], "served": None}), check_paths=False)["vskipper"]["quality"][
        "served"] is None
    from impl.vskipper.schema import served_knee_workload

    v = out["vskipper"]
    assert served_knee_workload(v, "gsm8k") == "gsm8k" and served_knee_workload(v, "bbh") == v["workloads"][0]
    assert validate_config(_cfg({"tasks": ["coqa"], "limit": None}), check_paths=False)["vskipper"]["quality"][
        "limit"] is None


@pytest.mark.parametrize("quality, key", [
    ({"limit": 3}, "vskipper.quality"),
    ({"tasks": ["mmlu"]}, "vskipper.quality.tasks[0]"),
    ({"tasks": ["gsm8k"], "limit": 0}, "vskipper.quality.limit"),
    ({"tasks": ["gsm8k"], "bogus": 1}, "vskipper.quality.bogus"),
    ({"tasks": ["gsm8k"], "tol": 0}, "vskipper.quality.tol"),
    ({"tasks": ["gsm8k"], "gsm8k_num_fewshot": -1}, "vskipper.quality.gsm8k_num_fewshot"),
    ({"tasks": ["gsm8k"], "max_gen_toks": {"gsm8k": 0}}, "vskipper.quality.max_gen_toks.gsm8k"),
    ({"tasks": ["gsm8k"], "max_gen_toks": {"mmlu": 8}}, "vskipper.quality.max_gen_toks.mmlu"),
    ({"tasks": ["coqa"], "max_gen_toks": {"coqa": 300}}, "vskipper.quality.max_gen_toks.coqa"),
    ({"tasks": ["bbh"], "bbh_subtasks": ["Bad-Name"]}, "vskipper.quality.bbh_subtasks[0]"),
    ({"tasks": ["bbh"], "bbh_subtasks": ["navigate", "no_such_task"]}, "vskipper.quality.bbh_subtasks[1]"),
    ({"tasks": ["gsm8k"], "served": {"point": "peak"}}, "vskipper.quality.served.point"),
    ({"tasks": ["gsm8k"], "served": {"workload": "xsum"}}, "vskipper.quality.served.workload"),
    ({"tasks": ["gsm8k"], "served": {"workload": "mmlu"}}, "vskipper.quality.served.workload"),
    ({"tasks": ["gsm8k"], "served": {"requests": -1}}, "vskipper.quality.served.requests"),
    ({"tasks": ["gsm8k"], "served": {"rate": 3}}, "vskipper.quality.served.rate"),
    ({"tasks": ["gsm8k"], "http_concurrency": 0}, "vskipper.quality.http_concurrency"),
])
def test_quality_schema_errors_name_the_key(quality, key, data_dir):
    with pytest.raises(ConfigError) as e:
        validate_config(_cfg(quality, data_dir), check_paths=False)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("config: ") and key in msg, msg


# -------------------------------------------------------------------------- tables from synthetic rows
def _summary_row(suite, metric, *, task=None, primary=True, n=4, did=(0.0, -1.0, 1.0, False), hashes=True):
    m, lo, hi, res = did
    return {"kind": "summary", "suite": suite, "task": task, "metric": metric, "primary": primary, "n": n,
            "mean_A": 50.0, "mean_B": 25.0, "mean_C": 50.0, "mean_D": 25.0 + m,
            "B_minus_A_mean": -25.0, "B_minus_A_ci_low": -40.0, "B_minus_A_ci_high": -10.0,
            "D_minus_C_mean": -25.0 + m, "D_minus_C_ci_low": -40.0, "D_minus_C_ci_high": -10.0,
            "did_mean": m, "did_ci_low": lo, "did_ci_high": hi, "did_resolved": res,
            "tokens_equal_AB": 1, "tokens_equal_AC": n, "tokens_equal_BD": n, "tokens_equal_all": 1,
            "prompt_hashes_equal": hashes}


def _ft_row(suite, arm, ref, diff, argmax=True):
    return {"kind": "first_token", "suite": suite, "task": f"vsk_{suite}", "doc_id": 0, "arm": arm, "reference": ref,
            "k": 5, "tol": 0.01, "max_abs_diff": diff, "argmax_equal": argmax, "top_ids_equal": argmax,
            "agree": bool(argmax and diff <= 0.01)}


def _write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_table5_and_first_token_from_rows(tmp_path):
    from impl.vskipper.serving_report import QUALITY_TABLE_NAMES, TABLE_NAMES, quality_section_lines, vskipper_tables
    from impl.report.tables import write_table

    g = [_summary_row("gsm8k", "exact_match,strict-match", primary=False),
         _summary_row("gsm8k", "exact_match,composite", did=(5.0, 1.0, 9.0, True)),
         {"kind": "doc", "suite": "gsm8k", "arm": "A", "score": 1.0}]
    b = [_summary_row("bbh", "exact_match,get-answer", task="vsk_bbh_navigate", n=2),
         _summary_row("bbh", "exact_match,get-answer", n=4)]
    ft = [_ft_row("gsm8k", "C", "A", 2e-6), _ft_row("gsm8k", "D", "B", 3e-6), _ft_row("gsm8k", "B", "A", 0.7, False)]
    files = [_write_rows(tmp_path / "gsm8k.jsonl", g + ft), _write_rows(tmp_path / "bbh.jsonl", b)]
    tabs = vskipper_tables(quality=files)
    assert set(tabs) == set(TABLE_NAMES) | set(QUALITY_TABLE_NAMES)
    assert set(vskipper_tables()) == set(TABLE_NAMES)  # no quality rule: no quality tables
    t5 = tabs["vskipper_table5"]
    assert list(t5["suite"]) == ["gsm8k", "gsm8k", "bbh", "bbh"]
    assert list(t5["metric"])[:2] == ["exact_match,composite", "exact_match,strict-match"]  # primary first
    assert list(t5["task"]) == ["all", "all", "all", "vsk_bbh_navigate"]
    top = t5.iloc[0]
    assert top["did"] == "+5.00 [+1.00, +9.00] *" and top["B_minus_A"] == "-25.00 [-40.00, -10.00]"
    assert top["n"] == 4 and top["gate"] == "PASS" and top["tokens_equal_AC"] == 4 and top["mean_D"] == 30.0
    assert tabs["vskipper_first_token"].shape[0] == 3
    out = tmp_path / "tables"
    for name, df in tabs.items():
        write_table(df, out / name)
    lines = quality_section_lines(out)
    text = "\n".join(lines)
    assert "prompt-hash gate" in text and "**PASS** (suites bbh, gsm8k; 8 documents)" in text
    assert "first-token agreement C vs A" in text and "1/1 documents" in text
    assert [ln for ln in lines if ln.startswith("- first-token agreement C vs A")][0].endswith("**PASS**")
    assert "resolved DiD on 1/2 suites" in text and "| vsk_bbh_navigate |" in text
    # the vSkipper report section carries the quality lines
    from impl.vskipper.serving_report import report_section

    assert "### Task quality: the 2x2 difference-in-differences (Table 5 left shape; App. E.1)" in report_section(
        out, tmp_path / "figs", tmp_path)
    # without the quality tables: no lines
    assert quality_section_lines(tmp_path / "nothing") == []


def test_gate_and_agreement_failures_are_reported(tmp_path):
    from impl.report.tables import write_table
    from impl.vskipper.serving_report import quality_section_lines, vskipper_tables

    rows = [_summary_row("coqa", "f1,none", n=2),
            {"kind": "rejected", "suite": "gsm8k", "reason": "prompt-hash gate",
             "error": "PromptMismatchError: prompt token ids differ between arms on 1 document(s)"},
            _ft_row("coqa", "C", "A", 0.05)]
    tabs = vskipper_tables(quality=[_write_rows(tmp_path / "q.jsonl", rows)])
    t5 = tabs["vskipper_table5"]
    assert list(t5["suite"]) == ["gsm8k", "coqa"] and list(t5["gate"]) == ["FAIL", "PASS"]
    for name, df in tabs.items():
        write_table(df, tmp_path / "t" / name)
    text = "\n".join(quality_section_lines(tmp_path / "t"))
    assert "**FAIL** (suites coqa, gsm8k; 2 documents; gsm8k: PromptMismatchError" in text
    assert "C vs A (upstream engine vs HF backend, base model)" in text and "0/1 documents, worst 0.05 nats: **FAIL**" in text


def _served_row(suite, metric, *, task=None, primary=True, n=4, diff=(0.0, -2.0, 2.0, False)):
    m, lo, hi, res = diff
    return {"kind": "served_summary", "suite": suite, "task": task, "metric": metric, "primary": primary, "n": n,
            "point": "knee", "factor": 0.95, "rate": 7.6, "knee_workload": "gsm8k", "knee_status": "ok",
            "mean_hybrid": 50.0 + m, "mean_always-route": 50.0, "diff_mean": m, "diff_ci_low": lo, "diff_ci_high": hi,
            "diff_resolved": res, "routed_share_hybrid": 0.895, "routed_share_always-route": 1.0,
            "routed_share_docs_hybrid": 0.9, "routed_share_docs_always-route": 1.0, "switch_routed_share_hybrid": 0.89,
            "tokens_equal": 3, "n_requests": 48, "n_padding": 44}


def test_table5_served_from_rows(tmp_path):
    from impl.report.tables import write_table
    from impl.vskipper.serving_report import (QUALITY_SERVED_TABLE_NAMES, QUALITY_TABLE_NAMES, TABLE_NAMES,
                                     quality_served_section_lines, report_section, vskipper_tables)

    rows = [_served_row("coqa", "f1,none", diff=(-0.05, -1.76, 1.66, False)),
            _served_row("gsm8k", "exact_match,strict-match", primary=False),
            _served_row("gsm8k", "exact_match,composite", diff=(-4.0, -7.0, -1.0, True)),
            {"kind": "served_doc", "suite": "gsm8k", "arm": "hybrid", "score": 1.0},
            {"kind": "rejected", "suite": "bbh", "point": "knee", "reason": "failed requests",
             "error": "ServedStreamError: arm hybrid: 1 of 48 requests failed"}]
    f = _write_rows(tmp_path / "served.jsonl", rows)
    tabs = vskipper_tables(quality=[], quality_served=[f])
    assert set(tabs) == set(TABLE_NAMES) | set(QUALITY_TABLE_NAMES) | set(QUALITY_SERVED_TABLE_NAMES)
    assert "vskipper_table5_served" not in vskipper_tables(quality=[])
    t = tabs["vskipper_table5_served"]
    assert list(t["suite"]) == ["gsm8k", "gsm8k", "bbh", "coqa"]
    assert list(t["metric"])[:2] == ["exact_match,composite", "exact_match,strict-match"]
    top = t.iloc[0]
    assert top["diff"] == "-4.00 [-7.00, -1.00] *" and top["routed"] == "0.895 / 1.000"
    assert top["mean_hybrid"] == 46.0 and top["mean_always_route"] == 50.0 and top["status"] == "ok"
    assert t.iloc[2]["status"] == "rejected" and "1 of 48 requests failed" in t.iloc[2]["message"]
    out = tmp_path / "tables"
    for name, df in tabs.items():
        write_table(df, out / name)
    text = "\n".join(quality_served_section_lines(out))
    assert "Table 5 right shape" in text and "resolved on 1/2 suites" in text
    assert "gsm8k -4.00 [-7.00, -1.00] *, n = 4, routed 0.895 / 1.000" in text and "bbh: rejected" in text
    assert "Table 5 right shape" in "\n".join(report_section(out, tmp_path / "figs", tmp_path))
    assert quality_served_section_lines(tmp_path / "nothing") == []


# ------------------------------------------------------------------------- the command on a tiny model
GEN = 8


@pytest.fixture(scope="module")
def tiny_quality(tmp_path_factory, tiny_tokenizer):
    """A seeded random 4-layer Llama over the tiny tokenizer (context 512), an untrained FlexiDepth
    checkpoint on layers 2-3 (routers spread so that some rows skip), and a config whose
    ``vskipper.quality`` runs every suite with limit 2 (BBH: one subtask) and budgets of 8 tokens."""

    from conftest import DATA_DIR
    from impl.vskipper.flexidepth import FlexiDepthSkipper

    if not DATA_DIR.is_dir():
        pytest.skip(f"data folder {DATA_DIR} not present")
    root = tmp_path_factory.mktemp("vskq")
    mdir = root / "model"
    model = save_wide_llama(mdir, tiny_tokenizer, 512)
    sk = FlexiDepthSkipper.for_model(model, [2, 3], init_logit=0.0, init_spread=3.0, seed=1)
    ckpt = sk.save(root / "model-flexidepth", extra={"num_hidden_layers": 4})
    c = _cfg({"tasks": ["gsm8k", "bbh", "coqa"], "limit": 2, "bbh_subtasks": ["boolean_expressions"],
              "gsm8k_num_fewshot": 2, "max_gen_toks": {"gsm8k": GEN, "bbh": GEN, "coqa": GEN},
              "first_token_docs": 1}, DATA_DIR)
    c["vskipper"].update({"model": "tiny-std", "engine": {"page_size": 16, "max_batch_tokens": 256,
                                                           "max_requests_per_batch": 4}})
    conf = root / "config.json"
    conf.write_text(json.dumps(validate_config(c, check_paths=False)))
    return {"root": root, "model": mdir, "ckpt": ckpt, "config": conf}


def _cli(d, *argv):
    from impl.cli import main

    main([argv[0], "--config-json", f"@{d['config']}", "--quiet", *argv[1:]])


@pytest.mark.parametrize("suite, n_tasks, metric", [("gsm8k", 1, "exact_match,composite"),
                                                     ("bbh", 1, "exact_match,get-answer"),
                                                     ("coqa", 1, "f1,none")])
def test_quality_cell_end_to_end(tiny_quality, suite, n_tasks, metric):
    from impl.provenance import read_jsonl

    d = tiny_quality
    qdir = d["root"] / "results" / "vskipper" / "quality"
    out, summ, work = qdir / f"{suite}.jsonl", qdir / f"{suite}.json", qdir / f"{suite}_run"
    reqf = qdir / f"{suite}_requests.jsonl"
    _cli(d, "quality-cell", "--model-dir", str(d["model"]), "--flexidepth", str(d["ckpt"]), "--suite", suite,
         "--work-dir", str(work), "--out", str(out), "--summary", str(summ), "--requests", str(reqf))
    rows = read_jsonl(out)
    reqs = read_jsonl(reqf)
    assert len(reqs) == 2 * n_tasks and all(len(r["prompt_ids"]) > 0 and r["max_gen_toks"] == GEN for r in reqs)
    docs = [r for r in rows if r["kind"] == "doc"]
    assert len(docs) == 4 * 2 * n_tasks and {r["arm"] for r in docs} == set("ABCD")
    for r in docs:
        assert r["suite"] == suite and r["metric"] == metric and 0.0 <= r["score"] <= 1.0
        assert r["model"] == "tiny-std" and r["policy"] == "flexidepth" and r["checkpoint"] == str(d["ckpt"])
        assert len(r["prompt_hash"]) == 16 and 1 <= r["n_gen_tokens"] <= GEN
        assert r["run_id"] == rows[0]["run_id"] and "git_sha" in r and "config_hash" in r
    by_doc = {}
    for r in docs:
        by_doc.setdefault(r["doc_id"], set()).add(r["prompt_hash"])
    assert all(len(h) == 1 for h in by_doc.values())  # the gate: identical ids in every arm
    prim = [r for r in rows if r["kind"] == "summary" and r["primary"] and r["task"] is None]
    assert len(prim) == 1
    p = prim[0]
    assert p["metric"] == metric and p["n"] == 2 and p["prompt_hashes_equal"]
    for k in ("mean_A", "mean_B", "mean_C", "mean_D", "did_mean", "B_minus_A_mean", "D_minus_C_mean"):
        assert math.isfinite(p[k]), k
    assert math.isclose(p["did_mean"], (p["mean_D"] - p["mean_C"]) - (p["mean_B"] - p["mean_A"]), abs_tol=1e-9)
    assert 0 <= p["tokens_equal_all"] <= p["tokens_equal_AC"] <= 2
    ft = [r for r in rows if r["kind"] == "first_token"]
    assert {(r["arm"], r["reference"]) for r in ft} == {("B", "A"), ("C", "A"), ("D", "A"), ("D", "B")}
    ca = [r for r in ft if (r["arm"], r["reference"]) == ("C", "A")]
    db = [r for r in ft if (r["arm"], r["reference"]) == ("D", "B")]
    assert all(r["agree"] and r["max_abs_diff"] <= 0.01 for r in ca + db)
    s = json.loads(summ.read_text())
    assert s["gate"] == "PASS" and s["suite"] == suite and s["n_docs"] == 2 * n_tasks
    assert s["served"] == "http" and s["served_stats"]["D"]["skipper"]["class"] == "FlexiDepthSkipper"
    assert set(s["wall_s"]) == set("ABCD") and s["options"][f"{suite}_max_gen_toks"] == GEN
    assert (work / "tasks").is_dir() and (work / "lm_eval_D.json").is_file()


def test_quality_tables_from_the_command(tiny_quality, tmp_path):
    d = tiny_quality
    qdir = d["root"] / "results" / "vskipper" / "quality"
    files = sorted(f for f in qdir.glob("*.jsonl") if not f.stem.endswith("_requests"))
    if not files:
        pytest.skip("run with test_quality_cell_end_to_end")
    out = tmp_path / "tables"
    from impl.cli import main

    main(["vskipper-tables", "--quality", *map(str, files), "--out-dir", str(out)])
    t5 = pd.read_csv(out / "vskipper_table5.csv")
    assert set(t5["suite"]) == {f.stem for f in files} and (t5["gate"] == "PASS").all()
    assert (out / "vskipper_first_token.md").is_file() and (out / "vskipper_gate.csv").is_file()
    from impl.vskipper.serving_report import quality_section_lines

    text = "\n".join(quality_section_lines(out))
    assert "**PASS**" in text and "FAIL" not in text


def test_quality_served_command(tiny_quality, tmp_path, capsys):
    """quality-served on the requests quality-cell wrote (run with test_quality_cell_end_to_end): a knee
    JSON gives the rate (0.95 x Q*), the thresholds JSON the hybrid's switch, the prompts the padding."""
    from impl.provenance import read_jsonl
    from impl.vskipper.mode import derive_thresholds

    d = tiny_quality
    qdir = d["root"] / "results" / "vskipper" / "quality"
    reqf = qdir / "coqa_requests.jsonl"
    if not reqf.is_file():
        pytest.skip("run with test_quality_cell_end_to_end")
    knee = tmp_path / "knee.json"
    knee.write_text(json.dumps({"workload": "gsm8k", "status": "ok", "bracketed": True, "q_star": 20.0,
                                "q_star_used": 20.0, "load_factors": {"knee": 0.95}, "load_points": {"knee": 19.0}}))
    prof = {"prefill": {"fixed_cost_s": 1e-3, "fixed_cost_per_row_s": 1e-6, "saving_per_row_layer_s": 1e-5},
            "decode": {"fixed_cost_s": 1e-3, "fixed_cost_per_row_s": 1e-6, "saving_per_row_layer_s": 1e-5}}
    prof = {**prof, "n_routed_layers": 2}
    thr = tmp_path / "thr.json"
    thr.write_text(json.dumps({"thresholds": derive_thresholds(prof, {"prefill": 0.5, "decode": 0.5})}))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "input_ids": list(range(3 + i, 30 + i))}) + "\n"
                               for i in range(3)))
    sdir = d["root"] / "results" / "vskipper" / "quality_served"
    out, summ = sdir / "coqa.jsonl", sdir / "coqa.json"
    _cli(d, "quality-served", "--model-dir", str(d["model"]), "--flexidepth", str(d["ckpt"]), "--thresholds", str(thr),
         "--knee", str(knee), "--requests", str(reqf), "--prompts", str(prompts), "--suite", "coqa",
         "--work-dir", str(sdir / "coqa_run"), "--out", str(out), "--summary", str(summ))
    rows = read_jsonl(out)
    kinds = {r["kind"] for r in rows}
    assert kinds == {"served_request", "served_doc", "served_arm", "served_summary"}, kinds
    reqs = [r for r in rows if r["kind"] == "served_request"]
    n_req = json.loads(d["config"].read_text())["vskipper"]["requests"]  # served.requests: null = this
    assert len(reqs) == 2 * n_req
    assert all(r["rate"] == pytest.approx(19.0) and r["point"] == "knee" and r["knee_workload"] == "gsm8k" for r in rows)
    docs = [r for r in rows if r["kind"] == "served_doc"]
    assert len(docs) == 2 * 2 and {r["arm"] for r in docs} == {"hybrid", "always-route"}
    by = {(r["doc_id"], r["arm"]): r for r in docs}
    cell = {r["doc_id"]: r for r in read_jsonl(qdir / "coqa.jsonl") if r["kind"] == "doc" and r["arm"] == "D"}
    for (doc, arm), r in by.items():
        assert r["prompt_hash"] == cell[doc]["prompt_hash"]
        if arm == "always-route":  # the same checkpoint, ids and request ids as the 2x2's arm D
            assert r["gen_ids"] == cell[doc]["gen_ids"]
    prim = [r for r in rows if r["kind"] == "served_summary" and r["primary"] and r["task"] is None]
    assert len(prim) == 1 and prim[0]["n"] == 2 and prim[0]["routed_share_always-route"] == 1.0
    assert 0.0 <= prim[0]["routed_share_hybrid"] <= 1.0
    s = json.loads(summ.read_text())
    assert s["status"] == "ok" and s["rate"] == pytest.approx(19.0) and len(s["stream"]) == n_req
    # the tables
    tdir = tmp_path / "tables"
    from impl.cli import main

    main(["vskipper-tables", "--quality-served", str(out), "--out-dir", str(tdir)])
    t = pd.read_csv(tdir / "vskipper_table5_served.csv")
    assert list(t["suite"]) == ["coqa"] * len(t) and (t["status"] == "ok").all()
    # a knee JSON without the configured load point is refused with the key named
    bad = tmp_path / "bad_knee.json"
    bad.write_text(json.dumps({**json.loads(knee.read_text()), "load_factors": {"below": 0.75}}))
    with pytest.raises(SystemExit):  # the CLI prints "error: vskipper.quality.served.point = 'knee' is not ..."
        _cli(d, "quality-served", "--model-dir", str(d["model"]), "--flexidepth", str(d["ckpt"]), "--thresholds",
             str(thr), "--knee", str(bad), "--requests", str(reqf), "--suite", "coqa", "--work-dir",
             str(tmp_path / "w"), "--out", str(tmp_path / "o.jsonl"), "--summary", str(tmp_path / "o.json"))
    assert "vskipper.quality.served.point = 'knee' is not a load point" in capsys.readouterr().err
