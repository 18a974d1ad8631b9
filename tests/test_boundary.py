"""Bad input at the boundary: command-line arguments and config files are refused before any work, with
one line naming the argument or key; result rows are strict JSON."""

import json
import math

import numpy as np
import pytest

from impl.argtypes import fraction, nonneg_int, port, positive_float, positive_int, temperature
from impl.config import ConfigError, load_config, read_yaml, validate_config
from impl.provenance import strict_json, write_json, write_jsonl


@pytest.mark.parametrize("fn, good, bad", [
    (temperature, ["0", "0.7", "1e-3"], ["nan", "inf", "-inf", "-0.1", "x", ""]),
    (positive_int, ["1", "64"], ["0", "-3", "1.5", "nan", "two"]),
    (nonneg_int, ["0", "7"], ["-1", "0.5"]),
    (positive_float, ["0.5", "600"], ["0", "-1", "nan", "inf"]),
    (fraction, ["0", "0.25", "1"], ["1.01", "-0.1", "nan"]),
    (port, ["0", "8080", "65535"], ["65536", "-1", "http"]),
])
def test_argument_types(fn, good, bad):
    import argparse

    for g in good:
        assert fn(g) == (int(g) if fn in (positive_int, nonneg_int, port) else float(g))
    for b in bad:
        with pytest.raises(argparse.ArgumentTypeError, match=repr(b).strip("'") or "got ''"):
            fn(b)


def _cli_error(capsys, argv):
    from impl.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    return err


@pytest.mark.parametrize("flag, value", [("--temperature", "nan"), ("--temperature", "inf"), ("--threads", "0"),
                                         ("--max-new-tokens", "0"), ("--seed", "-1")])
def test_decode_refuses_bad_numbers_before_loading(capsys, tmp_path, flag, value):
    # the model directory does not exist: the argument error must come first, naming the flag
    err = _cli_error(capsys, ["decode", "--model-dir", str(tmp_path / "none"), "--method", "ar", "--prompts",
                              str(tmp_path / "p.jsonl"), "--out", str(tmp_path / "o.jsonl"), flag, value])
    assert f"argument {flag}" in err and repr(value) in err


@pytest.mark.parametrize("content, needle", [(None, "is a directory"), ("", "holds no prompt rows"),
                                              ('{"input_ids": [1]}\n', "missing or non-string 'id'"),
                                              ("not json\n", "--prompts: ")])
def test_decode_refuses_bad_prompt_files_before_loading(capsys, tmp_path, content, needle):
    """An empty, malformed or directory --prompts fails in one line before the (missing) model is read."""
    prompts = tmp_path / "p.jsonl"
    if content is None:
        prompts.mkdir()
    else:
        prompts.write_text(content)
    err = _cli_error(capsys, ["decode", "--model-dir", str(tmp_path / "none"), "--method", "ar", "--prompts",
                              str(prompts), "--out", str(tmp_path / "o.jsonl")])
    assert "--prompts" in err and needle in err, err


def test_commands_that_read_no_config_refuse_config(capsys, tmp_path):
    """A command that reads no run config refuses --config rather than ignoring it (decode once took
    ``--config`` with a bad key and exited 0); the ones that read it still take it."""
    import argparse

    from impl.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    takes = {name: "--config" in sp._option_string_actions for name, sp in sub.choices.items()}
    assert not any(takes[c] for c in ("decode", "report", "figures", "tev-tables", "vskipper-tables",
                                      "vskipper-bench-tables", "vskipper-figures")), takes
    assert all(takes[c] for c in ("validate-config", "ead", "tev-cell", "serve-cell", "vskipper-bench")), takes
    err = _cli_error(capsys, ["decode", "--model-dir", "m", "--method", "ar", "--prompts", "p", "--out", "o",
                              "--config", "configs/default.yaml"])
    assert "unrecognized arguments: --config" in err


@pytest.mark.parametrize("params, needle", [("{gamma: 4}", "argument --params: not valid JSON"),
                                            ("[4]", "argument --params: must be a JSON object"),
                                            (None, "--method pearl needs --params")])
def test_decode_refuses_bad_params_with_usage_status(capsys, tmp_path, params, needle):
    """Bad --params (malformed, not an object, missing) is bad usage: exit status 2 and one line, before any
    model is loaded (the model directory does not exist)."""
    argv = ["decode", "--model-dir", str(tmp_path / "none"), "--method", "pearl", "--prompts", "p", "--out", "o"]
    err = _cli_error(capsys, argv + (["--params", params] if params is not None else []))
    assert needle in err


def test_decode_params_on_a_method_without_them_is_usage(capsys, tmp_path):
    err = _cli_error(capsys, ["decode", "--model-dir", str(tmp_path / "none"), "--method", "ar", "--prompts", "p",
                              "--out", "o", "--params", "{}"])
    assert err.startswith("error: --params applies to the methods with parameters (") and "not to ar" in err


def test_decode_dtype_choices(capsys, tmp_path):
    err = _cli_error(capsys, ["decode", "--model-dir", str(tmp_path), "--method", "ar", "--prompts", "p",
                              "--out", "o", "--dtype", "float64"])
    assert "argument --dtype" in err


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_distributed_dex_refuses_non_finite_temperature(capsys, value):
    from impl.dex.distributed import main

    with pytest.raises(SystemExit) as e:
        main(["--model", "m", "--prompts", "p", "--out", "o", "--temperature", value])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "argument --temperature" in err and err.count("\n") == 0


def test_server_refuses_bad_port_and_threads(capsys):
    from impl.vskipper.server import main

    for argv in (["--port", "70000"], ["--threads", "0"]):
        with pytest.raises(SystemExit) as e:
            main(["--model", "m", *argv])
        assert e.value.code == 2
        err = capsys.readouterr().err.strip()
        assert f"argument {argv[0]}" in err and err.count("\n") == 0


# ------------------------------------------------------------------------------------------- YAML


def test_duplicated_yaml_key_is_an_error(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("seed: 1\nthreads: 1\nseed: 2\n")
    with pytest.raises(ConfigError) as e:
        read_yaml(f)
    msg = str(e.value)
    assert "\n" not in msg and f"{f}:3:1" in msg and "'seed'" in msg and "line 1" in msg


def test_duplicated_nested_key_is_an_error(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("training:\n  steps: 10\n  lr: 0.1\n  steps: 20\n")
    with pytest.raises(ConfigError, match=r"c\.yaml:4:3: .*'steps'"):
        load_config(f)


def test_yaml_syntax_error_names_line_and_column(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("seed: 1\ntraining: {steps: 10, lr: 0.1\nthreads: 1\n")
    with pytest.raises(ConfigError) as e:
        read_yaml(f)
    msg = str(e.value)
    assert "\n" not in msg and "not valid YAML" in msg
    assert any(f"{f}:{line}:" in msg for line in (2, 3, 4)), msg


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        read_yaml(tmp_path / "none.yaml")


@pytest.fixture()
def smoke_cfg(data_dir):
    import yaml
    from pathlib import Path

    c = yaml.safe_load((Path(__file__).resolve().parents[1] / "configs" / "smoke.yaml").read_text())
    c["data_dir"] = str(data_dir)
    return c


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_config_refuses_non_finite_numbers(smoke_cfg, value):
    smoke_cfg["training"]["lr"] = value
    with pytest.raises(ConfigError, match=r"'training\.lr'.*not a finite number"):
        validate_config(smoke_cfg, check_paths=False)
    smoke_cfg["training"]["lr"] = 1e-3
    smoke_cfg["dex"]["temperatures"] = [0.0, value]
    with pytest.raises(ConfigError, match=r"'dex\.temperatures\[1\]'"):
        validate_config(smoke_cfg, check_paths=False)


def test_training_seq_len_beyond_context(smoke_cfg):
    smoke_cfg["training"]["seq_len"] = smoke_cfg["tiny_arch"]["max_position_embeddings"] + 1
    with pytest.raises(ConfigError, match=r"'training\.seq_len' = \d+ exceeds 'tiny_arch\.max_position_embeddings'"):
        validate_config(smoke_cfg, check_paths=False)


def test_adapter_seq_len_beyond_context(smoke_cfg):
    smoke_cfg["dex"]["adapters"]["seq_len"] = smoke_cfg["tiny_arch"]["max_position_embeddings"] * 2
    with pytest.raises(ConfigError, match=r"'dex\.adapters\.seq_len'"):
        validate_config(smoke_cfg, check_paths=False)


def test_schema_errors_use_bracket_indices(smoke_cfg):
    smoke_cfg["ead"]["workloads"] = ["gsm8k", 3]
    with pytest.raises(ConfigError, match=r"'ead\.workloads\[1\]'"):
        validate_config(smoke_cfg, check_paths=False)


# ------------------------------------------------------------------------------------------- rows


def test_rows_are_strict_json(tmp_path):
    rows = [{"a": float("nan"), "b": [1.0, float("inf"), np.float32("nan")], "c": {"d": -math.inf}, "e": 0.5}]
    write_jsonl(tmp_path / "r.jsonl", rows)
    text = (tmp_path / "r.jsonl").read_text()
    assert "NaN" not in text and "Infinity" not in text

    def strict(x):
        raise ValueError(x)

    back = json.loads(text, parse_constant=strict)
    assert back == {"a": None, "b": [1.0, None, None], "c": {"d": None}, "e": 0.5}
    write_json(tmp_path / "r.json", {"x": np.float64("nan"), "y": np.arange(2)})
    assert json.loads((tmp_path / "r.json").read_text(), parse_constant=strict) == {"x": None, "y": [0, 1]}
    assert strict_json({"k": 1}) == '{"k": 1}'


def test_a_file_output_naming_a_directory_is_refused_and_the_directory_kept(capsys, tmp_path):
    """``--out`` naming an existing folder used to replace the folder (and all in it) with the rows file:
    the argument is refused before any work, and atomic_path, the last guard, keeps the folder too."""
    from impl.argtypes import output_file
    from impl.provenance import atomic_path

    folder = tmp_path / "results"
    folder.mkdir()
    (folder / "keep.txt").write_text("mine")
    err = _cli_error(capsys, ["decode", "--model-dir", str(tmp_path / "none"), "--method", "ar", "--prompts",
                              str(tmp_path / "p.jsonl"), "--out", str(folder)])
    assert "argument --out" in err and "is an existing directory" in err
    with pytest.raises(IsADirectoryError, match="refusing to replace it with a file"):
        write_json(folder, {"a": 1})
    with atomic_path(folder) as tmp:  # a directory output still replaces a directory whole (a rerun)
        tmp.mkdir()
        (tmp / "new.txt").write_text("2")
    assert [p.name for p in folder.iterdir()] == ["new.txt"]
    assert output_file(str(tmp_path / "missing" / "rows.jsonl")).endswith("rows.jsonl")


@pytest.mark.parametrize("have, prompts, needle", [
    (("base", "token", "prefix", "opd"), '{"id": "a", "input_ids": [1, 2]}\n', "no exit drafter"),
    ((), '{"id": "a", "input_ids": [1, 2]}\n', "no base, token, prefix, exit, opd drafter"),
    (("base", "token", "prefix", "exit", "opd"), "", "--prompts"),
])
def test_tev_cell_refuses_missing_drafters_and_empty_prompts_before_loading(capsys, tmp_path, data_dir, have,
                                                                            prompts, needle):
    """A drafters folder lacking one of the config's objectives used to drop that objective's arms silently
    (20 rows instead of 28, accepted by the rule), and an empty prompts file wrote a 0-row cell: both are
    one-line errors now, before the (missing) model is read, and no output is written."""
    from conftest import smoke_config

    (tmp_path / "cfg.json").write_text(json.dumps(smoke_config(data_dir=str(data_dir))))
    for k in have:
        (tmp_path / "drafters" / k).mkdir(parents=True)
    (tmp_path / "p.jsonl").write_text(prompts)
    err = _cli_error(capsys, ["tev-cell", "--config-json", f"@{tmp_path / 'cfg.json'}", "--model", "tiny-ls",
                              "--model-dir", str(tmp_path / "none"), "--drafters", str(tmp_path / "drafters"),
                              "--prompts", str(tmp_path / "p.jsonl"), "--out", str(tmp_path / "o.jsonl")])
    assert needle in err, err
    assert not (tmp_path / "o.jsonl").exists()
