"""impl.quality.scoring on hand-built strings: the GSM8K composite filter (strict-match when it parses,
otherwise flexible-extract; vSkipper App. E.2), BBH answer extraction, CoQA EM / F1 (official
normalisation, leave-one-out over references)."""

import pytest

pytest.importorskip("lm_eval")

from impl.quality.scoring import (  # noqa: E402
    answer_f1,
    bbh_extract,
    coqa_scores,
    gsm8k_composite,
    gsm8k_composite_filter,
    gsm8k_flexible,
    gsm8k_strict,
    normalize_answer,
)


@pytest.mark.parametrize(
    "text, strict, flexible, composite, source",
    [
        # marked answer followed by a confidence epilogue: flexible misreads 95, strict and composite read 594
        ("She pays 600 - 6 = 594.\n#### 594\nConfidence: 95%", "594", "95", "594", "strict"),
        # no marker: strict is invalid, composite falls back to the last number
        ("Tom has 3 + 4 = 7 apples. The answer is 7.", "[invalid]", "7.", "7.", "flexible"),
        # marker followed by something strict-match cannot parse ("#### $21"): fallback
        ("It costs 21 dollars.\n#### $21", "[invalid]", "$21", "$21", "flexible"),
        # negative and comma numbers are strict
        ("so -1,250 in all\n#### -1,250", "-1,250", "-1,250", "-1,250", "strict"),
        # two markers: strict takes the first
        ("#### 12\nwait\n#### 13", "12", "13", "12", "strict"),
        # nothing numeric
        ("I do not know.", "[invalid]", "[invalid]", "[invalid]", "invalid"),
    ],
)
def test_gsm8k_composite(text, strict, flexible, composite, source):
    assert gsm8k_strict(text) == strict
    assert gsm8k_flexible(text) == flexible
    assert gsm8k_composite(text) == (composite, source)


def test_composite_filter_is_an_lm_eval_filter_function():
    resps = [["#### 5\nConfidence: 90%"], ["total 8"], ["none"]]
    assert gsm8k_composite_filter(resps, [None] * 3) == [["5"], ["8"], ["[invalid]"]]
    # lm-eval's custom filter + take_first, as the generated YAML wires it
    from lm_eval.filters import build_filter_ensemble

    ens = build_filter_ensemble("composite", [("custom", {"filter_fn": gsm8k_composite_filter}), ("take_first", None)])
    from lm_eval.api.instance import Instance

    insts = [Instance("generate_until", {}, ("q", {}), i, resps=r) for i, r in enumerate(resps)]
    ens.apply(insts)
    assert [i.filtered_resps["composite"] for i in insts] == ["5", "8", "[invalid]"]


def test_composite_scored_with_lm_eval_exact_match():
    """The composite answer is scored against the gold with lm-eval's gsm8k exact_match normalisation."""
    from lm_eval.api.metrics import exact_match_hf_evaluate

    ignore = [",", "\\$", "(?s).*#### ", "\\.$"]
    gold = "Janet sells 9 eggs.\n#### 1,250"
    for text, want in (("#### 1,250\nConfidence: 95%", 1.0), ("so 1250.", 1.0), ("#### 1251", 0.0)):
        pred, _ = gsm8k_composite(text)
        em = exact_match_hf_evaluate([pred], [gold], regexes_to_ignore=ignore, ignore_case=True,
                                     ignore_punctuation=False)["exact_match"]
        assert em == want, (text, pred)


def test_bbh_extract():
    assert bbh_extract("A: step... So the answer is (B).") == "(B)"
    assert bbh_extract("So the answer is ] } ].") == "] } ]"
    assert bbh_extract("So the answer is -12.") == "-12"
    assert bbh_extract("I give up") == "[invalid]"


def test_coqa_f1_hand_built():
    assert normalize_answer("The  Cat, sat!") == "cat sat"
    assert answer_f1("the cat sat", "a cat sat down") == pytest.approx(2 * (2 / 3) * 1 / (2 / 3 + 1))
    assert answer_f1("Mickey Mouse", "mickey mouse.") == 1.0
    assert answer_f1("yes", "no") == 0.0
    assert answer_f1("", "") == 1.0 and answer_f1("the", "cat") == 0.0  # empty after normalisation
    # one reference
    assert coqa_scores(["Walt Disney"], "Disney") == {"em": 0.0, "f1": pytest.approx(2 / 3)}
    # several references: mean over i of the max over the others (leave one out)
    golds = ["white", "white cat", "a white cat"]
    s = coqa_scores(golds, "white cat")
    f = [max(answer_f1(g, "white cat") for j, g in enumerate(golds) if j != i) for i in range(3)]
    assert s["f1"] == pytest.approx(sum(f) / 3) and s["f1"] == pytest.approx(1.0)
    assert s["em"] == pytest.approx(1.0)
    s = coqa_scores(["white", "white cat"], "white")
    assert s["f1"] == pytest.approx((answer_f1("white cat", "white") + 1.0) / 2) and s["em"] == 0.5
    with pytest.raises(ValueError):
        coqa_scores([], "x")
