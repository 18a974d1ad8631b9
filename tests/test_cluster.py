"""Cluster deliverables: configs/paper/*.yaml validate, the SLURM profile dry-runs, and lint.

Dry runs happen in a temporary copy of the workflow (Snakefile, workflows/, impl/, configs/,
profiles/) with ../shared/data linked to the data folder, so they never read or write the
repository's results/, .snakemake/ or the state of a run in progress there; a fresh copy also makes
every rule appear in the plan.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from impl.config import validate_config

ROOT = Path(__file__).resolve().parents[1]
PAPER_CONFIGS = sorted((ROOT / "configs" / "paper").glob("*.yaml"))
PROFILE = ROOT / "profiles" / "slurm" / "config.yaml"
GPU_RULES = ("measure_ead", "ar_bench", "train_model", "train_adapters", "train_draft", "train_head", "dex_cell", "tev_train", "tev_cell",
             "tev_latency", "vskipper_train_flexidepth", "vskipper_profile", "vskipper_knee", "vskipper_cell",
             "vskipper_ablation", "vskipper_randomskip", "vskipper_http", "vskipper_model_train_flexidepth",
             "vskipper_model_profile", "vskipper_model_knee", "vskipper_model_cell", "vskipper_sglang_knee",
             "vskipper_sglang_cell", "vskipper_sglang_ablation", "vskipper_sglang_quality")
MULTI_GPU_RULES = ("dex_distributed", "dex_pearl_ranks", "dex_tensor_parallel")  # gres gpu:K from the rule
# `rule NAME:` and `use rule PARENT as NAME with:` (the vSkipper Table 6 / 7 rules)
ALL_RULES = tuple(re.findall(r"^\s*(?:use )?rule (?:\w+ as )?(\w+)(?: with)?:", "\n".join(
    p.read_text() for p in sorted((Path(__file__).resolve().parents[1] / "workflows").glob("*.smk"))), re.M))


def _run(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "snakemake", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=120)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, data_dir) -> Path:
    base = tmp_path_factory.mktemp("cluster")
    repo = base / "repo"
    repo.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copy2(ROOT / "Snakefile", repo / "Snakefile")
    for d in ("workflows", "impl", "configs", "profiles"):
        shutil.copytree(ROOT / d, repo / d, ignore=ignore)
    (base / "shared").mkdir()
    (base / "shared" / "data").symlink_to(Path(data_dir).resolve(), target_is_directory=True)
    return repo


# --- configs/paper ----------------------------------------------------------------------------

def test_paper_configs_exist():
    names = {p.name for p in PAPER_CONFIGS}
    assert {"dex.yaml", "tev.yaml", "vskipper.yaml"} <= names, names


@pytest.mark.parametrize("path", PAPER_CONFIGS, ids=lambda p: p.name)
def test_paper_config_validates(path):
    text = path.read_text()
    assert text.startswith("#"), f"{path.name} must start with a comment block"
    raw = yaml.safe_load(text)
    cfg = validate_config(raw, check_paths=False)
    assert cfg["device"] == "cuda" and cfg["dtype"] == "bfloat16"
    for name, m in raw["models"].items():
        assert m["kind"] == "pretrained", name
        assert m["path"].startswith("/path/to/"), f"{name}: path should be a placeholder to fill in"


def test_dex_config_matches_figure6():
    cfg = validate_config(yaml.safe_load((ROOT / "configs" / "paper" / "dex.yaml").read_text()),
                          check_paths=False)
    assert cfg["ead"]["workloads"] == ["gsm8k", "humaneval", "xsum"]
    assert all(cfg["workloads"][w]["n_prompts"] == 36 for w in cfg["ead"]["workloads"])
    assert cfg["ead"]["max_new_tokens"] == 512
    assert cfg["ead"]["compare"] == {"baseline": "llama2-70b", "treatment": "ls-llama2-70b", "shared": True}


# --- profiles/slurm -----------------------------------------------------------------------------

def test_profile_settings():
    prof = yaml.safe_load(PROFILE.read_text())
    assert prof["executor"] == "slurm"
    assert prof["retries"] == 1 and prof["rerun-incomplete"] is True
    for key in ("slurm_account", "slurm_partition", "mem_mb", "runtime", "cpus_per_task"):
        assert key in prof["default-resources"], key
    res = prof["set-resources"]
    for rule in GPU_RULES:
        assert res[rule]["gres"] == "gpu:1", rule
    for rule, r in res.items():
        assert rule in ALL_RULES, f"set-resources names unknown rule {rule}"
        assert "gres" not in str(r.get("slurm_extra", "")) and "gpus" not in str(r.get("slurm_extra", ""))


#: rules a config must turn on (vskipper.http.bench_serving.python, a Python with SGLang)
OPT_IN_RULES = ("vskipper_bench_serving", "vskipper_knee_bench_serving")
#: the SGLang section's rules (vskipper.sglang_section, configs/sglang.yaml)
SGLANG_RULES = ("vskipper_sglang_knee", "vskipper_sglang_cell", "vskipper_sglang_ablation", "vskipper_sglang_quality",
                "vskipper_sglang_tables", "vskipper_engine_tables")


@pytest.mark.parametrize("extra", [["--configfile", "configs/smoke.yaml"], [],
                                   ["--configfile", "configs/smoke.yaml", "bench_serving.yaml"],
                                   ["--configfile", "configs/smoke.yaml", "configs/sglang.yaml", "sglang_python.yaml"]],
                         ids=["smoke", "default", "smoke+bench_serving", "smoke+sglang"])
def test_profile_dry_run(workdir, extra):
    opt_in = "bench_serving.yaml" in extra
    on_sglang = "configs/sglang.yaml" in extra
    if opt_in:  # the overlay of configs/bench_serving.yaml, with a Python that exists here
        (workdir / "bench_serving.yaml").write_text(
            f"vskipper: {{http: {{bench_serving: {{python: {sys.executable}, models: [tiny-ls]}}}}}}\n")
    if on_sglang:  # configs/sglang.yaml with an interpreter that exists here
        (workdir / "sglang_python.yaml").write_text(f"vskipper: {{sglang: {{python: {sys.executable}}}}}\n")
    p = _run(workdir, "--profile", "profiles/slurm", "-n", *extra)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    assert "Using profile profiles/slurm" in out
    # the default compares tiny-ls with smollm2 (two tokenizers): no shared-context rule there; the trained-head
    # arm uses the TEV drafters of its model (tev.models has smollm2 in the default, tiny-ls in smoke): no
    # train_head in either (tests/test_tev_train.py runs its command)
    expected = [r for r in ALL_RULES if not (not extra and r == "ead_shared") and r != "train_head"
                and (opt_in or r not in OPT_IN_RULES) and (on_sglang or r not in SGLANG_RULES)]
    if on_sglang:
        assert "results/smoke/tables/vskipper/sglang/vskipper_engines_table2.csv" in out
    else:
        assert not re.search(r"^rule vskipper_(sglang_\w+|engine_tables):", out, re.M)
    if not opt_in:
        assert not re.search(r"^rule vskipper_(knee_)?bench_serving:", out, re.M)
    else:
        assert len(re.findall(r"^rule vskipper_bench_serving:", out, re.M)) == 1  # models: [tiny-ls]
        assert len(re.findall(r"^rule vskipper_knee_bench_serving:", out, re.M)) == 1  # vskipper.model at its knee
    for rule in expected:
        assert re.search(rf"^rule {rule}:", out, re.M), f"rule {rule} not in the dry-run plan"
    if not extra:
        assert re.search(r"^rule convert_smollm2:", out, re.M)
    # the GPU rules get their SLURM resources from the profile
    blocks = re.findall(r"^rule (\w+):\n(.*?)(?=^\S)", out, re.M | re.S)
    assert {r for r, _ in blocks} >= set(expected)
    for rule, body in blocks:
        if rule in GPU_RULES:
            assert "gres=gpu:1" in body and "slurm_partition=gpu" in body, (rule, body)
        elif rule in MULTI_GPU_RULES:
            assert re.search(r"gres=gpu:\d+", body) and "slurm_partition=gpu" in body, (rule, body)
        elif rule != "all":
            assert "gres=" not in body, (rule, body)


DRY_RUN_CONFIGS = ("dex.yaml", "dex-llama2-70b.yaml")  # the commands in Snakefile and the profile README


def test_paper_configs_dry_run(workdir, tmp_path):
    """Paper configs plan their EAD/AR jobs once the model paths exist (stub HF directories). Two
    configs only, run in parallel (--nolock; each has its own results_dir), to keep this file fast;
    the others differ only in values the schema test covers."""
    procs = {}
    for path in (ROOT / "configs" / "paper" / n for n in DRY_RUN_CONFIGS):
        raw = yaml.safe_load(path.read_text())
        for name, m in raw["models"].items():
            d = tmp_path / path.stem / name
            d.mkdir(parents=True)
            (d / "config.json").write_text("{}")
            m["path"] = str(d)
        cfg_file = tmp_path / path.name
        cfg_file.write_text(yaml.safe_dump(raw))
        cmd = [sys.executable, "-m", "snakemake", "--profile", "profiles/slurm", "-n", "--nolock",
               "--configfile", str(cfg_file)]
        procs[path.name] = (raw, subprocess.Popen(cmd, cwd=workdir, stdout=subprocess.PIPE,
                                                  stderr=subprocess.STDOUT, text=True))
    for name, (raw, p) in procs.items():
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0, (name, out[-4000:])
        n = len(raw["ead"]["models"]) * len(raw["ead"]["workloads"])
        for rule in ("measure_ead", "ar_bench"):
            assert re.search(rf"^{rule}\s+{n}$", out, re.M), f"{name}: {rule}: expected {n} jobs"
        assert not re.search(r"^(train_model|tokenizer|corpus)\s", out, re.M), name


# --- lint -----------------------------------------------------------------------------------------


def test_lint(workdir):
    p = _run(workdir, "--lint")
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    assert "Congratulations" in out
