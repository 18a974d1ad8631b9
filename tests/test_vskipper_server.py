"""The OpenAI-compatible server in front of one vSkipper engine arm (impl/vskipper/server.py), on a tiny
random Llama saved with a tokenizer: health and model listing, greedy completions equal to
``generate_greedy`` for the same arm (upstream dense, always-route and a hybrid whose switch routes
everything, with RandomSkip), string and token-id prompts, SSE streaming (one chunk per token and a
usage chunk), exact ``ignore_eos`` lengths, stop strings, top-k logprobs, concurrent requests batched
in the shared manager, malformed requests answered with 4xx while the server keeps serving, the
load generator's HTTP client arm, lm-eval's ``local-completions`` client, skipper specs and the
command line with a clean SIGTERM shutdown."""

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from impl.models.load import load_model, load_tokenizer
from impl.vskipper import ModeSwitch, RandomSkip, bind_skipper, generate_greedy, routed_cb_config
from impl.vskipper.driver import ARMS
import impl.vskipper.server as server_mod
from impl.vskipper.server import serve
from impl.vskipper.spec import check_skipper_spec, parse_layers, parse_skipper_spec
from conftest import save_wide_llama

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ROOT = Path(__file__).resolve().parents[1]
SPEC = "randomskip:r=0.6,d=0.5,seed=3"
CB = dict(page_size=16, num_blocks=64, max_batch_tokens=24, max_requests_per_batch=8)  # chunked prefill
TEXT_PROMPTS = ["Question: how many apples?", "def f(x):\n", "Answer: 3 apples."]
ID_PROMPTS = [[5, 6, 7, 8, 9], list(range(40, 60)), [60, 2]]
NEW = 10


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tiny_tokenizer):
    """A seeded random 4-layer Llama over the tiny tokenizer's vocabulary, saved with the tokenizer."""
    d = tmp_path_factory.mktemp("srv_model")
    save_wide_llama(d, tiny_tokenizer, 128)
    return d


@pytest.fixture(scope="module")
def tok(model_dir):
    return load_tokenizer(model_dir)


def _start(model_dir, arm, **kw):
    return serve(model_dir, arm, kw.pop("spec", SPEC), port=0, block=False, served_model_name="tiny",
                 cb_overrides=CB, **kw)


@pytest.fixture(scope="module")
def upstream(model_dir):
    srv = _start(model_dir, "upstream")
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def always_route(model_dir):
    srv = _start(model_dir, "always-route")
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def hybrid_all(model_dir):
    """Hybrid with thresholds that every batch passes: the switch routes every phase of every request."""
    srv = _start(model_dir, "hybrid", switch=ModeSwitch(min_prefill_tokens=0, enter_threshold=0, initial_share=1.0))
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def refs(model_dir):
    """Reference generators: the unmodified model (dense) and a RandomSkip-bound copy (routed)."""
    dense = load_model(model_dir)
    routed = load_model(model_dir)
    bind_skipper(routed, parse_skipper_spec(SPEC, routed))
    eos = dense.generation_config.eos_token_id

    def run(kind, prompts, ids, new=NEW, natural=True, **kw):
        model = dense if kind == "dense" else routed
        return generate_greedy(model, prompts, max_new_tokens=new, mode=kind, request_ids=ids,
                               eos_token_id=eos if natural else None, cb_config=routed_cb_config(**CB), **kw)

    return run


def _post(url, body, path="/v1/completions", raw: bytes | None = None, headers=None):
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _json(url, body, **kw):
    code, text = _post(url, body, **kw)
    return code, json.loads(text)


def _get(url, path):
    try:
        with urllib.request.urlopen(url + path, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _sse(text):
    out = []
    for block in text.split("\n\n"):
        block = block.strip()
        if block:
            assert block.startswith("data: "), block
            out.append(block[6:])
    return out


# ---------------------------------------------------------------------------------------------------------
def test_health_models_and_stats(upstream, always_route):
    for srv in (upstream, always_route):
        code, body = _get(srv.url, "/health")
        assert code == 200 and body["status"] == "ok" and body["arm"] == srv.engine.arm
        code, body = _get(srv.url, "/v1/models")
        assert code == 200 and [m["id"] for m in body["data"]] == ["tiny"]
        assert body["data"][0]["max_model_len"] == 128
    code, st = _get(always_route.url, "/v1/vskipper/stats")
    assert code == 200 and st["arm"] == "always-route" and st["skipper_bound"]
    assert st["skipper"]["class"] == "RandomSkip" and st["skipper"]["routed_layers"] == [2, 3]
    assert st["cb_config"]["allow_block_sharing"] is False and st["cb_config"]["use_async_batching"] is False
    code, st = _get(upstream.url, "/v1/vskipper/stats")
    assert st["arm"] == "upstream" and not st["skipper_bound"] and "project_only_share" not in st
    assert set(ARMS) >= {"upstream", "hybrid", "always-route"}


@pytest.mark.parametrize("arm, kind", [("upstream", "dense"), ("always_route", "routed"), ("hybrid_all", "routed")])
def test_greedy_matches_generate_greedy(request, refs, tok, arm, kind):
    srv = request.getfixturevalue(arm)
    text_ids = [tok(p)["input_ids"] for p in TEXT_PROMPTS]
    prompts = text_ids + ID_PROMPTS
    rids = [f"{arm}-p{i}" for i in range(len(prompts))]
    want = refs(kind, prompts, rids)
    if kind == "routed":  # the arm and the request id matter, so equality below is a real check
        assert want != refs("dense", prompts, rids)
        assert want != refs(kind, prompts, [r + "x" for r in rids])
    bodies = [{"model": "tiny", "prompt": p, "max_tokens": NEW, "temperature": 0} for p in TEXT_PROMPTS]
    bodies += [{"prompt": p, "max_tokens": NEW} for p in ID_PROMPTS[:2]]
    bodies += [{"prompt": [ID_PROMPTS[2]], "max_tokens": NEW}]  # a list holding one token-id prompt
    for body, rid, ids, exp in zip(bodies, rids, prompts, want):
        code, out = _json(srv.url, {**body, "request_id": rid})
        assert code == 200, out
        ch = out["choices"][0]
        assert ch["token_ids"] == exp, (rid, ch["token_ids"], exp)
        assert out["usage"] == {"prompt_tokens": len(ids), "completion_tokens": len(exp),
                                "total_tokens": len(ids) + len(exp)}
        assert ch["finish_reason"] == ("stop" if len(exp) < NEW else "length")
        assert ch["text"] == tok.decode(exp, skip_special_tokens=True) or not isinstance(body["prompt"], str)
        assert ch["vskipper"]["request_id"] == rid
        if arm == "hybrid_all":  # the switch recorded this request's modes: routed prefill and decode
            assert ch["vskipper"]["prefill_routed"]
            assert ch["vskipper"]["decode_routed_from"] == (len(ids) if len(exp) > 1 else None)
    if arm == "hybrid_all":
        st = _get(srv.url, "/v1/vskipper/stats")[1]
        assert st["mode_switch"]["rows"]["decode"]["routed"] > 0 and st["mode_switch"]["rows"]["decode"]["dense"] == 0
        assert 0 < st["project_only_share"]["all"] < 1
        assert st["counters"]["decode_routed_requests"] >= len(prompts)


def test_several_prompts_in_one_request(always_route, refs):
    code, out = _json(always_route.url, {"prompt": ID_PROMPTS, "max_tokens": 6, "request_id": "multi",
                                         "ignore_eos": True})
    assert code == 200 and [c["index"] for c in out["choices"]] == [0, 1, 2]
    want = refs("routed", ID_PROMPTS, [f"multi-{i}" for i in range(3)], new=6, natural=False)
    assert [c["token_ids"] for c in out["choices"]] == want
    assert out["usage"]["completion_tokens"] == 18


def test_streaming_one_chunk_per_token_then_usage(always_route):
    body = {"prompt": TEXT_PROMPTS[0], "max_tokens": NEW, "ignore_eos": True, "request_id": "s0"}
    code, full = _json(always_route.url, body)
    assert code == 200
    # without stream_options.include_usage (OpenAI's rule): no usage anywhere, every chunk has a choice
    code, text = _post(always_route.url, {**body, "stream": True})
    assert code == 200
    plain = [json.loads(e) for e in _sse(text)[:-1]]
    assert len(plain) == NEW and all(len(c["choices"]) == 1 and "usage" not in c for c in plain)
    code, text = _post(always_route.url, {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert code == 200
    events = _sse(text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    token_chunks, usage = chunks[:-1], chunks[-1]
    assert len(token_chunks) == NEW
    assert [c["choices"][0]["token_ids"] for c in token_chunks] == [[t] for t in full["choices"][0]["token_ids"]]
    assert "".join(c["choices"][0]["text"] for c in token_chunks) == full["choices"][0]["text"]
    assert [c["choices"][0]["finish_reason"] for c in token_chunks] == [None] * (NEW - 1) + ["length"]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == NEW
    assert usage["usage"]["prompt_tokens"] == full["usage"]["prompt_tokens"]
    assert all(c["usage"] is None for c in token_chunks)  # "usage": null on every other chunk
    assert [c["choices"][0]["token_ids"] for c in plain] == [c["choices"][0]["token_ids"] for c in token_chunks]


def test_ignore_eos_gives_exactly_max_tokens(upstream):
    body = {"prompt": ID_PROMPTS[0], "max_tokens": 12, "request_id": "e0"}
    code, out = _json(upstream.url, {**body, "ignore_eos": True})
    ids = out["choices"][0]["token_ids"]
    assert code == 200 and len(ids) == 12 and out["usage"]["completion_tokens"] == 12
    # make the third generated token this request's EOS: the natural lane stops there ...
    eos = ids[2]
    first = ids.index(eos)
    gen = json.dumps({"eos_token_id": eos})
    code, nat = _json(upstream.url, {**body, "generation_config": gen})
    assert nat["choices"][0]["token_ids"] == ids[: first + 1] and nat["choices"][0]["finish_reason"] == "stop"
    assert nat["usage"]["completion_tokens"] == first + 1  # the EOS counts
    # ... and ignore_eos (field, or generation_config eos_token_id=-1 as HTTPCompletionsArm sends) does not
    gen_off = json.dumps({"eos_token_id": -1, "max_new_tokens": 12})  # max_tokens absent: taken from here
    for b in ({**body, "ignore_eos": True},
              {"prompt": ID_PROMPTS[0], "request_id": "e0", "generation_config": gen_off}):
        code, out2 = _json(upstream.url, b)
        assert code == 200 and out2["choices"][0]["token_ids"] == ids, b
        assert out2["choices"][0]["finish_reason"] == "length"


def test_stop_strings_cut_text_and_free_the_request_id(upstream):
    base = {"prompt": TEXT_PROMPTS[1], "max_tokens": 24, "ignore_eos": True, "request_id": "stop0"}
    full = _json(upstream.url, base)[1]["choices"][0]
    text = full["text"]
    visible = [i for i, c in enumerate(text) if c.isprintable() and c != "\ufffd"]
    assert len(visible) >= 6, text
    stop = text[visible[3]: visible[3] + 2]
    cut = text[: text.find(stop)]
    before = _get(upstream.url, "/v1/vskipper/stats")[1]["counters"]
    code, out = _json(upstream.url, {**base, "stop": [stop, "\x00never"]})
    ch = out["choices"][0]
    assert code == 200 and ch["text"] == cut and ch["finish_reason"] == "stop"
    assert 1 <= out["usage"]["completion_tokens"] < 24
    # a stop-string end is a normal end: counted finished with its tokens, not cancelled
    after = _get(upstream.url, "/v1/vskipper/stats")[1]["counters"]
    assert (after["finished"] - before["finished"], after["cancelled"] - before["cancelled"]) == (1, 0), after
    assert after["completion_tokens"] - before["completion_tokens"] == out["usage"]["completion_tokens"]
    assert ch["token_ids"] == full["token_ids"][: len(ch["token_ids"])]
    # streamed: the same text, the stop string never sent
    code, raw = _post(upstream.url, {**base, "stop": stop, "stream": True})
    chunks = [json.loads(e) for e in _sse(raw)[:-1]]  # no usage chunk: stream_options not set
    assert "".join(c["choices"][0]["text"] for c in chunks) == cut
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    # the cancelled request's id is released for reuse (the server waits for the engine to drop it)
    code, again = _json(upstream.url, base)
    assert code == 200 and again["choices"][0]["token_ids"] == full["token_ids"]


def test_top_logprobs(always_route, refs, tok):
    ids = tok(TEXT_PROMPTS[2])["input_ids"]
    code, out = _json(always_route.url, {"prompt": TEXT_PROMPTS[2], "max_tokens": 6, "ignore_eos": True,
                                         "logprobs": 3, "request_id": "lp0"})
    assert code == 200
    ch = out["choices"][0]
    lp = ch["logprobs"]
    assert len(lp["token_logprobs"]) == len(lp["top_logprob_ids"]) == len(lp["tokens"]) == 6
    for tid, chosen, top in zip(ch["token_ids"], lp["token_logprobs"], lp["top_logprob_ids"]):
        assert len(top) == 3 and top[0][0] == tid and abs(top[0][1] - chosen) < 1e-6  # greedy: top-1
        assert top[0][1] >= top[1][1] >= top[2][1]
    want_ids, want_lp = refs("routed", [ids], ["lp0"], new=6, natural=False, return_logprobs=True)
    assert want_ids[0] == ch["token_ids"]
    assert max(abs(a - b) for a, b in zip(want_lp[0], lp["token_logprobs"])) < 1e-4
    code, err = _json(always_route.url, {"prompt": "x", "logprobs": 6})
    assert code == 400 and "max_logprobs" in err["error"]["message"]


def test_concurrent_requests_batch_and_match_solo(always_route, refs):
    prompts = ID_PROMPTS + [[7, 8, 9, 10, 11, 12, 13]]
    rids = [f"c{i}" for i in range(len(prompts))]
    solo = [_json(always_route.url, {"prompt": p, "max_tokens": NEW, "ignore_eos": True, "request_id": r})[1]
            for p, r in zip(prompts, rids)]
    assert [s["choices"][0]["token_ids"] for s in solo] == refs("routed", prompts, rids, natural=False)
    batches_before = _get(always_route.url, "/v1/vskipper/stats")[1]["batches"]
    results = [None] * len(prompts)
    barrier = threading.Barrier(len(prompts))

    def worker(i):  # even: non-streaming, odd: streaming
        body = {"prompt": prompts[i], "max_tokens": NEW, "ignore_eos": True, "request_id": rids[i],
                "stream": i % 2 == 1}
        barrier.wait()
        code, text = _post(always_route.url, body)
        if body["stream"]:
            chunks = [json.loads(e) for e in _sse(text)[:-1]]
            results[i] = code, [t for c in chunks for ch in c["choices"] for t in ch["token_ids"]]
        else:
            results[i] = code, json.loads(text)["choices"][0]["token_ids"]

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for res, s in zip(results, solo):
        assert res is not None and res[0] == 200
        assert res[1] == s["choices"][0]["token_ids"]
    batches = _get(always_route.url, "/v1/vskipper/stats")[1]["batches"] - batches_before
    solo_batches = sum(-(-len(p) // CB["max_batch_tokens"]) + NEW - 1 for p in prompts)
    assert batches < solo_batches  # requests shared batches


BAD = [
    ({"prompt": 3}, 400, "prompt"),
    ({"prompt": {"a": 1}}, 400, "prompt"),
    ({"prompt": ""}, 400, "empty"),
    ({"prompt": []}, 400, "empty"),
    ({"prompt": [[]]}, 400, "empty"),
    ({"prompt": [1, "a"]}, 400, "mixes"),
    ({"prompt": [1, True]}, 400, "prompt"),
    ({"prompt": [1, 10 ** 9]}, 400, "token ids"),
    ({"prompt": [1, -1]}, 400, "token ids"),
    ({"max_tokens": 4}, 400, "required"),
    ({"prompt": "hi", "model": "gpt-4"}, 404, "not served"),
    ({"prompt": "hi", "max_tokens": -3}, 400, ">= 1"),
    ({"prompt": "hi", "max_tokens": 0}, 400, ">= 1"),
    ({"prompt": "hi", "max_tokens": "5"}, 400, "integer"),
    ({"prompt": "hi", "max_tokens": 2.5}, 400, "integer"),
    ({"prompt": list(range(1, 120)), "max_tokens": 16}, 400, "context length"),
    ({"prompt": "hi", "temperature": 0.7}, 400, "greedy"),
    ({"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ({"prompt": "hi", "n": 2}, 400, "'n'"),
    ({"prompt": "hi", "echo": True, "logprobs": 1}, 400, "echo"),
    ({"prompt": "hi", "stream": "yes"}, 400, "stream"),
    ({"prompt": ["a", "b"], "stream": True}, 400, "exactly one"),
    ({"prompt": "hi", "stop": 5}, 400, "stop"),
    ({"prompt": "hi", "ignore_eos": "true"}, 400, "ignore_eos"),
    ({"prompt": "hi", "logprobs": -1}, 400, "logprobs"),
    ({"prompt": "hi", "generation_config": "{not json"}, 400, "generation_config"),
    ({"prompt": "hi", "generation_config": json.dumps({"do_sample": True})}, 400, "sampling"),
    ({"prompt": "hi", "request_id": 7}, 400, "request_id"),
    ({"prompt": "hi", "frequency_penalty": 0.5}, 400, "frequency_penalty"),
    ({"prompt": "hi", "temperature": float("nan")}, 400, "'temperature': Input should be a finite number"),
    ({"prompt": "hi", "temperature": float("inf")}, 400, "finite"),
    ({"prompt": "hi", "top_p": float("nan")}, 400, "'top_p'"),
    ({"prompt": "hi", "top_p": 1.5}, 400, "'top_p' must be in (0, 1]"),
    ({"prompt": "hi", "top_p": 0}, 400, "'top_p' must be in (0, 1]"),
    ({"prompt": "hi", "top_k": -5}, 400, "'top_k'"),
    ({"prompt": "hi", "min_p": 2}, 400, "'min_p'"),
    ({"prompt": "hi", "temperature": "hot"}, 400, "'temperature': Input should be a valid number"),
    ({"prompt": "hi", "response_format": {"type": "json_object"}}, 400, "'response_format'"),
    ({"prompt": "hi", "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "'tools'"),
    ({"prompt": "hi", "tool_choice": "auto"}, 400, "'tool_choice'"),
    ({"prompt": "hi", "guided_regex": "a+"}, 400, "'guided_regex'"),
    ({"prompt": "hi", "json_schema": "{}"}, 400, "'json_schema'"),
    ({"prompt": "hi", "max_tokens": 10 ** 8}, 400, "'max_tokens' must be < 128"),
    ({"prompt": "hi", "model": ""}, 400, "'model' must be a non-empty string"),
    ({"prompt": [1.5, 2.5]}, 400, "prompt token ids must be integers in [0, "),
    ({"prompt": [True, False]}, 400, "got [true, false]"),
    ({"prompt": [[1, 2], [3.5]]}, 400, "got [3.5]"),
    ({"prompt": "hi", "generation_config": {"max_new_tokens": 0}}, 400, "'generation_config.max_new_tokens' must be >= 1"),
    ({"prompt": "hi", "generation_config": {"eos_token_id": 10 ** 12}}, 400, "eos_token_id must be token ids in [0, "),
    ({"prompt": "hi", "generation_config": {"eos_token_id": [3, -7]}}, 400, "got [-7]"),
    ({"prompt": "hi", "generation_config": {"eos_token_id": []}}, 400, "non-empty list of ints"),
    ({"prompt": "hi", "rid": ""}, 400, "'rid' must be a non-empty string"),
]

#: Chat bodies refused before the chat template is needed (the tiny tokenizer has none).
BAD_CHAT = [
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}, "'max_completion_tokens' must be >= 1"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 10 ** 8}, "'max_completion_tokens' must be < 128"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "'messages[0].content[0].text' must be a string"),
    ({"messages": [{"role": "user", "content": "hi"}], "continue_final_message": True}, "must be the assistant's (got role 'user')"),
    ({"messages": [{"role": "user"}]}, "a user message needs 'content'"),
    ({"messages": [{"role": "system", "content": None}, {"role": "user", "content": "hi"}]}, "a system message needs 'content'"),
]

#: Fields that do not change a greedy decode: checked, then accepted (200).
ACCEPTED = [{"top_p": 0.9}, {"top_k": 40}, {"top_k": -1}, {"min_p": 0.05}, {"seed": 7}, {"user": "u"},
            {"response_format": {"type": "text"}}, {"tool_choice": "none"}, {"frobnicate": {"x": 1}}]


def test_malformed_requests_get_4xx_and_the_server_keeps_serving(upstream):
    before = _get(upstream.url, "/v1/vskipper/stats")[1]["counters"]
    for body, status, words in BAD:
        code, out = _json(upstream.url, body)
        assert code == status, (body, out)
        assert words in out["error"]["message"], (body, out)
        assert out["error"]["code"] == status
    for raw in (b"{not json", b"[1, 2]", b"\xff\xfe", b""):
        code, text = _post(upstream.url, None, raw=raw)
        assert code == 400 and "error" in json.loads(text), raw
    code, text = _post(upstream.url, None, raw=b'{"prompt": "\\ud800", "max_tokens": 2}')  # a lone surrogate
    assert code == 400 and "'prompt' is not valid Unicode" in json.loads(text)["error"]["message"], text
    code, text = _post(upstream.url, None, raw=b'{"prompt": "\xff"}')
    assert code == 400 and "not valid JSON" in json.loads(text)["error"]["message"]
    for extra in ACCEPTED:
        code, out = _json(upstream.url, {"prompt": "hi", "max_tokens": 2, **extra})
        assert code == 200 and out["usage"]["completion_tokens"] >= 1, (extra, out)
    code, out = _json(upstream.url, {"messages": [{"role": "user", "content": "hi"}]}, path="/v1/chat/completions")
    assert code == 400 and "chat template" in out["error"]["message"]  # the tiny tokenizer has none
    for body, words in (({"messages": []}, "messages"), ({"messages": [{"role": "robot", "content": "x"}]}, "role"),
                        ({"prompt": "hi"}, "messages"), *BAD_CHAT):
        code, out = _json(upstream.url, body, path="/v1/chat/completions")
        assert code == 400 and words in out["error"]["message"], (body, out)
    code, out = _json(upstream.url, {"prompt": "hi"}, headers={"X-Request-ID": "x" * 1000})
    assert code == 400 and "'X-Request-ID' must be a non-empty string" in out["error"]["message"], out
    # every 4xx above counts as rejected, none as admitted: requests grew by the accepted ones only
    after = _get(upstream.url, "/v1/vskipper/stats")[1]["counters"]
    n_bad = len(BAD) + 4 + 2 + 1 + 3 + len(BAD_CHAT) + 1  # BAD, raw bodies, bad text, chat template, chat bodies, header
    assert after["rejected"] - before["rejected"] == n_bad
    assert after["requests"] - before["requests"] >= len(ACCEPTED)  # (a request of an earlier test may land late)
    code, out = _json(upstream.url, {"prompt": "hi"}, headers={"Content-Type": "text/plain"})
    assert code == 400 and "'Content-Type: application/json' (got 'text/plain')" in out["error"]["message"], out
    # a body over the 64 MiB limit gets a JSON 413: announced by Content-Length (refused unread), or
    # chunked without one (refused at the byte that crosses the limit: here the last one sent)
    conn = http.client.HTTPConnection(upstream.host, upstream.port, timeout=60)
    conn.putrequest("POST", "/v1/completions")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", str(100 << 20))
    conn.endheaders(b'{"prompt": "hi"}')
    resp = conn.getresponse()
    assert resp.status == 413 and "request body larger than" in json.loads(resp.read())["error"]["message"]
    conn.close()
    big = b'{"prompt": "' + b"a" * ((64 << 20) + 1 - 14) + b'"}'
    conn = http.client.HTTPConnection(upstream.host, upstream.port, timeout=60)
    conn.request("POST", "/v1/completions", body=iter([big[i:i + (1 << 20)] for i in range(0, len(big), 1 << 20)]),
                 headers={"Content-Type": "application/json"}, encode_chunked=True)
    resp = conn.getresponse()
    assert resp.status == 413 and "request body larger than" in json.loads(resp.read())["error"]["message"]
    conn.close()
    assert _get(upstream.url, "/nope")[0] == 404
    assert _get(upstream.url, "/v1/completions")[0] == 405
    assert _post(upstream.url, {}, path="/health")[0] == 405
    # a client that goes away mid-stream: its request is cancelled, the server goes on
    conn = http.client.HTTPConnection(upstream.host, upstream.port, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps({"prompt": [5, 6], "max_tokens": 100, "stream": True,
                                                        "ignore_eos": True}), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.readline().startswith(b"data: ")
    conn.close()
    # a non-streaming client that goes away: its request is cancelled too (not decoded to the end). On a
    # loaded machine the tiny model can finish all 120 tokens before the server reads the disconnect (then
    # there is nothing left to cancel): such a try is repeated; one of five must end in a cancellation.
    def stats():
        return _get(upstream.url, "/v1/vskipper/stats")[1]["counters"]

    outcomes = []
    for _ in range(5):
        before = stats()
        with socket.create_connection((upstream.host, upstream.port), timeout=30) as sock:
            body = json.dumps({"prompt": [5, 6], "max_tokens": 120, "ignore_eos": True}).encode()
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            deadline = time.time() + 30
            while stats()["requests"] == before["requests"]:
                assert time.time() < deadline, "the request never reached the engine"
                time.sleep(0.01)
        deadline = time.time() + 30
        while (now := stats())["cancelled"] == before["cancelled"] and now["finished"] == before["finished"]:
            assert time.time() < deadline, "the disconnected non-streaming request was neither cancelled nor finished"
            time.sleep(0.05)
        outcomes.append("cancelled" if now["cancelled"] > before["cancelled"] else "finished")
        if outcomes[-1] == "cancelled":
            break
    assert outcomes[-1] == "cancelled", f"the disconnected non-streaming request was never cancelled: {outcomes}"
    code, out = _json(upstream.url, {"prompt": "Question: how many", "max_tokens": 3, "model": "tiny"})
    assert code == 200 and out["usage"]["completion_tokens"] >= 1
    assert _get(upstream.url, "/health")[0] == 200
    # every admitted request is accounted for once: finished, failed, cancelled, refused or in flight
    st = _get(upstream.url, "/v1/vskipper/stats")[1]
    c = st["counters"]
    assert c["requests"] == c["finished"] + c["failed"] + c["cancelled"] + c["refused"] + st["in_flight"], st


def test_http_completions_arm_drives_the_server(always_route, tok):
    from impl.serving.arms import HTTPCompletionsArm

    detok = lambda ids: tok.decode(ids)  # noqa: E731
    for via in ("field", "generation_config"):
        arm = HTTPCompletionsArm(always_route.url, "tiny", detokenize=detok, ignore_eos_via=via, name=f"http-{via}",
                                 include_usage=True)
        arm.start()
        ids = {f"{via}-{i}": tok(p)["input_ids"] for i, p in enumerate(TEXT_PROMPTS)}
        for rid, p in ids.items():
            arm.submit(rid, p, 8, ignore_eos=True)
        traces = arm.wait(list(ids), timeout_s=60)
        arm.stop()
        for rid, tr in traces.items():
            assert tr.error is None, tr.error
            assert tr.output_tokens == 8 and tr.finish_reason == "length"
            assert tr.prompt_tokens == len(ids[rid])
            assert 1 <= len(tr.token_times) <= 8
            assert all(a <= b for a, b in zip(tr.token_times, tr.token_times[1:]))
            assert tr.finish_time >= tr.token_times[-1]
            # the server used the arm's X-Request-ID as the engine request id (routes hash it)
            want = _json(always_route.url, {"prompt": detok(ids[rid]), "max_tokens": 8, "ignore_eos": True,
                                            "request_id": rid})[1]["choices"][0]["text"]
            assert tr.output_text == want


def test_lm_eval_local_completions_generate_until(upstream, model_dir):
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    lm = LocalCompletionsAPI(base_url=f"{upstream.url}/v1/completions", model="tiny", tokenizer_backend="huggingface",
                             tokenizer=str(model_dir), tokenized_requests=False, max_gen_toks=8, max_retries=1)
    ctx = ["Question: how many apples?", "def f(x):"]
    reqs = [Instance(request_type="generate_until", doc={}, idx=i,
                     arguments=(c, {"until": ["\n\n"], "max_gen_toks": 8, "do_sample": False}))
            for i, c in enumerate(ctx)]
    out = lm.generate_until(reqs, disable_tqdm=True)
    assert len(out) == 2 and all(isinstance(o, str) for o in out)
    for c, o in zip(ctx, out):
        direct = _json(upstream.url, {"prompt": c, "max_tokens": 8, "stop": ["\n\n", tok_eos(model_dir)]})[1]
        assert o == direct["choices"][0]["text"]


def tok_eos(model_dir):
    return load_tokenizer(model_dir).eos_token


def test_parse_skipper_spec(model_dir, tmp_path):
    from impl.vskipper import FlexiDepthSkipper, StaticDepthSkipper

    model = load_model(model_dir)
    sk = parse_skipper_spec("randomskip:r=0.5,d=0.5", model)
    assert isinstance(sk, RandomSkip) and sk.routed_layers == (2, 3) and sk.r == 0.5 and sk.seed == 0
    sk = parse_skipper_spec("random:r=1,d=1,seed=4,layers=0+2-3,layer_choice=fixed", model)
    assert sk.routed_layers == (0, 2, 3) and sk.layer_choice == "fixed" and sk.seed == 4
    assert isinstance(parse_skipper_spec("static:n_run=1,layers=1-3", model), StaticDepthSkipper)
    assert isinstance(parse_skipper_spec("static-depth:n_run=1", model), StaticDepthSkipper)  # registered name
    assert parse_layers("6-8+1", 12) == [1, 6, 7, 8]
    for bad in ("randomskip:r=0.5", "randomskip:r=0.5,d=0.5,zz=1", "randomskip:r=0.5,d=0.5,layers=3-9", "",
                "nosuch:x=1", "randomskip:r", "static-depth:layers=2-3", "random:r=0.5,d=0.5,bogus=1"):
        with pytest.raises(ValueError):
            parse_skipper_spec(bad, model)
    ck = FlexiDepthSkipper.for_model(model, [2, 3]).save(tmp_path / "ck", extra={"num_hidden_layers": 4})
    for spec in (f"flexidepth:{ck}", f"flexidepth:checkpoint={ck}", str(ck)):
        fd = parse_skipper_spec(spec, model)
        assert isinstance(fd, FlexiDepthSkipper) and fd.routed_layers == (2, 3)
    with pytest.raises(FileNotFoundError):
        parse_skipper_spec(f"flexidepth:{tmp_path / 'missing'}", model)
    with pytest.raises(ValueError):
        serve(model_dir, "sideways", SPEC, block=False)
    with pytest.raises(ValueError, match="needs a skipper"):
        serve(model_dir, "always-route", None, block=False)


@pytest.mark.parametrize("spec, exc, match", [
    ("randomskip:r=2,d=0.5", ValueError, "r and d in"),
    ("randomskip:r=0.5,d=abc", ValueError, "d must be a number"),
    ("randomskip:r=0.5,d=0.5,seed=x", ValueError, "seed must be an integer"),
    ("randomskip:r=0.5", ValueError, "missing d"),
    ("randomskip:r=0.5,d=0.5,zz=1", ValueError, "unknown zz"),
    ("random:r=0.5,d=0.5,layers=3-9", ValueError, "outside the model's 4 layers"),
    ("static:n_run=9", ValueError, "n_run=9"),
    ("nosuch:x=1", ValueError, "nosuch"),
    ("flexidepth:/no/such/dir", FileNotFoundError, "checkpoint directory not found"),
])
def test_bad_skipper_spec_refused_before_weights_load(model_dir, monkeypatch, spec, exc, match):
    """The server's start-up check names the bad parameter from config.json alone: no weights read."""
    def no_load(*a, **k):
        raise AssertionError("weights loaded before the skipper spec was checked")

    monkeypatch.setattr(server_mod, "load_model", no_load)
    with pytest.raises(exc, match=match):
        serve(model_dir, "always-route", spec, block=False)
    check_skipper_spec("randomskip:r=0.5,d=0.5", 4)  # a good spec passes
    check_skipper_spec("static:n_run=1,layers=1-3", 4)


def test_switch_arguments_keep_infinite_thresholds(tmp_path):
    """--thresholds (profile-mode JSON) and --switch (fields on top): a phase that never routes stays inf."""
    derived = {"min_prefill_tokens": None, "min_skip_share": 0.1, "probe_every": 8, "enter_threshold": 66}
    prof = tmp_path / "flexidepth.json"
    prof.write_text(json.dumps({"thresholds": derived}))
    sw = server_mod._switch_arg(None, str(prof))
    assert sw == ModeSwitch.from_thresholds(derived) and sw.min_prefill_tokens == float("inf")
    both = server_mod._switch_arg('{"enter_threshold": 4, "promote": false}', str(prof))
    assert (both.min_prefill_tokens, both.enter_threshold, both.probe_every, both.promote) == (float("inf"), 4, 8, False)
    assert server_mod._switch_arg('{"enter_threshold": null}', None).enter_threshold == float("inf")
    assert server_mod._switch_arg(None, None) is None
    with pytest.raises(ValueError, match="no field 'bogus'"):
        server_mod._switch_arg('{"bogus": 1}', None)
    with pytest.raises(ValueError, match="nope.json"):
        server_mod._switch_arg(None, str(tmp_path / "nope.json"))


@pytest.mark.parametrize("extra, match", [
    (["--cb", "bogus_key=1"], "--cb: unknown key 'bogus_key'"),
    (["--cb", "num_blocks=abc"], "--cb: num_blocks='abc'"),
    (["--cb", "page_size=2.5"], "--cb: page_size='2.5'"),
    (["--cb", "num_blocks=0"], "--cb: num_blocks must be >= 1"),
    (["--cb", "nokv"], "--cb: expected KEY=VALUE"),
    (["--switch", "notjson"], "--switch: not a JSON object"),
    (["--switch", "[1, 2]"], "--switch: expected a JSON object"),
    (["--switch", '{"probe_every": "x"}'], "--switch: "),
    (["--switch", '{"min_skip_share": 2}'], "--switch: ModeSwitch.min_skip_share"),
    (["--thresholds", "/nonexistent/t.json"], "--thresholds: thresholds file"),
    (["--device", "cuda:7"], "--device: 'cuda:7' is not available"),
    (["--device", "banana"], "--device: "),
    (["--ready-file", "/nonexistent/dir/port"], "--ready-file: folder /nonexistent/dir does not exist"),
    (["--log-level", "bogus"], "argument --log-level: invalid choice: 'BOGUS'"),
    (["--host", "no.such.host.invalid"], "--host: cannot resolve 'no.such.host.invalid'"),
    (["--arm", "upstream", "--skipper", "randomskip:r=0.5,d=0.5"], "--skipper: --arm upstream serves the unmodified"),
    (["--arm", "upstream", "--switch", "{}", "--thresholds", "t.json"], "--switch, --thresholds: --arm upstream"),
])
def test_cli_refuses_bad_arguments_before_loading(model_dir, monkeypatch, capsys, extra, match):
    """Every bad argument is one ``error:`` line naming it, exit status 2, and no weights are read."""
    monkeypatch.setattr(server_mod, "serve", lambda *a, **k: pytest.fail("serve() reached with a bad argument"))
    with pytest.raises(SystemExit) as exit_:
        server_mod.main(["--model", str(model_dir), "--port", "0", *extra])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and match in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err


def test_cli_refuses_a_taken_port_before_loading(model_dir, monkeypatch, capsys):
    import socket

    monkeypatch.setattr(server_mod, "serve", lambda *a, **k: pytest.fail("serve() reached with a taken port"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit) as exit_:
            server_mod.main(["--model", str(model_dir), "--port", str(port)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and f"--port: cannot listen on 127.0.0.1:{port}" in err


def test_cb_overrides_keep_typed_values():
    got = server_mod.cb_overrides_from_args(["num_blocks=64", "page_size=16", "max_memory_percent=0.5",
                                             "allow_block_sharing=false", "max_batch_tokens=none"])
    assert got == {"num_blocks": 64, "page_size": 16, "max_memory_percent": 0.5, "allow_block_sharing": False,
                   "max_batch_tokens": None}
    assert server_mod.cb_overrides_from_args([]) == {}


def test_cli_prints_port_and_stops_on_sigterm(model_dir):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "impl.vskipper.server", "--model", str(model_dir), "--arm",
                             "hybrid", "--skipper", SPEC, "--port", "0", "--threads", "1", "--cb", "num_blocks=64",
                             "--cb", "page_size=16", "--switch", '{"enter_threshold": 2}'],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line, proc.stderr.read()
        info = json.loads(line)
        assert info["arm"] == "hybrid" and info["port"] > 0 and info["model"] == model_dir.name
        assert info["torch_threads"] == 1 and info["max_model_len"] == 128 and info["max_num_seqs"] == 8
        assert info["kv_cache"]["num_blocks"] == 64 and info["kv_cache"]["tokens"] == 64 * 16
        url = info["listening"]
        assert _get(url, "/health")[0] == 200
        code, out = _json(url, {"prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True, "model": str(model_dir)})
        assert code == 200 and out["usage"]["completion_tokens"] == 4
        assert _get(url, "/v1/vskipper/stats")[1]["switch"]["enter_threshold"] == 2
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_close_lets_in_flight_requests_finish(model_dir):
    srv = _start(model_dir, "upstream", spec=None)
    inner = srv.engine.model.model
    forward = inner.forward

    def slow_forward(*args, **kwargs):  # ~0.5 s for the request below: it is in flight when close() starts
        threading.Event().wait(0.005)
        return forward(*args, **kwargs)

    inner.forward = slow_forward
    got = {}

    def client():
        got["res"] = _post(srv.url, {"prompt": [5, 6, 7], "max_tokens": 100, "ignore_eos": True, "stream": True,
                                     "stream_options": {"include_usage": True}})

    t = threading.Thread(target=client)
    t.start()
    while srv.engine.counters["requests"] == 0:  # the request reached the engine
        threading.Event().wait(0.005)
    assert srv.engine.describe()["in_flight"] == 1
    srv.close(grace_s=30)
    t.join(30)
    code, text = got["res"]
    events = _sse(text)
    assert code == 200 and events[-1] == "[DONE]"
    assert json.loads(events[-2])["usage"]["completion_tokens"] == 100
    assert not srv.engine.healthy and srv.engine.error is None
    with pytest.raises(OSError):
        urllib.request.urlopen(srv.url + "/health", timeout=5)


CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def chat_server(model_dir, tmp_path_factory):
    """The upstream arm of the same model, its tokenizer given a chat template."""
    import shutil

    d = tmp_path_factory.mktemp("chat_model") / "m"
    shutil.copytree(model_dir, d)
    t = load_tokenizer(d)
    t.chat_template = CHAT_TEMPLATE
    t.save_pretrained(d)
    srv = serve(d, "upstream", None, port=0, block=False, served_model_name="tiny-chat", cb_overrides=CB)
    yield srv, t
    srv.close()


def test_chat_completions_use_the_chat_template(chat_server):
    srv, t = chat_server
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "how many apples?"}]
    ids = t(t.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True), add_special_tokens=False)["input_ids"]
    want = _json(srv.url, {"prompt": ids, "max_tokens": 8, "ignore_eos": True})[1]["choices"][0]
    code, out = _json(srv.url, {"messages": msgs, "max_completion_tokens": 8, "ignore_eos": True, "logprobs": True,
                                "top_logprobs": 2, "model": "tiny-chat"}, path="/v1/chat/completions")
    assert code == 200, out
    ch = out["choices"][0]
    assert out["object"] == "chat.completion" and ch["message"]["role"] == "assistant"
    assert out["id"].startswith("chatcmpl-") and not out["id"].startswith("chatcmpl-cmpl-")
    assert ch["token_ids"] == want["token_ids"] and ch["message"]["content"] == want["text"]
    assert out["usage"]["prompt_tokens"] == len(ids) and out["usage"]["completion_tokens"] == 8
    lp = ch["logprobs"]["content"]
    assert len(lp) == 8 and all(len(x["top_logprobs"]) == 2 for x in lp)
    assert all(abs(x["logprob"] - x["top_logprobs"][0]["logprob"]) < 1e-6 for x in lp)  # greedy: top-1
    # streaming: a role chunk, one chunk per token, then (asked for) the usage chunk
    code, text = _post(srv.url, {"messages": msgs, "max_tokens": 8, "ignore_eos": True, "stream": True,
                                 "stream_options": {"include_usage": True}}, path="/v1/chat/completions")
    events = _sse(text)
    assert code == 200 and events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    toks = chunks[1:-1]
    assert [c["choices"][0]["token_ids"][0] for c in toks] == want["token_ids"]
    assert "".join(c["choices"][0]["delta"]["content"] for c in toks) == want["text"]
    assert toks[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8


def test_openapi_schema_lists_the_routes(upstream):
    code, spec = _get(upstream.url, "/openapi.json")
    assert code == 200
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health"} <= set(spec["paths"])


def test_kv_cache_is_sized_from_context_and_concurrency(model_dir):
    from impl.vskipper.server import kv_cache_plan

    model = load_model(model_dir)
    c = model.config
    plan = kv_cache_plan(model, 128, 8, 16, torch.float32)
    per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads) * 4
    assert plan["num_blocks"] == 64 and plan["tokens"] == 1024
    assert plan["mib"] == round(1024 * per_token / 2**20, 1)
    assert kv_cache_plan(model, 100, 3, 16, torch.float32)["num_blocks"] == 19  # ceil(300 / 16)
    assert abs(kv_cache_plan(model, 128, 8, 16, torch.bfloat16)["mib"] - plan["mib"] / 2) <= 0.1
    with pytest.raises(ValueError, match="max_position_embeddings"):
        serve(model_dir, "upstream", None, block=False, max_model_len=4096)


def test_hybrid_stats_count_requests_alike_in_both_places(model_dir):
    """``/v1/vskipper/stats``: the driver's counters and the mode switch's summary count the same requests
    (the switch's per-request entries are dropped on release; its counts must not be)."""
    srv = _start(model_dir, "hybrid", switch={"min_prefill_tokens": 2, "min_skip_share": 0.0, "enter_threshold": 1,
                                              "initial_share": 0.5})
    try:
        for n in range(3):
            code, out = _json(srv.url, {"prompt": [5, 6, 7 + n], "max_tokens": 3, "ignore_eos": True, "model": "tiny"})
            assert code == 200
        stats = _get(srv.url, "/v1/vskipper/stats")[1]
        counters, modes = stats["counters"], stats["mode_switch"]
        assert counters["prefill_routed_requests"] == modes["prefill_routed_requests"] == 3, (counters, modes)
        assert counters["decode_routed_requests"] == modes["decode_routed_requests"] == 3
        assert modes["rows"]["prefill"]["routed"] == 9 and modes["rows"]["prefill"]["dense"] == 0
    finally:
        srv.close()
