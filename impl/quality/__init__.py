"""Quality evaluation of vSkipper: lm-eval tasks on local data, the four arms, the 2x2 DiD and the served
hybrid at the knee (vSkipper Sec. 4.1 "Quality", Sec. 4.3, Table 5 left and right, App. E.1-E.3).

- :mod:`.tasks`: lm-eval task YAMLs generated over the local data folder (GSM8K 5-shot, BBH CoT, CoQA);
- :mod:`.scoring`: the GSM8K composite filter (strict-match when it parses, else flexible-extract),
  BBH answer extraction, CoQA F1;
- :mod:`.arms`: the arms as lm-eval LMs (A: lm-eval's HF backend; B: plain PyTorch with routed layers;
  C / D: the vSkipper HTTP server in process, upstream / always-route, driven by lm-eval's
  ``local-completions`` client with token ids - or in process on the same engine), each recording
  per-document prompt token ids and their hash;
- :mod:`.did`: per-document scores, the identical-prompt gate, the paired DiD and first-token agreement;
- :mod:`.run`: :func:`run_quality`, tying the 2x2 together;
- :mod:`.served`: :func:`~impl.quality.served.run_served_knee`, Table 5 (right): the documents' requests
  as a seeded Poisson stream at the knee to the hybrid and always-route servers, scored by lm-eval.

lm-eval (``lm-eval[hf,api]==0.4.13``) is imported by :mod:`.arms` and :mod:`.run`; :mod:`.tasks`,
:mod:`.scoring` (except the GSM8K filters, which use lm-eval's RegexFilter) and :mod:`.did` work without it.
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
    "run_quality",
    "QualityResult",
    "run_served_knee",
    "ServedKneeResult",
]


def __getattr__(name):
    # run_quality pulls in lm-eval, torch and transformers: import it lazily
    if name in ("run_quality", "QualityResult"):
        from . import run

        return getattr(run, name)
    if name in ("run_served_knee", "ServedKneeResult"):
        from . import served

        return getattr(served, name)
    raise AttributeError(name)
