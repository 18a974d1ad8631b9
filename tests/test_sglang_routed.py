"""vSkipper inside upstream SGLang (impl.vskipper.sglang_model, impl.vskipper.sglang_routed): the routed model
directory, the launch environment, and the correctness of routed SGLang on the real server.

Always: the directory SGLang reads (links, architecture, policy entry; refusals), the environment that
registers the package, request ids on ``/generate``. With ``.venv-sglang`` (scripts/setup_sglang.sh; CI does
not install it, 11 GB): always-RUN routed SGLang equals upstream SGLang token for token, and RandomSkip on
SGLang equals the project's routed transformers engine under the same routes (same request ids, same
hashes), alone and batched with requests of different lengths joining and leaving; the server's realised
skip share is the policy's.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest

from impl.serving.sglang_server import REPO_ROOT, SGLangLaunch, greedy_ids, server_env
from impl.vskipper.sglang_routed import ARCHITECTURE, PACKAGE, routed_launch, write_routed_model_dir

ROOT = Path(__file__).resolve().parents[1]
SGLANG_PY = ROOT / ".venv-sglang" / "bin" / "python"
SGLANG_READY = any((ROOT / ".venv-sglang").glob(".installed-sglang-*"))
needs_sglang = pytest.mark.skipif(not (SGLANG_PY.exists() and SGLANG_READY),
                                  reason="no SGLang environment (scripts/setup_sglang.sh)")


def _hf_dir(d: Path, arch: str = "LlamaForCausalLM") -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({"architectures": [arch], "model_type": "llama", "hidden_size": 8}))
    (d / "model.safetensors").write_bytes(b"weights")
    (d / "tokenizer.json").write_text("{}")
    return d


def test_routed_model_dir_links_the_weights_and_names_the_policy(tmp_path):
    src = _hf_dir(tmp_path / "m")
    out = write_routed_model_dir(src, tmp_path / "routed", "random", {"routed_layers": [2, 3], "r": 0.5, "d": 0.5},
                                 stats_path=tmp_path / "stats.json")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == [ARCHITECTURE] and cfg["hidden_size"] == 8
    assert cfg["vskipper"] == {"policy": "random", "kwargs": {"routed_layers": [2, 3], "r": 0.5, "d": 0.5},
                               "stats_path": str((tmp_path / "stats.json").resolve())}
    for name in ("model.safetensors", "tokenizer.json"):
        assert (out / name).is_symlink() and (out / name).resolve() == (src / name).resolve()
    assert json.loads((src / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]  # source untouched
    # written again (another policy): links replaced, no error
    write_routed_model_dir(src, out, "random", {"routed_layers": [3], "r": 1.0, "d": 1.0})
    assert json.loads((out / "config.json").read_text())["vskipper"]["kwargs"]["routed_layers"] == [3]


def test_routed_model_dir_refuses_what_it_cannot_serve(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        write_routed_model_dir(tmp_path / "missing", tmp_path / "o", "random")
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        write_routed_model_dir(_hf_dir(tmp_path / "q", "Qwen3ForCausalLM"), tmp_path / "o", "random")
    with pytest.raises(ValueError, match="plain JSON"):
        write_routed_model_dir(_hf_dir(tmp_path / "m"), tmp_path / "o", "random", {"r": float("nan")})
    assert not (tmp_path / "o").exists()  # nothing half-written


def test_the_launch_registers_the_package_with_the_repository_on_the_path(tmp_path):
    launch = routed_launch(SGLangLaunch(model_dir=tmp_path, python=Path("/bin/true"), threads=1))
    assert launch.external_model_package == PACKAGE
    env = server_env(launch, base={"PYTHONPATH": "/elsewhere"})
    assert env["SGLANG_EXTERNAL_MODEL_PACKAGE"] == "impl.vskipper.sglang_model"
    parts = env["PYTHONPATH"].split(os.pathsep)
    assert parts[0].endswith("sglang_cpu") and parts[1] == str(REPO_ROOT) and parts[2] == "/elsewhere"
    assert (REPO_ROOT / "impl" / "vskipper" / "sglang_model" / "vskipper_llama.py").is_file()
    plain = server_env(SGLangLaunch(model_dir=tmp_path, python=Path("/bin/true")), base={})
    assert "SGLANG_EXTERNAL_MODEL_PACKAGE" not in plain and str(REPO_ROOT) not in plain["PYTHONPATH"].split(os.pathsep)


def test_greedy_ids_checks_request_ids_before_sending():
    with pytest.raises(ValueError, match="rids"):
        greedy_ids("http://127.0.0.1:9", [[1], [2]], 4, rids=["a", "a"])
    with pytest.raises(ValueError, match="rids"):
        greedy_ids("http://127.0.0.1:9", [[1], [2]], 4, rids=["a"])


# -- the real thing (needs .venv-sglang) --------------------------------------------------------------------
PROMPTS = [[5, 17, 40, 9], [3, 3, 8, 100, 21, 64, 2], [12, 7], [44, 45, 46, 47, 48, 49]]
RIDS = [f"vsk-{i}" for i in range(len(PROMPTS))]


def _served(launch: SGLangLaunch, log: Path, n_new: int) -> dict:
    from impl.serving.sglang_server import SGLangServer

    with SGLangServer(launch, log_path=log) as srv:
        alone = greedy_ids(srv.url, PROMPTS, n_new, concurrent=False, rids=[r + "-a" for r in RIDS])
        # batched: every request in flight; the short prompts finish their prefill first and decode beside
        # the longer ones (requests join and leave the running batch)
        batched = greedy_ids(srv.url, PROMPTS, n_new, concurrent=True, rids=RIDS)
    return {"alone": alone, "batched": batched}


@needs_sglang
@pytest.mark.slow
def test_routed_sglang_equals_upstream_all_run_and_the_transformers_engine_under_randomskip(tmp_path, tiny_tokenizer):
    from conftest import save_wide_llama

    from impl.vskipper.engine import bind_skipper, generate_greedy, unbind_skipper
    from impl.vskipper.random_skip import RandomSkip

    n_new, layers = 10, [1, 2, 3]
    model_dir = tmp_path / "model"
    model = save_wide_llama(model_dir, tiny_tokenizer, 128)
    base = SGLangLaunch(model_dir=model_dir, python=SGLANG_PY, threads=1, max_total_tokens=4096)
    upstream = _served(base, tmp_path / "upstream.log", n_new)

    # always-RUN routed: the routed layer stack with nothing skipped is upstream SGLang, token for token
    all_run_dir = write_routed_model_dir(model_dir, tmp_path / "all_run", "random",
                                         {"routed_layers": layers, "r": 0.0, "d": 0.5, "seed": 0})
    all_run = _served(routed_launch(replace(base, model_dir=all_run_dir)), tmp_path / "all_run.log", n_new)
    for mode in ("alone", "batched"):
        assert [o["output_ids"] for o in all_run[mode]] == [o["output_ids"] for o in upstream[mode]], mode

    # RandomSkip r = d = 0.5 on SGLang vs the project's routed transformers engine, same request ids
    stats = tmp_path / "stats.json"
    rs_dir = write_routed_model_dir(model_dir, tmp_path / "rs", "random",
                                    {"routed_layers": layers, "r": 0.5, "d": 0.5, "seed": 0}, stats_path=stats)
    routed = _served(routed_launch(replace(base, model_dir=rs_dir)), tmp_path / "rs.log", n_new)
    skipper = RandomSkip(layers, r=0.5, d=0.5, seed=0)
    bind_skipper(model, skipper)
    try:
        ref = {mode: generate_greedy(model, PROMPTS, max_new_tokens=n_new, mode="routed",
                                     request_ids=[r + ("-a" if mode == "alone" else "") for r in RIDS])
               for mode in ("alone", "batched")}
    finally:
        unbind_skipper(model)
    for mode in ("alone", "batched"):
        assert [o["output_ids"] for o in routed[mode]] == ref[mode], mode
    # the routes changed the computation (the wide model's ids move when layers are skipped) ...
    assert [o["output_ids"] for o in routed["batched"]] != [o["output_ids"] for o in upstream["batched"]]
    # ... and the server routed about r * d of its routed (row, layer) pairs in both phases
    counts = json.loads(stats.read_text())["counts"]
    for phase in ("prefill", "decode"):
        run, po = counts[phase]
        assert run + po > 0 and 0.05 < po / (run + po) < 0.6, (phase, counts)
