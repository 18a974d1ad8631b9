"""impl.quality.tasks: lm-eval task YAMLs generated over the local data folder, loaded by lm-eval 0.4.13
fully offline (vSkipper Sec. 4.1 "Quality"): the YAMLs name the data folder's files, lm-eval builds the
documented prompts from them, and scores a stub model's responses with the composite GSM8K filter,
the BBH answer filter and CoQA F1."""

import json
from pathlib import Path

import pytest
import yaml

pytest.importorskip("lm_eval")

from lm_eval.api.model import LM  # noqa: E402

from impl.vskipper.quality_run import offline  # noqa: E402
from impl.quality.tasks import QUALITY_SUITES, TaskOptions, bbh_task_names, write_task_yamls  # noqa: E402
from impl.workloads.suites import DEFAULT_TEMPLATES, load_records  # noqa: E402

BBH = ("boolean_expressions", "dyck_languages")


class _Loader(yaml.SafeLoader):
    pass


_Loader.add_constructor("!function", lambda loader, node: ("!function", loader.construct_scalar(node)))


def _opts(tmp_path):
    return TaskOptions(bbh_subtasks=BBH, gsm8k_max_gen_toks=32, datasets_cache_dir=str(tmp_path / "hf"))


def test_yamls_point_at_the_data_folder(tmp_path, data_dir):
    ts = write_task_yamls(data_dir, tmp_path / "tasks", QUALITY_SUITES, _opts(tmp_path))
    assert ts.tasks == {"gsm8k": ["vsk_gsm8k"], "bbh": [f"vsk_bbh_{t}" for t in BBH], "coqa": ["vsk_coqa"]}
    root = Path(data_dir).resolve()
    for name, path in ts.files.items():
        cfg = yaml.load(path.read_text(), Loader=_Loader)
        assert cfg["task"] == name and cfg["dataset_path"] == "json"
        files = cfg["dataset_kwargs"]["data_files"]
        assert files == ts.data_files[name]
        for f in files.values():
            assert Path(f).is_file() and Path(f).resolve().is_relative_to(root), f
        assert cfg["dataset_kwargs"]["cache_dir"] == str(tmp_path / "hf")
        assert cfg["output_type"] == "generate_until" and cfg["generation_kwargs"]["do_sample"] is False
    gsm = yaml.load(ts.files["vsk_gsm8k"].read_text(), Loader=_Loader)
    assert gsm["num_fewshot"] == 5 and gsm["generation_kwargs"]["max_gen_toks"] == 32
    assert [f["name"] for f in gsm["filter_list"]] == ["strict-match", "flexible-extract", "composite"]
    assert gsm["filter_list"][2]["filter"][0]["filter_fn"] == ("!function", "impl.quality.scoring.gsm8k_composite_filter")
    meta = json.loads((tmp_path / "tasks" / "tasks.json").read_text())
    assert meta["data_dir"] == str(root) and meta["options"]["bbh_subtasks"] == list(BBH)
    assert len(bbh_task_names(data_dir)) == 27


def test_unknown_suite_and_missing_data(tmp_path, data_dir):
    with pytest.raises(ValueError, match="unknown quality suite"):
        write_task_yamls(data_dir, tmp_path / "t", ["mmlu"])
    with pytest.raises(ValueError, match="unknown BBH task"):
        write_task_yamls(data_dir, tmp_path / "t", ["bbh"], TaskOptions(bbh_subtasks=("nope",)))
    with pytest.raises(FileNotFoundError, match="gsm8k"):
        write_task_yamls(tmp_path / "empty", tmp_path / "t", ["gsm8k"])


class _Stub(LM):
    """Answers every request with a fixed string per task and remembers the requests."""

    def __init__(self, answers):
        super().__init__()
        self.answers = answers
        self.requests = []

    def loglikelihood(self, requests, disable_tqdm=False):
        raise NotImplementedError

    def loglikelihood_rolling(self, requests, disable_tqdm=False):
        raise NotImplementedError

    def generate_until(self, requests, disable_tqdm=False):
        self.requests += requests
        return [self.answers(r) for r in requests]


def test_lm_eval_loads_the_tasks_offline(tmp_path, data_dir):
    import lm_eval
    from lm_eval.tasks import TaskManager

    ts = write_task_yamls(data_dir, tmp_path / "tasks", QUALITY_SUITES, _opts(tmp_path))
    gsm = load_records("gsm8k", data_dir)
    gsm_finals = [r["fields"]["answer"].split("####")[-1].strip() for r in gsm[:2]]

    def answers(req):
        if req.task_name == "vsk_gsm8k":
            # doc 0: marked answer then a confidence epilogue (strict parses); doc 1: no marker, the
            # right number last (flexible fallback)
            return (f" So {gsm_finals[0]}.\n#### {gsm_finals[0]}\nConfidence: 95%" if req.doc_id == 0
                    else f" The total is 3 + 4 = {gsm_finals[1]}")
        if req.task_name.startswith("vsk_bbh_"):
            return f" ... So the answer is {req.doc['target']}."
        return " " + req.doc["answers"][-1]["input_text"] + "\nQ: extra"

    lm = _Stub(answers)
    with offline():
        tm = TaskManager(include_path=str(ts.include_path), include_defaults=False)
        res = lm_eval.simple_evaluate(model=lm, tasks=ts.task_names, task_manager=tm, limit=2, log_samples=True,
                                      bootstrap_iters=0)
    r = res["results"]
    assert r["vsk_gsm8k"]["exact_match,composite"] == 1.0
    assert r["vsk_gsm8k"]["exact_match,strict-match"] == 0.5  # doc 1 has no marker
    assert r["vsk_gsm8k"]["exact_match,flexible-extract"] == 0.5  # doc 0 reads the 95 of the epilogue
    for t in BBH:
        assert r[f"vsk_bbh_{t}"]["exact_match,get-answer"] == 1.0
    assert r["vsk_coqa"]["f1,none"] == 1.0 and r["vsk_coqa"]["em,none"] == 1.0
    assert {len(s) for s in res["samples"].values()} >= {2}

    by = {(q.task_name, q.doc_id): q.args for q in lm.requests}
    assert len(by) == 2 * len(ts.task_names)
    # GSM8K: lm-eval's 5-shot "Question: ...\nAnswer:" prompt ending with the test question
    ctx, gen = by[("vsk_gsm8k", 0)]
    assert ctx.endswith(f"Question: {gsm[0]['fields']['question']}\nAnswer:") and ctx.count("Question: ") == 6
    assert gen["until"][0] == "Question:" and gen["max_gen_toks"] == 32 and gen["do_sample"] is False
    # BBH: exactly the frozen serving suite's CoT rendering (SOURCES.md protocol)
    recs = {r["source_id"]: r["fields"] for r in load_records("bbh", data_dir)}
    for t in BBH:
        for doc in (0, 1):
            want = DEFAULT_TEMPLATES["bbh"].format(**recs[f"{t}/{doc}"])
            assert by[(f"vsk_bbh_{t}", doc)][0] == want
    # CoQA: story, earlier turns with answers, last question then "A:"
    story = json.loads((Path(data_dir) / "coqa/coqa_test_bigbench.json").read_text())["data"][0]
    ctx = by[("vsk_coqa", 0)][0]
    assert ctx.startswith(story["story"] + "\n\n") and ctx.endswith(f"Q: {story['questions'][-1]['input_text']}\n\nA:")
    assert f"Q: {story['questions'][0]['input_text']}\n\nA: {story['answers'][0]['input_text']}\n\n" in ctx
    assert by[("vsk_coqa", 0)][1]["until"] == ["\nQ:"]


def test_quality_tasks_command_writes_the_yamls_and_prints_the_lm_eval_command(tmp_path, capsys, data_dir,
                                                                                  monkeypatch):
    from impl.cli import main

    monkeypatch.setenv("IMPL_DATA_DIR", str(data_dir))
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "tasks"
    main(["quality-tasks", "--config", str(root / "configs" / "smoke.yaml"), "--out", str(out), "--suites", "gsm8k"])
    text = capsys.readouterr().out
    assert (out / "vsk_gsm8k.yaml").is_file()
    assert "lm_eval --model local-completions" in text and f"--include_path {out}" in text
    assert "--tasks vsk_gsm8k " in text
    with pytest.raises(SystemExit, match="invalid choice|2"):
        main(["quality-tasks", "--config", str(root / "configs" / "smoke.yaml"), "--out", str(out),
              "--suites", "mmlu"])
