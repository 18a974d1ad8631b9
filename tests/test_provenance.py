"""Atomic outputs and provenance stamps."""

import json

import pytest

from impl.provenance import atomic_path, config_hash, provenance, read_jsonl, write_jsonl


def test_atomic_write_leaves_nothing_on_failure(tmp_path):
    dest = tmp_path / "rows.jsonl"

    def rows():
        yield {"a": 1}
        raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError):
        write_jsonl(dest, rows())
    assert not dest.exists()
    assert list(tmp_path.iterdir()) == []


def test_atomic_directory_replaces_whole(tmp_path):
    dest = tmp_path / "model"
    with atomic_path(dest) as tmp:
        tmp.mkdir()
        (tmp / "w").write_text("1")
    with atomic_path(dest) as tmp:
        tmp.mkdir()
        (tmp / "v").write_text("2")
    assert sorted(p.name for p in dest.iterdir()) == ["v"]


def test_roundtrip_and_malformed(tmp_path):
    p = tmp_path / "x.jsonl"
    assert write_jsonl(p, [{"a": 1}, {"b": [1, 2]}]) == 2
    assert read_jsonl(p) == [{"a": 1}, {"b": [1, 2]}]
    p.write_text('{"a": 1}\n{oops\n')
    with pytest.raises(ValueError, match="x.jsonl:2"):
        read_jsonl(p)


def test_provenance_fields():
    prov = provenance({"a": 1}, seed=3)
    for k in ("run_id", "git_sha", "git_dirty", "config_hash", "seed", "device", "dtype", "torch_version",
              "transformers_version"):
        assert k in prov
    assert prov["config_hash"] == config_hash({"a": 1}) != config_hash({"a": 2})
    json.dumps(prov)


def test_git_state_is_fixed_at_the_process_start(monkeypatch):
    """A commit made while a long job runs does not relabel its rows: the first read is kept."""
    import impl.provenance as prov

    prov.process_git_state.cache_clear()
    try:
        monkeypatch.setattr(prov, "git_state", lambda: ("aaaa", False))
        assert prov.provenance({})["git_sha"] == "aaaa"
        monkeypatch.setattr(prov, "git_state", lambda: ("bbbb", True))
        row = prov.provenance({})
        assert (row["git_sha"], row["git_dirty"]) == ("aaaa", False)
    finally:
        prov.process_git_state.cache_clear()
