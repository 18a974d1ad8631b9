"""Answer extraction and per-document scoring for the quality evaluation (vSkipper Sec. 4.1 "Quality",
App. E.2).

- GSM8K: lm-eval's two answer filters, strict-match (``#### <number>``) and flexible-extract (the last
  number), and the paper's *composite*: strict-match when it parses, otherwise flexible-extract
  (App. E.2: "The composite applies one rule to every arm"). Both component filters are lm-eval's own
  :class:`lm_eval.filters.extraction.RegexFilter` with the patterns of lm-eval's ``gsm8k`` task.
  :func:`gsm8k_composite_filter` is the function the generated task YAML plugs into lm-eval's
  ``custom`` filter, so lm-eval itself applies the composite and scores it with its ``exact_match``.
- CoQA: the official CoQA / SQuAD answer normalisation and token F1 (transformers 5 dropped
  ``transformers.data.metrics.squad_metrics``, which lm-eval's ``coqa`` task imports, so the same
  functions live here), with lm-eval's / the official evaluator's leave-one-out maximum over the
  reference answers (:func:`coqa_scores`).
- BBH: lm-eval's ``bbh_cot_fewshot`` extraction (the text after "the answer is", without the final
  character) and exact match (:func:`bbh_extract`).
"""

from __future__ import annotations

import collections
import re
import string
from typing import Any, Sequence

__all__ = [
    "GSM8K_STRICT_PATTERN",
    "GSM8K_FLEXIBLE_PATTERN",
    "GSM8K_FALLBACK",
    "BBH_ANSWER_PATTERN",
    "gsm8k_strict",
    "gsm8k_flexible",
    "gsm8k_composite",
    "gsm8k_composite_filter",
    "bbh_extract",
    "normalize_answer",
    "answer_f1",
    "answer_exact",
    "coqa_scores",
]

#: lm-eval ``gsm8k`` task, filter "strict-match" (regex, then take_first).
GSM8K_STRICT_PATTERN = r"#### (\-?[0-9\.\,]+)"
#: lm-eval ``gsm8k`` task, filter "flexible-extract" (regex with group_select=-1, then take_first).
GSM8K_FLEXIBLE_PATTERN = r"(-?[$0-9.,]{2,})|(-?[0-9]+)"
#: what lm-eval's RegexFilter returns when the pattern does not match.
GSM8K_FALLBACK = "[invalid]"
#: lm-eval ``bbh_cot_fewshot`` filter "get-answer".
BBH_ANSWER_PATTERN = r"(?<=the answer is )(.*)(?=.)"


def _regex_filter(pattern: str, group_select: int = 0):
    from lm_eval.filters.extraction import RegexFilter

    return RegexFilter(regex_pattern=pattern, group_select=group_select, fallback=GSM8K_FALLBACK)


_FILTERS: dict[str, Any] = {}


def _apply(name: str, pattern: str, group_select: int, response: str) -> str:
    f = _FILTERS.get(name)
    if f is None:
        f = _FILTERS[name] = _regex_filter(pattern, group_select)
    return list(f.apply([[response]], [None]))[0][0]


def gsm8k_strict(response: str) -> str:
    """lm-eval's GSM8K strict-match extraction of one response: the number after the first
    ``#### `` marker, or ``"[invalid]"`` when there is none."""
    return _apply("strict", GSM8K_STRICT_PATTERN, 0, response)


def gsm8k_flexible(response: str) -> str:
    """lm-eval's GSM8K flexible-extract extraction of one response: the last number-like match, or
    ``"[invalid]"`` when the response has no digit."""
    return _apply("flexible", GSM8K_FLEXIBLE_PATTERN, -1, response)


def gsm8k_composite(response: str) -> tuple[str, str]:
    """The paper's composite GSM8K extraction (App. E.2): strict-match when it parses, otherwise
    flexible-extract.

    Returns:
        ``(answer, source)`` with ``source`` one of ``"strict"``, ``"flexible"`` or ``"invalid"``
        (neither filter parses; ``answer`` is then ``"[invalid]"``).
    """
    strict = gsm8k_strict(response)
    if strict != GSM8K_FALLBACK:
        return strict, "strict"
    flexible = gsm8k_flexible(response)
    if flexible != GSM8K_FALLBACK:
        return flexible, "flexible"
    return GSM8K_FALLBACK, "invalid"


def gsm8k_composite_filter(resps: Sequence[Sequence[str]], docs: Sequence[Any]) -> list[list[str]]:
    """lm-eval ``custom`` filter function (``filter_fn``) applying :func:`gsm8k_composite` to every
    response of every document; followed by ``take_first`` in the generated task YAML."""
    return [[gsm8k_composite(r if isinstance(r, str) else "")[0] for r in inst] for inst in resps]


def bbh_extract(response: str) -> str:
    """lm-eval's BBH CoT answer extraction ("get-answer"): the text after the first
    ``"the answer is "`` up to, not including, the last character of that line (the final period),
    or ``"[invalid]"``."""
    return _apply("bbh", BBH_ANSWER_PATTERN, 0, response)


# -- CoQA F1 (the official CoQA evaluator's / SQuAD v2 normalisation) --------------------------------
_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)
_PUNCT = set(string.punctuation)


def normalize_answer(s: str) -> str:
    """Lower-case, drop punctuation and the articles a/an/the, collapse whitespace (SQuAD / CoQA)."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _PUNCT)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def _tokens(s: str) -> list[str]:
    return normalize_answer(s).split() if s else []


def answer_exact(gold: str, pred: str) -> float:
    """1.0 when the normalised answers are equal, else 0.0."""
    return float(normalize_answer(gold) == normalize_answer(pred))


def answer_f1(gold: str, pred: str) -> float:
    """Token-overlap F1 of the normalised answers (SQuAD ``compute_f1``): when either side has no
    tokens, 1.0 if both are empty else 0.0."""
    g, p = _tokens(gold), _tokens(pred)
    if not g or not p:
        return float(g == p)
    common = collections.Counter(g) & collections.Counter(p)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(p), same / len(g)
    return 2 * precision * recall / (precision + recall)


def coqa_scores(gold_list: Sequence[str], pred: str) -> dict[str, float]:
    """CoQA EM and F1 of one prediction against its references, as lm-eval's ``coqa`` task and the
    official evaluator compute them: with n > 1 references, the mean over i of the maximum over the
    other n - 1 references (leave one out); with one reference, the score against it.

    Returns:
        ``{"em": float, "f1": float}`` in [0, 1].

    Raises:
        ValueError: for an empty reference list.
    """
    golds = list(gold_list)
    if not golds:
        raise ValueError("coqa_scores needs at least one reference answer")
    if len(golds) == 1:
        return {"em": answer_exact(golds[0], pred), "f1": answer_f1(golds[0], pred)}
    em = f1 = 0.0
    for i in range(len(golds)):
        others = golds[:i] + golds[i + 1:]
        em += max(answer_exact(g, pred) for g in others)
        f1 += max(answer_f1(g, pred) for g in others)
    return {"em": em / len(golds), "f1": f1 / len(golds)}
