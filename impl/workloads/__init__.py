"""Frozen prompt suites for the benchmark: load, sample, render and tokenize prompts.

Source: DEX-harness issue 2, item 4 (workloads).
"""

from impl.workloads.suites import (
    DATA_DIR_HINT,
    DATA_FILES,
    DEFAULT_TEMPLATES,
    FIELDS,
    SUITES,
    build_text_suite,
    held_out_text_suite,
    check_data,
    load_records,
)
from impl.workloads.prompts import read_prompts
from impl.workloads.tokenize import OVERLONG_RULES, tokenize_suite

__all__ = [
    "DATA_DIR_HINT",
    "DATA_FILES",
    "DEFAULT_TEMPLATES",
    "FIELDS",
    "OVERLONG_RULES",
    "SUITES",
    "build_text_suite",
    "held_out_text_suite",
    "check_data",
    "load_records",
    "read_prompts",
    "tokenize_suite",
]
