"""Upstream SGLang as an engine arm of the serving protocol (impl.serving.sglang_arm) and the config key that
selects it (``vskipper.engines.upstream``).

Two tiers: the arm's life cycle and gates against a stand-in ``sglang.launch_server`` speaking SGLang's
``/health_generate``, ``/server_info``, ``/flush_cache`` and streamed ``/v1/completions`` (always); real
upstream SGLang as the baseline of a matched-work cell against the project's transformers engine on the
same model (only where ``scripts/setup_sglang.sh`` has installed ``.venv-sglang``; CI does not, 11 GB).
"""

from __future__ import annotations

import json
import sys
import textwrap
import urllib.request
from pathlib import Path

import pytest

from impl.config import ConfigError, read_yaml, validate_config
from impl.serving.loadgen import Request
from impl.serving.protocol import CellError, run_cell
from impl.serving.sglang_arm import SGLangArm
from impl.serving.sglang_server import SGLangLaunch

ROOT = Path(__file__).resolve().parents[1]
SGLANG_PY = ROOT / ".venv-sglang" / "bin" / "python"
#: the install stamp scripts/setup_sglang.sh writes last: an interpreter alone may be a half-done install
SGLANG_READY = any((ROOT / ".venv-sglang").glob(".installed-sglang-*"))
needs_sglang = pytest.mark.skipif(not (SGLANG_PY.exists() and SGLANG_READY),
                                  reason="no SGLang environment (scripts/setup_sglang.sh)")

FAKE_SERVER = textwrap.dedent('''
    """Stand-in for sglang.launch_server: streamed /v1/completions over token-id prompts (token t -> t + 1,
    EOS after 3 tokens unless ignore_eos), /server_info, /flush_cache. A prompt starting with 999 is
    counted one token longer (a BOS the server would add)."""
    import argparse, json, time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int)
    ap.add_argument("--host")
    a, _ = ap.parse_known_args()
    state = {"flushes": 0, "completions": 0}

    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"

        def log_message(self, *args):
            pass

        def _send(self, code, obj):
            body = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if self.path == "/health_generate":
                self._send(200, {})
            elif self.path == "/server_info":
                self._send(200, {"version": "stand-in", "attention_backend": "torch_native", "dtype": "float32",
                                 "sampling_backend": "pytorch", "internal_states": [{"max_total_num_tokens": 4096}],
                                 **state})
            else:
                self._send(404, {})

        def do_POST(self):
            n = int(self.headers.get("Content-Length") or 0)
            req = json.loads(self.rfile.read(n)) if n else {}
            if self.path == "/flush_cache":
                state["flushes"] += 1
                self._send(200, {})
                return
            assert self.path == "/v1/completions", self.path
            prompt = req["prompt"]
            assert isinstance(prompt, list) and all(isinstance(t, int) for t in prompt), prompt
            assert req["stream"] and req["temperature"] == 0.0 and req["stream_options"] == {"include_usage": True}
            state["completions"] += 1
            k = req["max_tokens"] if req.get("ignore_eos") else min(3, req["max_tokens"])
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            t = prompt[-1]
            for i in range(k):
                t += 1
                done = "length" if i == k - 1 and k == req["max_tokens"] else ("stop" if i == k - 1 else None)
                chunk = {"choices": [{"index": 0, "text": f" t{t}", "finish_reason": done}]}
                self.wfile.write(f"data: {json.dumps(chunk)}\\n\\n".encode())
                self.wfile.flush()
                time.sleep(0.002)
            usage = {"prompt_tokens": len(prompt) + (prompt[0] == 999), "completion_tokens": k}
            self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\\n\\n".encode())
            self.wfile.write(b"data: [DONE]\\n\\n")

    ThreadingHTTPServer((a.host, a.port), H).serve_forever()
''')


@pytest.fixture
def fake_sglang(tmp_path, monkeypatch):
    pkg = tmp_path / "fake" / "sglang"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "launch_server.py").write_text(FAKE_SERVER)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "fake"))
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    return model


def _info(arm: SGLangArm) -> dict:
    with urllib.request.urlopen(f"{arm.server.url}/server_info", timeout=10) as r:
        return json.loads(r.read())


def _requests(n: int = 4) -> list[Request]:
    return [Request(f"r{i}", tuple(range(10 * i + 1, 10 * i + 4 + i)), 6) for i in range(n)]


def test_sglang_arm_serves_a_matched_work_cell_with_one_server(fake_sglang, tmp_path):
    """The protocol drives the arm as any other: one server for every run (started once), a cache flush
    and a warm-up per run, natural lengths recorded, the replay generates exactly them (gate passes)."""
    launch = SGLangLaunch(model_dir=fake_sglang, python=sys.executable, threads=1)
    with SGLangArm(launch, name="upstream", log_path=tmp_path / "a.log", ready_timeout_s=60) as a, \
            SGLangArm(launch, name="copy", log_path=tmp_path / "b.log", ready_timeout_s=60) as b:
        res = run_cell({"upstream": a, "copy": b}, _requests(), cell="knee", rate=50.0, repetitions=2, seed=0,
                       lane="matched", workload="w", timeout_s=60)
        pid = a.server.proc.pid
        info = _info(a)
        # record + 2 repetitions -> 3 starts of the baseline: one flush and one warm-up each
        assert (info["flushes"], info["completions"]) == (3, 3 + 3 * 4)
        assert a.server.proc.pid == pid and a.server.startup_s is not None
        settings = a.describe()
    assert a.server.proc.poll() is not None and b.server.proc.poll() is not None  # closed with the arms
    assert res.lengths == {f"r{i}": 3 for i in range(4)}  # the stand-in's EOS after 3 tokens
    cells = [r for r in res.rows if r["kind"] == "cell"]
    assert len(cells) == 4 and {r["arm"] for r in cells} == {"upstream", "copy"}
    reqs = [r for r in res.rows if r["kind"] == "request" and r["phase"] == "measure"]
    assert all(r["output_tokens"] == 3 and r["prompt_tokens"] == r["prompt_tokens_requested"] for r in reqs)
    assert (settings["engine"], settings["sglang_version"], settings["attention_backend"], settings["prompt_as"],
            settings["max_total_tokens"]) == ("sglang", "stand-in", "torch_native", "token_ids", 4096)


def test_a_prompt_the_engine_read_differently_fails_the_request_and_the_cell(fake_sglang, tmp_path):
    launch = SGLangLaunch(model_dir=fake_sglang, python=sys.executable, threads=1)
    with SGLangArm(launch, log_path=tmp_path / "a.log", ready_timeout_s=60, warmup_requests=0) as arm:
        arm.start()
        arm.submit("ok", [5, 6], 4, ignore_eos=True)
        arm.submit("bos", [999, 6], 4, ignore_eos=True)
        got = arm.wait(["ok", "bos"], 30)
        arm.stop()
        assert got["ok"].error is None and got["ok"].output_tokens == 4 and got["ok"].prompt_tokens == 2
        assert "read 3 prompt tokens, the request sent 2" in got["bos"].error and got["bos"].finish_time is None
        bad = [Request("x", (999, 1, 2), 4), Request("y", (1, 2), 4)]
        with pytest.raises(CellError, match="requests failed"):
            run_cell({"upstream": arm}, bad, cell="c", rate=10.0, repetitions=1, seed=0, lane="natural",
                     workload="w", timeout_s=30)
        with pytest.raises(ValueError, match="empty prompt"):
            arm.start()
            try:
                arm.submit("e", [], 4, ignore_eos=False)
            finally:
                arm.stop()
    with pytest.raises(RuntimeError, match="not started"):
        arm.submit("late", [1], 1, ignore_eos=False)
    with pytest.raises(ValueError, match="warmup_requests"):
        SGLangArm(launch, warmup_requests=-1)


def _load(tmp_path, **vskipper) -> dict:
    raw = read_yaml(ROOT / "configs" / "smoke.yaml")
    raw["vskipper"].update(vskipper)
    return validate_config(raw, check_paths=False)


def test_engines_key_selects_sglang_and_refuses_what_is_not_built(tmp_path):
    cfg = _load(tmp_path)
    assert cfg["vskipper"]["engines"] == {"upstream": "transformers", "routed": "transformers"}
    assert cfg["vskipper"]["sglang"]["python"] == ".venv-sglang/bin/python"
    py = tmp_path / "python"
    py.write_text("")
    py.chmod(0o755)  # the config check wants an executable interpreter
    ok = _load(tmp_path, engines={"upstream": "sglang"}, sglang={"python": str(py)})
    assert ok["vskipper"]["engines"]["upstream"] == "sglang" and ok["vskipper"]["sglang"]["max_total_tokens"] == 16384
    with pytest.raises(ConfigError, match=r"vskipper\.sglang\.python.*setup_sglang"):
        _load(tmp_path, engines={"upstream": "sglang"}, sglang={"python": str(tmp_path / "nope")})
    with pytest.raises(ConfigError, match=r"vskipper\.engines\.routed.*vskipper\.sglang\.python.*setup_sglang"):
        _load(tmp_path, engines={"routed": "sglang"}, sglang={"python": str(tmp_path / "nope")})
    both = _load(tmp_path, engines={"upstream": "sglang", "routed": "sglang"}, sglang={"python": str(py)})
    assert both["vskipper"]["engines"] == {"upstream": "sglang", "routed": "sglang"}
    with pytest.raises(ConfigError, match=r"vskipper\.engines\.routed"):
        _load(tmp_path, engines={"routed": "vllm"})
    with pytest.raises(ConfigError, match=r"vskipper\.engines\.upstream"):
        _load(tmp_path, engines={"upstream": "vllm"})
    with pytest.raises(ConfigError, match=r"vskipper\.sglang\.max_total_tokens"):
        _load(tmp_path, sglang={"max_total_tokens": 0})


# -- the real thing (needs .venv-sglang) --------------------------------------------------------------------
@needs_sglang
@pytest.mark.slow
def test_upstream_sglang_is_the_baseline_of_a_matched_cell_against_transformers(tmp_path, tiny_tokenizer):
    """Real SGLang records the natural lengths, the project's transformers engine replays them on the same
    model: the matched-work gate passes, and in the natural lane both engines stop on the same tokens
    (float32 greedy ids are equal, test_sglang_server)."""
    from conftest import save_wide_llama

    from impl.serving.inprocess import ContinuousBatchingArm
    from impl.vskipper.engine import sized_cb_config
    from impl.vskipper.schema import Engine

    model_dir = tmp_path / "model"
    model = save_wide_llama(model_dir, tiny_tokenizer, 128)
    reqs = [Request(f"r{i}", tuple(p), 10) for i, p in enumerate([[5, 17, 40, 9], [3, 3, 8, 100, 21], [12, 7]])]
    cb = sized_cb_config(Engine(), [len(r.input_ids) + r.max_new_tokens for r in reqs])
    launch = SGLangLaunch(model_dir=model_dir, python=SGLANG_PY, threads=1, max_total_tokens=4096)
    with SGLangArm(launch, name="upstream", log_path=tmp_path / "sglang.log") as sg:
        arms = {"upstream": sg, "transformers": ContinuousBatchingArm(model, "transformers", cb_config=cb)}
        matched = run_cell(arms, reqs, cell="c", rate=4.0, repetitions=1, seed=0, lane="matched", workload="w",
                           timeout_s=300)
        natural = run_cell(arms, reqs, cell="c", rate=4.0, repetitions=1, seed=0, lane="natural", workload="w",
                           timeout_s=300)
        settings = sg.describe()
    assert settings["engine"] == "sglang" and settings["attention_backend"] == "torch_native"
    assert set(matched.lengths) == {"r0", "r1", "r2"}
    counts = {}
    for r in natural.rows:
        if r["kind"] == "request" and r["phase"] == "measure":
            counts.setdefault(r["request_id"], {})[r["arm"]] = r["output_tokens"]
    assert all(len(set(v.values())) == 1 for v in counts.values()), counts


def test_upstream_sglang_runs_without_graphs_like_the_routed_arms_unless_asked(tmp_path):
    """The upstream SGLang arm launches with graph capture off by default (the routed arms cannot capture: their
    routes change per step), so the arms compare like for like; vskipper.sglang.upstream_graphs: true keeps
    SGLang's capture, and a user's own --cuda-graph-backend flag is left as given."""
    from impl.serving.sglang_server import NO_GRAPHS
    from impl.vskipper.serving_commands import sglang_launch

    py = tmp_path / "python"
    py.write_text("")
    py.chmod(0o755)
    off = sglang_launch(_load(tmp_path, sglang={"python": str(py)}), tmp_path)
    assert off.extra_args[-4:] == NO_GRAPHS
    on = sglang_launch(_load(tmp_path, sglang={"python": str(py), "upstream_graphs": True}), tmp_path)
    assert not any(a.startswith("--cuda-graph-backend") for a in on.extra_args)
    mine = ["--cuda-graph-backend-decode", "full"]
    kept = sglang_launch(_load(tmp_path, sglang={"python": str(py), "extra_args": mine}), tmp_path)
    assert list(kept.extra_args) == mine


def test_server_per_run_holds_one_server_at_a_time(fake_sglang, tmp_path):
    """With server_per_run each run starts its arm's server and stops it after: between runs no server of
    either arm is up, every run starts one (the baseline's record + 2 repetitions), and the cell's rows and
    lengths are those of the shared-server mode."""
    launch = SGLangLaunch(model_dir=fake_sglang, python=sys.executable, threads=1)
    up: list[int] = []

    class Watch(SGLangArm):  # how many of the two arms' servers are up while each run starts
        def start(self, hint=None):
            super().start(hint)
            up.append(sum(x.server.proc is not None and x.server.proc.poll() is None for x in arms.values()))

    arms = {n: Watch(launch, name=n, log_path=tmp_path / f"{n}.log", ready_timeout_s=60, server_per_run=True)
            for n in ("upstream", "copy")}
    try:
        res = run_cell(arms, _requests(), cell="knee", rate=50.0, repetitions=2, seed=0, lane="matched",
                       workload="w", timeout_s=60)
        assert all(a.server.proc is None for a in arms.values())  # down after the cell's last run
        # the baseline records natural lengths first: 3 runs; the other arm runs in the 2 repetitions
        assert [a.server_starts for a in arms.values()] == [3, 2] and set(up) == {1}
        assert arms["upstream"].describe()["server_per_run"] is True
    finally:
        for a in arms.values():
            a.close()
    assert res.lengths == {f"r{i}": 3 for i in range(4)}
    assert len([r for r in res.rows if r["kind"] == "cell"]) == 4
