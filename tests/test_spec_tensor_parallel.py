"""Tensor parallelism (impl/spec/tensor_parallel.py): transformers' own TP plan over two gloo ranks on
CPU must give AR's ids on every prompt; a split the model's heads do not allow is refused in one line
before any process group starts."""

import json
from pathlib import Path

import pytest
from conftest import torchrun
import torch

from impl.spec.tensor_parallel import tp_split_problem

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [7], [11, 13, 17, 19, 23, 29, 31, 37, 41, 43]]


def test_split_rule():
    smol = {"num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536}
    assert tp_split_problem(smol, 3) is None
    why = tp_split_problem(smol, 2)
    assert "num_attention_heads = 9" in why and "num_key_value_heads = 3" in why and "[3]" in why
    assert "at least 2" in tp_split_problem(smol, 1)
    assert tp_split_problem({"num_attention_heads": 4, "intermediate_size": 64}, 2) is None  # kv heads default


@pytest.fixture(scope="module")
def tp_model(tmp_path_factory):
    from transformers import LlamaForCausalLM

    from impl.models.tiny import TinyArch

    torch.manual_seed(0)
    cfg = TinyArch(num_layers=4, hidden_size=32, num_heads=4, intermediate_size=64,
                   max_position_embeddings=128).to_hf_config(vocab_size=97, eos_token_id=0)
    cfg.initializer_range = 0.2
    d = tmp_path_factory.mktemp("tp") / "model"
    LlamaForCausalLM(cfg).save_pretrained(d)
    p = d.parent / "prompts.jsonl"
    p.write_text("".join(json.dumps({"id": f"p{i}", "input_ids": ids}) + "\n" for i, ids in enumerate(PROMPTS))
                 + json.dumps({"id": "empty", "input_ids": []}) + "\n"
                 + json.dumps({"id": "foreign", "input_ids": [1, 999]}) + "\n")
    return d, p


def _torchrun(K: int, *args, **kw):
    return torchrun("impl.spec.tensor_parallel", K, *args, **kw)


@pytest.mark.slow
def test_two_ranks_equal_ar(tp_model, tmp_path):
    d, prompts = tp_model
    out = tmp_path / "tp.jsonl"
    proc = _torchrun(2, "--model", d, "--prompts", prompts, "--out", out, "--max-new-tokens", 12, "--ignore-eos")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["prompt_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert set(rows) == {"p0", "p1", "p2", "empty", "foreign"} and "error" in rows["empty"]
    assert "outside [0, 97)" in rows["foreign"]["error"]  # an error row on every rank; the others still run
    for pid in ("p0", "p1", "p2"):
        r = rows[pid]
        assert r["ar_match"] is True and r["n_new_tokens"] == 12 and r["world_size"] == 2
        assert r["backend"] == "gloo" and r["seconds"] > 0 and r["git_sha"]


@pytest.mark.slow
def test_split_the_heads_do_not_allow_is_one_line(tp_model, tmp_path):
    d, prompts = tp_model
    proc = _torchrun(3, "--model", d, "--prompts", prompts, "--out", tmp_path / "x.jsonl", timeout=90)
    assert proc.returncode != 0
    assert "a 3-way split needs 3 to divide num_attention_heads = 4" in proc.stderr
    assert not (tmp_path / "x.jsonl").exists()
