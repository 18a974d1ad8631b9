"""The top of REPORT.md tallies every method section's PASS / FAIL verdict lines."""

from impl.report.markdown import _section_check_summary


def test_section_check_summary_counts_and_repeats_failures():
    lines = ["## DEX: depth", "", "- a: **PASS** (3)", "- b: **FAIL** (1/2)", "text **bold**",
             "## TEV", "- c: **PASS**", "## vSkipper", "nothing checked here"]
    out = _section_check_summary(lines)
    assert out[0] == "- DEX: depth: **1/2 PASS** (details in its section)"
    assert out[1] == "  - FAIL: b: **FAIL** (1/2)"
    assert out[2] == "- TEV: **1/1 PASS** (details in its section)"
    assert len(out) == 3  # a section without verdict lines is not listed
