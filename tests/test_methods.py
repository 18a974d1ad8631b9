"""Every method behind the one interface of impl.methods: exact against AR, critical-path layers
charged, bad parameters rejected before decoding."""

import pytest

from impl.methods import build_method, decode_prompts
from impl.spec.ar import ar_decode
from impl.spec.sampling import DecodeRule

CASES = [
    ("ar", {}),
    ("dex", {"exploration_set": [3, 6, 9, 12], "dedupe": True}),
    ("self_spec", {"exit_layer": 3, "num_speculations": 4}),
    ("adadecode", {"shortcut_layers": [4, 8], "threshold": 0.05, "num_speculations": 4}),
    ("dynamic_exit", {"confidence_threshold": 0.0}),
    ("lookahead", {"window": 3, "ngram": 3, "max_candidates": 3}),
]


@pytest.mark.parametrize("name,params", CASES)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_methods_equal_ar(tiny_model, name, params, temperature):
    rule = DecodeRule(temperature, seed=11)
    run = build_method(name, tiny_model, rule, params)
    prompt = [4, 9, 33, 2, 71]
    out = run(prompt, 14, None)
    assert out["token_ids"] == ar_decode(tiny_model, prompt, 14, rule=rule).tokens
    assert out["critical_layers_total"] > 0  # a selection baseline may charge more than AR's L per token
    if name == "ar":
        assert out["critical_layers_total"] == 12 * 14


def test_bad_parameters(tiny_model):
    with pytest.raises(ValueError, match="unknown parameter"):
        build_method("self_spec", tiny_model, DecodeRule(), {"exit_layer": 3, "num_speculations": 2, "x": 1})
    with pytest.raises(ValueError, match="unknown method"):
        build_method("nope", tiny_model, DecodeRule(), {})
    # out-of-range or missing values fail once, before any prompt is decoded (not as per-row errors)
    with pytest.raises(ValueError, match="exit_layer"):
        decode_prompts(tiny_model, None, [{"id": "a", "input_ids": [1, 2]}], "self_spec",
                       {"exit_layer": 12, "num_speculations": 2}, DecodeRule(), 4, None)


@pytest.mark.parametrize("name,params,needle", [
    ("self_spec", {}, "missing parameter"),
    ("self_spec", {"exit_layer": 99, "num_speculations": 2}, "exit_layer"),
    ("self_spec", {"exit_layer": 3, "num_speculations": 0}, "num_speculations"),
    ("adadecode", {"shortcut_layers": [4, 8], "threshold": 0.5}, "missing parameter"),
    ("adadecode", {"shortcut_layers": [8, 4], "threshold": 0.5, "num_speculations": 2}, "increasing"),
    ("adadecode", {"shortcut_layers": [4, 12], "threshold": 0.5, "num_speculations": 2}, r"\[1, 11\]"),
    ("adadecode", {"shortcut_layers": [4], "threshold": 1.5, "num_speculations": 2}, "threshold"),
    ("dynamic_exit", {"exit_layers": [0, 3]}, "exit_layers"),
    ("dynamic_exit", {"confidence_threshold": -1}, "confidence_threshold"),
])
def test_baseline_parameters_checked_before_decoding(tiny_model, name, params, needle):
    with pytest.raises(ValueError, match=needle):
        build_method(name, tiny_model, DecodeRule(), params)


def test_dflash_chain_is_the_trained_head_arm(tiny_model, tmp_path):
    """TEV's block drafter, saved and loaded by directory, drafting a chain verified by one target pass
    per round: the ids equal AR's (with and without EOS), the rounds and the layer accounting add up,
    and what it cannot do is refused before decoding."""
    import torch

    from impl.tev.drafter import BlockDrafter, DrafterConfig

    torch.manual_seed(0)
    BlockDrafter(tiny_model, DrafterConfig(block_size=4, n_layers=1)).save(tmp_path / "drafter")
    run = build_method("dflash_chain", tiny_model, DecodeRule(), {"drafter": str(tmp_path / "drafter"), "depth": 3})
    prompt = [4, 9, 33, 2, 71]
    ar = ar_decode(tiny_model, prompt, 14).tokens
    out = run(prompt, 14, None)
    assert out["token_ids"] == ar
    assert out["spec_rounds"] <= 14 and out["critical_layers_total"] == (12 + 1) * out["spec_rounds"]
    assert 0 <= out["accepted"] <= out["drafted"]
    eos = ar[6]
    assert run(prompt, 14, eos)["token_ids"] == ar_decode(tiny_model, prompt, 14, eos_token_id=eos).tokens
    rows = decode_prompts(tiny_model, None, [{"id": "a", "input_ids": prompt}], "trained_head",
                          {"drafter": str(tmp_path / "drafter"), "depth": 2}, DecodeRule(), 8, None)
    assert rows[0]["ar_match"] is True
    with pytest.raises(ValueError, match="depth"):
        build_method("dflash_chain", tiny_model, DecodeRule(), {"drafter": str(tmp_path / "drafter"), "depth": 5})
    with pytest.raises(ValueError, match="greedy"):
        build_method("dflash_chain", tiny_model, DecodeRule(1.0, 3), {"drafter": str(tmp_path / "drafter"), "depth": 2})
    with pytest.raises(FileNotFoundError):
        build_method("dflash_chain", tiny_model, DecodeRule(), {"drafter": str(tmp_path / "none"), "depth": 2})
