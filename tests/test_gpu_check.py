"""The GPU check script's CPU mode (--small): the same code path the device runs, on tiny shapes, so
that the script cannot rot (issue: the GPU path, checked)."""

import json

import pytest

from impl.gpu_check import SECTIONS, main


@pytest.mark.slow
def test_small_mode_runs_every_section_and_exactness_holds(tmp_path):
    import torch

    torch.set_num_threads(1)
    rc = main(["--small", "--device", "cpu", "--out", str(tmp_path)])
    rows = [json.loads(x) for x in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert rc == 0, [r for r in rows if "error" in r or r.get("passed") is False]
    assert {r["section"] for r in rows} == set(SECTIONS) and not any("error" in r for r in rows)
    ex = [r for r in rows if r["section"] == "exactness"]
    assert {r["tier"] for r in ex} == {1, 2, 3}
    f32 = [r for r in ex if r["dtype"] == "float32"]
    assert all(r["passed"] is True for r in f32)  # float32: exact, incl. the wrong verifier failing tier 2
    assert any(r["check"] == "distribution/wrong_argmax" for r in f32)
    checks = {r["check"] for r in ex if r["tier"] == 3}
    assert {"ar_equality/dex_K2", "ar_equality/self_spec", "ar_equality/adadecode", "ar_equality/dynamic_exit",
            "ar_equality/tev_tree/tev"} <= checks
    bf = [r for r in ex if r["dtype"] == "bfloat16"]
    assert bf and all(r["passed"] is None and 0 <= r["agreement_rate"] <= 1 for r in bf)  # agreement, not pass/fail
    vb = [r for r in rows if r["section"] == "vskipper_bench"]
    assert {r["arm"] for r in vb} >= {"upstream", "all_run", "random_r0.5_d0.5"}
    assert all(r["torch_version"] and r["weights"].startswith("random") for r in vb)
    tl = [r for r in rows if r["section"] == "tev_latency"]
    assert {r["verifier"] for r in tl} == {"predraw_follow", "predraw_ddtree_multinomial", "sequential_residual", "tev"}
    dx = [r for r in rows if r["section"] == "dex_critical_path"]
    assert dx and all(r["ar_match"] and r["projected_speedup"] > 0 for r in dx)
    summary = (tmp_path / "summary.md").read_text()
    assert "Exactness (float32, exact):" in summary and "bfloat16 (agreement rate" in summary


def test_a_failing_section_is_a_row_with_its_error(tmp_path, monkeypatch):
    import impl.gpu_check as gc

    def boom(device, small):
        raise RuntimeError("kernel not available in this torch")

    monkeypatch.setitem(gc.SECTIONS, "tev_latency", boom)
    rc = main(["--small", "--device", "cpu", "--out", str(tmp_path), "--sections", "tev_latency"])
    rows = [json.loads(x) for x in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert rc == 1 and rows[0]["section"] == "tev_latency" and "RuntimeError: kernel not available" in rows[0]["error"]
    assert "kernel not available" in (tmp_path / "summary.md").read_text()


def test_bad_arguments(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path), "--threads", "0", "--device", "cpu"])
    assert "--threads must be >= 1" in capsys.readouterr().err
