"""The smoke DAG end to end (real data, tiny models trained in the DAG), an interrupted run that
resumes without accepting partial files, and command-line error behaviour."""

import json
import re
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[1]

from conftest import smoke_snakemake as _snakemake  # noqa: E402


@pytest.mark.slow
def test_smoke_report_and_checks(smoke_run):
    report = (smoke_run / "results" / "REPORT.md").read_text()
    assert "EAD measurement equals AR decoding token for token on every prompt: **PASS**" in report
    assert "AR benchmark ids equal the EAD run's ids: **PASS**" in report
    assert "S_X rises along every nested chain toward S_EAD (Prop. 7): **PASS**" in report
    for fig in ("ead_hist", "s_x_vs_k", "selection", "loss_by_depth"):
        assert (smoke_run / "figures" / f"{fig}.png").stat().st_size > 1000
        assert f"{fig}.png" in report
    summary = pd.read_csv(smoke_run / "results" / "tables" / "ead_summary.csv")
    assert set(summary["workload"]) == {"gsm8k", "humaneval", "xsum", "mt_bench"}
    assert set(summary["model"]) == {"tiny-ls", "tiny-std"}
    assert summary["ar_match"].all()


@pytest.mark.slow
def test_smoke_dex_section(smoke_run):
    """The DEX rules ran: every arm equals AR, the rounds identity holds, tables and figures exist."""
    report = (smoke_run / "results" / "REPORT.md").read_text()
    assert "every DEX arm and baseline equals AR token for token on every prompt" in report
    assert re.search(r"equals AR token for token on every prompt \(greedy and sampling.*\*\*PASS\*\*", report)
    assert re.search(r"rounds identity .*\*\*PASS\*\*", report)
    assert re.search(r"Multi-process explorers.*\n\n- token ids equal AR on every prompt: \*\*PASS\*\*", report)
    arms = pd.read_csv(smoke_run / "results" / "tables" / "dex" / "dex_arms.csv")
    assert set(arms["variant"]) == {"tiny-ls", "tiny-std", "tiny-std+ad"}
    assert {"self_spec", "adadecode", "dynamic_exit", "dex-1/12", "dex-1/4-single", "dex-1/4-decs@T1",
            "ead_oracle"} <= set(arms["arm"])
    assert arms["ar_match_all"].all()
    dex = arms[arms.arm.str.match(r"^dex-1/\d+$")]
    assert (dex["depth_speedup"] >= 1.0).all()
    for fig in ("dex_fig3", "dex_fig4"):
        assert (smoke_run / "figures" / f"{fig}.png").stat().st_size > 1000
    summary = json.loads((smoke_run / "results" / "dex" / "adapters" / "tiny-std.json").read_text())
    assert summary["parameters_per_adapter"] == 4 * 64 * 64 + 4 * 64 + 1
    assert all(summary["after"][d]["kl"] < summary["before"][d]["kl"] for d in summary["after"])
    drafts = pd.read_csv(smoke_run / "results" / "tables" / "dex" / "dex_draft.csv")  # dex.draft: 3 layers
    assert list(drafts["model"]) == ["tiny-ls", "tiny-std"] and (drafts["depths"] == "1 6 12").all()
    assert ((drafts["top1_after"] >= 0) & (drafts["top1_after"] <= 1)).all() and "Draft models for the speculative" in report
    draft_cfg = json.loads((smoke_run / "models" / "tiny-std-draft" / "config.json").read_text())
    assert draft_cfg["num_hidden_layers"] == 3 and draft_cfg["draft_of_depths"] == [1, 6, 12]
    # Fig. 5: the speculative arms (dex.speculative) beside AR, the best DEX arm and the baselines, plain models only
    fig5 = pd.read_csv(smoke_run / "results" / "tables" / "dex" / "dex_fig5.csv")
    assert set(fig5["variant"]) == {"tiny-ls", "tiny-std"}
    for (variant, _), cell in fig5.groupby(["variant", "suite"]):
        assert {"ar", "prompt_lookup", "lookahead", "assisted", "pearl", "self_spec"} <= set(cell["arm"])
        assert cell["arm"].str.startswith("dex").sum() == 1
        # the trained-head arm runs where TEV trains the model's drafters (tev.models: tiny-ls)
        assert ("dflash_chain" in set(cell["arm"])) == (variant == "tiny-ls")
        # the multi-process arms (PEARL on two ranks, TP over dex.speculative.tensor_parallel.ranks) on the first dex model
        assert ({"pearl-2ranks", "tensor_parallel-2"} <= set(cell["arm"])) == (variant == "tiny-ls")
    mp = pd.read_csv(smoke_run / "results" / "tables" / "dex" / "dex_fig5_multiprocess.csv")
    assert set(mp["arm"]) == {"pearl-2ranks", "tensor_parallel-2"} and mp["ar_match_all"].all()
    assert (mp["ar_seconds"] > 0).all() and "Multi-process arms in detail" in report
    assert fig5["ar_match_all"].all() and (fig5["tokens_per_s"] > 0).all()
    assert (fig5.loc[fig5.arm == "ar", "wall_speedup"] == 1.0).all()
    assert re.search(r"Fig. 5 shape\)\n\n- every arm below equals AR token for token on every prompt: \*\*PASS\*\*", report)
    assert (smoke_run / "figures" / "dex_fig5.png").stat().st_size > 1000


@pytest.mark.slow
def test_smoke_rows_carry_provenance(smoke_run):
    rows = [json.loads(l) for l in (smoke_run / "results" / "ead" / "tiny-ls" / "gsm8k.jsonl").read_text().splitlines()]
    assert rows
    for k in ("run_id", "git_sha", "git_dirty", "config_hash", "seed", "device", "dtype", "torch_version",
              "transformers_version", "ar_match", "stable_ead", "omega", "candidates", "source_id"):
        assert k in rows[0], k
    prompts = [json.loads(l) for l in (smoke_run / "results" / "workloads" / "tiny-ls" / "gsm8k.jsonl").read_text().splitlines()]
    assert all(p["source_id"].startswith("test-") and p["input_ids"] for p in prompts)
    # the model directory is a from_pretrained-loadable HF directory with its tokenizer
    from impl.models.load import load_model, load_tokenizer

    m = load_model(smoke_run / "models" / "tiny-ls")
    assert m.config.num_hidden_layers == 12 and load_tokenizer(smoke_run / "models" / "tiny-ls").eos_token_id is not None


@pytest.mark.slow
def test_interrupted_run_resumes(tmp_path, data_dir, smoke_run):
    # Reuse the trained models of the smoke run (copied), interrupt the EAD stage, then resume. Both runs
    # target the foundation (rule `tables`: EAD, AR and their tables), the part the interruption hits; the
    # whole DAG after it is covered by the smoke run itself.
    import shutil

    shutil.copytree(smoke_run / "models", tmp_path / "models")
    shutil.copytree(smoke_run / "results" / "train", tmp_path / "results" / "train")
    # "--" ends the options (--rerun-triggers takes several values): `tables` is the target
    p = _snakemake(tmp_path, data_dir, "--rerun-triggers", "mtime", "--", "tables", start_new_session=True)
    deadline = time.time() + 300
    ead_dir = tmp_path / "results" / "ead"
    while time.time() < deadline and not (ead_dir.exists() and any(ead_dir.rglob("*.jsonl"))):
        time.sleep(0.5)
    # a hard kill of Snakemake and its jobs mid-run (a crash: nothing gets to clean up), as soon as the
    # first EAD job has started writing
    os.killpg(p.pid, signal.SIGKILL)
    p.communicate(timeout=60)
    # whatever exists now is complete: every row file parses; partial files live only in the writers'
    # temp directories (".<name>.*.tmp"), which no rule takes for output
    for f in (tmp_path / "results").rglob("*.jsonl"):
        if any(part.endswith(".tmp") for part in f.relative_to(tmp_path).parts):
            continue
        for line in f.read_text().splitlines():
            json.loads(line)
    assert not (tmp_path / "results" / "tables" / "provenance.json").exists()
    p = _snakemake(tmp_path, data_dir, "--rerun-incomplete", "--rerun-triggers", "mtime", "--", "tables")
    log, _ = p.communicate(timeout=1800)
    assert p.returncode == 0, log[-4000:]
    assert (tmp_path / "results" / "tables" / "provenance.json").is_file()
    assert "train_model" not in log  # cached models were not retrained
    # the resumed foundation equals the uninterrupted one: same generated token ids per prompt
    for f in sorted((smoke_run / "results" / "ar").rglob("*.jsonl")):
        g = tmp_path / "results" / "ar" / f.relative_to(smoke_run / "results" / "ar")
        ids = lambda path: [json.loads(x)["token_ids"] for x in path.read_text().splitlines()]
        assert ids(g) == ids(f), g


def test_cli_bad_config_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text((ROOT / "configs" / "smoke.yaml").read_text().replace("steps: 120", "stepz: 120"))
    r = subprocess.run([sys.executable, "-m", "impl", "validate-config", "--config", str(bad)],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "training.stepz" in r.stderr


def test_snakemake_bad_config_fails_before_jobs(tmp_path, data_dir):
    r = subprocess.run([sys.executable, "-m", "snakemake", "-n", "--nolock", "--configfile", "configs/smoke.yaml",
                        "--config", f"data_dir={tmp_path}/missing"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode != 0
    assert "data_dir" in r.stdout + r.stderr


def test_cli_help_lists_every_rule_command():
    r = subprocess.run([sys.executable, "-m", "impl", "--help"], capture_output=True, text=True, cwd=ROOT)
    for cmd in ("tokenizer", "corpus", "train", "workload", "tokenize", "ead", "ar-bench", "tables", "figures",
                "report", "train-adapters", "dex-cell", "dex-tables", "dex-figures"):
        assert cmd in r.stdout


@pytest.mark.slow
def test_config_edit_reruns_only_affected_rules(smoke_run, data_dir, tmp_path):
    import yaml

    cfg = yaml.safe_load((ROOT / "configs" / "smoke.yaml").read_text())
    cfg["ead"]["max_new_tokens"] = 20
    edited = tmp_path / "edited.yaml"
    edited.write_text(yaml.safe_dump(cfg))
    cmd = [sys.executable, "-m", "snakemake", "-n", "--nolock", "--configfile", str(edited), "--config",
           f"data_dir={data_dir}", f"results_dir={smoke_run}/results", f"figures_dir={smoke_run}/figures",
           f"models_dir={smoke_run}/models", f"logs_dir={smoke_run}/logs"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    planned = set(re.findall(r"^(?:local)?rule (\w+):", r.stdout, re.M))
    assert "measure_ead" in planned and "report" in planned
    assert not planned & {"tokenizer", "corpus", "train_model", "workload_text", "workload_tokens", "ar_bench",
                          "train_adapters", "dex_cell", "dex_distributed"}


def test_default_dag_converts_smollm2_before_its_jobs(tmp_path, data_dir):
    """The default plans rule convert_smollm2 into models_dir/smollm2 and feeds it to the foundation and
    DEX jobs of smollm2 (the tiny models keep train_model)."""
    cmd = [sys.executable, "-m", "snakemake", "-n", "--nolock", "--config", f"data_dir={data_dir}",
           f"results_dir={tmp_path}/results", f"models_dir={tmp_path}/models", f"figures_dir={tmp_path}/figures",
           f"logs_dir={tmp_path}/logs"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    outputs: dict[str, list[str]] = {}
    for rule, out in re.findall(r"^(?:local)?rule (\w+):\n(?:    .*\n)*?    output: (.*)", r.stdout, re.M):
        outputs.setdefault(rule, []).append(out)
    assert outputs["convert_smollm2"] == [f"{tmp_path}/models/smollm2"]
    trained = sorted(o.split(",")[0] for o in outputs["train_model"])
    assert trained == [f"{tmp_path}/models/tiny-ls"]  # tiny-std is the smoke config's only
    assert any("/ead/smollm2/" in o for o in outputs["measure_ead"])
    assert any("/dex/smollm2+ad/" in o for o in outputs["dex_cell"])
    assert outputs["vskipper_train_flexidepth"][0].startswith(f"{tmp_path}/models/smollm2-flexidepth")  # vSkipper on smollm2
    # TEV trains drafters for the real model and for tiny-ls; DEX's trained-head arm reads smollm2's (no train_head)
    assert sorted(o.split(",")[0] for o in outputs["tev_train"]) == [f"{tmp_path}/models/tev/smollm2",
                                                                    f"{tmp_path}/models/tev/tiny-ls"]
    assert "train_head" not in outputs
