"""The quality 2x2 end to end (vSkipper Sec. 4.1 "Quality", Table 5 left, App. E.1) on a tiny random
Llama saved to disk with a tiny tokenizer: GSM8K, one BBH task and CoQA, 2 documents each, the four arms
(A: lm-eval's HF backend; B: plain PyTorch with routed layers; C / D: the vSkipper HTTP server in
process, upstream / always-route, with lm-eval's ``local-completions`` client sending token ids).

- all-RUN skipper over HTTP: all four arms produce the same token ids and scores (C == A and D == B),
  the DiD is exactly 0, every arm's first-token log-probabilities match arm A's within 0.01 nats, the
  served arms' recorded prompt ids are the ids their server's engine received, and ``requests.jsonl``
  lists every document's request;
- RandomSkip over HTTP: the run completes with identical prompt hashes in every arm, and routed serving
  (D) reproduces the checkpoint in process (B) token for token and in first-token log-probabilities
  (the request id ``<task>/<doc_id>`` reaches the server);
- the prompt-hash gate refuses a tokenization difference in an in-process arm and in a served arm;
- the in-process served path (``served="inprocess"``) still agrees with A.
"""

import json

import pytest
import torch

pytest.importorskip("lm_eval")

from impl.models.tiny import TinyArch  # noqa: E402
from impl.provenance import read_jsonl  # noqa: E402
from impl.quality import PromptMismatchError  # noqa: E402
from impl.vskipper.quality_run import run_quality  # noqa: E402
from impl.quality.tasks import TaskOptions  # noqa: E402
from impl.vskipper import RandomSkip, StaticDepthSkipper, routed_cb_config  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

LIMIT = 2
ROUTED = [1, 2]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tiny_tokenizer):
    """A seeded random 4-layer Llama (hidden 32, context 512) over the tiny tokenizer, initialised wide so
    that greedy outputs vary and skipped layers change them; saved with its tokenizer. The (tied) EOS
    embedding is set to 1.05 x that of the token the model generates most often on a probe prompt, so
    that EOS wins where that token would and some generations stop early (every arm must then stop
    at the same token)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    cfg = TinyArch(num_layers=4, hidden_size=32, num_heads=4, intermediate_size=64,
                   max_position_embeddings=512).to_hf_config(vocab_size=len(tiny_tokenizer),
                                                             eos_token_id=tiny_tokenizer.eos_token_id)
    cfg.initializer_range = 0.2
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.down_proj.weight.mul_(4.0)
        probe = torch.tensor([tiny_tokenizer.encode("Question: how many apples? Answer: 3 apples.")])
        gen = model.generate(probe, max_new_tokens=24, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0, probe.shape[1]:]
        common = int(torch.mode(gen).values)
        emb = model.get_input_embeddings().weight
        emb[tiny_tokenizer.eos_token_id] = 1.05 * emb[common]
    d = tmp_path_factory.mktemp("quality_model")
    model.save_pretrained(d)
    tiny_tokenizer.save_pretrained(d)
    return d


def _opts(tmp_path):
    return TaskOptions(gsm8k_max_gen_toks=12, bbh_max_gen_toks=12, coqa_max_gen_toks=12,
                       bbh_subtasks=("boolean_expressions",), datasets_cache_dir=str(tmp_path / "hf"))


def _cb():
    return routed_cb_config(page_size=16, num_blocks=96, max_batch_tokens=256, max_requests_per_batch=4)


def _run(model_dir, skipper, data_dir, tmp_path, **kw):
    return run_quality(model_dir, skipper, data_dir, ("gsm8k", "bbh", "coqa"), LIMIT, tmp_path / "out",
                       options=_opts(tmp_path), cb_config=_cb(), first_token_docs=1, **kw)


def test_all_run_arms_identical(model_dir, data_dir, tmp_path):
    res = _run(model_dir, StaticDepthSkipper(ROUTED, n_run=len(ROUTED)), data_dir, tmp_path)
    keys = sorted(res.records["A"])
    assert len(keys) == 3 * LIMIT
    for k in keys:
        recs = [res.records[a][k] for a in "ABCD"]
        assert len({r.prompt_hash for r in recs}) == 1
        assert all(r.prompt_ids == recs[0].prompt_ids for r in recs)
        assert all(r.gen_ids == recs[0].gen_ids for r in recs), k
        assert all(r.text == recs[0].text for r in recs)
        assert 1 <= len(recs[0].gen_ids) <= 12 and len(recs[0].prompt_ids) <= 512 - 12
        scores = [res.scores[a][k]["scores"] for a in "ABCD"]
        assert all(s == scores[0] for s in scores)
    lengths = [len(res.records["A"][k].gen_ids) for k in keys]
    assert min(lengths) < 12 <= max(lengths)  # some generations stop early (EOS), some use the budget
    assert len({tuple(res.records["A"][k].gen_ids) for k in keys}) > 1
    for suite, metric in (("gsm8k", "exact_match,composite"), ("bbh", "exact_match,get-answer"),
                          ("coqa", "f1,none")):
        row = res.summary_for(suite)
        assert row["metric"] == metric and row["primary"] and row["n"] == LIMIT
        assert row["did_mean"] == 0.0 and row["did_ci_low"] == 0.0 and row["did_ci_high"] == 0.0
        assert not row["did_resolved"] and row["B_minus_A_mean"] == 0.0 and row["D_minus_C_mean"] == 0.0
        assert row["tokens_equal_all"] == LIMIT
    assert {r["metric"] for r in res.summary if r["suite"] == "gsm8k"} == {
        "exact_match,composite", "exact_match,strict-match", "exact_match,flexible-extract"}
    ft = res.first_token
    assert len(ft) == 3 * 4 and all(r["agree"] and r["max_abs_diff"] <= 0.01 for r in ft)

    out = tmp_path / "out"
    rows = read_jsonl(out / "quality.jsonl")
    docs = [r for r in rows if r["kind"] == "doc"]
    assert len(docs) == 4 * 3 * LIMIT
    for r in rows:
        assert r["run_id"] == rows[0]["run_id"] and "git_sha" in r and r["lm_eval_version"] == "0.4.13"
    assert {r["arm"] for r in docs} == set("ABCD") and all(len(r["prompt_hash"]) == 16 for r in docs)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["skipper"]["class"] == "StaticDepthSkipper"
    # C and D went over HTTP: the engine counted every document, the records carry the server's report
    assert summary["served"] == "http" and set(summary["served_stats"]) == {"C", "D"}
    assert summary["served_stats"]["C"]["arm"] == "upstream" and summary["served_stats"]["D"]["arm"] == "always-route"
    for arm in "CD":
        assert summary["served_stats"][arm]["counters"]["finished"] >= 3 * LIMIT
        for k in keys:
            rec = res.records[arm][k]
            assert rec.served["ids_source"] == "engine" and rec.served["vskipper"]["request_id"] == rec.request_id
            assert rec.served["vskipper"]["arm"] == {"C": "upstream", "D": "always-route"}[arm]
        assert json.loads((out / f"lm_eval_{arm}.json").read_text())["served"] == "http"
    for k in keys:  # every record keeps its stop strings (the EOS string included)
        assert res.records["A"][k].until == res.records["C"][k].until == res.records["B"][k].until
        assert res.records["A"][k].until[-1] == "<|endoftext|>"
    reqs = read_jsonl(out / "requests.jsonl")
    assert [(r["task"], r["doc_id"]) for r in reqs] == keys
    for r in reqs:
        rec = res.records["A"][(r["task"], r["doc_id"])]
        assert r["prompt_ids"] == rec.prompt_ids and r["prompt_hash"] == rec.prompt_hash and r["until"] == rec.until
        assert r["max_gen_toks"] == 12 and r["max_length"] == 512 and r["request_id"] == rec.request_id
    for arm in "ABCD":
        assert "vsk_gsm8k" in json.loads((out / f"lm_eval_{arm}.json").read_text())["results"]
    assert sorted(p.name for p in (out / "tasks").glob("*.yaml")) == [
        "vsk_bbh_boolean_expressions.yaml", "vsk_coqa.yaml", "vsk_gsm8k.yaml"]


def test_random_skip_completes_with_matching_hashes(model_dir, data_dir, tmp_path):
    skipper = RandomSkip(ROUTED, r=0.5, d=1.0, seed=3)
    res = _run(model_dir, skipper, data_dir, tmp_path)
    keys = sorted(res.records["A"])
    for k in keys:
        assert len({res.records[a][k].prompt_hash for a in "ABCD"}) == 1
        # the unmodified engine reproduces the base model; routed serving reproduces the checkpoint
        assert res.records["C"][k].gen_ids == res.records["A"][k].gen_ids
        assert res.records["D"][k].gen_ids == res.records["B"][k].gen_ids
    # the skipper does change the model
    assert any(res.records["B"][k].gen_ids != res.records["A"][k].gen_ids for k in keys)
    by = {(r["task"], r["doc_id"], r["arm"], r["reference"]): r for r in res.first_token}
    for task, doc, _, _ in by:
        assert by[(task, doc, "C", "A")]["agree"] and by[(task, doc, "D", "B")]["agree"]
    assert any(not r["agree"] for r in res.first_token if (r["arm"], r["reference"]) == ("B", "A"))
    for suite in ("gsm8k", "bbh", "coqa"):
        row = res.summary_for(suite)
        assert row["n"] == LIMIT and row["tokens_equal_BD"] == LIMIT and row["tokens_equal_AC"] == LIMIT


def test_prompt_mismatch_refused(model_dir, data_dir, tmp_path, monkeypatch):
    import impl.vskipper.quality_arms as arms

    real = arms.encode_context

    def altered(tokenizer, context, max_ctx_len, add_bos_token=None):
        return [tokenizer.eos_token_id] + real(tokenizer, context, max_ctx_len - 1, add_bos_token)

    monkeypatch.setattr(arms, "encode_context", altered)  # arm B now prepends a BOS-like token
    with pytest.raises(PromptMismatchError, match="differ between arms"):
        run_quality(model_dir, StaticDepthSkipper(ROUTED, n_run=2), data_dir, ("coqa",), 1, tmp_path / "out",
                    options=_opts(tmp_path), first_token_docs=0, arms=("A", "B"))
    assert not (tmp_path / "out" / "quality.jsonl").exists()


def test_prompt_mismatch_refused_over_http(model_dir, data_dir, tmp_path, monkeypatch):
    """The served arm's client tokenizes differently from arm A (the last prompt token becomes the special
    token, a change that commutes with lm-eval's left truncation): the server's engine receives those
    ids, they are recorded, and the gate refuses."""
    import impl.vskipper.quality_arms as arms
    from impl.vskipper.quality_arms import RecordingCompletionsLM

    real = arms.encode_context
    seen = {}

    def altered(tokenizer, context, max_ctx_len, add_bos_token=None):
        return real(tokenizer, context, max_ctx_len, add_bos_token)[:-1] + [tokenizer.eos_token_id]

    orig_init = RecordingCompletionsLM.__init__

    def init(self, *a, **kw):
        orig_init(self, *a, **kw)
        seen["received"] = kw["received"]

    monkeypatch.setattr(arms, "encode_context", altered)  # B, C and D use it; A is lm-eval's own HFLM
    monkeypatch.setattr(RecordingCompletionsLM, "__init__", init)
    with pytest.raises(PromptMismatchError, match="differ between arms") as e:
        run_quality(model_dir, StaticDepthSkipper(ROUTED, n_run=2), data_dir, ("coqa",), 1, tmp_path / "out",
                    options=_opts(tmp_path), first_token_docs=0, arms=("A", "C"), cb_config=_cb())
    assert "C=" in str(e.value) and "A=" in str(e.value)
    (ids,) = seen["received"].values()  # what the server's engine got: the special token last
    assert ids[-1] == 0 and len(ids) >= 2
    assert not (tmp_path / "out" / "quality.jsonl").exists()


def test_inprocess_served_arms_still_agree(model_dir, data_dir, tmp_path):
    res = run_quality(model_dir, StaticDepthSkipper(ROUTED, n_run=len(ROUTED)), data_dir, ("coqa",), 1,
                      tmp_path / "out", options=_opts(tmp_path), cb_config=_cb(), first_token_docs=1,
                      served="inprocess")
    (k,) = res.records["A"]
    assert all(res.records[a][k].gen_ids == res.records["A"][k].gen_ids for a in "BCD")
    assert res.records["C"][k].served is None and not res.served_stats
    assert all(r["agree"] for r in res.first_token)
    with pytest.raises(ValueError, match="served must be one of"):
        run_quality(model_dir, "randomskip", data_dir, ("coqa",), 1, tmp_path / "o2", served="socket")
