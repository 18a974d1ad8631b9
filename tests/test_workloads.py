"""Tests for impl.workloads (DEX-harness issue 2, item 4 (workloads))."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from impl.workloads import (
    DATA_FILES,
    DEFAULT_TEMPLATES,
    SUITES,
    build_text_suite,
    held_out_text_suite,
    check_data,
    load_records,
    tokenize_suite,
)

DATA_DIR = Path("/work/shared/data")
needs_data = pytest.mark.skipif(not (DATA_DIR / "SOURCES.md").is_file(), reason="no shared data")

EXPECTED_COUNTS = {
    "gsm8k": 1319,
    "humaneval": 164,
    "xsum": 1000,
    "mt_bench": 80,
    "math500": 500,
    "bbh": 6511,
    "coqa": 10930,
}


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = ["Question: what is two plus two?", "Answer: four.", "hello world " * 5]
    tok.train_from_iterator(corpus, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>")


def _rows(texts):
    return [{"id": f"t-{i:04d}", "suite": "t", "source_id": str(i), "text": t}
            for i, t in enumerate(texts)]


def test_suite_tables_consistent():
    assert set(SUITES) == set(DATA_FILES) == set(DEFAULT_TEMPLATES)


@needs_data
@pytest.mark.parametrize("suite", SUITES)
def test_every_suite_loads_with_expected_count(suite):
    records = load_records(suite, DATA_DIR)
    assert len(records) == EXPECTED_COUNTS[suite]
    ids = [r["source_id"] for r in records]
    assert len(set(ids)) == len(ids)
    for r in records[:50]:
        assert isinstance(r["source_id"], str)
        assert all(isinstance(v, str) for v in r["fields"].values())
    # the default template renders every record
    for r in records[:50]:
        DEFAULT_TEMPLATES[suite].format(**r["fields"])


@needs_data
def test_record_details():
    g = load_records("gsm8k", DATA_DIR)
    assert g[0]["source_id"] == "test-0"
    assert not any("<<" in r["fields"]["answer"] for r in g)
    assert "####" in g[0]["fields"]["answer"]
    b = load_records("bbh", DATA_DIR)
    assert b[0]["source_id"] == "boolean_expressions/0"
    assert not b[0]["fields"]["cot_prompt"].startswith("-----")
    assert "canary" not in b[0]["fields"]["cot_prompt"]
    assert b[0]["fields"]["cot_prompt"].startswith("Evaluate")
    c = load_records("coqa", DATA_DIR)
    assert c[0]["fields"]["history"] == ""
    assert c[1]["fields"]["history"].startswith("Q: " + c[0]["fields"]["question"] + "\nA: ")
    assert c[1]["source_id"].endswith("/2")
    m = load_records("mt_bench", DATA_DIR)
    assert m[0]["source_id"] == "81" and m[0]["fields"]["turn2"]


@needs_data
def test_build_text_suite_deterministic_and_seeded():
    a = build_text_suite("gsm8k", DATA_DIR, 20, 0, DEFAULT_TEMPLATES["gsm8k"])
    b = build_text_suite("gsm8k", str(DATA_DIR), 20, 0, DEFAULT_TEMPLATES["gsm8k"])
    c = build_text_suite("gsm8k", DATA_DIR, 20, 1, DEFAULT_TEMPLATES["gsm8k"])
    assert a == b
    assert [r["source_id"] for r in a] != [r["source_id"] for r in c]
    assert [r["id"] for r in a] == [f"gsm8k-{k:04d}" for k in range(20)]
    # nested samples: more prompts append, the first ones (and their ids) stay
    longer = build_text_suite("gsm8k", DATA_DIR, 36, 0, DEFAULT_TEMPLATES["gsm8k"])
    assert longer[:20] == a
    idx = [int(r["source_id"].split("-")[1]) for r in a]
    assert idx != sorted(idx) and len(set(idx)) == 20
    assert a[0]["text"].startswith("Question: ") and a[0]["text"].endswith("\nAnswer:")
    assert set(a[0]) == {"id", "suite", "source_id", "text"}
    full = build_text_suite("mt_bench", DATA_DIR, 1000, 3, "{turn1}")
    assert len(full) == 80 and full[0]["source_id"] == "81"


@needs_data
def test_build_text_suite_errors():
    with pytest.raises(ValueError) as e:
        build_text_suite("gsm8k", DATA_DIR, 5, 0, "Q: {nope}")
    msg = str(e.value)
    assert "gsm8k" in msg and "nope" in msg and "question" in msg
    with pytest.raises(ValueError):
        build_text_suite("gsm8k", DATA_DIR, 0, 0, "{question}")
    with pytest.raises(ValueError):
        build_text_suite("nosuch", DATA_DIR, 5, 0, "{question}")


def test_missing_data_dir_message(tmp_path):
    with pytest.raises(FileNotFoundError) as e:
        check_data("gsm8k", tmp_path / "absent")
    msg = str(e.value)
    assert "data_dir" in msg and "gsm8k/test.jsonl" in msg and "SOURCES.md" in msg
    assert "\n" not in msg
    with pytest.raises(FileNotFoundError, match="data_dir"):
        load_records("bbh", tmp_path)


def test_truncate_left_keeps_tail_and_bos(tokenizer, caplog):
    text = "hello world " * 40
    body = tokenizer(text, add_special_tokens=False)["input_ids"]
    bos = tokenizer.bos_token_id
    assert bos is not None and len(body) > 10
    with caplog.at_level(logging.INFO, logger="impl.workloads"):
        out, summary = tokenize_suite(_rows([text, "hello"]), tokenizer, 10)
    assert out[0]["input_ids"] == [bos] + body[-9:]
    assert out[0]["n_tokens"] == 10 and out[0]["truncated"]
    assert out[0]["original_n_tokens"] == len(body) + 1
    assert not out[1]["truncated"] and out[1]["input_ids"][0] == bos
    assert summary == {"n_in": 2, "n_out": 2, "n_truncated": 1, "n_skipped_overlong": 0,
                       "n_skipped_empty": 0, "n_chat": 0, "format": "plain", "rule": "truncate_left", "max_prompt_tokens": 10}
    assert "truncated" in caplog.text


def test_skip_rule_and_empty(tokenizer, caplog):
    with caplog.at_level(logging.INFO, logger="impl.workloads"):
        out, summary = tokenize_suite(
            _rows(["hello world " * 40, "hello", ""]), tokenizer, 10, overlong="skip"
        )
    assert [r["id"] for r in out] == ["t-0001"]
    assert summary["n_skipped_overlong"] == 1 and summary["n_skipped_empty"] == 1
    assert summary["n_out"] == 1 and summary["rule"] == "skip"
    assert "skipped" in caplog.text


def test_no_bos_truncation():
    class NoBos:
        bos_token_id = None

        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [ord(ch) for ch in text]}

    out, _ = tokenize_suite(_rows(["abcdefghij"]), NoBos(), 4)
    assert out[0]["input_ids"] == [ord(c) for c in "ghij"]


def test_tokenize_argument_errors(tokenizer):
    with pytest.raises(ValueError):
        tokenize_suite(_rows(["a"]), tokenizer, 1)
    with pytest.raises(ValueError) as e:
        tokenize_suite(_rows(["a"]), tokenizer, 8, overlong="truncate_right")
    assert "truncate_right" in str(e.value) and "skip" in str(e.value)


@needs_data
def test_held_out_text_suite_is_the_rest_of_the_permutation():
    """The held-out rows are every record the frozen sample of n prompts leaves out, rendered alike, with
    none of the sample's records, and nested samples keep it disjoint for any n' <= n."""
    t = DEFAULT_TEMPLATES["math500"]
    sample = build_text_suite("math500", DATA_DIR, 36, 0, t)
    rest = held_out_text_suite("math500", DATA_DIR, 36, 0, t)
    assert len(rest) == 500 - 36 and not {r["source_id"] for r in rest} & {r["source_id"] for r in sample}
    assert {r["source_id"] for r in rest} | {r["source_id"] for r in sample} == \
        {r["source_id"] for r in load_records("math500", DATA_DIR)}
    rec = next(r for r in load_records("math500", DATA_DIR) if r["source_id"] == rest[0]["source_id"])
    assert rest[0]["id"] == "math500-heldout-0000" and rest[0]["text"] == t.format(**rec["fields"])
    # the rest of the permutation: a larger sample's extra prompts are the held-out rows' head
    assert [r["source_id"] for r in build_text_suite("math500", DATA_DIR, 46, 0, t)[36:]] == \
        [r["source_id"] for r in rest[:10]]
    assert held_out_text_suite("math500", DATA_DIR, 36, 0, t, n=5) == rest[:5]
    assert held_out_text_suite("mt_bench", DATA_DIR, 80, 0, "{turn1}") == []  # the sample covers the suite
    with pytest.raises(ValueError, match="n_evaluated"):
        held_out_text_suite("math500", DATA_DIR, 0, 0, t)
