"""The OpenAI /v1/completions streaming client arm against a local stand-in server that mimics
``transformers serve --continuous-batching`` (5.24): string prompts only, unknown fields rejected with
HTTP 422 (so ``ignore_eos`` is refused), a ``generation_config`` JSON string honoured, text chunks per
token (none for the EOS) and a final chunk with ``usage``. fastapi is not installed here, so the real
server cannot be started in the tests."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from impl.serving import (HTTPCompletionsArm, Request, cell_metrics, check_matched, poisson_arrivals, record_lengths,
                          replay_requests, run_load)

ALLOWED = {"model", "prompt", "max_tokens", "stream", "temperature", "top_p", "seed", "stop", "suffix",
           "generation_config", "frequency_penalty"}
NATURAL = 3  # visible tokens before the stand-in model's EOS
ABORT_ID = 999  # a prompt starting with this id is aborted by the stand-in server, as SGLang streams an abort


class Handler(BaseHTTPRequestHandler):
    bodies: list = []

    def log_message(self, *args):
        pass

    def _json(self, code, obj):
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        Handler.bodies.append(body)
        unexpected = set(body) - ALLOWED
        if unexpected:
            return self._json(422, {"detail": f"Unexpected fields in the request: {unexpected}"})
        if not isinstance(body.get("prompt"), str):
            return self._json(400, {"detail": "prompt must be a string."})
        if body["prompt"].split()[0] == str(ABORT_ID):  # SGLang's stream of a request its server aborted
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for chunk in ({"choices": [{"text": "w0 ", "index": 0, "finish_reason": None}]},
                          {"choices": [{"text": "", "index": 0, "finish_reason": "abort"}]}):
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
            return
        n_max = int(body["max_tokens"])
        eos_off = body.get("generation_config") and json.loads(body["generation_config"]).get("eos_token_id") == -1
        n = n_max if eos_off else min(n_max, NATURAL + 1)  # + 1: the EOS counts, without text
        visible = n if (eos_off or n <= NATURAL) else NATURAL
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for k in range(visible):
            time.sleep(0.003)
            chunk = {"object": "text_completion", "choices": [{"text": f"w{k} ", "index": 0, "finish_reason": None}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()
        p = len(body["prompt"].split())
        final = {"choices": [{"text": "", "index": 0, "finish_reason": "length" if n >= n_max else "stop"}],
                 "usage": {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n}}
        self.wfile.write(f"data: {json.dumps(final)}\n\n".encode())
        self.wfile.flush()


@pytest.fixture(scope="module")
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def _arm(url, **kw):
    return HTTPCompletionsArm(url, "tiny", detokenize=lambda ids: " ".join(map(str, ids)), **kw)


def _requests(new=8):
    return [Request(f"h{i}", tuple(range(1, 3 + i)), new) for i in range(5)]


def test_natural_and_matched_replay_over_http(server):
    Handler.bodies.clear()
    reqs = _requests()
    sched = poisson_arrivals(50.0, n=5, seed=0)
    nat = run_load(_arm(server), reqs, sched)
    for r, q in zip(nat.records, reqs):
        assert r.ok, r.error
        assert r.output_tokens == NATURAL + 1 and len(r.token_times_s) == NATURAL and r.finish_reason == "stop"
        assert r.timestamp_source == "chunk" and r.output_ids == []
        assert r.prompt_tokens == len(q.input_ids) == r.prompt_tokens_requested
        assert r.arrival_s <= r.first_token_s <= r.token_times_s[-1] <= r.finish_s
    assert all(b["stream"] and b["temperature"] == 0.0 and isinstance(b["prompt"], str) for b in Handler.bodies)
    m = cell_metrics(nat.records, 10.0)  # everything inside a long window: the untimed EOS counts at the finish
    assert m["tps_window"] == pytest.approx(5 * (NATURAL + 1) / 10.0)

    lengths = {k: v - (i % 2) for i, (k, v) in enumerate(record_lengths(nat.records).items())}
    Handler.bodies.clear()
    rep = run_load(_arm(server), replay_requests(reqs, lengths), sched)
    check_matched({"http": rep.records}, lengths)
    gc = [json.loads(b["generation_config"]) for b in Handler.bodies]
    assert all(g["eos_token_id"] == -1 and g["do_sample"] is False for g in gc)
    assert sorted(g["max_new_tokens"] for g in gc) == sorted(lengths.values())


def test_ignore_eos_field_is_rejected_like_transformers_serve(server):
    rep = run_load(_arm(server, ignore_eos_via="field"), [Request("x", (1, 2), 4, True), Request("y", (3,), 4, True)],
                   poisson_arrivals(50.0, n=2, seed=0))
    assert all(not r.ok and r.error.startswith("HTTP 422") and "ignore_eos" in r.error for r in rep.records)


def test_ignore_eos_unsupported_raises():
    arm = _arm("http://127.0.0.1:9", ignore_eos_via=None)
    with pytest.raises(NotImplementedError):
        run_load(arm, [Request("x", (1,), 2, True), Request("y", (1,), 2, True)], poisson_arrivals(5.0, n=2, seed=0))
    with pytest.raises(NotImplementedError, match="ignore_eos"):
        arm.body([1], 2, True)


def test_connection_error_is_recorded():
    rep = run_load(_arm("http://127.0.0.1:9"), [Request("x", (1,), 2), Request("y", (1,), 2)],
                   poisson_arrivals(50.0, n=2, seed=0), timeout_s=30)
    assert all(not r.ok and r.error for r in rep.records)


def test_a_request_the_server_aborted_is_an_error_not_a_short_completion(server):
    rep = run_load(_arm(server), [Request("a", (ABORT_ID, 1), 8), Request("b", (1, 2), 8)],
                   poisson_arrivals(50.0, n=2, seed=0), timeout_s=30)
    aborted, fine = rep.records
    assert not aborted.ok and "finish_reason 'abort'" in aborted.error
    assert fine.ok and fine.finish_reason == "stop"
