"""Quality evaluation as a library: lm-eval tasks on local data, answer scoring, per-document scores, the
identical-prompt gate and the 2x2 difference-in-differences (the vSkipper paper's quality protocol,
Sec. 4.1 "Quality", Table 5; its arms and runs live in :mod:`impl.vskipper`: ``quality_arms``,
``quality_run``, ``quality_served``). Imports no paper package.

- :mod:`.tasks`: lm-eval task YAMLs generated over the local data folder (GSM8K 5-shot, BBH CoT, CoQA);
- :mod:`.scoring`: the GSM8K composite filter (strict-match when it parses, else flexible-extract),
  BBH answer extraction, CoQA F1;
- :mod:`.did`: per-document scores, the identical-prompt gate, the paired DiD and first-token agreement;

:mod:`.tasks`, :mod:`.scoring` (except the GSM8K filters, which use lm-eval's RegexFilter, ``lm-eval[hf,api]==0.4.13``)
and :mod:`.did` work without lm-eval.
"""

from .scoring import (
    bbh_extract,
    coqa_scores,
    answer_f1,
    gsm8k_composite,
    gsm8k_composite_filter,
    gsm8k_flexible,
    gsm8k_strict,
    normalize_answer,
)
from .tasks import PRIMARY_METRIC, QUALITY_SUITES, TaskOptions, TaskSet, write_task_yamls
from .did import PromptMismatchError, check_prompt_hashes, first_token_agreement, per_doc_scores, quality_did, summarize

__all__ = [
    "bbh_extract",
    "coqa_scores",
    "answer_f1",
    "gsm8k_composite",
    "gsm8k_composite_filter",
    "gsm8k_flexible",
    "gsm8k_strict",
    "normalize_answer",
    "PRIMARY_METRIC",
    "QUALITY_SUITES",
    "TaskOptions",
    "TaskSet",
    "write_task_yamls",
    "PromptMismatchError",
    "check_prompt_hashes",
    "first_token_agreement",
    "per_doc_scores",
    "quality_did",
    "summarize",
]
