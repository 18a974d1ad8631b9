"""Upstream SGLang as a subprocess (impl.serving.sglang_server) and its greedy check against transformers
(impl.vskipper.sglang_check).

Three tiers: the command line, environment and comparison on hand-built inputs (always); the server's
life cycle against a stand-in ``sglang.launch_server`` module speaking SGLang's ``/health_generate`` and
``/generate`` (always); the CPU import workaround and real upstream SGLang serving a model, token ids equal
to transformers' alone and batched (only where ``scripts/setup_sglang.sh`` has installed
``.venv-sglang``: CI does not install it, 11 GB).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from impl.serving.sglang_server import (CPU_SHIM_DIR, SGLangLaunch, SGLangServer, greedy_ids, launch_args,
                                        server_env)
from impl.vskipper.sglang_check import check_greedy_against_transformers, compare_greedy

ROOT = Path(__file__).resolve().parents[1]
SGLANG_PY = ROOT / ".venv-sglang" / "bin" / "python"
#: the install stamp scripts/setup_sglang.sh writes last: an interpreter alone may be a half-done install
SGLANG_READY = any((ROOT / ".venv-sglang").glob(".installed-sglang-*"))
needs_sglang = pytest.mark.skipif(not (SGLANG_PY.exists() and SGLANG_READY),
                                  reason="no SGLang environment (scripts/setup_sglang.sh)")


# -- command line and environment --------------------------------------------------------------------------
def test_cpu_launch_has_the_cpu_flags_and_the_import_workaround():
    launch = SGLangLaunch(model_dir="/m", python="/py", threads=1, served_model_name="smollm2")
    args = launch_args(launch, 8123)
    assert args[:3] == ["/py", "-m", "sglang.launch_server"]
    flag = {a: args[i + 1] for i, a in enumerate(args[:-1]) if a.startswith("--")}
    assert (flag["--model-path"], flag["--port"], flag["--dtype"], flag["--device"]) == ("/m", "8123", "float32", "cpu")
    assert (flag["--attention-backend"], flag["--sampling-backend"], flag["--max-total-tokens"]) == \
        ("torch_native", "pytorch", "16384")
    assert {"--sleep-on-idle", "--disable-radix-cache"} <= set(args) and flag["--served-model-name"] == "smollm2"
    env = server_env(launch, {"PYTHONPATH": "/other", "PATH": "/bin"})
    assert env["PYTHONPATH"].split(os.pathsep) == [str(CPU_SHIM_DIR), "/other"]
    assert (env["SGLANG_USE_CPU_ENGINE"], env["OMP_NUM_THREADS"], env["HF_HUB_OFFLINE"], env["PATH"]) == \
        ("1", "1", "1", "/bin")
    assert (CPU_SHIM_DIR / "sgl_kernel" / "__init__.py").is_file()


def test_cuda_launch_has_no_cpu_workaround():
    launch = SGLangLaunch(model_dir="/m", device="cuda", dtype="bfloat16", max_total_tokens=None)
    args = launch_args(launch, 1)
    assert "--device" not in args and "--sleep-on-idle" not in args and "--attention-backend" not in args
    assert "--max-total-tokens" not in args and "--disable-radix-cache" in args
    env = server_env(launch, {})
    assert "PYTHONPATH" not in env and "SGLANG_USE_CPU_ENGINE" not in env


@pytest.mark.parametrize("kw, match", [({"device": "tpu"}, "device"), ({"dtype": "int8"}, "dtype"),
                                       ({"max_total_tokens": 0}, "max_total_tokens"), ({"threads": 0}, "threads")])
def test_bad_launch_settings_name_the_field(kw, match):
    with pytest.raises(ValueError, match=match):
        SGLangLaunch(model_dir="/m", **kw)


def test_compare_greedy_on_hand_built_outputs():
    ref = {"output_ids": [5, 6, 7, 8], "logprobs": [-0.1, -0.2, -0.3, -0.4]}
    same = compare_greedy(ref, {"output_ids": [5, 6, 7, 8], "logprobs": [-0.1, -0.25, -0.3, -0.4]})
    assert same["ids_match"] and same["first_diff"] is None and same["agreement"] == 1.0
    assert same["max_logprob_diff"] == pytest.approx(0.05)
    diff = compare_greedy(ref, {"output_ids": [5, 6, 9, 8], "logprobs": [-0.1, -0.2, -2.0, -0.4]})
    assert not diff["ids_match"] and diff["first_diff"] == 2 and diff["agreement"] == 0.5
    assert diff["max_logprob_diff"] == pytest.approx(0.0)  # only the matched prefix is compared
    short = compare_greedy(ref, {"output_ids": [5, 6]})
    assert (short["ids_match"], short["first_diff"], short["max_logprob_diff"]) == (False, 2, None)


# -- life cycle against a stand-in server ------------------------------------------------------------------
FAKE_SERVER = textwrap.dedent('''
    """Stand-in for sglang.launch_server: /health_generate, and /generate answering token t -> t + 1."""
    import argparse, json, time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int)
    ap.add_argument("--host")
    ap.add_argument("--crash", action="store_true")
    a, _ = ap.parse_known_args()
    if a.crash:
        raise SystemExit("boom: the stand-in refuses to start")
    time.sleep(1.5)  # the server answers only after a start-up

    class H(BaseHTTPRequestHandler):
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
            self._send(200 if self.path == "/health_generate" else 404, {})

        def do_POST(self):
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            sp = req["sampling_params"]
            assert sp["temperature"] == 0.0 and sp["ignore_eos"] is True and req["return_logprob"]
            t, out = req["input_ids"][-1], []
            for _ in range(sp["max_new_tokens"]):
                t += 1
                out.append([-0.5, t, None])
            self._send(200, {"text": "", "output_ids": [o[1] for o in out],
                             "meta_info": {"output_token_logprobs": out}})

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


def test_server_starts_answers_and_stops_with_its_process_group(fake_sglang, tmp_path):
    launch = SGLangLaunch(model_dir=fake_sglang, python=sys.executable, threads=1)
    with SGLangServer(launch, log_path=tmp_path / "srv.log", ready_timeout_s=60) as srv:
        assert srv.startup_s >= 1.0 and srv.url.startswith("http://127.0.0.1:")
        solo = greedy_ids(srv.url, [[1, 2, 3], [10]], 4, concurrent=False)
        batched = greedy_ids(srv.url, [[1, 2, 3], [10]], 4)
        assert solo == batched and solo[0]["output_ids"] == [4, 5, 6, 7] and solo[1]["logprobs"] == [-0.5] * 4
        with pytest.raises(ValueError, match="at least one token"):
            greedy_ids(srv.url, [[]], 4)
        proc = srv.proc
    assert proc.poll() is not None  # closed on exit
    with pytest.raises(RuntimeError, match="not started"):
        SGLangServer(launch).url


def test_a_server_that_dies_at_start_up_says_why(fake_sglang, tmp_path):
    launch = SGLangLaunch(model_dir=fake_sglang, python=sys.executable, extra_args=("--crash",))
    with pytest.raises(RuntimeError, match=r"exited with status 1(.|\n)*boom: the stand-in refuses"):
        SGLangServer(launch, log_path=tmp_path / "srv.log", ready_timeout_s=60).start()
    with pytest.raises(FileNotFoundError, match="setup_sglang"):
        SGLangServer(SGLangLaunch(model_dir=fake_sglang, python=tmp_path / "nope")).start()
    with pytest.raises(FileNotFoundError, match="config.json"):
        SGLangServer(SGLangLaunch(model_dir=tmp_path, python=sys.executable)).start()


def test_sglang_check_command_refuses_bad_arguments_before_any_server(tmp_path):
    from conftest import DATA_DIR

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "IMPL_DATA_DIR": str(DATA_DIR)}
    r = subprocess.run([sys.executable, "-m", "impl", "sglang-check", "--config", str(ROOT / "configs" / "smoke.yaml"),
                        "--model-dir", str(tmp_path), "--prompts", str(tmp_path / "p.jsonl"), "--out", "o", "--summary",
                        "s", "--sglang-python", str(tmp_path / "nope")], cwd=ROOT, env=env, capture_output=True, text=True)
    assert r.returncode != 0 and "--sglang-python" in r.stderr and "setup_sglang.sh" in r.stderr


def test_a_run_reuses_request_ids_only_after_sglangs_deferred_abort_has_fired(fake_sglang, monkeypatch):
    """SGLang aborts a stream's rid 2 s after the stream ends if a request then holds that rid; runs of a cell
    reuse ids, so SGLangArm.start waits RID_RELEASE_S after the previous run's streams ended (and a fresh
    server, which holds no ids, needs no wait)."""
    from impl.serving import sglang_arm as A

    clock, slept = [100.0], []
    monkeypatch.setattr(A.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(A.time, "sleep", lambda s: (slept.append(s), clock.__setitem__(0, clock[0] + s)))

    class Alive:  # a running server process
        returncode = None

        def poll(self):
            return None

    arm = A.SGLangArm(SGLangLaunch(model_dir=fake_sglang, python=sys.executable), warmup_requests=0)
    monkeypatch.setattr(arm, "_post", lambda path: None)
    arm.server.proc, arm.server.port = Alive(), 9  # no request is sent (no warm-up)
    arm.start()  # the first run on this server: nothing to wait for
    clock[0] += 0.5
    arm.stop()  # streams ended at t = 100.5
    clock[0] += 1.0
    arm.start()  # 1 s later: waits until 3 s after the streams ended
    assert slept == [pytest.approx(A.RID_RELEASE_S - 1.0)] and clock[0] == pytest.approx(100.5 + A.RID_RELEASE_S)
    arm.stop()
    clock[0] += A.RID_RELEASE_S + 1
    arm.start()  # long enough ago: no wait
    assert len(slept) == 1 and arm.describe()["rid_release_waits_s"] == [0.0, pytest.approx(2.0), 0.0]
    arm.server.proc = None  # nothing to close


# -- the real thing (needs .venv-sglang) --------------------------------------------------------------------
@needs_sglang
def test_cpu_import_workaround_loads_sgl_kernel_where_the_wheel_cannot():
    code = ("import sgl_kernel; from sgl_kernel import copy_all_layer_kv_cache_cpu; "
            "print(getattr(sgl_kernel, 'CPU_SHIM_FALLBACK', None))")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    plain = subprocess.run([str(SGLANG_PY), "-c", "import sgl_kernel"], env=env, capture_output=True, text=True)
    shim = subprocess.run([str(SGLANG_PY), "-c", code], capture_output=True, text=True,
                          env={**env, "PYTHONPATH": str(CPU_SHIM_DIR)})
    assert shim.returncode == 0, shim.stderr[-2000:]
    # the fallback engages exactly where the installed wheel cannot load (this CPU), never elsewhere
    assert shim.stdout.strip() == str(plain.returncode != 0)


@needs_sglang
@pytest.mark.slow
def test_upstream_sglang_greedy_ids_equal_transformers(tmp_path, tiny_tokenizer):
    from conftest import save_wide_llama

    model = tmp_path / "model"
    save_wide_llama(model, tiny_tokenizer, 128)
    prompts = [[5, 17, 40, 9], [3, 3, 8, 100, 21, 7, 64], [12]]
    launch = SGLangLaunch(model_dir=model, python=SGLANG_PY, threads=1, max_total_tokens=4096)
    rows, summary = check_greedy_against_transformers(model, prompts, 12, launch, log_path=tmp_path / "sglang.log")
    assert summary["verdict"] == "PASS", json.dumps([r for r in rows if not r["ids_match"]])[:2000]
    assert [(r["mode"], r["prompt"]) for r in rows] == [(m, str(i)) for m in ("solo", "batched") for i in range(3)]
    assert summary["max_logprob_diff"] < 1e-3 and summary["policy"].startswith("ids equal")


def test_sigterm_stops_sglang_check_and_its_server(tmp_path, tiny_tokenizer):
    """SIGTERM (what Snakemake and ``timeout`` send) to ``python -m impl sglang-check`` stops the server it
    started in its own session, prints one ``interrupted`` line, exits 143 and writes no output (the server
    here is a stand-in interpreter that records its pid and never becomes ready)."""
    import signal
    import time

    from conftest import DATA_DIR, save_wide_llama

    save_wide_llama(tmp_path / "model", tiny_tokenizer)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "input_ids": [1, 2, 3]}) + "\n")
    pidfile = tmp_path / "server.pid"
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\necho $$ > {pidfile}\nexec sleep 300\n")
    fake.chmod(0o755)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "IMPL_DATA_DIR": str(DATA_DIR)}
    p = subprocess.Popen([sys.executable, "-m", "impl", "sglang-check", "--config", str(ROOT / "configs" / "smoke.yaml"),
                          "--model-dir", str(tmp_path / "model"), "--prompts", str(prompts), "--n-prompts", "1",
                          "--max-new-tokens", "2", "--server-threads", "1", "--sglang-python", str(fake),
                          "--out", str(tmp_path / "o.jsonl"), "--summary", str(tmp_path / "s.json")],
                         cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (pidfile.exists() and pidfile.read_text().strip()):
            assert p.poll() is None, p.communicate()
            assert time.monotonic() < deadline, "the stand-in server never started"
            time.sleep(0.2)
        server = int(pidfile.read_text())
        time.sleep(1.0)
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 143, err
    assert "interrupted (SIGTERM): sglang-check stopped" in err and "Traceback" not in err, err
    with pytest.raises(ProcessLookupError):  # the server's process group is gone
        os.killpg(server, 0)
    assert not (tmp_path / "o.jsonl").exists() and not (tmp_path / "s.json").exists()


def test_sglang_check_command_writes_its_verdict_and_server_threads(fake_sglang, tmp_path, tiny_tokenizer):
    """``python -m impl sglang-check`` end to end against the stand-in server (which answers t + 1, t + 2, ...,
    not the model's ids): rows and summary are written, the verdict is FAIL with exit status 1, and the summary
    names the server's thread count."""
    from conftest import DATA_DIR, save_wide_llama

    save_wide_llama(tmp_path / "wide", tiny_tokenizer)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "input_ids": [1, 2, 3]}) + "\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp_path / "fake")]),
           "IMPL_DATA_DIR": str(DATA_DIR)}
    r = subprocess.run([sys.executable, "-m", "impl", "sglang-check", "--config", str(ROOT / "configs" / "smoke.yaml"),
                        "--model-dir", str(tmp_path / "wide"), "--prompts", str(prompts), "--max-new-tokens", "3",
                        "--server-threads", "1", "--sglang-python", sys.executable, "--out", str(tmp_path / "o.jsonl"),
                        "--summary", str(tmp_path / "s.json")], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 1 and "sglang-check FAIL" in r.stdout, (r.stdout, r.stderr[-2000:])
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["verdict"] == "FAIL" and summary["server_threads"] == 1
    assert len((tmp_path / "o.jsonl").read_text().splitlines()) == summary["rows"] > 0
