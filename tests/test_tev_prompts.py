"""The drafter's training prompts (impl.tev.prompts): ShareGPT turns, GSM8K train questions rendered as the
gsm8k workload, the mixture's apportionment and even interleaving, and the errors that name the key."""

from copy import deepcopy

import pytest

from impl.provenance import read_jsonl
from impl.tev.prompts import (
    drafter_prompt_ids,
    drafter_prompt_texts,
    gsm8k_train_prompt_texts,
    mix_counts,
    sharegpt_prompt_ids,
    sharegpt_prompt_texts,
)
from impl.workloads.tokenize import chat_ids

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def test_sharegpt_prompt_texts(data_dir):
    rows = sharegpt_prompt_texts(data_dir, 3)
    assert len(rows) == 3
    assert all(r["text"].startswith("User: ") and r["text"].endswith("\nAssistant:") for r in rows)
    assert sharegpt_prompt_texts(data_dir, 2, skip=1)[0] == rows[1]
    assert all(r["text"] == f"User: {r['chat']}\nAssistant:" and r["suite"] == "sharegpt" for r in rows)


def test_sharegpt_prompt_ids_use_the_chat_template(data_dir, tiny_tokenizer):
    """A target with a chat template (smollm2) is rolled out on its own chat format; one without keeps
    the plain User:/Assistant: text."""
    rows = sharegpt_prompt_texts(data_dir, 2)
    plain = sharegpt_prompt_ids(tiny_tokenizer, data_dir, 2, max_prompt_tokens=4096)
    assert tiny_tokenizer.decode(plain[0], skip_special_tokens=True).startswith("User: ")
    tok = deepcopy(tiny_tokenizer)
    tok.chat_template = CHAT_TEMPLATE
    chat = sharegpt_prompt_ids(tok, data_dir, 2, max_prompt_tokens=4096)
    assert chat[0] == chat_ids(tok, rows[0]["chat"]) != plain[0]


def test_gsm8k_train_prompts_render_as_the_workload(data_dir):
    """Train-split questions (never the test split the cells sample), through the workload's template and,
    when given, its chat message."""
    raw = read_jsonl(data_dir / "gsm8k" / "train.jsonl")[:3]
    test_questions = {r["question"] for r in read_jsonl(data_dir / "gsm8k" / "test.jsonl")}
    rows = gsm8k_train_prompt_texts(data_dir, 3)
    assert [r["text"] for r in rows] == [f"Question: {r['question']}\nAnswer:" for r in raw]
    assert all("chat" not in r and r["suite"] == "gsm8k" for r in rows)
    assert not {r["question"] for r in raw} & test_questions
    chat = gsm8k_train_prompt_texts(data_dir, 2, template="Q: {question}\nA:", chat="Solve: {question}")
    assert chat[1]["text"] == f"Q: {raw[1]['question']}\nA:" and chat[1]["chat"] == f"Solve: {raw[1]['question']}"
    with pytest.raises(ValueError, match="names a field other than 'question'"):
        gsm8k_train_prompt_texts(data_dir, 1, template="{problem}")


@pytest.mark.parametrize("n,mix,want", [
    (10, {"sharegpt": 1.0}, {"sharegpt": 10}),
    (10, {"sharegpt": 0.5, "gsm8k": 0.5}, {"sharegpt": 5, "gsm8k": 5}),
    (7, {"sharegpt": 1, "gsm8k": 1}, {"sharegpt": 4, "gsm8k": 3}),    # tie: the first listed
    (7, {"gsm8k": 1, "sharegpt": 1}, {"gsm8k": 4, "sharegpt": 3}),
    (10, {"sharegpt": 2, "gsm8k": 1}, {"sharegpt": 7, "gsm8k": 3}),   # 6.67 / 3.33: largest remainder
    (1, {"sharegpt": 1, "gsm8k": 3}, {"sharegpt": 0, "gsm8k": 1}),
])
def test_mix_counts_hand_computed(n, mix, want):
    got = mix_counts(n, mix)
    assert got == want and list(got) == list(mix) and sum(got.values()) == n


@pytest.mark.parametrize("mix,match", [({}, "empty"), ({"alpaca": 1}, "unknown source 'alpaca'"),
                                       ({"gsm8k": 0.0}, r"prompt_mix\.gsm8k: share must be > 0")])
def test_mix_counts_refuse_bad_mixes(mix, match):
    with pytest.raises(ValueError, match=match):
        mix_counts(4, mix)


def test_mixture_interleaves_evenly_and_keeps_one_source_in_file_order(data_dir):
    assert drafter_prompt_texts(data_dir, 5) == sharegpt_prompt_texts(data_dir, 5)
    assert drafter_prompt_texts(data_dir, 5, {"gsm8k": 1.0}) == gsm8k_train_prompt_texts(data_dir, 5)
    rows = drafter_prompt_texts(data_dir, 20, {"sharegpt": 0.5, "gsm8k": 0.5})
    assert [r["suite"] for r in rows] == ["sharegpt", "gsm8k"] * 10
    # each source keeps its own order, and every tail slice (the held-out rollouts) holds both sources
    assert [r for r in rows if r["suite"] == "gsm8k"] == gsm8k_train_prompt_texts(data_dir, 10)
    assert [r for r in rows if r["suite"] == "sharegpt"] == sharegpt_prompt_texts(data_dir, 10)
    skew = drafter_prompt_texts(data_dir, 12, {"sharegpt": 3, "gsm8k": 1})
    assert [r["suite"] for r in skew].count("gsm8k") == 3
    assert {r["suite"] for r in skew[-4:]} == {"sharegpt", "gsm8k"}


def test_mixture_ids_and_sources(data_dir, tiny_tokenizer):
    """Ids as the workloads tokenize (the gsm8k rows plain with BOS, ShareGPT rows through a chat template
    when the tokenizer has one), with the source of each."""
    tok = deepcopy(tiny_tokenizer)
    tok.chat_template = CHAT_TEMPLATE
    ids, sources = drafter_prompt_ids(tok, data_dir, 4, {"sharegpt": 1, "gsm8k": 1}, max_prompt_tokens=4096)
    rows = drafter_prompt_texts(data_dir, 4, {"sharegpt": 1, "gsm8k": 1})
    assert sources == ["sharegpt", "gsm8k", "sharegpt", "gsm8k"]
    assert ids[0] == chat_ids(tok, rows[0]["chat"])
    bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
    assert ids[1] == bos + tok(rows[1]["text"], add_special_tokens=False)["input_ids"]


def test_a_short_source_is_refused_by_name(data_dir):
    with pytest.raises(ValueError, match=r"prompt_mix\.gsm8k: 8000 prompts asked .* it has 7473"):
        drafter_prompt_texts(data_dir, 8000, {"gsm8k": 1.0})


def test_held_out_workload_sources_leave_the_frozen_sample_out(data_dir):
    """math500 / humaneval / mt_bench sources: the workload's records outside its frozen sample (the config's
    n_prompts and seed), rendered with its template or chat; a source whose workload is absent is refused."""
    from impl.workloads.suites import DEFAULT_TEMPLATES, build_text_suite

    workloads = {"math500": {"n_prompts": 36, "template": "Q: {problem}\nA:"},
                 "humaneval": {"n_prompts": 36}, "mt_bench": {"n_prompts": 36, "chat": "{turn1}"}}
    rows = drafter_prompt_texts(data_dir, 30, {"math500": 1, "humaneval": 1, "mt_bench": 1}, workloads=workloads,
                                seed=7)
    assert [r["suite"] for r in rows[:3]] == ["math500", "humaneval", "mt_bench"] and len(rows) == 30
    for suite, w in workloads.items():
        frozen = {r["source_id"] for r in build_text_suite(suite, data_dir, 36, 7, w.get("template")
                                                           or DEFAULT_TEMPLATES[suite])}
        mine = [r for r in rows if r["suite"] == suite]
        assert len(mine) == 10 and not {r["source_id"] for r in mine} & frozen
    assert next(r for r in rows if r["suite"] == "math500")["text"].startswith("Q: ")
    assert "chat" in next(r for r in rows if r["suite"] == "mt_bench")
    with pytest.raises(ValueError, match=r"prompt_mix\.math500: .* needs workloads\.math500"):
        drafter_prompt_texts(data_dir, 4, {"math500": 1.0}, workloads={})
    with pytest.raises(ValueError, match=r"prompt_mix\.mt_bench: 50 prompts asked .* it has 44"):
        drafter_prompt_texts(data_dir, 50, {"mt_bench": 1.0}, workloads=workloads)
