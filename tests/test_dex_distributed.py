"""Distributed DEX executor (impl/dex/distributed.py): torchrun with one gloo rank per explorer on CPU
must commit exactly AR's tokens and the reference executor's rounds and match indices, greedy and
sampled; launch errors are clear; the plan codec and the per-stage KV view hold in-process."""

import json
from pathlib import Path

import pytest
from conftest import torchrun
import torch
import torch.distributed as dist

from impl.dex import DEXDecoder, ReferenceExecutor
from impl.dex.distributed import (DistributedExecutor, Plan, StageExecutor, decode_plan, encode_plan,
                                  exploration_set_for_world)
from impl.dex.reference import StageBatch
from impl.spec.ar import ar_decode
from impl.spec.sampling import DecodeRule

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [7], [11, 13, 17, 19, 23, 29, 31, 37, 41, 43]]
TEXT = "Question: how many apples?"
N_NEW = 12


def _tiny6(vocab_size: int):
    """The conftest tiny_model recipe with 6 layers (wide init so depths disagree often)."""
    from transformers import LlamaForCausalLM

    from impl.models.tiny import TinyArch

    torch.manual_seed(0)
    cfg = TinyArch(num_layers=6, hidden_size=32, num_heads=4, intermediate_size=64,
                   max_position_embeddings=128).to_hf_config(vocab_size=vocab_size, eos_token_id=0)
    cfg.initializer_range = 0.2
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.down_proj.weight.mul_(4.0)
    return model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tiny_tokenizer):
    d = tmp_path_factory.mktemp("dist") / "model"
    _tiny6(len(tiny_tokenizer)).save_pretrained(d)
    tiny_tokenizer.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def loaded(model_dir):
    from impl.models.load import load_model, load_tokenizer

    return load_model(model_dir), load_tokenizer(model_dir)


@pytest.fixture(scope="module")
def prompts_file(model_dir):
    p = model_dir.parent / "prompts.jsonl"
    rows = [{"id": f"p{i}", "input_ids": ids} for i, ids in enumerate(PROMPTS)]
    rows += [{"id": "text", "text": TEXT}, {"id": "empty", "text": ""}]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p


def _torchrun(K: int, *args, **kw):
    return torchrun("impl.dex.distributed", K, *args, device=None, **kw)


def _reference(model, ids, X, rule, decs):
    """AR and the single-process reference executor, single-threaded like the ranks."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ar = ar_decode(model, ids, N_NEW, rule=rule).tokens
        res = DEXDecoder(ReferenceExecutor(model, X, rule=rule), decs=decs).decode(ids, N_NEW)
    finally:
        torch.set_num_threads(threads)
    return ar, res


@pytest.mark.slow
@pytest.mark.parametrize("K,temperature,decs", [(2, 0.0, False), (3, 0.0, True), (2, 1.0, True), (3, 1.0, False)])
def test_torchrun_equals_ar_and_reference(tmp_path, model_dir, prompts_file, loaded, K, temperature, decs):
    out = tmp_path / "out.jsonl"
    args = ["--model", model_dir, "--prompts", prompts_file, "--out", out, "--max-new-tokens", N_NEW,
            "--temperature", temperature, "--seed", 3, "--ignore-eos", "--warmup-prompts", 0]
    proc = _torchrun(K, *args, *(["--decs"] if decs else []))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["prompt_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert set(rows) == {"p0", "p1", "p2", "text", "empty"}
    assert "error" in rows["empty"]
    model, tok = loaded
    X = tuple(6 // K * (k + 1) for k in range(K))
    rule = DecodeRule(temperature=temperature, seed=3)
    text_ids = [tok.bos_token_id] + tok(TEXT, add_special_tokens=False)["input_ids"]
    for pid, ids in [("p0", PROMPTS[0]), ("p1", PROMPTS[1]), ("p2", PROMPTS[2]), ("text", text_ids)]:
        r = rows[pid]
        ar, ref = _reference(model, ids, X, rule, decs)
        assert r["exploration_set"] == list(X) and r["world_size"] == K and r["backend"] == "gloo"
        assert r["ar_match"] is True
        assert r["token_ids"] == ar == ref.tokens
        assert r["rounds"] == [m.rounds for m in ref.metrics]
        assert r["match_index"] == [m.match_index for m in ref.metrics]
        # the same explorers ran in the same rounds as in the reference executor
        R = sum(r["rounds"])
        assert len(r["round_explorer_seconds"]) == len(r["round_comm_seconds"]) == R == len(ref.round_seconds)
        assert [[s > 0 for s in row] for row in r["round_explorer_seconds"]] == \
               [[s > 0 for s in row] for row in ref.round_seconds]
        assert all(c >= 0 for c in r["round_comm_seconds"])
        assert r["critical_path_plus_comm_seconds"] == pytest.approx(r["critical_path_seconds"] + r["comm_seconds"])
        assert r["critical_path_seconds"] <= r["rounds_wall_seconds"] + 1e-9
        assert len(r["prefill_explorer_seconds"]) == K and r["git_sha"]
    assert rows["text"]["input_ids"] == text_ids


@pytest.mark.slow
def test_torchrun_exploration_set_mismatch_is_a_clear_error(tmp_path, model_dir, prompts_file):
    out = tmp_path / "out.jsonl"
    proc = _torchrun(2, "--model", model_dir, "--prompts", prompts_file, "--out", out,
                     "--max-new-tokens", 4, "--exploration-set", "2,4,6", timeout=90)
    assert proc.returncode != 0
    assert "has 3 depths but the world size is 2" in proc.stderr
    assert "--nproc-per-node 3" in proc.stderr
    assert not out.exists()


# --- in-process checks (no torchrun) --------------------------------------------------------------------

def test_exploration_set_for_world():
    assert exploration_set_for_world(None, 3, 6) == (2, 4, 6)
    assert exploration_set_for_world("1,6", 2, 6) == (1, 6)
    with pytest.raises(ValueError, match="has 3 depths but the world size is 2"):
        exploration_set_for_world("2,4,6", 2, 6)
    with pytest.raises(ValueError, match="K=4 explorers.*does not divide"):
        exploration_set_for_world(None, 4, 6)
    with pytest.raises(ValueError, match="not strictly increasing"):
        exploration_set_for_world("4,2,6", 3, 6)
    with pytest.raises(ValueError, match="comma-separated"):
        exploration_set_for_world("2,x", 2, 6)


def test_plan_codec_roundtrip():
    b0 = StageBatch(0, [5, 6], [9, 10], [17, 3], [[4], [5, 4]], [[], [1, 2]])
    b2 = StageBatch(2, [1], [8], [40], [[]], [[]])
    for plan in [Plan("round", [("commit", [4]), ("drop", [0, 1, 2])], batches=[b0, b2]),
                 Plan("prefill", input_ids=[1, 2, 3]), Plan("prefill"), Plan("stop"), Plan("round")]:
        assert decode_plan(encode_plan(plan)) == plan
    with pytest.raises(ValueError, match="malformed"):
        decode_plan(encode_plan(Plan("round", batches=[b0]))[:-1])
    with pytest.raises(ValueError, match="malformed"):
        decode_plan(encode_plan(Plan("stop")) + [0])


def test_stage_executors_chain_like_reference(loaded):
    """Stages run one after another in-process, each with only its own KV view, reproduce the
    reference executor's candidates and KV at their layers."""
    model, _ = loaded
    X, ids = (2, 4, 6), PROMPTS[0]
    ref = ReferenceExecutor(model, X)
    ref.prefill(ids[:-1])
    stages = [StageExecutor(model, X, k) for k in range(3)]
    h = None
    for st in stages:
        h = st.prefill(ids[:-1], h)
    b = dict(sids=[0], positions=[len(ids) - 1], tokens=[ids[-1]], ancestors=[[]], banned=[[]])
    for k, st in enumerate(stages):
        if k:
            st._hidden[0] = stages[k - 1]._hidden.pop(0)
        r = st.run_stage(StageBatch(stage=k, **b))
        assert r.cands == ref.run_stage(StageBatch(stage=k, **b)).cands
        lo, hi = st.layer_range
        for layer in range(6):
            assert st._ck[layer].shape[2] == len(ids) - 1
            if lo <= layer < hi:
                assert torch.equal(st._ck[layer], ref._ck[layer])
                assert torch.equal(st._tree_k[layer][0], ref._tree_k[layer][0])
            else:
                assert st._ck[layer].numel() == 0 and not st._tree_k[layer]
    for st in stages:
        st.commit(0)
        assert st.committed_length == len(ids)
    ref.commit(0)
    assert sum(st.kv_bytes() for st in stages) == sum(t.numel() * 4 for t in ref._ck + ref._cv)
    with pytest.raises(ValueError, match="stage 3"):
        StageExecutor(model, X, 3)


def test_single_rank_executor_in_process(loaded):
    """World size 1 (one explorer, X = (L,)) through the same collectives; errors of the interface."""
    model, _ = loaded
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match="has 2 depths but the world size is 1"):
            DistributedExecutor(model, (3, 6))
        ex = DistributedExecutor(model, (6,))
        res = DEXDecoder(ex).decode(PROMPTS[0], 8)
        assert res.tokens == ar_decode(model, PROMPTS[0], 8).tokens
        assert len(ex.rounds) == 8 and all(r.comm_seconds >= 0 for r in ex.rounds)
        with pytest.raises(ValueError, match="distinct stages"):
            ex.run_round([StageBatch(1, [0], [0], [1], [[]], [[]])])
        with pytest.raises(RuntimeError, match="rank 0 drives"):
            ex.serve()
        ex.close()
        with pytest.raises(RuntimeError, match="closed"):
            ex.prefill([1])
    finally:
        dist.destroy_process_group()
