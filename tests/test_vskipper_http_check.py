"""The engine arms over HTTP (impl/vskipper/http_check.py) on a tiny random Llama saved with a tokenizer:
every arm passes every check (OpenAI-style client with ignore_eos + streaming, greedy ids equal to the
arm in process, lm-eval local-completions on the offline GSM8K task, endpoints) and records its routed
share; a deliberately wrong in-process reference (dense ids for a routed arm) or a failing one yields
FAIL rows; bad arguments are refused; the command writes the CSV + summary and the report section
renders them, and a failed run leaves no output file."""

import argparse
import csv
import json

import pytest

from impl.vskipper import http_check as hc
from impl.vskipper.http_check import ARMS, COLUMNS, DEFAULT_CHECKS, check_arms, in_process_reference, write_outputs
from impl.vskipper.schema import Engine
from conftest import save_wide_llama

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SPEC = "randomskip:r=0.6,d=0.5,seed=3"
ENGINE = dict(page_size=16, num_blocks=64, max_batch_tokens=24, max_requests_per_batch=8)  # chunked prefill
NEW = 6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tiny_tokenizer):
    """A seeded random 4-layer Llama over the tiny tokenizer's vocabulary, saved with the tokenizer
    (as tests/test_vskipper_server.py: wide init so routes change the greedy ids)."""
    d = tmp_path_factory.mktemp("http_model")
    save_wide_llama(d, tiny_tokenizer, 128)
    return d


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory, tiny_tokenizer):
    """A workload suite file as rule workload_tokens writes it (id, text, input_ids)."""
    p = tmp_path_factory.mktemp("wl") / "gsm8k.jsonl"
    texts = ["Question: how many apples?\nAnswer:", "def f(x):\n    return", "Answer: 3 apples. #### 3"]
    with open(p, "w") as fh:
        for i, t in enumerate(texts):
            rec = {"id": f"gsm8k-{i:04d}", "text": t, "input_ids": tiny_tokenizer(t)["input_ids"]}
            fh.write(json.dumps(rec) + "\n")
    return p


def _run(model_dir, prompts_file, **kw):
    base = dict(skipper_spec=SPEC, prompts=prompts_file, n_prompts=2, max_tokens=NEW, engine=Engine(**ENGINE), label="tiny")
    return check_arms(model_dir, **{**base, **kw})


def test_every_arm_passes_every_check(model_dir, prompts_file, data_dir):
    rows = _run(model_dir, prompts_file, data_dir=data_dir, limit=2, num_fewshot=0, max_gen_toks=8)
    assert [(r["arm"], r["check"]) for r in rows] == [(a, c) for a in ARMS for c in DEFAULT_CHECKS]
    bad = [(r["arm"], r["check"], r["detail"]) for r in rows if r["verdict"] != "PASS"]
    assert not bad, bad
    for r in rows:
        assert set(r) == set(COLUMNS) and r["model"] == "tiny"
        assert r["skipper"] == ("" if r["arm"] == "upstream" else SPEC)
        if r["check"] in ("client_stream", "greedy_ids", "openai_sdk"):
            assert r["max_tokens"] == NEW and r["tokens_exact"] is True
            assert r["requests"] == (2 if r["check"] != "openai_sdk" else 3 * 2 + 3)
        if r["check"] == "openai_sdk":  # the SDK's streams end with a usage-only chunk; text equals in-process
            assert r["text_match"] is True and "2/2 streams (include_usage) equal" in r["detail"]
        if r["check"] == "lm_eval":
            assert r["served_requests"] == 2 and r["metric"] == "exact_match,composite"
            assert 0.0 <= r["metric_value"] <= 1.0
    by = {(r["arm"], r["check"]): r for r in rows}
    up = by[("upstream", "greedy_ids")]
    assert up["routed_share"] == 0.0 and up["skip_share"] is None
    # the hybrid switch routes at this load (every row routed), and routing skips rows
    for arm in ("hybrid", "always-route"):
        g = by[(arm, "greedy_ids")]
        assert g["routed_share"] == 1.0 and 0.0 < g["skip_share"] < 1.0
        assert "2/2 routed in some phase" in g["detail"]
    assert "0/2 routed" in by[("upstream", "greedy_ids")]["detail"]


def test_mechanism_ablation_arms_equal_their_in_process_reference(model_dir, prompts_file):
    """The Table 3 ablations serve under the same switch as the reference (ModeSwitch.ablation), so
    the streamed ids equal the in-process ones; never-route routes nothing, the others route."""
    arms = ["prefill-only", "decode-only", "no-promotion", "never-route"]
    rows = _run(model_dir, prompts_file, arms=arms, checks=["greedy_ids", "openai_sdk"])
    bad = [(r["arm"], r["check"], r["detail"]) for r in rows if r["verdict"] != "PASS"]
    assert not bad, bad
    by = {(r["arm"], r["check"]): r for r in rows}
    assert "0/2 routed" in by[("never-route", "greedy_ids")]["detail"]
    for arm in ("prefill-only", "decode-only", "no-promotion"):
        assert "2/2 routed in some phase" in by[(arm, "greedy_ids")]["detail"], by[(arm, "greedy_ids")]["detail"]


def test_wrong_reference_fails(model_dir, prompts_file):
    def dense_for_everyone(model_dir, arm, spec, prompts, rids, max_tokens, **kw):
        return in_process_reference(model_dir, "upstream", None, prompts, rids, max_tokens, **kw)

    rows = _run(model_dir, prompts_file, arms=["always-route"], checks=["openai_sdk", "client_stream", "greedy_ids"],
                reference=dense_for_everyone)
    assert [r["check"] for r in rows] == ["client_stream", "greedy_ids", "openai_sdk"]  # CHECKS' order
    assert all(r["verdict"] == "FAIL" for r in rows), rows
    assert rows[2]["text_match"] is False and "texts equal in-process" in rows[2]["detail"]
    ids = rows[1]
    assert ids["ids_match"] is False and ids["tokens_exact"] is True  # right length, wrong ids
    assert "differ from in-process" in ids["detail"]
    assert rows[0]["text_match"] is False and rows[0]["tokens_exact"] is True

    def broken(*a, **kw):
        raise RuntimeError("boom")

    rows = _run(model_dir, prompts_file, arms=["upstream"], checks=["greedy_ids", "endpoints"], reference=broken)
    assert rows[0]["verdict"] == "FAIL" and "in-process reference failed: RuntimeError: boom" in rows[0]["detail"]
    assert rows[1]["verdict"] == "PASS"  # the other checks still run

    # a skipper the server refuses: every check of the arm FAILs, the run goes on
    rows = _run(model_dir, prompts_file, arms=["upstream", "always-route"], checks=["greedy_ids", "endpoints"],
                skipper_spec="randomskip:r=0.5,d=0.5,layers=0-99")
    assert [r["verdict"] for r in rows] == ["PASS", "PASS", "FAIL", "FAIL"]
    assert all("the server did not start: ValueError" in r["detail"] for r in rows[2:])


def test_bad_arguments(model_dir, prompts_file, tmp_path):
    with pytest.raises(ValueError, match="unknown arm"):
        _run(model_dir, prompts_file, arms=["sideways"])
    with pytest.raises(ValueError, match="unknown check"):
        _run(model_dir, prompts_file, checks=["vibes"])
    with pytest.raises(ValueError, match="need a skipper"):
        _run(model_dir, prompts_file, skipper_spec=None, checks=["endpoints"])
    with pytest.raises(ValueError, match="needs data_dir"):
        _run(model_dir, prompts_file, checks=["lm_eval"])
    with pytest.raises(FileNotFoundError):
        _run(tmp_path / "nope", prompts_file)
    with pytest.raises(FileNotFoundError):
        hc.load_prompts(tmp_path / "missing.jsonl", 2)
    ids, names = hc.load_prompts(prompts_file, 10)  # fewer in the file: all of them
    assert len(ids) == 3 and names[0] == "gsm8k-0000"
    assert hc.default_skipper_specs(None) == ["randomskip:r=0.5,d=0.5"]
    assert hc.default_skipper_specs(tmp_path) == ["randomskip:r=0.5,d=0.5"]  # no flexidepth.json there
    (tmp_path / "flexidepth.json").write_text("{}")
    assert hc.default_skipper_specs(tmp_path) == [f"flexidepth:{tmp_path}"]


def _parser():
    from impl.vskipper import commands

    p = argparse.ArgumentParser()
    sub = p.add_subparsers()

    def add(name, fn, help_, config=True):  # impl.cli.build_parser's add; the config comes from the patch
        sp = sub.add_parser(name)
        sp.add_argument("--quiet", action="store_true")
        sp.set_defaults(fn=fn)
        return sp

    commands.register(add)
    return p


def test_command_writes_rows_summary_and_report(model_dir, prompts_file, tmp_path, monkeypatch, data_dir):
    from impl.vskipper.http_report import report_section

    from conftest import smoke_config

    cfg = smoke_config(seed=0, threads=1, device="cpu", dtype="float32", data_dir=str(data_dir),
                       vskipper={"engine": ENGINE, "randomskip": {"seed": 3}})
    monkeypatch.setattr("impl.runtime.config_from_args", lambda args: cfg)
    out = tmp_path / "http" / "tiny.csv"
    summ = tmp_path / "http" / "tiny.json"
    args = _parser().parse_args(["vskipper-http-check", "--quiet", "--model-dir", str(model_dir), "--prompts",
                                 str(prompts_file), "--arms", "upstream", "always-route", "--checks", "endpoints",
                                 "greedy_ids", "--n-prompts", "1", "--max-tokens", "4", "--label", "tiny",
                                 "--out", str(out), "--summary", str(summ)])
    args.fn(args)
    with open(out) as fh:
        rows = list(csv.DictReader(fh))
    assert list(rows[0]) == list(COLUMNS) and len(rows) == 4
    assert {r["verdict"] for r in rows} == {"PASS"}
    assert rows[2]["skipper"] == "randomskip:r=0.5,d=0.5,seed=3,layer_choice=per_row"
    s = json.loads(summ.read_text())
    assert s["all_pass"] and s["counts"] == {"PASS": 4, "FAIL": 0} and s["settings"]["max_tokens"] == 4
    assert s["label"] == "tiny" and "git_sha" in s and s["wall_s"] > 0
    lines = "\n".join(report_section(out.parent, tmp_path, tmp_path))
    assert "## vSkipper: engine arms over HTTP" in lines and "All checks: **PASS** (4/4)" in lines
    assert "| tiny    | always-route | RandomSkip r=0.5 d=0.5" in lines and "(http/tiny.csv)" in lines

    # a FAIL row is reported with its detail
    rows_fail = [dict(r, verdict="FAIL", detail="broken on purpose") if i == 0 else r for i, r in enumerate(rows)]
    write_outputs(rows_fail, out, summ)
    lines = "\n".join(report_section(out.parent, tmp_path, tmp_path))
    assert "All checks: **FAIL** (3/4)" in lines and "broken on purpose" in lines

    # a run that fails leaves no output file behind
    bad_out, bad_summ = tmp_path / "bad" / "x.csv", tmp_path / "bad" / "x.json"
    args = _parser().parse_args(["vskipper-http-check", "--quiet", "--model-dir", str(tmp_path / "nope"),
                                 "--prompts", str(prompts_file), "--out", str(bad_out), "--summary", str(bad_summ)])
    with pytest.raises(FileNotFoundError):
        args.fn(args)
    assert not bad_out.exists() and not bad_summ.exists()
