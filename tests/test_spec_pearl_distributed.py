"""PEARL on two torch.distributed ranks (impl/spec/pearl_distributed.py): the post-verify decision on
hand-built token lists (tier 1), then the target on rank 0 and a layer-truncated draft on rank 1 over
gloo must give AR's ids and the single-process executor's rounds on every prompt, greedy and sampled,
with and without EOS (tiers 2-3); bad launches are refused in one line before any process group."""

import json
from pathlib import Path

import pytest
from conftest import torchrun
import torch

from impl.spec.pearl import continuation_length, post_verify

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [7], [11, 13, 17, 19, 22, 1, 3, 5, 7, 9]]


def test_post_verify_rejection_commits_prefix_and_correction():
    v = post_verify([5, 6, 7, 8], ys=[6, 9, 1, 2], nxt=[4, 4], n_tokens=0, max_new=20)
    assert v.new == [5, 6, 9] and v.next_block is None and v.keep == 2
    assert (v.drafted, v.accepted) == (3, 1)


def test_post_verify_whole_block_then_continuation():
    v = post_verify([5, 6, 7], ys=[6, 7, 8], nxt=[8, 3, 2], n_tokens=0, max_new=20)
    assert v.new == [5, 6, 7] and v.next_block == [8, 3, 2] and v.keep is None
    assert (v.drafted, v.accepted) == (3, 3)


def test_post_verify_wrong_continuation_start_goes_back_to_pre_verify():
    v = post_verify([5, 6, 7], ys=[6, 7, 8], nxt=[9, 3], n_tokens=0, max_new=20)
    assert v.new == [5, 6, 7, 8] and v.next_block is None and v.keep == 3
    assert (v.drafted, v.accepted) == (3, 2)


def test_post_verify_budget_end():
    # e_1 verified by this pass and the budget ends with it: commit it, no further target pass
    v = post_verify([5, 6], ys=[6, 7], nxt=[7], n_tokens=5, max_new=8)
    assert v.new == [5, 6, 7] and v.next_block is None
    assert continuation_length(4, 8, 5, 2) == 1 and continuation_length(4, 8, 6, 2) == 0
    assert continuation_length(4, 100, 0, 4) == 4


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from transformers import LlamaForCausalLM

    from impl.models.draft import truncated_draft
    from impl.models.tiny import TinyArch

    torch.manual_seed(0)
    cfg = TinyArch(num_layers=6, hidden_size=32, num_heads=4, intermediate_size=64,
                   max_position_embeddings=128).to_hf_config(vocab_size=23, eos_token_id=2)
    cfg.initializer_range = 0.3  # a peaked target over a small vocabulary: drafts are often right
    d = tmp_path_factory.mktemp("pearl")
    target = LlamaForCausalLM(cfg).eval()
    target.save_pretrained(d / "target")
    truncated_draft(target, [1, 3, 6]).save_pretrained(d / "draft")
    p = d / "prompts.jsonl"
    p.write_text("".join(json.dumps({"id": f"p{i}", "input_ids": ids}) + "\n" for i, ids in enumerate(PROMPTS))
                 + json.dumps({"id": "empty", "input_ids": []}) + "\n"
                 + json.dumps({"id": "foreign", "input_ids": [1, 40]}) + "\n")
    return d / "target", d / "draft", p


def _torchrun(K: int, *args, **kw):
    return torchrun("impl.spec.pearl_distributed", K, *args, **kw)


@pytest.mark.slow
@pytest.mark.parametrize("extra", [["--ignore-eos", "--gamma", "3"], ["--temperature", "1.0", "--seed", "7", "--gamma", "4"],
                                   ["--gamma", "2"]], ids=["greedy", "sampled", "eos"])
def test_two_ranks_equal_ar_and_single_process(models, tmp_path, extra):
    target, draft, prompts = models
    out = tmp_path / "pearl.jsonl"
    proc = _torchrun(2, "--model", target, "--draft", draft, "--prompts", prompts, "--out", out,
                     "--max-new-tokens", 20, *extra)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["prompt_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert set(rows) == {"p0", "p1", "p2", "empty", "foreign"} and "error" in rows["empty"]
    assert "outside [0, 23)" in rows["foreign"]["error"]  # both ranks skip it: the next prompts still run
    kinds = set()
    for pid in ("p0", "p1", "p2"):
        r = rows[pid]
        assert r.get("ar_match") is True and r.get("rounds_match") is True, {k: v for k, v in r.items() if k != "round_log"}
        assert r["world_size"] == 2 and r["backend"] == "gloo" and r["git_sha"]
        assert sum(x["committed"] for x in r["round_log"]) == r["n_new_tokens"]
        if "--ignore-eos" in extra:
            assert r["n_new_tokens"] == 20
        assert r["seconds"] > 0 and r["ar_seconds"] > 0 and r["comm_seconds"] >= 0
        for x in r["round_log"]:
            assert x["wall_seconds"] >= x["comm_seconds"] >= 0
        kinds |= {x["kind"] for x in r["round_log"]}
    assert "post" in kinds  # some draft was accepted: the overlap phases both ran


@pytest.mark.slow
def test_refuses_one_rank_and_a_foreign_draft(models, tmp_path):
    target, draft, prompts = models
    proc = _torchrun(1, "--model", target, "--draft", draft, "--prompts", prompts, "--out", tmp_path / "x.jsonl",
                     timeout=90)
    assert proc.returncode != 0 and "exactly 2 ranks" in proc.stderr
    cfg = json.loads((draft / "config.json").read_text())
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({**cfg, "vocab_size": 99}))
    proc = _torchrun(2, "--model", target, "--draft", other, "--prompts", prompts, "--out", tmp_path / "x.jsonl",
                     timeout=90)
    assert proc.returncode != 0 and "vocabulary (99 ids) is not the target's (23)" in proc.stderr
    assert not (tmp_path / "x.jsonl").exists()
