"""The in-process continuous-batching arm on a tiny random Llama (transformers 5.24 engine): every
request completes, token counts honour max_new_tokens, per-token engine timestamps, natural stops on
EOS, ignore-EOS replay reproduces exactly the recorded lengths (vSkipper Sec. 4.1, "Matched work"),
and a paired matched-work cell between the dense (upstream) and routed (RandomSkip) modes of one
bound model."""

import copy
from collections import Counter

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from impl.serving import (ContinuousBatchingArm, Request, check_matched, poisson_arrivals, record_lengths,
                          replay_requests, run_cell, run_load)
from impl.vskipper import RandomSkip, bind_skipper, routed_cb_config, routed_context

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NEW = 12
PROMPTS = [[5, 6, 7, 8, 9], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19], [1, 2, 3],
           [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50], [60, 2], [20, 30, 40, 50, 21, 31, 41]]
RATE = 30.0  # requests/s: 6 requests injected over ~0.2 s, several in flight at once


@pytest.fixture(scope="module")
def model():
    """A seeded random 2-layer Llama (hidden 32, vocab 61), initialised wide so greedy outputs vary."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, eos_token_id=0, initializer_range=0.2)
    m = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in m.model.layers:
            layer.mlp.down_proj.weight.mul_(4.0)
    return m


def _cb():
    # small pages and token budget: chunked prefill and mixed prefill / decode batches
    return routed_cb_config(page_size=16, num_blocks=64, max_batch_tokens=24, max_requests_per_batch=8)


def _requests():
    return [Request(f"req{i}", tuple(p), NEW) for i, p in enumerate(PROMPTS)]


def _check_timeline(records, *, engine_stamps=True):
    for r in records:
        assert r.ok, (r.request_id, r.error)
        assert len(r.token_times_s) == r.output_tokens == len(r.output_ids)
        assert r.arrival_s >= r.scheduled_s - 1e-9
        assert r.arrival_s <= r.first_token_s <= r.finish_s
        assert all(a <= b for a, b in zip(r.token_times_s, r.token_times_s[1:]))
        assert r.finish_s == r.token_times_s[-1]
        assert r.prompt_tokens == r.prompt_tokens_requested
        if engine_stamps:
            assert r.timestamp_source == "engine"


def test_natural_run_and_exact_ignore_eos_replay(model):
    reqs = _requests()
    sched = poisson_arrivals(RATE, n=len(reqs), seed=0)
    # 1) no EOS at all: every request generates exactly max_new_tokens
    probe = run_load(ContinuousBatchingArm(model, "probe", cb_config=_cb(), eos_token_id=None), reqs, sched)
    _check_timeline(probe.records)
    assert all(r.output_tokens == NEW and r.finish_reason == "length" for r in probe.records)
    assert probe.settings["cb_config"]["max_batch_tokens"] == 24

    # 2) natural generation with a token the model often emits as EOS: requests stop on it (EOS counted)
    eos = Counter(t for r in probe.records for t in r.output_ids[:-1]).most_common(1)[0][0]
    arm = ContinuousBatchingArm(model, "upstream", cb_config=_cb(), eos_token_id=eos)
    nat = run_load(arm, reqs, sched)
    _check_timeline(nat.records)
    for p, r in zip(probe.records, nat.records):
        cut = p.output_ids.index(eos) + 1 if eos in p.output_ids else NEW
        assert r.output_ids == p.output_ids[:cut]
        assert r.output_tokens <= NEW
    assert any(r.output_tokens < NEW and r.finish_reason == "stop" for r in nat.records)

    # 3) matched-work replay with EOS ignored, on another schedule: exactly the recorded lengths
    lengths = record_lengths(nat.records)
    rep = run_load(arm, replay_requests(reqs, lengths), poisson_arrivals(RATE, n=len(reqs), seed=1))
    _check_timeline(rep.records)
    assert {r.request_id: r.output_tokens for r in rep.records} == lengths
    assert [r.output_ids for r in rep.records] == [r.output_ids for r in nat.records]
    check_matched({"upstream": rep.records}, lengths)


def test_matched_cell_dense_vs_routed(model):
    bound = copy.deepcopy(model)
    bind_skipper(bound, RandomSkip(routed_layers=[1], r=0.5, d=1.0, seed=1))
    ctx = routed_context(bound)
    arms = {"upstream": ContinuousBatchingArm(bound, "upstream", cb_config=_cb(), eos_token_id=7, mode="dense",
                                              binding=ctx),
            "vskipper": ContinuousBatchingArm(bound, "vskipper", cb_config=_cb(), eos_token_id=7, mode="routed",
                                              binding=ctx)}
    res = run_cell(arms, _requests(), cell="knee", rate=RATE, repetitions=2, seed=5, workload="tiny")
    assert res.orders == [["upstream", "vskipper"], ["vskipper", "upstream"]]
    measured = [r for r in res.rows if r["kind"] == "request" and r["phase"] == "measure"]
    assert len(measured) == 2 * 2 * len(PROMPTS)
    assert all(r["output_tokens"] == res.lengths[r["request_id"]] and r["error"] is None for r in measured)
    # routing changes the tokens but not the (replayed) amount of work
    ids = {(r["arm"], r["repetition"], r["request_id"]): r["output_ids"] for r in measured}
    assert any(ids[("upstream", 0, q)] != ids[("vskipper", 0, q)] for q in res.lengths)
    summ = [r for r in res.rows if r["kind"] == "summary"]
    assert summ and all(r["n"] == 2 for r in summ)
    cells = [r for r in res.rows if r["kind"] == "cell"]
    assert {r["arm_settings"]["mode"] for r in cells} == {"dense", "routed"}


def test_soft_reset_keeps_a_time_for_every_token(model):
    """A cache of 4 pages x 8 tokens cannot hold the six requests: the engine evicts and re-prefills
    (soft reset), which restarts its timestamp list; the arm then stamps each streamed token with the
    update's latest engine stamp (timestamp_source "stream") and still times every token."""
    reqs = [Request(f"s{i}", tuple(range(1, 8 + i)), 10, True) for i in range(6)]
    sched = poisson_arrivals(1e5, n=6, seed=0)  # all at once
    small = routed_cb_config(page_size=8, num_blocks=4, max_batch_tokens=16, max_requests_per_batch=8)
    res = run_load(ContinuousBatchingArm(model, "small", cb_config=small, eos_token_id=None), reqs, sched, timeout_s=60)
    ref = run_load(ContinuousBatchingArm(model, "ref", cb_config=_cb(), eos_token_id=None), reqs, sched)
    _check_timeline(res.records, engine_stamps=False)
    assert all(r.output_tokens == 10 for r in res.records)
    assert any(r.timestamp_source == "stream" for r in res.records)
    assert [r.output_ids for r in res.records] == [r.output_ids for r in ref.records]
