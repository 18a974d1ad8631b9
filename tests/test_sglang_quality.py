"""The quality 2x2 with arms C and D served by upstream SGLang (impl.vskipper.quality_sglang; issue 16's
quality cells): lm-eval's recording client speaking SGLang's dialect (``rid``, ``return_token_ids``,
first-token log-probabilities from ``/generate``), on the wide random Llama under RandomSkip.

Always: the client's payload and response recording against hand-built SGLang answers; refusals before any
server. With ``.venv-sglang`` (CI installs it): the four arms end to end - C (upstream SGLang) equals A
(lm-eval's HF backend) and D (vSkipper inside SGLang, always-route) equals B (the checkpoint in plain
PyTorch) token for token, with the prompt ids SGLang received, identical prompt hashes in every arm, and
first-token log-probabilities within the 0.01-nat tolerance; the OpenAI Python SDK drives arm D's server
(plain and streamed) and gets the routed transformers engine's ids.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval")

ROOT = Path(__file__).resolve().parents[1]
SGLANG_PY = ROOT / ".venv-sglang" / "bin" / "python"
SGLANG_READY = SGLANG_PY.exists() and any((ROOT / ".venv-sglang").glob(".installed-sglang-*"))
needs_sglang = pytest.mark.skipif(not SGLANG_READY, reason="no SGLang environment (scripts/setup_sglang.sh)")
LAYERS = [1, 2, 3]


@pytest.fixture(scope="module")
def wide_dir(tmp_path_factory, tiny_tokenizer):
    from conftest import save_wide_llama

    d = tmp_path_factory.mktemp("sglang_quality") / "model"
    save_wide_llama(d, tiny_tokenizer, 1024)  # the runs use max_length 512: SGLang keeps a margin below the context
    return d


def _lm(wide_dir, **kw):
    from impl.vskipper.quality_sglang import SGLangCompletionsLM

    return SGLangCompletionsLM("D", generate_url="http://127.0.0.1:1/generate",
                               base_url="http://127.0.0.1:1/v1/completions", model="m", tokenizer=wide_dir,
                               max_length=512, **kw)


def test_the_client_speaks_sglangs_dialect(wide_dir):
    lm = _lm(wide_dir)
    lm._rid_queue[(5, 6, 7)].append("vsk_gsm8k/3")
    payload = lm._create_payload([[5, 6, 7]], generate=True, gen_kwargs={"max_gen_toks": 4, "until": ["\n"]})
    assert payload["rid"] == "vsk_gsm8k/3" and "request_id" not in payload and payload["return_token_ids"] is True
    assert payload["prompt"] == [5, 6, 7]  # one prompt: a batch of one would get the rid "vsk_gsm8k/3_0"
    answer = {"id": "vsk_gsm8k/3", "object": "text_completion",
              "choices": [{"index": 0, "text": "ab", "token_ids": [9, 10], "prompt_token_ids": [5, 6, 7],
                           "finish_reason": "stop", "logprobs": None}]}
    assert "stop" not in payload  # HFLM's stop rule is applied to the ids here, not by SGLang
    # lm-eval gets the ids decoded as arm A's text (the hand-built "ab" is not what [9, 10] decode to)
    assert lm.parse_generations(answer) == [lm.tokenizer.decode([9, 10], skip_special_tokens=True)]
    assert lm.received == {"vsk_gsm8k/3": [5, 6, 7]}
    assert lm._responses["vsk_gsm8k/3"]["token_ids"] == [9, 10]
    assert lm._responses["vsk_gsm8k/3"]["vskipper"] == {"request_id": "vsk_gsm8k/3", "engine": "sglang"}


def test_served_sglang_is_refused_without_its_launch_or_policy(wide_dir, data_dir, tmp_path):
    from impl.vskipper.quality_run import run_quality

    with pytest.raises(ValueError, match="sglang_launch"):
        run_quality(wide_dir, "randomskip", data_dir, ("coqa",), 1, tmp_path / "o", served="sglang")
    from impl.serving.sglang_server import SGLangLaunch

    with pytest.raises(ValueError, match="sglang_policy"):
        run_quality(wide_dir, "randomskip", data_dir, ("coqa",), 1, tmp_path / "o", served="sglang",
                    sglang_launch=SGLangLaunch(model_dir=wide_dir))
    assert not (tmp_path / "o").exists()  # refused before anything was written


@needs_sglang
@pytest.mark.slow
def test_the_quality_2x2_on_sglang_reproduces_the_in_process_arms(wide_dir, data_dir, tmp_path):
    from impl.quality.tasks import TaskOptions
    from impl.serving.sglang_server import SGLangLaunch
    from impl.vskipper.quality_run import run_quality
    from impl.vskipper.random_skip import RandomSkip

    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        kwargs = {"routed_layers": LAYERS, "r": 0.5, "d": 1.0, "seed": 3}
        opts = TaskOptions(gsm8k_max_gen_toks=12, bbh_max_gen_toks=12, coqa_max_gen_toks=12,
                           bbh_subtasks=("boolean_expressions",), datasets_cache_dir=str(tmp_path / "hf"))
        launch = SGLangLaunch(model_dir=wide_dir, python=SGLANG_PY, threads=1, max_total_tokens=4096)
        res = run_quality(wide_dir, RandomSkip(**kwargs), data_dir, ("gsm8k", "coqa"), 2, tmp_path / "out",
                          options=opts, first_token_docs=1, max_length=512, served="sglang", sglang_launch=launch,
                          sglang_policy=("random", kwargs), http_concurrency=4)
    finally:
        torch.set_num_threads(prev)
    keys = sorted(res.records["A"])
    assert len(keys) == 4
    for k in keys:
        assert len({res.records[a][k].prompt_hash for a in "ABCD"}) == 1  # the gate's condition
        for arm in "CD":
            rec = res.records[arm][k]
            assert rec.served["ids_source"] == "engine"  # SGLang's own prompt_token_ids
            assert rec.served["vskipper"]["request_id"] == rec.request_id == f"{k[0]}/{k[1]}"
        assert res.records["C"][k].gen_ids == res.records["A"][k].gen_ids, k  # upstream SGLang = HF greedy
        assert res.records["D"][k].gen_ids == res.records["B"][k].gen_ids, k  # routed SGLang = the checkpoint
    assert any(res.records["B"][k].gen_ids != res.records["A"][k].gen_ids for k in keys)  # the skipper matters
    by = {(r["task"], r["doc_id"], r["arm"], r["reference"]): r for r in res.first_token}
    for task, doc, _, _ in by:
        assert by[(task, doc, "C", "A")]["agree"] and by[(task, doc, "D", "B")]["agree"]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["served"] == "sglang"
    assert summary["served_stats"]["C"]["engine"] == "sglang" and summary["served_stats"]["D"]["policy"] == "random"
    run, po = summary["served_stats"]["D"]["route_counts"]["decode"]
    assert po > 0 and run > 0  # D routed its decode rows (r = 0.5 of the requests, every routed layer)
    for suite in ("gsm8k", "coqa"):
        row = res.summary_for(suite)
        assert row["n"] == 2 and row["tokens_equal_BD"] == 2 and row["tokens_equal_AC"] == 2


@needs_sglang
@pytest.mark.slow
def test_the_openai_sdk_drives_vskipper_inside_sglang(wide_dir):
    """The OpenAI Python SDK (a real client) against quality arm D's server (vSkipper inside SGLang,
    always-route, RandomSkip): token-id prompts with SGLang's ``rid`` and ``return_token_ids`` through
    ``extra_body``, plain and streamed; the ids equal the project's routed transformers engine under the
    same request ids."""
    import openai

    from impl.models.load import load_model
    from impl.serving.sglang_server import SGLangLaunch
    from impl.vskipper.engine import bind_skipper, generate_greedy, unbind_skipper
    from impl.vskipper.quality_sglang import sglang_quality_arm
    from impl.vskipper.random_skip import RandomSkip

    kwargs = {"routed_layers": LAYERS, "r": 0.5, "d": 1.0, "seed": 3}
    prompts = [[5, 17, 33, 2, 9, 41], [7, 7, 21, 60, 3], [11, 4, 90, 12, 8, 30, 2]]
    rids = [f"sdk/{i}" for i in range(len(prompts))]
    model = load_model(wide_dir)
    bind_skipper(model, RandomSkip(**kwargs))
    try:
        ref = generate_greedy(model, prompts, max_new_tokens=8, mode="routed", request_ids=rids)
    finally:
        unbind_skipper(model)
    launch = SGLangLaunch(model_dir=wide_dir, python=SGLANG_PY, threads=1, max_total_tokens=4096)
    with sglang_quality_arm("D", launch, policy="random", policy_kwargs=kwargs) as server:
        client = openai.OpenAI(base_url=f"{server.server.url}/v1", api_key="none")
        for p, rid, want in zip(prompts, rids, ref):
            out = client.completions.create(model=server.served_model_name, prompt=p, max_tokens=8, temperature=0,
                                            extra_body={"rid": rid, "return_token_ids": True, "ignore_eos": True})
            assert out.id == rid and out.choices[0].model_extra["token_ids"] == want
            assert out.choices[0].model_extra["prompt_token_ids"] == p
            pieces = client.completions.create(model=server.served_model_name, prompt=p, max_tokens=8, temperature=0,
                                               stream=True, extra_body={"rid": rid, "ignore_eos": True})
            assert "".join(c.choices[0].text for c in pieces if c.choices) == out.choices[0].text
        stats = server.describe()
    run, po = stats["route_counts"]["decode"]
    assert po > 0  # the server routed decode rows

