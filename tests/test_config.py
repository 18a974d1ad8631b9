"""Bad configs fail before any job starts, with one line naming the key or path."""

import copy
from pathlib import Path

import pytest
import yaml

from impl.config import ConfigError, load_config, validate_config

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture()
def cfg(data_dir):
    c = yaml.safe_load((ROOT / "configs" / "smoke.yaml").read_text())
    c["data_dir"] = str(data_dir)
    return c


def _err(c, **kw):
    with pytest.raises(ConfigError) as e:
        validate_config(c, **kw)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


@pytest.mark.parametrize("name", ["default.yaml", "smoke.yaml"])
def test_shipped_configs_validate(name, data_dir):
    c = yaml.safe_load((ROOT / "configs" / name).read_text())
    assert c["data_dir"] == "../shared/data"
    c["data_dir"] = str(data_dir)
    out = validate_config(c)
    chains = [[2, 4, 12], [3, 6, 12]]
    if name == "default.yaml":  # smollm2 (30 layers) beside tiny-ls (12)
        chains += [[2, 6, 30], [5, 10, 30], [3, 15, 30]]
    assert out["ead"]["nested_chains"] == chains


def test_unknown_key_named(cfg):
    cfg["training"]["stepz"] = 3
    assert "training.stepz" in _err(cfg)
    c = copy.deepcopy(cfg)
    c["bogus"] = 1
    assert "'bogus'" in _err(c)


def test_wrong_type_named(cfg):
    cfg["training"]["steps"] = "many"
    assert "training.steps" in _err(cfg)
    cfg["training"]["steps"] = 0
    assert "training.steps" in _err(cfg)


def test_unknown_workload_and_references(cfg):
    c = copy.deepcopy(cfg)
    c["workloads"]["nosuch"] = {"n_prompts": 2}
    assert "nosuch" in _err(c)
    c = copy.deepcopy(cfg)
    c["ead"]["models"] = ["tiny-ls", "ghost"]
    assert "ead.models[1]" in _err(c)
    c = copy.deepcopy(cfg)
    c["ead"]["workloads"] = ["math500"]
    assert "ead.workloads[0]" in _err(c)
    c = copy.deepcopy(cfg)
    c["ead"]["nested_chains"] = [[5, 12]]
    assert "ead.nested_chains[0]" in _err(c)
    c = copy.deepcopy(cfg)
    c["ead"]["compare"] = {"baseline": "tiny-std", "treatment": "x"}
    assert "ead.compare.treatment" in _err(c)


def test_context_budget(cfg):
    cfg["max_prompt_tokens"] = 10_000
    assert "max_prompt_tokens" in _err(cfg)


def test_missing_data_dir_and_file(cfg, tmp_path):
    c = copy.deepcopy(cfg)
    c["data_dir"] = str(tmp_path / "nowhere")
    assert "data_dir" in _err(c)
    (tmp_path / "gsm8k").mkdir()
    c["data_dir"] = str(tmp_path)
    msg = _err(c)
    assert "workloads." in msg and str(tmp_path) in msg


def test_missing_pretrained_model_dir(cfg, tmp_path):
    cfg["models"]["big"] = {"kind": "pretrained", "path": str(tmp_path / "llama")}
    msg = _err(cfg)
    assert "models.big.path" in msg
    del cfg["models"]["big"]["path"]
    assert "path" in _err(cfg, check_paths=False)


def test_yaml_errors(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("a: [1,\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(p)
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "none.yaml")


def test_template_fields_checked_before_jobs(cfg):
    cfg["workloads"]["gsm8k"]["template"] = "Q: {questoin}"
    msg = _err(cfg)
    assert "workloads.gsm8k.template" in msg and "questoin" in msg and "question" in msg


def test_env_data_dir_overrides(cfg, monkeypatch, data_dir):
    cfg["data_dir"] = "/nonexistent"
    monkeypatch.setenv("IMPL_DATA_DIR", str(data_dir))
    assert validate_config(cfg)["data_dir"] == str(data_dir)
    monkeypatch.setenv("IMPL_DATA_DIR", "/nope")
    assert "IMPL_DATA_DIR" in _err(cfg)


def test_suite_prompt_cap_in_the_context_budget(cfg):
    suite = next(iter(cfg["workloads"]))
    cfg["workloads"][suite]["max_prompt_tokens"] = 10_000
    assert f"workloads.{suite}.max_prompt_tokens" in _err(cfg)
    cfg["workloads"][suite]["max_prompt_tokens"] = 1
    assert f"workloads.{suite}.max_prompt_tokens" in _err(cfg)


def test_prompt_cap_per_suite(cfg):
    from impl.schema import core_config, prompt_cap

    s0, s1 = list(cfg["workloads"])[:2]
    cfg["workloads"][s0]["max_prompt_tokens"] = 64
    core = core_config(validate_config(cfg))
    assert prompt_cap(core, s0) == 64
    assert prompt_cap(core, s1) == core.max_prompt_tokens != 64
    assert prompt_cap(core, None) == prompt_cap(core, "not-a-suite") == core.max_prompt_tokens


def test_tokenize_command_applies_the_suite_cap(cfg, tmp_path, tiny_tokenizer):
    """`python -m impl tokenize` caps a suite's prompts at its own max_prompt_tokens (truncate_left keeps
    the tail), and the other suites at the top-level cap."""
    import json

    from impl.cli import main

    suites = list(cfg["workloads"])
    cfg["workloads"][suites[0]]["max_prompt_tokens"] = 8
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    tiny_tokenizer.save_pretrained(tmp_path / "tok")
    text = "Question: what is two plus two? " * 40
    lens = {}
    for s in suites[:2]:
        (tmp_path / f"{s}.jsonl").write_text(json.dumps({"id": "a", "suite": s, "source_id": "0", "text": text}) + "\n")
        main(["tokenize", "--config-json", f"@{tmp_path / 'cfg.json'}", "--model-dir", str(tmp_path / "tok"),
              "--prompts", str(tmp_path / f"{s}.jsonl"), "--out", str(tmp_path / f"{s}.tok.jsonl")])
        lens[s] = len(json.loads((tmp_path / f"{s}.tok.jsonl").read_text())["input_ids"])
    assert lens[suites[0]] == 8
    assert 8 < lens[suites[1]] <= cfg.get("max_prompt_tokens", 512)


def test_tev_target_prompts_fit_the_frozen_suites(cfg):
    cfg["tev"]["target_prompts"] = cfg["workloads"]["gsm8k"]["n_prompts"] + 1
    msg = _err(cfg)
    assert "'tev.target_prompts'" in msg and "'workloads.gsm8k.n_prompts'" in msg
    cfg["tev"]["target_prompts"] = 0
    assert "target_prompts" in _err(cfg)
    cfg["tev"]["target_prompts"] = None
    assert validate_config(cfg)["tev"]["target_prompts"] is None


def test_tev_latency_vocab_sizes_hold_the_largest_tree(cfg):
    """A restricted vocabulary below 2 * max(budgets) + 1 is refused when the config is read, naming the
    key, not by tev-latency after the model is loaded."""
    cfg["tev"]["latency"] = {"budgets": [32, 64], "vocab_sizes": [4096, 100]}
    msg = _err(cfg)
    assert "'tev.latency.vocab_sizes[1]' = 100" in msg and "= 129" in msg
    cfg["tev"]["latency"]["vocab_sizes"] = [129]
    assert validate_config(cfg)["tev"]["latency"]["vocab_sizes"] == [129]


def test_an_overlay_alone_is_named_as_such():
    """An overlay given alone lacks the top-level keys: the one-line error says to merge it onto a full config."""
    raw = yaml.safe_load((ROOT / "configs" / "sglang.yaml").read_text())
    with pytest.raises(ConfigError, match=r"'data_dir' is a required property.*--configfile configs/default\.yaml <overlay>"):
        validate_config(raw)
