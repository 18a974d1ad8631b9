"""impl.quality.did and the arms' shared pieces: the per-document paired DiD equals impl.stats, the
identical-prompt gate refuses mismatches, lm-eval samples become per-document scores, first-token
agreement, and the arms tokenize and stop exactly as lm-eval's HF backend does."""

import numpy as np
import pytest
import torch

pytest.importorskip("lm_eval")

from impl.vskipper.quality_arms import GenRecord, StopRule, encode_context, prompt_hash  # noqa: E402
from impl.quality.did import (  # noqa: E402
    PromptMismatchError,
    check_prompt_hashes,
    first_token_agreement,
    per_doc_scores,
    quality_did,
    summarize,
)
from impl.stats import difference_in_differences, paired_difference  # noqa: E402


def _scores(seed, n=40):
    rng = np.random.default_rng(seed)
    a = rng.integers(0, 2, n).astype(float)
    b = np.where(rng.random(n) < 0.2, 1 - a, a)
    c = np.where(rng.random(n) < 0.05, 1 - a, a)
    d = np.where(rng.random(n) < 0.1, 1 - b, b)
    return a, b, c, d


def test_did_equals_impl_stats():
    a, b, c, d = _scores(0)
    got = quality_did(a, b, c, d)
    want = difference_in_differences(a * 100, b * 100, c * 100, d * 100)
    assert got == want
    assert quality_did(a, b, c, d, scale=1.0) == difference_in_differences(a, b, c, d)
    # the same through summarize, from per-arm per-document records
    keys = [("t", i) for i in range(len(a))]
    doc = {arm: {k: {"scores": {"m,f": float(v[i])}} for i, k in enumerate(keys)}
           for arm, v in zip("ABCD", (a, b, c, d))}
    row = summarize(doc, None, keys, "m,f", suite="s")
    assert row["n"] == len(a) and row["did_mean"] == want.mean and row["did_ci_low"] == want.ci_low
    assert row["did_ci_high"] == want.ci_high and row["did_resolved"] == want.resolved
    ba = paired_difference(a * 100, b * 100)
    assert row["B_minus_A_mean"] == ba.mean and row["B_minus_A_ci_low"] == ba.ci_low
    assert row["mean_A"] == pytest.approx(100 * a.mean())
    # identical arms: DiD exactly 0, unresolved
    z = quality_did(a, a, a, a)
    assert z.mean == 0.0 and z.ci_low == 0.0 and z.ci_high == 0.0 and not z.resolved


def _rec(arm, task, doc, ids, gen=(1,)):
    return GenRecord(arm, task, doc, f"{task}/{doc}", list(ids), prompt_hash(ids), list(gen), "x")


def test_prompt_hash_gate():
    assert prompt_hash([1, 2, 3]) == prompt_hash([1, 2, 3]) != prompt_hash([1, 2, 3, 4])
    assert prompt_hash([1, 2, 3]) != prompt_hash([3, 2, 1])
    same = {a: {("t", 0): _rec(a, "t", 0, [5, 6, 7]), ("t", 1): _rec(a, "t", 1, [8])} for a in "ABCD"}
    assert check_prompt_hashes(same) == 2
    bad = dict(same)
    bad["C"] = {("t", 0): _rec("C", "t", 0, [1, 5, 6, 7]), ("t", 1): _rec("C", "t", 1, [8])}
    with pytest.raises(PromptMismatchError, match=r"task t doc 0: .*C=.*\(4 tokens\)"):
        check_prompt_hashes(bad)
    missing = dict(same)
    missing["D"] = {("t", 0): _rec("D", "t", 0, [5, 6, 7])}
    with pytest.raises(PromptMismatchError, match="different documents"):
        check_prompt_hashes(missing)
    # dict rows (as written to quality.jsonl) work too
    rows = {a: {k: r.to_row() for k, r in recs.items()} for a, recs in same.items()}
    assert check_prompt_hashes(rows) == 2


def test_per_doc_scores_from_lm_eval_samples():
    samples = {"vsk_gsm8k": [
        {"doc_id": 0, "filter": "strict-match", "metrics": ["exact_match"], "exact_match": 0.0,
         "filtered_resps": ["[invalid]"], "target": "x"},
        {"doc_id": 0, "filter": "composite", "metrics": ["exact_match"], "exact_match": 1.0,
         "filtered_resps": ["7"], "target": "x"},
    ], "vsk_coqa": [{"doc_id": 3, "filter": "none", "metrics": ["em", "f1"], "em": 0.0, "f1": 0.5,
                     "filtered_resps": [" a b"]}]}
    s = per_doc_scores(samples, "A")
    assert s[("vsk_gsm8k", 0)]["scores"] == {"exact_match,strict-match": 0.0, "exact_match,composite": 1.0}
    assert s[("vsk_gsm8k", 0)]["filtered"]["composite"] == "7"
    assert s[("vsk_coqa", 3)]["scores"] == {"em,none": 0.0, "f1,none": 0.5}
    with pytest.raises(ValueError, match="not a finite number"):
        per_doc_scores({"t": [{"doc_id": 0, "filter": "none", "metrics": ["f1"], "f1": float("nan")}]}, "A")


def test_first_token_agreement():
    ref = torch.log_softmax(torch.tensor([3.0, 1.0, 0.5, 0.2, -1.0, -2.0, 2.0]), -1)
    close = ref + 0.004
    far = ref.clone()
    far[1] += 0.05
    swapped = ref.clone()
    swapped[6] = ref[0] + 0.1
    rows = first_token_agreement({"A": ref, "B": close, "C": far, "D": swapped},
                                 pairs=(("B", "A"), ("C", "A"), ("D", "A"), ("D", "X")))
    by = {r["arm"]: r for r in rows}
    assert len(rows) == 3
    assert by["B"]["agree"] and by["B"]["max_abs_diff"] == pytest.approx(0.004, abs=1e-6)
    assert by["B"]["top_ids"] == [0, 6, 1, 2, 3]
    assert not by["C"]["agree"] and by["C"]["argmax_equal"]
    assert not by["D"]["agree"] and not by["D"]["argmax_equal"]


def test_stop_rule_matches_lm_eval_criteria(tiny_tokenizer):
    """StopRule.cut stops at the same token as lm-eval's stop_sequences_criteria plus the EOS criterion
    (what HFLM's model.generate does), and StopRule.text is HFLM's post-processed response."""
    from lm_eval.models.utils_hf import stop_sequences_criteria

    tok = tiny_tokenizer
    eos = tok.eos_token_id
    eos_str = tok.decode(eos, skip_special_tokens=False)
    until = ["Q:", "\n\n", eos_str]
    prompt = tok.encode("Answer: x", add_special_tokens=False)
    cases = (("12 so 5\n\nmore apples", None), ("ab Q: cd", None), ("abc def", 2), ("no stop at all", None),
             ("x\n\nQ: y", None))
    for text, eos_at in cases:
        gen = tok.encode(text, add_special_tokens=False)
        if eos_at is not None:
            gen = gen[:eos_at] + [eos] + gen[eos_at:]
        crit = stop_sequences_criteria(tok, until, len(prompt), 1)
        want = len(gen)
        for i in range(1, len(gen) + 1):
            if gen[i - 1] == eos or bool(crit(torch.tensor([prompt + gen[:i]]), None)):
                want = i
                break
        rule = StopRule(tok, until, {eos})
        cut = rule.cut(gen)
        assert len(cut) == want, text
        s = tok.decode(cut, skip_special_tokens=True)
        for term in until:
            s = s.split(term)[0]
        assert rule.text(cut) == s
        assert rule.text(cut) == (tok.decode(gen[:eos_at]) if eos_at else text).split("Q:")[0].split("\n\n")[0]


def test_encode_context_matches_hflm(tiny_model, tiny_tokenizer):
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=tiny_model, tokenizer=tiny_tokenizer, device="cpu", batch_size=1, max_length=64)
    for text in ("Question: how many apples?\nAnswer:", "x" * 200, tiny_tokenizer.bos_token + "hi"):
        ids, _ = lm.tok_batch_encode([text], left_truncate_len=40)
        assert encode_context(tiny_tokenizer, text, 40) == ids[0].tolist()
    ids, _ = lm.tok_batch_encode(["abc"], left_truncate_len=40)
    lm.add_bos_token = True
    ids_bos, _ = lm.tok_batch_encode(["abc"], left_truncate_len=40)
    assert encode_context(tiny_tokenizer, "abc", 40, add_bos_token=True) == ids_bos[0].tolist()
