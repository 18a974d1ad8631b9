"""The served-at-knee pass (vSkipper Sec. 4.3, Table 5 right; impl/quality/served.py):

- unit level: decode-row accounting, the request rows' validation (errors name the key), the seeded
  stream (documents + padding, deterministic order), the open-loop client against a stub server (one
  POST per request at its scheduled offset, token-id prompts, stop strings, request ids), the paired
  summary on hand-made scores and the replay LM's prompt-hash gate;
- end to end on a tiny random Llama: a quality run (HTTP arms) writes the documents' requests, which are
  served as one Poisson stream to the hybrid and to always-route with the same schedule; rows are paired
  per document, scored by lm-eval, the always-route outputs equal the 2x2's arm D, and the routed share
  of decode rows is 1 / 1 for a switch that routes everything and 0 / 1 for one that keeps decode dense.
"""

import json
import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

pytest.importorskip("lm_eval")

from impl.vskipper.quality_arms import prompt_hash  # noqa: E402
from impl.vskipper.quality_served import (  # noqa: E402
    StreamRequest,
    build_stream,
    doc_requests,
    routed_decode_rows,
    run_stream,
    served_summary,
)
from impl.serving.arrivals import poisson_arrivals  # noqa: E402
from impl.vskipper.schema import Engine  # noqa: E402
from conftest import save_wide_llama

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _req_row(task="vsk_gsm8k", doc=0, ids=(5, 6, 7), **kw):
    row = {"kind": "request", "suite": "gsm8k", "task": task, "doc_id": doc, "request_id": f"{task}/{doc}",
           "prompt_ids": list(ids), "prompt_hash": prompt_hash(list(ids)), "until": ["Question:", "<|endoftext|>"],
           "max_gen_toks": 8, "max_length": 512, "add_bos_token": None}
    row.update(kw)
    return row


# ------------------------------------------------------------------------------------------ units
def test_routed_decode_rows():
    assert routed_decode_rows(10, 5, None) == (4, 0)  # dense decode
    assert routed_decode_rows(10, 5, 10) == (4, 4)  # always-route: every decode row from the first
    assert routed_decode_rows(10, 5, 12) == (4, 2)  # promoted: rows at 12, 13
    assert routed_decode_rows(10, 1, 10) == (0, 0)  # one token: no decode row
    assert routed_decode_rows(10, 0, None) == (0, 0)
    with pytest.raises(ValueError):
        routed_decode_rows(-1, 3, None)


def test_doc_requests_validate_and_sort():
    rows = [_req_row(doc=1, ids=(9, 9)), _req_row(doc=0)]
    docs = doc_requests(rows)
    assert [(d.task, d.doc_id) for d in docs] == [("vsk_gsm8k", 0), ("vsk_gsm8k", 1)]
    assert docs[0].stop == ("Question:", "<|endoftext|>") and docs[0].max_tokens == 8 and docs[0].scored
    bad = _req_row()
    del bad["until"]
    with pytest.raises(ValueError, match="until"):
        doc_requests([bad])
    with pytest.raises(ValueError, match="prompt_hash"):
        doc_requests([_req_row(prompt_hash="0" * 16)])
    with pytest.raises(ValueError, match="listed twice"):
        doc_requests([_req_row(), _req_row()])
    with pytest.raises(ValueError, match="max_gen_toks"):
        doc_requests([_req_row(max_gen_toks=0)])


def test_build_stream_pads_and_orders_deterministically():
    docs = doc_requests([_req_row(doc=i, ids=(5 + i, 6)) for i in range(3)])
    pads = [{"id": "a", "input_ids": [1, 2]}, {"id": "b", "input_ids": [3]}, {"id": "x", "error": "too long"}]
    s1 = build_stream(docs, pads, n_requests=7, pad_max_tokens=4, seed=3)
    s2 = build_stream(docs, pads, n_requests=7, pad_max_tokens=4, seed=3)
    assert [r.request_id for r in s1] == [r.request_id for r in s2]
    assert sorted(r.request_id for r in s1) == sorted(
        ["vsk_gsm8k/0", "vsk_gsm8k/1", "vsk_gsm8k/2", "pad/a", "pad/b", "pad/a#1", "pad/b#1"])
    pad = [r for r in s1 if not r.scored]
    assert all(r.max_tokens == 4 and r.stop == () for r in pad)
    assert [r.request_id for r in build_stream(docs, pads, n_requests=7, seed=4)] != [r.request_id for r in s1]
    assert len(build_stream(docs, (), n_requests=None)) == 3  # documents only
    with pytest.raises(ValueError, match="padding"):
        build_stream(docs, [], n_requests=5)


class _Stub(BaseHTTPRequestHandler):
    """Answers /v1/completions with the prompt reversed as token ids and a fixed routed-from index."""

    def log_message(self, *a):
        pass

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.bodies.append(body)
        toks = list(reversed(body["prompt"]))[: body["max_tokens"]]
        out = {"choices": [{"index": 0, "text": "x" * len(toks), "token_ids": toks, "finish_reason": "length",
                            "vskipper": {"request_id": body["request_id"], "decode_routed_from": len(body["prompt"])}}],
               "usage": {"completion_tokens": len(toks)}}
        data = json.dumps(out).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def test_run_stream_open_loop_against_a_stub():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Stub)
    srv.bodies = []
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    try:
        stream = [StreamRequest("vsk/0", (1, 2, 3), 2, ("Q:",), "vsk", 0, "h"), StreamRequest("pad/a", (4, 5), 5),
                  StreamRequest("vsk/1", (6,), 1, ("Q:",), "vsk", 1, "h")]
        sched = poisson_arrivals(50.0, 3, seed=1)
        got = run_stream(f"http://127.0.0.1:{srv.server_address[1]}/v1/completions", "m", stream, sched, timeout_s=30)
    finally:
        srv.shutdown()
        srv.server_close()
    assert set(got) == {"vsk/0", "pad/a", "vsk/1"} and all(r["error"] is None for r in got.values())
    assert got["vsk/0"]["token_ids"] == [3, 2] and got["pad/a"]["token_ids"] == [5, 4]
    for req, off in zip(stream, sched.offsets_s):
        rec = got[req.request_id]
        assert rec["scheduled_s"] == off and rec["arrival_s"] >= off - 1e-3 and rec["finish_s"] >= rec["arrival_s"]
        assert rec["vskipper"]["decode_routed_from"] == len(req.prompt_ids)
    by_id = {b["request_id"]: b for b in srv.bodies}
    assert by_id["vsk/0"] == {"model": "m", "prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0, "stop": ["Q:"],
                              "request_id": "vsk/0"}
    assert by_id["pad/a"]["stop"] == []
    with pytest.raises(ValueError, match="scheduled arrivals"):
        run_stream("http://127.0.0.1:9/v1/completions", "m", stream[:2], sched)


def test_served_summary_is_paired_per_document():
    keys = [("t", i) for i in range(4)]
    hy = [1.0, 0.0, 1.0, 1.0]
    ar = [1.0, 1.0, 0.0, 0.0]
    scores = {"hybrid": {k: {"scores": {"m,f": v}} for k, v in zip(keys, hy)},
              "always-route": {k: {"scores": {"m,f": v}} for k, v in zip(keys, ar)}}
    row = served_summary(scores, keys, "m,f", suite="gsm8k")
    assert row["n"] == 4 and row["mean_hybrid"] == 75.0 and row["mean_always-route"] == 50.0
    assert row["diff_mean"] == pytest.approx(25.0)
    d = [100 * (h - a) for h, a in zip(hy, ar)]
    sd = float(torch.tensor(d).std())
    assert row["diff_sd"] == pytest.approx(sd)
    assert row["diff_ci_low"] < 0 < row["diff_ci_high"] and not row["diff_resolved"]
    assert row["treatment"] == "hybrid" and row["reference"] == "always-route"
    with pytest.raises(ValueError):
        served_summary(scores, [], "m,f", suite="gsm8k")


def test_replay_lm_gate(tiny_tokenizer):
    from lm_eval.api.instance import Instance

    from impl.vskipper.quality_arms import encode_context
    from impl.quality.did import PromptMismatchError
    from impl.vskipper.quality_served import ReplayLM

    ctx = "Question: how many apples?\nAnswer:"
    ids = encode_context(tiny_tokenizer, ctx, 512 - 8)
    inst = Instance(request_type="generate_until", doc={}, arguments=(ctx, {"until": ["Q"], "max_gen_toks": 8}),
                    idx=0, metadata=("t", 0, 1))
    lm = ReplayLM.make({("t", 0): "3"}, {("t", 0): prompt_hash(ids)}, tiny_tokenizer, max_length=512,
                       add_bos_token=None)
    assert lm.generate_until([inst]) == ["3"]
    bad = ReplayLM.make({("t", 0): "3"}, {("t", 0): "0" * 16}, tiny_tokenizer, max_length=512, add_bos_token=None)
    with pytest.raises(PromptMismatchError, match="served prompt hash"):
        bad.generate_until([inst])
    none = ReplayLM.make({}, {}, tiny_tokenizer, max_length=512, add_bos_token=None)
    with pytest.raises(ValueError, match="no served response"):
        none.generate_until([inst])


# ------------------------------------------------------------------------------- end to end (tiny)
@pytest.fixture(scope="module")
def quality_run(tmp_path_factory, tiny_tokenizer, data_dir):
    """A tiny random 4-layer Llama (context 512) and a quality run over HTTP with RandomSkip on GSM8K
    (3 documents) and CoQA (2): the requests the served pass replays, and arm D's records."""

    from impl.vskipper.quality_run import run_quality
    from impl.quality.tasks import TaskOptions
    from impl.vskipper import RandomSkip, routed_cb_config

    root = tmp_path_factory.mktemp("served")
    save_wide_llama(root / "model", tiny_tokenizer, 512)
    opts = TaskOptions(gsm8k_max_gen_toks=10, coqa_max_gen_toks=10, datasets_cache_dir=str(root / "hf"))
    skipper = RandomSkip([1, 2], r=0.5, d=1.0, seed=3)
    cb = routed_cb_config(page_size=16, num_blocks=96, max_batch_tokens=256, max_requests_per_batch=4)
    runs = {}
    for suite, limit in (("gsm8k", 3), ("coqa", 2)):
        runs[suite] = run_quality(root / "model", skipper, data_dir, (suite,), limit, root / f"q_{suite}", options=opts,
                                  first_token_docs=0, cb_config=cb, arms=("A", "D"))
    return {"root": root, "model": root / "model", "skipper": skipper, "opts": opts, "runs": runs}


ENGINE = Engine(page_size=16, num_blocks=None, max_batch_tokens=256, max_requests_per_batch=4)
PADS = [{"id": f"p{i}", "input_ids": list(range(5 + i, 25 + i))} for i in range(3)]


def _served(q, suite, switch, out, **kw):
    from impl.vskipper.quality_served import run_served_knee

    run = q["runs"][suite]
    limit = {"gsm8k": 3, "coqa": 2}[suite]
    return run_served_knee(q["model"], q["skipper"], run.requests, q["data_dir"], suite, rate=25.0, switch=switch,
                           out=out, limit=limit, options=q["opts"], pad_prompts=PADS, n_requests=8, pad_max_tokens=6,
                           seed=7, engine=ENGINE, timeout_s=120, extra={"point": "knee", "rate": 25.0}, **kw)


@pytest.mark.parametrize("suite", ["gsm8k", "coqa"])
def test_served_knee_pass_all_routed(quality_run, suite, tmp_path, data_dir):
    """A switch that routes every phase: the hybrid's outputs equal always-route's, which equal the
    2x2's arm D (same ids, same request ids, greedy); difference exactly 0; routed share 1 / 1."""
    from impl.provenance import read_jsonl
    from impl.vskipper import ModeSwitch

    q = {**quality_run, "data_dir": data_dir}
    res = _served(q, suite, ModeSwitch(min_prefill_tokens=0, enter_threshold=0, initial_share=1.0), tmp_path / "s")
    run = quality_run["runs"][suite]
    docs = sorted(run.records["D"])
    # the same schedule and order for both arms
    reqs = [r for r in res.rows if r["kind"] == "served_request"]
    sched = {a: [(r["request_id"], r["scheduled_s"]) for r in reqs if r["arm"] == a] for a in ("hybrid", "always-route")}
    assert sched["hybrid"] == sched["always-route"] and len(sched["hybrid"]) == 8
    assert list(res.schedule.offsets_s) == [s for _, s in sched["hybrid"]]
    assert sum(r["scored"] for r in reqs if r["arm"] == "hybrid") == len(docs)
    # paired per-document rows, scored by lm-eval, outputs equal the 2x2's arm D
    drows = [r for r in res.rows if r["kind"] == "served_doc"]
    assert len(drows) == 2 * len(docs)
    for r in drows:
        rec = run.records["D"][(r["task"], r["doc_id"])]
        assert r["prompt_hash"] == rec.prompt_hash and r["gen_ids"] == rec.gen_ids and r["response"] == rec.text
        assert r["score"] == run.scores["D"][(r["task"], r["doc_id"])]["scores"][r["metric"]]
        assert 0.0 <= r["score"] <= 1.0 and r["decode_rows"] == r["decode_routed_rows"] == r["n_served_tokens"] - 1
        assert r["point"] == "knee" and "run_id" in r
    row = res.summary_for(suite)
    assert row["n"] == len(docs) and row["diff_mean"] == 0.0 and row["tokens_equal"] == len(docs)
    assert row["routed_share_hybrid"] == 1.0 and row["routed_share_always-route"] == 1.0
    assert row["n_requests"] == 8 and row["n_padding"] == 8 - len(docs)
    arms = {r["arm"]: r for r in res.arm_rows}
    assert arms["hybrid"]["switch_routed_share"] == 1.0 and arms["hybrid"]["server_stats"]["arm"] == "hybrid"
    assert arms["always-route"]["server_text_equal"] == len(docs)
    written = read_jsonl(tmp_path / "s" / "served.jsonl")
    assert len(written) == len(res.rows)
    assert json.loads((tmp_path / "s" / "summary.json").read_text())["stream"] == [r.request_id for r in res.stream]


def test_served_knee_pass_dense_decode_hybrid(quality_run, tmp_path, data_dir):
    """A hybrid whose switch never routes (thresholds out of reach): routed share of decode rows 0 / 1;
    the hybrid then serves the base model, whose outputs the quality run's arm A gives."""
    from impl.vskipper import ModeSwitch

    q = {**quality_run, "data_dir": data_dir}
    sw = ModeSwitch(min_prefill_tokens=math.inf, enter_threshold=math.inf, initial_share=1.0)
    res = _served(q, "gsm8k", sw, tmp_path / "s")
    row = res.summary_for("gsm8k")
    assert row["routed_share_hybrid"] == 0.0 and row["routed_share_always-route"] == 1.0
    assert row["prefill_routed_share_hybrid"] == 0.0 and row["switch_routed_share_hybrid"] == 0.0
    run = quality_run["runs"]["gsm8k"]
    for r in res.rows:
        if r["kind"] == "served_doc" and r["arm"] == "hybrid":
            assert r["gen_ids"] == run.records["A"][(r["task"], r["doc_id"])].gen_ids
    lo, hi = row["diff_ci_low"], row["diff_ci_high"]
    assert (lo <= row["diff_mean"] <= hi) or math.isnan(lo)


def test_served_knee_pass_refuses_bad_input(quality_run, tmp_path, data_dir):
    from impl.vskipper.quality_served import run_served_knee
    from impl.vskipper import ModeSwitch

    q = {**quality_run, "data_dir": data_dir}
    reqs = q["runs"]["coqa"].requests
    with pytest.raises(ValueError, match="rate"):
        run_served_knee(q["model"], q["skipper"], reqs, data_dir, "coqa", rate=0, switch=ModeSwitch(),
                        out=tmp_path / "a", limit=2)
    with pytest.raises(ValueError, match="arms"):
        _served(q, "coqa", ModeSwitch(), tmp_path / "b", arms=("hybrid", "upstream"))
    with pytest.raises(ValueError, match="at least 2 requests"):
        run_served_knee(q["model"], q["skipper"], reqs[:1], data_dir, "coqa", rate=5.0, switch=ModeSwitch(),
                        out=tmp_path / "c", limit=1)
