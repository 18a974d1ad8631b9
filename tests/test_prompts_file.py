"""Prompt files are checked at the boundary: missing or repeated ids fail before decoding."""

import json
from pathlib import Path

import pytest

from impl.workloads import read_prompts

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "default.yaml"


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_read_prompts_accepts_tokenized_rows(tmp_path):
    p = _write(tmp_path / "p.jsonl", [{"id": "a", "input_ids": [1, 2]}, {"id": "b", "input_ids": [3]}])
    assert [r["id"] for r in read_prompts(p, require_input_ids=True)] == ["a", "b"]


@pytest.mark.parametrize("rows, needle", [
    ([{"input_ids": [1]}], "missing or non-string 'id'"),
    ([{"id": 3, "input_ids": [1]}], "missing or non-string 'id'"),
    ([{"id": "a"}, {"id": "a"}], "repeats row 1"),
    ([["not", "an", "object"]], "expected a JSON object"),
])
def test_read_prompts_names_file_and_row(tmp_path, rows, needle):
    p = _write(tmp_path / "bad.jsonl", rows)
    with pytest.raises(ValueError) as e:
        read_prompts(p)
    assert needle in str(e.value) and "bad.jsonl" in str(e.value)


def test_read_prompts_token_ids_checked_when_required(tmp_path):
    p = _write(tmp_path / "p.jsonl", [{"id": "a", "input_ids": [1, "x"]}])
    read_prompts(p)  # not required: passes
    with pytest.raises(ValueError, match="input_ids"):
        read_prompts(p, require_input_ids=True)


def test_ead_command_rejects_prompt_without_id(tmp_path, capsys, monkeypatch):
    from impl.cli import main

    from conftest import DATA_DIR

    monkeypatch.setenv("IMPL_DATA_DIR", str(DATA_DIR))  # the config's ../shared/data may not exist here

    p = _write(tmp_path / "p.jsonl", [{"input_ids": [1, 2, 3]}])
    with pytest.raises(SystemExit) as e:
        main(["ead", "--config", str(CONFIG), "--model-dir", str(tmp_path / "nomodel"), "--prompts", str(p), "--out", str(tmp_path / "o.jsonl"),
              "--model", "m"])
    assert e.value.code not in (0, None)
    assert "missing or non-string 'id'" in capsys.readouterr().err
    assert not (tmp_path / "o.jsonl").exists()
