"""SGLang's bench_serving against served arms (impl/vskipper/bench_serving.py and its check in
impl/vskipper/http_check.py).

Without SGLang: a stand-in client (an executable that takes bench_serving's arguments and writes the
result line it is told to) checks the verdict rules: all requests completed with every token and
finite timings is PASS; request errors, missing tokens, a crash or no result line are FAIL with the
reason; the ShareGPT subset is converted to the JSON list the client reads; a missing interpreter or
one without SGLang is refused before any arm is served; the config check names the key; the report
renders the timing table.

With SGLang (``.venv-sglang/bin/python`` from scripts/setup_sglang.sh, or ``$SGLANG_PYTHON``): the real
client, unmodified, against every served arm of a tiny model; every request succeeds and TTFT / TPOT
are reported. Skipped where that environment is absent (CI does not install its 11 GB).
"""

import json
import math
import os
import stat
import sys
import types
from pathlib import Path

import pytest

from impl.vskipper import bench_serving as bs
from impl.vskipper.schema import SERVED_ARMS, BenchServing

REPO = Path(__file__).resolve().parents[1]
FAKE = '''#!{python}
import json, os, sys
a = sys.argv[1:]
assert a[:2] == ["-m", "sglang.bench_serving"], a
if "--help" in a:
    sys.exit(int(os.environ.get("FAKE_HELP_RC", "0")))
opt = dict(zip(a[2::2], a[3::2]))
mode = os.environ.get("FAKE_MODE", "ok")
n, out_len = int(opt["--num-prompts"]), int(opt["--sharegpt-output-len"])
with open(os.environ["FAKE_ARGV"], "w") as f:
    json.dump(a, f)
if mode == "crash":
    sys.stderr.write("Traceback ...\\nIndexError: list index out of range\\n")
    sys.exit(1)
res = dict(completed=n, total_output_tokens=n * out_len, mean_ttft_ms=12.5, median_ttft_ms=11.0,
           mean_tpot_ms=3.25, median_tpot_ms=3.0, mean_itl_ms=3.3, output_throughput=250.0, duration=1.5,
           errors=[""] * n)
if mode == "errors":
    res.update(completed=n - 1, total_output_tokens=(n - 1) * out_len, errors=["Bad Request: no"] + [""] * (n - 1))
if mode == "short":
    res.update(total_output_tokens=n * out_len - 3)
if mode == "nan":
    res.update(mean_tpot_ms=float("nan"))
if mode == "slow":  # per-request details (--output-details) of a client that saw 50 s TTFTs
    res.update(ttfts=[50.0] * n, itls=[[0.01] * (out_len - 1)] * n, output_lens=[out_len] * n)
with open(opt["--output-file"], "a") as f:
    f.write(json.dumps(res) + "\\n")
'''


@pytest.fixture
def fake_python(tmp_path, monkeypatch):
    p = tmp_path / "fake-python"
    p.write_text(FAKE.format(python=sys.executable))
    p.chmod(p.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("FAKE_ARGV", str(tmp_path / "argv.json"))
    return p


def _server(failed_after: int = 0):
    eng = types.SimpleNamespace(arm="hybrid", served_model_name="tiny", counters={"requests": 0, "failed": 0})
    return types.SimpleNamespace(url="http://127.0.0.1:9", engine=eng)


def test_verdicts(fake_python, tmp_path, monkeypatch, data_dir):
    ds = bs.sharegpt_json(data_dir, tmp_path / "sg.json", max_records=5)
    recs = json.loads(ds.read_text())
    assert len(recs) == 5 and recs[0]["conversations"][0]["from"] == "human"
    run = lambda **kw: bs.bench_serving(_server(), tmp_path / "model", fake_python, ds, tmp_path,  # noqa: E731
                                        num_prompts=4, output_len=8, seed=7, **kw)
    r = run()
    assert r["ok"] and r["tokens_exact"] and r["requests"] == 4 and r["max_tokens"] == 8
    assert (r["ttft_ms"], r["tpot_ms"], r["itl_ms"], r["output_tok_s"], r["bench_s"]) == (12.5, 3.25, 3.3, 250.0, 1.5)
    assert "4/4 completed, 32/32 tokens, mean TTFT 12.5 ms, mean TPOT 3.2 ms" in r["detail"]
    argv = json.loads((tmp_path / "argv.json").read_text())
    opt = dict(zip(argv[2::2], argv[3::2]))
    assert opt["--backend"] == "vllm" and opt["--served-model-name"] == "tiny" and opt["--dataset-name"] == "sharegpt"
    assert opt["--request-rate"] == "inf" and opt["--seed"] == "7" and "--disable-stream" not in argv
    assert "--apply-chat-template" not in argv  # a tokenizer without a chat template
    assert "(chat template)" in run(chat_template=True)["detail"]
    assert "--apply-chat-template" in json.loads((tmp_path / "argv.json").read_text())
    assert run(request_rate=2.0)["ok"] and json.loads((tmp_path / "argv.json").read_text())[
        argv.index("--request-rate") + 1] == "2.0"
    for mode, why in (("errors", "1 request errors: 'Bad Request: no'"), ("short", "29/32 tokens"),
                      ("nan", "a timing is not finite"), ("crash", "exited 1 without a result line")):
        monkeypatch.setenv("FAKE_MODE", mode)
        r = run()
        assert not r["ok"] and why in r["detail"], (mode, r["detail"])
    assert "IndexError" in r["detail"]  # the client's own last line is quoted


def test_refused_before_serving(fake_python, tmp_path, monkeypatch, data_dir):
    from impl.vskipper.http_check import check_arms

    assert bs.sglang_python_ok(fake_python) is None
    assert "no Python at" in bs.sglang_python_ok(tmp_path / "nope")
    monkeypatch.setenv("FAKE_HELP_RC", "3")
    assert "failed (rc 3)" in bs.sglang_python_ok(fake_python)
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="bench_serving.python: .*failed \\(rc 3\\)"):
        check_arms(tmp_path / "m", ["upstream"], checks=["bench_serving"], data_dir=data_dir,
                   bench=BenchServing(python=str(fake_python)))
    with pytest.raises(ValueError, match="needs vskipper.http.bench_serving.python"):
        check_arms(tmp_path / "m", ["upstream"], checks=["bench_serving"], data_dir=data_dir, bench=BenchServing())
    with pytest.raises(ValueError, match="needs data_dir"):
        check_arms(tmp_path / "m", ["upstream"], checks=["bench_serving"], bench=BenchServing(python="x"))
    with pytest.raises(ValueError, match="need prompts"):
        check_arms(tmp_path / "m", ["upstream"], checks=["endpoints"])
    with pytest.raises(FileNotFoundError, match="no ShareGPT subset"):
        bs.sharegpt_json(tmp_path, tmp_path / "x.json")


def test_config_check_names_the_key():
    import copy

    from impl.config import ConfigError, read_yaml, validate_config

    base = read_yaml(REPO / "configs" / "default.yaml")

    def check(bench):
        cfg = copy.deepcopy(base)
        cfg["vskipper"]["http"]["bench_serving"] = bench
        return validate_config(cfg, check_paths=False)

    with pytest.raises(ConfigError, match="'vskipper.http.bench_serving.python' = '/no/such/python' is not a file"):
        check({"python": "/no/such/python"})
    with pytest.raises(ConfigError, match="bench_serving.models\\[0\\]' names 'gpt9'"):
        check({"python": sys.executable, "models": ["gpt9"]})
    with pytest.raises(ConfigError, match="vskipper.http.bench_serving.arms"):
        check({"arms": ["sideways"]})
    with pytest.raises(ConfigError, match="vskipper.http.bench_serving.num_prompts"):
        check({"num_prompts": 0})
    b = check({"python": sys.executable, "num_prompts": 3})["vskipper"]["http"]["bench_serving"]
    assert b["num_prompts"] == 3 and b["arms"] == list(SERVED_ARMS) and b["output_len"] == 32
    overlay = read_yaml(REPO / "configs" / "bench_serving.yaml")["vskipper"]["http"]["bench_serving"]
    assert overlay["python"] == ".venv-sglang/bin/python"


def test_report_table(tmp_path):
    from impl.vskipper.http_check import _row, write_outputs
    from impl.vskipper.http_report import report_section

    rows = [_row("smollm2", arm, None if arm == "upstream" else "randomskip:r=0.5,d=0.5", "bench_serving", True,
                 "ok", requests=8, ttft_ms=100.0 + i, tpot_ms=20.5, itl_ms=20.0, output_tok_s=40.0, bench_s=6.4)
            for i, arm in enumerate(("upstream", "hybrid"))]
    write_outputs(rows, tmp_path / "http" / "smollm2.bench_serving.csv")
    text = "\n".join(report_section(tmp_path / "http", tmp_path, tmp_path))
    assert "### SGLang bench_serving against every arm" in text
    assert "| smollm2 | hybrid   | RandomSkip r=0.5 d=0.5 | PASS      | 8          | 101.0" in text
    assert "| SGLang bench_serving " in text and "OpenAI client" not in text  # only the checks that ran


def test_clients_compared_on_the_same_prompts(fake_python, tmp_path, monkeypatch, tiny_tokenizer, data_dir):
    """At a Poisson rate without a cap, the project's load generator replays bench_serving's prompts
    against the same server and the two clients' means are compared: a client reporting 50 s TTFTs
    against a server answering in milliseconds must DIFFER; with a cap, no comparison is made."""
    from conftest import save_wide_llama
    from impl.vskipper.http_check import check_arms
    from impl.vskipper.schema import Engine

    d = tmp_path / "model"
    save_wide_llama(d, tiny_tokenizer, 128)
    monkeypatch.setenv("FAKE_MODE", "slow")
    run = lambda **kw: check_arms(d, ["upstream"], checks=["bench_serving"], data_dir=data_dir, label="tiny",  # noqa: E731
                                  engine=Engine(page_size=16),
                                  bench=BenchServing(python=str(fake_python), num_prompts=4, output_len=8,
                                                     context_len=120, **kw))[0]
    r = run(request_rate=20.0, max_concurrency=None)
    argv = json.loads((tmp_path / "argv.json").read_text())
    assert "--max-concurrency" not in argv and argv[argv.index("--request-rate") + 1] == "20.0"
    assert r["verdict"] == "PASS" and r["clients_agree"] is False, r["detail"]
    assert r["bench_ttft_ms"] == 50000.0 and 0 < r["loadgen_ttft_ms"] < 50000.0 and r["loadgen_e2e_ms"] > 0
    assert "the clients DIFFER within their sampling error" in r["detail"] and "same 4 prompts" in r["detail"]
    r = run(request_rate=20.0, max_concurrency=2)
    assert r["verdict"] == "PASS" and r["clients_agree"] is None and "clients not compared" in r["detail"]


def test_sharegpt_prompts_are_the_ones_the_client_keeps(tmp_path, tiny_tokenizer, data_dir):
    rows = bs.sharegpt_prompts(data_dir, tiny_tokenizer, 3, 8, 120, False, tmp_path / "sg.json")
    kept = json.loads((tmp_path / "sg.json").read_text())
    assert len(rows) == len(kept) == 3 and [r["id"] for r in rows] == [k.get("id") for k in kept]
    for r, k in zip(rows, kept):
        assert r["prompt"] == k["conversations"][0]["value"]
        assert 2 <= len(tiny_tokenizer.encode(r["prompt"])) and len(tiny_tokenizer.encode(r["prompt"])) + 8 <= 120
        assert r["input_ids"] == tiny_tokenizer(r["prompt"])["input_ids"]
    with pytest.raises(ValueError, match="only 0 ShareGPT conversations fit context_len 9"):
        bs.sharegpt_prompts(data_dir, tiny_tokenizer, 3, 8, 9, False, tmp_path / "x.json")


def _sglang_python():
    p = os.environ.get("SGLANG_PYTHON") or str(REPO / ".venv-sglang" / "bin" / "python")
    return p if Path(p).is_file() else None


@pytest.mark.slow
@pytest.mark.skipif(_sglang_python() is None, reason="no SGLang environment (scripts/setup_sglang.sh)")
def test_real_bench_serving_every_arm(tmp_path, tiny_tokenizer, data_dir):
    """SGLang's own client, unmodified, completes a streaming run against every served arm."""
    import torch

    from conftest import save_wide_llama
    from impl.vskipper.http_check import check_arms
    from impl.vskipper.schema import Engine

    d = tmp_path / "model"
    save_wide_llama(d, tiny_tokenizer, 128)
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rows = check_arms(d, list(SERVED_ARMS), "randomskip:r=0.5,d=0.5,seed=3", checks=["bench_serving"],
                          data_dir=data_dir, label="tiny", engine=Engine(page_size=16),
                          bench=BenchServing(python=_sglang_python(), num_prompts=4, output_len=8, context_len=120,
                                             max_concurrency=None, request_rate=20.0))
    finally:
        torch.set_num_threads(prev)
    assert [r["arm"] for r in rows] == list(SERVED_ARMS)
    bad = [(r["arm"], r["detail"]) for r in rows if r["verdict"] != "PASS"]
    assert not bad, bad
    for r in rows:
        assert r["tokens_exact"] and r["served_requests"] == 5  # 4 measured + 1 warm-up
        assert all(math.isfinite(r[c]) and r[c] > 0 for c in ("ttft_ms", "tpot_ms", "itl_ms", "output_tok_s"))
        # the project's load generator replayed the same prompts at the same rate: both clients' means recorded
        assert r["clients_agree"] in (True, False) and r["loadgen_e2e_ms"] > 0 and r["bench_e2e_ms"] > 0


def test_workload_prompts_are_the_suites_own(tmp_path, tiny_tokenizer):
    """A frozen workload suite becomes the ShareGPT list bench_serving reads: its text as the human turn, in
    order, the ids the server makes of that text; chat rows ask for the chat template; bad suites refused."""
    suite = [{"id": f"gsm8k-{i}", "suite": "gsm8k", "format": "plain", "text": f"Question: {i} apples?\nAnswer:"}
             for i in range(5)]
    rows, chat = bs.workload_prompts(suite, tiny_tokenizer, 3, 8, 120, tmp_path / "w.json")
    kept = json.loads((tmp_path / "w.json").read_text())
    assert chat is False and [r["id"] for r in rows] == [k["id"] for k in kept] == ["gsm8k-0", "gsm8k-1", "gsm8k-2"]
    for r, k, s in zip(rows, kept, suite):
        assert r["prompt"] == k["conversations"][0]["value"] == s["text"] and len(k["conversations"]) == 2
        assert r["input_ids"] == tiny_tokenizer(s["text"])["input_ids"]
    with pytest.raises(ValueError, match="one format per suite"):
        bs.workload_prompts([{**suite[0], "format": "chat"}, suite[1]], tiny_tokenizer, 1, 8, 120, tmp_path / "x.json")
    with pytest.raises(ValueError, match="have no text"):
        bs.workload_prompts([{"id": "a", "input_ids": [1, 2]}], tiny_tokenizer, 1, 8, 120, tmp_path / "x.json")
    with pytest.raises(ValueError, match="only 0 workload prompts fit context_len 9"):
        bs.workload_prompts(suite, tiny_tokenizer, 3, 8, 9, tmp_path / "x.json")


def test_knee_command_runs_on_the_workload_at_the_knee_rate(fake_python, tmp_path, tiny_tokenizer, data_dir):
    """`vskipper-http-check --knee K --point knee --thresholds T --bench-prompts P` (rule
    vskipper_knee_bench_serving): bench_serving gets the workload's prompts, open loop at 0.95 x Q* with
    vskipper.requests prompts, and the hybrid is served under the thresholds' switch (recorded in the summary);
    a knee without the point, or unreadable thresholds, exit before any server starts."""
    import subprocess

    import yaml

    from conftest import save_wide_llama

    d = tmp_path / "model"
    save_wide_llama(d, tiny_tokenizer, 128)
    cfg = yaml.safe_load((REPO / "configs" / "smoke.yaml").read_text())
    cfg["data_dir"] = str(data_dir)
    cfg["vskipper"]["requests"] = 3
    cfg["vskipper"]["http"] = {"bench_serving": {"python": str(fake_python), "output_len": 8, "context_len": 120}}
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    suite = tmp_path / "gsm8k.jsonl"
    suite.write_text("".join(json.dumps({"id": f"g{i}", "suite": "gsm8k", "format": "plain", "input_ids": [1, 2],
                                         "text": f"Question: {i} apples?\nAnswer:"}) + "\n" for i in range(4)))
    knee = tmp_path / "knee.json"
    knee.write_text(json.dumps({"workload": "gsm8k", "load_factors": {"below": 0.75, "knee": 0.95}, "q_star": 20.0,
                                "q_star_used": 20.0, "status": "bracketed"}))
    # prefill never routes (null: profile-mode found it unprofitable), decode from 3 rows
    thr = {"thresholds": {"min_prefill_tokens": None, "min_skip_share": 0.05, "enter_threshold": 3}}
    (tmp_path / "thr.json").write_text(json.dumps(thr))
    base = [sys.executable, "-m", "impl", "vskipper-http-check", "--config-json", f"@{tmp_path / 'cfg.json'}",
            "--quiet", "--model-dir", str(d), "--checks", "bench_serving", "--arms", "upstream", "hybrid",
            "--skipper", "randomskip:r=0.5,d=0.5,seed=3",
            "--bench-prompts", str(suite), "--knee", str(knee), "--out", str(tmp_path / "o.csv"),
            "--summary", str(tmp_path / "o.json")]
    env = {**os.environ, "FAKE_ARGV": str(tmp_path / "argv.json"), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([*base, "--point", "overload"], capture_output=True, text=True, env=env, cwd=REPO)
    assert r.returncode != 0 and "--knee" in r.stderr and "overload" in r.stderr and not (tmp_path / "o.csv").exists()
    r = subprocess.run([*base, "--thresholds", str(tmp_path / "nope.json")], capture_output=True, text=True, env=env,
                       cwd=REPO)
    assert r.returncode != 0 and "--thresholds" in r.stderr and not (tmp_path / "o.csv").exists()
    r = subprocess.run([*base, "--thresholds", str(tmp_path / "thr.json")], capture_output=True, text=True, env=env,
                       cwd=REPO)
    assert r.returncode == 0, r.stderr[-2000:]
    argv = json.loads((tmp_path / "argv.json").read_text())
    assert argv[argv.index("--request-rate") + 1] == str(0.95 * 20.0) and "--max-concurrency" not in argv
    assert argv[argv.index("--num-prompts") + 1] == "3" and "--apply-chat-template" not in argv
    summary = json.loads((tmp_path / "o.json").read_text())
    st = summary["settings"]
    assert st["knee"]["rate"] == pytest.approx(19.0) and st["bench_serving"]["num_prompts"] == 3
    assert st["bench_prompts"] == str(suite) and st["hybrid_switch"]["min_prefill_tokens"] is None
    assert st["hybrid_switch"]["enter_threshold"] == 3
    assert summary["counts"]["PASS"] == 2, (tmp_path / "o.csv").read_text()  # upstream and the hybrid served
    rows = (tmp_path / "o.csv").read_text()
    assert "prompts of gsm8k.jsonl" in rows and "at 19 req/s" in rows
