"""scripts/run.sh's pre-flight (impl.launch): config files and overrides checked before Snakemake."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from impl.config import ConfigError
from impl.launch import DEFAULT_CONFIG, check, config_args, main, merged_config, report_path

ROOT = Path(__file__).resolve().parents[1]


def test_config_args_reads_files_and_overrides_like_snakemake():
    files, over = config_args(["--cores", "2", "--configfile", "a.yaml", "b.yaml", "-n", "--config", "seed=7",
                               "results_dir=out", "x=[1, 2]", "--configfile=c.yaml", "-C", "seed=8"])
    assert files == ["a.yaml", "b.yaml", "c.yaml"]
    assert over == {"seed": 8, "results_dir": "out", "x": [1, 2]}
    assert config_args(["--cores", "2", "all"]) == ([DEFAULT_CONFIG], {})
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        config_args(["--config", "seed"])


def test_merged_config_merges_dicts_in_order_then_overrides(tmp_path):
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text("seed: 1\nvskipper: {http: {port: 1, host: h}}\nlist: [1, 2]\n")
    b.write_text("vskipper: {http: {port: 2}}\nlist: [3]\n")
    cfg = merged_config([a, b], {"seed": 5})
    assert cfg == {"seed": 5, "vskipper": {"http": {"port": 2, "host": "h"}}, "list": [3]}


def test_yaml_error_names_file_line_and_column(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("seed: 1\nmodels:\n  a: [1, 2\n")
    with pytest.raises(ConfigError, match=rf"{bad}:\d+:\d+: not valid YAML"):
        check(["--configfile", str(bad)])
    with pytest.raises(ConfigError, match="config file not found: .*nope.yaml"):
        check(["--configfile", str(tmp_path / "nope.yaml")])
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("- 1\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        check(["--configfile", str(scalar)])


def test_smoke_config_and_overlay_pass_and_a_bad_override_names_its_key(monkeypatch, data_dir):
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("IMPL_DATA_DIR", str(data_dir))
    cfg = check(["--configfile", "configs/smoke.yaml"])
    assert cfg["results_dir"] == "results/smoke"
    with pytest.raises(ConfigError, match="seed"):
        check(["--configfile", "configs/smoke.yaml", "--config", "seed=abc"])
    assert report_path(["--configfile", "configs/smoke.yaml", "--config", "results_dir=elsewhere"]) == \
        "elsewhere/REPORT.md"
    assert report_path(["--configfile", "configs/smoke.yaml", "-n"]) is None


def test_report_path_names_the_report_only_once_it_exists(monkeypatch, data_dir, tmp_path, capsys):
    """run.sh's last line: a run of chosen targets builds no report, so it says so instead of pointing at a
    file that is not there."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("IMPL_DATA_DIR", str(data_dir))
    argv = ["report-path", "--configfile", "configs/smoke.yaml", "--config", f"results_dir={tmp_path}"]
    assert main(argv) == 0
    assert capsys.readouterr().out.strip() == f"no report yet: {tmp_path}/REPORT.md is written by a run of the whole DAG (no target)"
    (tmp_path / "REPORT.md").write_text("# report\n")
    assert main(argv) == 0
    assert capsys.readouterr().out.strip() == f"report: {tmp_path}/REPORT.md"


def test_main_prints_one_line_and_exits_2(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: 1\na: 2\n")
    assert main(["check", "--configfile", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: config file") and "given twice" in err[0]
    assert main(["frobnicate"]) == 2


def test_run_sh_stops_on_a_yaml_error_before_snakemake(tmp_path):
    """The whole script: a syntax error is one line with its position and nothing runs."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("seed: [1\n")
    if not (ROOT / ".venv" / "bin" / "python").exists():
        pytest.skip("needs the project venv (scripts/setup_env.sh)")
    env = {**os.environ, "PYTHON": sys.executable}
    r = subprocess.run(["bash", "scripts/run.sh", "--configfile", str(bad)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 2, r.stderr
    lines = [x for x in r.stderr.splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and f"{bad}:" in lines[0] and "not valid YAML" in lines[0], r.stderr
    assert "Building DAG" not in r.stderr + r.stdout
