"""The SGLang section of the vSkipper protocol (vskipper.sglang_section): its config (validated before any job,
the effective config of its jobs) and the side-by-side tables and report section of two engines' runs
(impl.vskipper.engine_report, python -m impl vskipper-engine-tables)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from impl.config import ConfigError, read_yaml, validate_config
from impl.report.tables import write_table
from impl.vskipper.engine_report import ENGINE_TABLE_NAMES, engine_tables, report_section
from impl.vskipper.schema import engine_config, sglang_section_settings

ROOT = Path(__file__).resolve().parents[1]


def _cfg(tmp_path, section, python=None) -> dict:
    raw = read_yaml(ROOT / "configs" / "smoke.yaml")
    py = tmp_path / "python"
    py.write_text("")
    py.chmod(0o755)  # the config check wants an executable interpreter
    raw["vskipper"]["sglang"] = {"python": str(python or py)}
    if section is not None:
        raw["vskipper"]["sglang_section"] = section
    return validate_config(raw, check_paths=False)


def test_the_section_is_off_by_default_and_fills_in_from_the_main_run(tmp_path):
    assert _cfg(tmp_path, None)["vskipper"].get("sglang_section") is None
    assert sglang_section_settings(_cfg(tmp_path, None)["vskipper"]) is None
    cfg = _cfg(tmp_path, {})
    assert sglang_section_settings(cfg["vskipper"]) == {"workloads": ["gsm8k"], "points": ["knee"], "ablation": True,
                                                        "repetitions": None, "quality": True}
    off = _cfg(tmp_path, {"ablation": True})
    off["vskipper"]["ablations"] = []
    assert sglang_section_settings(off["vskipper"])["ablation"] is False  # nothing to ablate


def test_the_section_is_checked_before_any_job(tmp_path):
    with pytest.raises(ConfigError, match=r"sglang_section\.points\[0\].*'overload'.*load_points"):
        _cfg(tmp_path, {"points": ["overload"]})
    with pytest.raises(ConfigError, match=r"sglang_section\.workloads\[0\].*'bbh'.*vskipper\.workloads"):
        _cfg(tmp_path, {"workloads": ["bbh"]})
    with pytest.raises(ConfigError, match=r"sglang_section.*vskipper\.sglang\.python.*setup_sglang"):
        _cfg(tmp_path, {}, python=tmp_path / "missing")
    with pytest.raises(ConfigError, match=r"sglang_section\.repetitions"):
        _cfg(tmp_path, {"repetitions": 0})
    with pytest.raises(ConfigError, match=r"unknown key 'vskipper\.sglang_section\.engine'"):
        _cfg(tmp_path, {"engine": "vllm"})


def test_the_jobs_config_puts_both_arm_families_on_sglang(tmp_path):
    cfg = _cfg(tmp_path, {"repetitions": 3})
    out = engine_config(cfg)
    v = out["vskipper"]
    assert v["engines"] == {"upstream": "sglang", "routed": "sglang"} and v["repetitions"] == 3
    assert not any(k in v for k in ("sglang_section", "cross_model", "devices"))
    # the quality 2x2 runs again with C and D on SGLang; the served-at-knee pass stays on the main engine
    assert v["quality"]["tasks"] == cfg["vskipper"]["quality"]["tasks"] and v["quality"]["served"] is None
    assert cfg["vskipper"]["quality"]["served"] is not None
    off = engine_config(_cfg(tmp_path, {"quality": False}))["vskipper"]
    assert "quality" not in off and sglang_section_settings(_cfg(tmp_path, {"quality": False})["vskipper"])["quality"] is False
    assert v["model"] == cfg["vskipper"]["model"] and v["load_points"] == cfg["vskipper"]["load_points"]
    assert cfg["vskipper"]["engines"] == {"upstream": "transformers", "routed": "transformers"}  # main untouched
    with pytest.raises(ValueError, match="sglang_section"):
        engine_config(_cfg(tmp_path, None))


def _tables(d: Path, engine: str, backend: str, rows: list[tuple], gate: list[str]) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    write_table(pd.DataFrame([{"workload": w, "model": "m", "engine": engine, "attention_backend": backend,
                               "status": "ok", "q_star": q, "q_star_used": q, "message": "rule"}
                              for w, q in {(r[0], r[4]) for r in rows}]), d / "vskipper_knee_summary")
    write_table(pd.DataFrame([{"workload": w, "point": p, "factor": 0.95, "rate": 1.0, "knee_status": "ok",
                               "lane": lane, "n": 2, "E2E mean": e2e} for w, p, lane, e2e, _ in rows]),
                d / "vskipper_table2")
    write_table(pd.DataFrame([{"experiment": "main", "workload": "gsm8k", "point": "knee", "lane": f"l{i}",
                               "status": s} for i, s in enumerate(gate)]), d / "vskipper_gate")
    return d


def test_engine_tables_line_up_the_engines_on_the_pairs_both_measured(tmp_path):
    tr = _tables(tmp_path / "tr", "transformers", "paged sdpa",
                 [("gsm8k", "knee", "matched", "-3.0%", 1.4), ("gsm8k", "knee", "natural", "+1.0%", 1.4),
                  ("bbh", "knee", "matched", "-2.0%", 0.6)], ["ok", "ok", "ok"])
    sg = _tables(tmp_path / "sg", "sglang", "torch_native",
                 [("gsm8k", "knee", "natural", "+4.0%", 0.3), ("gsm8k", "knee", "matched", "-9.0%", 0.3)],
                 ["ok", "rejected", "skipped"])
    t = engine_tables({"transformers": tr, "sglang": sg})
    assert set(t) == set(ENGINE_TABLE_NAMES)
    t2 = t["vskipper_engines_table2"]
    # bbh was measured on transformers only: dropped; each (workload, point, lane) has its two engines in order
    assert list(zip(t2.lane, t2.engine, t2["E2E mean"])) == [
        ("matched", "transformers", "-3.0%"), ("matched", "sglang", "-9.0%"),
        ("natural", "transformers", "+1.0%"), ("natural", "sglang", "+4.0%")]
    assert list(t2.attention_backend) == ["paged sdpa", "torch_native"] * 2
    knee = t["vskipper_engines_knee"]
    assert sorted(zip(knee.engine, knee.workload, knee.q_star)) == [
        ("sglang", "gsm8k", 0.3), ("transformers", "bbh", 0.6), ("transformers", "gsm8k", 1.4)]
    gate = t["vskipper_engines_gate"].set_index("engine")
    assert gate.loc["transformers", ["lanes", "passed", "rejected"]].tolist() == [3, 3, 0]
    assert gate.loc["sglang", ["lanes", "passed", "rejected"]].tolist() == [2, 1, 1]  # "skipped" is not a lane

    out = tmp_path / "sg"
    for name, df in t.items():
        write_table(df, out / name)
    text = "\n".join(report_section(out, tmp_path, tmp_path))
    assert "vSkipper on upstream SGLang" in text and "**FAIL**" in text  # a rejected SGLang lane fails the check
    assert "torch_native" in text and "[vskipper_engines_table2](sg/vskipper_engines_table2.csv)" in text

    with pytest.raises(ValueError, match="at least two"):
        engine_tables({"sglang": sg})
    with pytest.raises(FileNotFoundError, match="engine 'x'"):
        engine_tables({"sglang": sg, "x": tmp_path / "none"})


def test_the_command_refuses_bad_engine_arguments(tmp_path):
    def run(*args):
        return subprocess.run([sys.executable, "-m", "impl", "vskipper-engine-tables", *args, "--out-dir",
                               str(tmp_path / "o")], capture_output=True, text=True, cwd=ROOT, timeout=120)

    for args, msg in ((["--engine", f"a={tmp_path}"], "at least two"),
                      (["--engine", f"a={tmp_path}", "--engine", f"a={tmp_path}"], "given twice"),
                      (["--engine", f"a={tmp_path}", "--engine", "b"], "LABEL=TABLES_DIR"),
                      (["--engine", f"a={tmp_path}", "--engine", f"b={tmp_path / 'none'}"], "not a folder")):
        p = run(*args)
        assert p.returncode != 0 and msg in p.stderr, (args, p.stderr[-500:])
    assert not (tmp_path / "o").exists()


def test_a_non_executable_interpreter_and_a_non_llama_model_are_refused_before_any_job(tmp_path):
    """vskipper.sglang.python must be executable; vSkipper inside SGLang serves Llama checkpoints, so a routed
    SGLang family (or the section) over an existing model directory of another architecture fails at the check,
    naming the key, the model and its architectures; a model the DAG has not made yet is not read."""
    import json

    py = tmp_path / "notexec"
    py.write_text("")
    with pytest.raises(ConfigError, match=r"sglang_section.*vskipper\.sglang\.python.*is not executable"):
        _cfg(tmp_path, {}, python=py)
    qwen = tmp_path / "qwen"
    qwen.mkdir()
    (qwen / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"]}))
    raw = read_yaml(ROOT / "configs" / "smoke.yaml")
    exe = tmp_path / "python"
    exe.write_text("")
    exe.chmod(0o755)
    raw["models"]["qwen"] = {"kind": "pretrained", "path": str(qwen)}
    raw["vskipper"].update(model="qwen", sglang={"python": str(exe)}, engines={"routed": "sglang"})
    with pytest.raises(ConfigError, match=r"'vskipper\.engines\.routed' serves model 'qwen'.*Qwen3ForCausalLM"):
        validate_config(raw, check_paths=False)
    raw["vskipper"].update(engines={"routed": "transformers"}, sglang_section={})
    with pytest.raises(ConfigError, match=r"'vskipper\.sglang_section' serves model 'qwen'"):
        validate_config(raw, check_paths=False)
    (qwen / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    assert validate_config(raw, check_paths=False)["vskipper"]["model"] == "qwen"


def test_an_optional_section_given_as_null_is_off(tmp_path):
    """An overlay turns off an optional vSkipper sub-section an earlier file set (vskipper.quality: null);
    a null that is a value stays (vskipper.sglang.max_total_tokens: null = SGLang's own sizing)."""
    from impl.launch import merged_config

    base = read_yaml(ROOT / "configs" / "smoke.yaml")
    assert base["vskipper"].get("quality") is not None
    over = tmp_path / "off.yaml"
    over.write_text("vskipper:\n  quality: null\n  sglang_section: null\n  sglang: {max_total_tokens: null}\n")
    cfg = validate_config(merged_config([ROOT / "configs" / "smoke.yaml", over], {}), check_paths=False)
    assert "quality" not in cfg["vskipper"] and "sglang_section" not in cfg["vskipper"]
    assert cfg["vskipper"]["sglang"]["max_total_tokens"] is None
