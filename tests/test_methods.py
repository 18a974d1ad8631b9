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
