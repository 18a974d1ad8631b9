"""vSkipper Table 6 (cross-model) and Table 7 (hardware transfer) shapes (Sec. 4.4):

- the ``vskipper.cross_model`` / ``vskipper.devices`` keys: defaults, one-line errors naming the key, and the
  effective config of each extra target (:func:`impl.vskipper.schema.target_config`);
- the table builders (:mod:`impl.vskipper.transfer`) on synthetic protocol rows: a resolved and an
  unresolved comparison, a rejected lane, the numbers equal to the protocol's own summary rows;
- the CLI command and the report lines;
- the DAG: ``snakemake -n`` on the smoke config lists the new jobs (and none without the keys), and the paper
  config routes each device's jobs with its own SLURM resources.
"""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from impl.config import ConfigError, validate_config

ROOT = Path(__file__).resolve().parents[1]
NEW_RULES = ("vskipper_model_train_flexidepth", "vskipper_model_profile", "vskipper_model_knee", "vskipper_model_cell",
             "vskipper_model_quality", "vskipper_device_profile", "vskipper_device_knee", "vskipper_device_cell",
             "vskipper_transfer_tables")


def _smoke() -> dict:
    return yaml.safe_load((ROOT / "configs" / "smoke.yaml").read_text())


def _with(**keys) -> dict:
    cfg = _smoke()
    for k in ("cross_model", "devices"):
        cfg["vskipper"].pop(k, None)
    cfg["vskipper"].update(keys)
    return cfg


# ---------------------------------------------------------------------------------------- schema
def test_defaults_and_absent_keys():
    from impl.vskipper.schema import transfer_settings

    v = validate_config(_with(), check_paths=False)["vskipper"]
    x = transfer_settings(v)
    assert x["models"] == [] and x["devices"] == [] and "cross_model" not in v
    v = validate_config(_with(cross_model={"models": ["tiny-ls"]}), check_paths=False)["vskipper"]
    assert v["cross_model"] == {"models": ["tiny-ls"], "workload": "gsm8k", "point": "knee", "repetitions": None}


@pytest.mark.parametrize("keys, key", [
    ({"cross_model": {"models": ["tiny-xl"]}}, "vskipper.cross_model.models[0]"),
    ({"cross_model": {"models": ["tiny-std"]}}, "vskipper.cross_model.models[0]"),  # that is vskipper.model
    ({"cross_model": {"models": ["tiny-ls", "tiny-ls"]}}, "vskipper.cross_model.models"),
    ({"cross_model": {"models": ["tiny-ls"], "workload": "xsum"}}, "vskipper.cross_model.workload"),
    ({"cross_model": {"models": ["tiny-ls"], "point": "overload"}}, "vskipper.cross_model.point"),
    ({"cross_model": {"models": ["tiny-ls"], "repetitions": 0}}, "vskipper.cross_model.repetitions"),
    ({"devices": [{"name": "a", "device": "cpu", "threads": 1}, {"name": "a", "device": "cpu", "threads": 2}]},
     "vskipper.devices[1].name"),
    ({"devices": [{"name": "cpu-0t", "device": "cpu", "threads": 0}]}, "vskipper.devices[0].threads"),
    ({"devices": [{"name": "x", "device": "cpu", "threads": "two"}]}, "vskipper.devices[0].threads"),
    ({"devices": [{"name": "../up", "device": "cpu", "threads": 1}]}, "vskipper.devices[0].name"),
    ({"devices": [{"name": "tpu", "device": "tpu", "threads": 1}]}, "vskipper.devices[0].device"),
    ({"devices": [{"name": "x", "device": "cpu"}]}, "vskipper.devices[0]"),
    ({"devices": [{"name": "x", "device": "cpu", "threads": 1, "gpus": 1}]}, "vskipper.devices[0].gpus"),
    ({"devices": [{"name": "x", "device": "cpu", "threads": 1}], "cross_model": {"workload": "coqa"}},
     "vskipper.cross_model.workload"),
])
def test_errors_name_the_key(keys, key):
    with pytest.raises(ConfigError) as e:
        validate_config(_with(**keys), check_paths=False)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("config: ") and key in msg, msg


def test_target_config():
    from impl.vskipper.schema import target_config

    cfg = validate_config(_with(cross_model={"models": ["tiny-ls"], "repetitions": 3},
                                devices=[{"name": "cpu-2t", "device": "cpu", "threads": 2, "repetitions": 4,
                                          "resources": {"slurm_partition": "p"}}]), check_paths=False)
    before = json.dumps(cfg, sort_keys=True)
    m = target_config(cfg, model="tiny-ls")
    assert m["vskipper"]["model"] == "tiny-ls" and m["vskipper"]["repetitions"] == 3
    assert m["vskipper"]["quality"]["tasks"] == ["gsm8k"] and m["vskipper"]["quality"]["served"] is None
    assert "cross_model" not in m["vskipper"] and "devices" not in m["vskipper"]
    assert (m["threads"], m["device"]) == (cfg["threads"], cfg["device"])
    d = target_config(cfg, device="cpu-2t")
    assert (d["threads"], d["device"], d["vskipper"]["model"]) == (2, "cpu", "tiny-std")
    assert d["vskipper"]["repetitions"] == 4
    assert json.dumps(cfg, sort_keys=True) == before  # not modified
    with pytest.raises(KeyError, match="nope"):
        target_config(cfg, device="nope")
    # the quality section is dropped when the workload is not one of its tasks
    cfg = validate_config(_with(cross_model={"models": ["tiny-ls"]}), check_paths=False)
    cfg["vskipper"]["quality"]["tasks"] = ["bbh"]
    assert "quality" not in target_config(cfg, model="tiny-ls")["vskipper"]


# --------------------------------------------------------------------------------- table builders
def _cell_rows(tpot_s: float, repetitions: int, seed: int) -> list[dict]:
    """Protocol rows of one matched-lane FakeArm cell (virtual clock) at the knee: upstream vs 'vskipper'."""
    from impl.serving import FakeArm, Request, run_cell

    reqs = [Request(f"q{i}", (1, 2, 3), 8) for i in range(12)]
    arms = {"upstream": FakeArm("upstream", slots=2, tpot_s=0.01, jitter=0.1, seed=seed),
            "vskipper": FakeArm("vskipper", slots=2, tpot_s=tpot_s, jitter=0.1, seed=seed + 1)}
    res = run_cell(arms, reqs, cell="knee", rate=95.0, repetitions=repetitions, seed=4, lane="matched",
                   workload="gsm8k")
    for r in res.rows:
        r.update({"experiment": "cross-model", "point": "knee", "factor": 0.95, "knee_status": "ok", "q_star": 100.0,
                  "q_star_used": 100.0})
    return res.rows


def _write(path: Path, obj) -> Path:
    if isinstance(obj, list):
        path.write_text("".join(json.dumps(r) + "\n" for r in obj))
    else:
        path.write_text(json.dumps(obj))
    return path


def _target(tmp_path: Path, name: str, rows: list[dict], *, q_star=100.0, device="cpu", threads=1, share=0.4,
            quality=None) -> dict:
    d = tmp_path / name
    d.mkdir()
    t = {"name": name, "role": "extra",
         "knee": _write(d / "knee.json", {"workload": "gsm8k", "status": "ok", "q_star": q_star,
                                          "q_star_used": q_star}),
         "cell": _write(d / "cell.jsonl", rows),
         "thresholds": _write(d / "thr.json", {
             "share": {"prefill": share + 0.1, "decode": share},
             "thresholds": {"enter_threshold": 12, "min_prefill_tokens": None},
             "profile": {"device": device, "threads": threads}})}
    if quality is not None:
        t["quality"] = _write(d / "quality.jsonl", quality)
    return t


def _quality(c: float, d: float) -> list[dict]:
    return [{"kind": "doc", "suite": "gsm8k"},
            {"kind": "summary", "suite": "gsm8k", "task": None, "metric": "exact_match,composite", "primary": True,
             "n": 8, "mean_A": c, "mean_B": d, "mean_C": c, "mean_D": d},
            {"kind": "summary", "suite": "gsm8k", "task": None, "metric": "exact_match,strict", "primary": False,
             "n": 8, "mean_A": 1.0, "mean_B": 1.0, "mean_C": 1.0, "mean_D": 1.0}]


def _summary_e2e(rows):
    return next(r for r in rows if r["kind"] == "summary" and r["metric"] == "e2e_mean_s")


def test_paired_e2e_resolved_unresolved_rejected():
    from impl.vskipper.transfer import paired_e2e

    fast = _cell_rows(0.006, 3, seed=1)
    p = paired_e2e(fast)
    s = _summary_e2e(fast)
    assert p["status"] == "ok" and p["n"] == 3 and p["e2e_resolved"] and p["e2e_pct_mean"] < 0
    # the same statistic as the protocol's own summary row (Table 2)
    assert p["e2e_pct_mean"] == pytest.approx(s["pct_mean"]) and p["e2e_ci_low"] == pytest.approx(s["pct_ci_low"])
    assert p["E2E mean"].endswith(" *") and (p["point"], p["rate"], p["q_star_used"]) == ("knee", 95.0, 100.0)
    one = paired_e2e(_cell_rows(0.006, 1, seed=1))  # one repetition is never resolved
    assert one["n"] == 1 and not one["e2e_resolved"] and one["E2E mean"].endswith("(n=1)")
    rej = paired_e2e([{"kind": "rejected", "lane": "matched", "error": "MatchedWorkError: 2 requests differ",
                       "workload": "gsm8k", "point": "knee"}])
    assert rej["status"] == "rejected" and "MatchedWorkError" in rej["message"] and rej["E2E mean"] == "-"
    assert paired_e2e([])["status"] == "missing"
    assert paired_e2e(fast, lane="natural")["status"] == "missing"


def test_table6_and_table7(tmp_path):
    from impl.vskipper.transfer import TABLE6_COLS, TABLE7_COLS, table6, table7

    main = _target(tmp_path, "tiny-std", _cell_rows(0.006, 3, seed=1), share=0.7, quality=_quality(12.5, 0.0))
    main["role"] = "main"
    same = _target(tmp_path, "tiny-ls", _cell_rows(0.01, 2, seed=7), q_star=48.0, share=0.1,
                   quality=_quality(25.0, 12.5))
    t6 = table6([main, same])
    assert list(t6.columns) == TABLE6_COLS and list(t6["model"]) == ["tiny-std", "tiny-ls"]
    a, b = t6.iloc[0], t6.iloc[1]
    assert a["e2e_resolved"] and a["e2e_pct_mean"] < 0 and a["n"] == 3 and a["role"] == "main"
    assert not b["e2e_resolved"] and b["n"] == 2 and b["q_star_used"] == 48.0  # Q* from the knee JSON
    assert (a["served accuracy"], b["served accuracy"]) == ("12.5 / 0.0", "25.0 / 12.5")
    assert a["acc_metric"] == "exact_match,composite" and a["acc_n"] == 8
    assert (a["skip_decode"], b["skip_decode"]) == (0.7, 0.1)
    # without a quality file the accuracy is "-"
    del same["quality"]
    assert table6([same]).iloc[0]["served accuracy"] == "-"

    dev = _target(tmp_path, "cpu-2t", _cell_rows(0.006, 3, seed=3), threads=2)
    rej = _target(tmp_path, "cpu-4t", [{"kind": "rejected", "lane": "matched", "error": "CellError: failed",
                                        "workload": "gsm8k", "point": "knee"}], threads=4)
    t7 = table7([{**main, "name": "main"}, dev, rej])
    assert list(t7.columns) == TABLE7_COLS and list(t7["threads"]) == [1, 2, 4]
    assert list(t7["status"]) == ["ok", "ok", "rejected"] and t7.iloc[1]["e2e_resolved"]
    assert t7.iloc[0]["decode_threshold_N"] == 12 and t7["prefill_threshold_N"].isna().all()
    with pytest.raises(FileNotFoundError, match="knee"):
        table7([{**dev, "knee": tmp_path / "nope" / "knee.json"}])


def test_command_and_report_lines(tmp_path):
    from impl.vskipper.transfer import transfer_section_lines

    main = _target(tmp_path, "tiny-std", _cell_rows(0.006, 3, seed=1), quality=_quality(12.5, 0.0))
    dev = _target(tmp_path, "cpu-2t", _cell_rows(0.006, 2, seed=3), threads=2)
    out = tmp_path / "tables"
    words = lambda t, role: [f"{k}={v}" for k, v in {**t, "role": role}.items()]  # noqa: E731
    cmd = [sys.executable, "-m", "impl", "vskipper-transfer-tables", "--model", *words(main, "main"),
           "--device", *words({**main, "name": "main"}, "main"), "--device", *words(dev, "extra"),
           "--out-dir", str(out)]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True)
    assert {p.name for p in out.iterdir()} == {f"vskipper_table{i}.{e}" for i in (6, 7) for e in ("csv", "md")}
    text = "\n".join(transfer_section_lines(out, tmp_path))
    assert "Table 6 shape" in text and "Table 7 shape" in text and "(tables/vskipper_table6.csv)" in text
    assert "CPU configurations of this one machine" in text and "cpu-2t (cpu, 2 thread(s)" in text
    assert "Table 7: every row's own knee sweep brackets Q*: **" in text
    bad = subprocess.run([sys.executable, "-m", "impl", "vskipper-transfer-tables", "--model", "name=x",
                          "--out-dir", str(out)], cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode != 0 and "missing knee, cell, thresholds" in bad.stderr
    assert transfer_section_lines(tmp_path / "none", tmp_path) == []


def test_knee_check_flags_unbracketed_rows():
    import pandas as pd

    from impl.vskipper.transfer import _knee_check

    ok = _knee_check(pd.DataFrame({"model": ["a", "b"], "knee_status": ["ok", "ok"]}), "model", "Table 6")
    assert ok.endswith("**PASS**")
    bad = _knee_check(pd.DataFrame({"device_name": ["main", "cpu-2t"], "knee_status": ["ok", "bottom"]}),
                      "device_name", "Table 7")
    assert "**FAIL**" in bad and "cpu-2t: bottom" in bad and "main" not in bad.split("unbracketed")[1]


# ------------------------------------------------------------------------------------------- the DAG
@pytest.fixture(scope="module")
def workdir(tmp_path_factory, data_dir) -> Path:
    """A fresh copy of the workflow (no results), ../shared/data linked to the data folder."""
    base = tmp_path_factory.mktemp("transfer")
    repo = base / "repo"
    repo.mkdir()
    shutil.copy2(ROOT / "Snakefile", repo / "Snakefile")
    for d in ("workflows", "impl", "configs", "profiles"):
        shutil.copytree(ROOT / d, repo / d, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    (base / "shared").mkdir()
    (base / "shared" / "data").symlink_to(Path(data_dir).resolve(), target_is_directory=True)
    return repo


def _dry(workdir: Path, *args: str) -> str:
    p = subprocess.run([sys.executable, "-m", "snakemake", "-n", "--nolock", *args], cwd=workdir,
                       capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    return p.stdout + p.stderr


def test_smoke_dry_run_lists_the_new_jobs(workdir, tmp_path):
    out = _dry(workdir, "--configfile", "configs/smoke.yaml")
    for rule in NEW_RULES:
        assert re.search(rf"^{rule}\s+1$", out, re.M), f"{rule} not planned once"
    assert "results/smoke/vskipper/models/tiny-ls/cells/gsm8k/knee.jsonl" in out
    assert "results/smoke/vskipper/devices/cpu-2t/knee/gsm8k.json" in out
    assert "models/smoke/tiny-ls-flexidepth" in out
    assert "--config-json @results/smoke/.config/vskipper/devices/cpu-2t.json" not in out  # -n without -p
    # the keys absent: no extra rule, no Table 6 / 7
    raw = _smoke()
    raw["vskipper"].pop("cross_model")
    raw["vskipper"].pop("devices")
    cfg = tmp_path / "plain.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    out = _dry(workdir, "--configfile", str(cfg))
    assert not any(re.search(rf"^{rule}\s", out, re.M) for rule in NEW_RULES)


def test_paper_config_routes_devices_to_their_hardware(workdir, tmp_path):
    raw = yaml.safe_load((ROOT / "configs" / "paper" / "vskipper.yaml").read_text())
    for name, m in raw["models"].items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
        m["path"] = str(tmp_path / name)
    cfg = tmp_path / "paper.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    target = "results/paper/vskipper/tables/vskipper/vskipper_table7.csv"
    out = _dry(workdir, "--profile", "profiles/slurm", target,
               "results/paper/vskipper/tables/vskipper/vskipper_table6.csv", "--configfile", str(cfg))
    blocks = re.findall(r"^rule (\w+):\n(.*?)(?=^\S)", out, re.M | re.S)
    dev = [(r, b) for r, b in blocks if r.startswith("vskipper_device_")]
    assert len(dev) == 6  # profile, knee, cell x (h100, a6000)
    for rule, body in dev:
        name = re.search(r"vsk_device=(\w+)", body)[1]
        assert f"slurm_partition=gpu-{name}" in body and "gres=gpu:1" in body and f"constraint={name}" in body, body
    models = {re.search(r"vsk_xmodel=([\w.-]+)", b)[1] for r, b in blocks if r == "vskipper_model_cell"}
    assert models == {"qwen3-4b", "qwen3-8b"}


def test_target_layout_and_resources():
    from impl.vskipper.targets import device_resources, target_args, target_files, transfer_targets

    t6, t7 = transfer_targets("r/vsk", "tiny-std", ["tiny-ls"], ["cpu-2t"], "gsm8k", "knee", quality=True)
    assert [(t["name"], t["role"]) for t in t6] == [("tiny-std", "main"), ("tiny-ls", "extra")]
    assert t6[0]["cell"] == "r/vsk/cells/gsm8k/knee.jsonl" and t6[0]["flexidepth"] == "r/vsk/flexidepth/tiny-std.json"
    assert t6[1]["knee"] == "r/vsk/models/tiny-ls/knee/gsm8k.json"
    assert t6[1]["quality"] == "r/vsk/models/tiny-ls/quality/gsm8k.jsonl"
    assert [t["name"] for t in t7] == ["main", "cpu-2t"] and "quality" not in t7[1]
    assert t7[1]["thresholds"] == "r/vsk/devices/cpu-2t/thresholds/flexidepth.json"
    assert len(target_files(t6)) == 2 * 5 and transfer_targets("r", "m", [], [], "gsm8k", "knee", False) == ([], [])
    args = target_args(t6, t7)
    assert args.count("--model ") == 2 and args.count("--device ") == 2 and "name=cpu-2t role=extra" in args
    res = device_resources({"h100": {"resources": {"gres": "gpu:1", "mem_mb": 9}}, "cpu": {}}, mem_mb=8000, runtime=60)
    assert res == {"gres": {"h100": "gpu:1", "cpu": None}, "mem_mb": {"h100": 9, "cpu": 8000},
                   "runtime": {"h100": 60, "cpu": 60}}
