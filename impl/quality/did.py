"""Per-document scores, the identical-prompt gate and the 2x2 difference-in-differences
(vSkipper Sec. 4.1 "Quality", Table 5 left; App. E.1-E.2).

- :func:`per_doc_scores` turns one arm's lm-eval samples into one score record per document, every
  (metric, filter) lm-eval scored kept (``"exact_match,composite"``, ``"exact_match,strict-match"``,
  ``"f1,none"`` ...);
- :func:`check_prompt_hashes` is the gate: every arm must have fed the same token ids for every
  document (same set of documents, same :func:`~impl.vskipper.quality_arms.prompt_hash`), else
  :class:`PromptMismatchError`;
- :func:`quality_did` / :func:`summarize` give the per-document paired DiD ``(D - C) - (B - A)`` with its
  95 % interval (:func:`impl.stats.difference_in_differences`) in percentage points, the checkpoint's
  own cost ``B - A`` and the serving effect ``D - C`` (:func:`impl.stats.paired_difference`).
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping, Sequence

from impl.stats import PairedResult, difference_in_differences, paired_difference

__all__ = [
    "PromptMismatchError",
    "per_doc_scores",
    "check_prompt_hashes",
    "quality_did",
    "summarize",
    "first_token_agreement",
]

ARM_ORDER = ("A", "B", "C", "D")


class PromptMismatchError(ValueError):
    """The arms did not feed identical token ids for the same documents (App. E.1)."""


def _num(x) -> float | None:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def per_doc_scores(samples: Mapping[str, Sequence[Mapping[str, Any]]], arm: str) -> dict[tuple[str, int], dict]:
    """Per-document scores of one arm from lm-eval's logged samples (``results["samples"]``).

    Args:
        samples: ``task -> [sample, ...]`` as ``lm_eval.simple_evaluate(..., log_samples=True)`` returns
            them (one sample per document and filter; each names its ``filter``, its ``metrics`` and
            holds their values).
        arm: the arm label stored in the records.

    Returns:
        ``(task, doc_id) -> {"arm", "task", "doc_id", "scores": {"metric,filter": float}, "filtered":
        {filter: str}, "target": str}``.

    Raises:
        ValueError: when a sample has no ``doc_id`` or a metric value is not a finite number.
    """
    out: dict[tuple[str, int], dict] = {}
    for task, rows in samples.items():
        for s in rows:
            if "doc_id" not in s:
                raise ValueError(f"task {task}: an lm-eval sample has no doc_id")
            key = (str(task), int(s["doc_id"]))
            rec = out.setdefault(key, {"arm": arm, "task": key[0], "doc_id": key[1], "scores": {}, "filtered": {},
                                       "target": s.get("target")})
            filt = str(s.get("filter", "none"))
            for m in s.get("metrics", []):
                v = _num(s.get(m))
                if v is None:
                    raise ValueError(f"task {task} doc {key[1]}: metric {m!r} is not a finite number: {s.get(m)!r}")
                rec["scores"][f"{m},{filt}"] = v
            fr = s.get("filtered_resps")
            if isinstance(fr, (list, tuple)) and len(fr) == 1:
                fr = fr[0]
            rec["filtered"][filt] = fr if isinstance(fr, str) else repr(fr)
    return out


def check_prompt_hashes(records: Mapping[str, Mapping[tuple[str, int], Any]]) -> int:
    """Refuse arms that did not see identical token ids (App. E.1 "All four quality arms receive
    identical token ids").

    Args:
        records: ``arm -> {(task, doc_id): record}``; a record has ``prompt_hash`` (a
            :class:`~impl.vskipper.quality_arms.GenRecord` or a dict).

    Returns:
        the number of documents checked.

    Raises:
        PromptMismatchError: when the arms cover different documents or a document's hash differs
            between arms (the message names the task, the document, and each arm's hash and length).
    """
    if not records:
        raise PromptMismatchError("no arms to compare")
    arms = list(records)

    def h(r):
        return r["prompt_hash"] if isinstance(r, Mapping) else r.prompt_hash

    def n(r):
        if isinstance(r, Mapping):
            return r.get("n_prompt_tokens", len(r.get("prompt_ids", ())))
        return len(r.prompt_ids)

    ref = arms[0]
    keys = set(records[ref])
    for a in arms[1:]:
        other = set(records[a])
        if other != keys:
            missing = sorted(keys - other)[:5]
            extra = sorted(other - keys)[:5]
            raise PromptMismatchError(
                f"arms {ref} and {a} scored different documents: only in {ref}: {missing}, only in {a}: {extra}"
            )
    bad = []
    for key in sorted(keys):
        hashes = {a: h(records[a][key]) for a in arms}
        if len(set(hashes.values())) > 1:
            bad.append((key, {a: (hashes[a], n(records[a][key])) for a in arms}))
    if bad:
        (task, doc), detail = bad[0]
        desc = ", ".join(f"{a}={hh} ({ln} tokens)" for a, (hh, ln) in detail.items())
        raise PromptMismatchError(
            f"prompt token ids differ between arms on {len(bad)} document(s); first: task {task} doc {doc}: {desc}. "
            "All arms must feed identical token ids (same tokenizer, BOS rule and truncation)."
        )
    return len(keys)


def quality_did(a: Sequence[float], b: Sequence[float], c: Sequence[float], d: Sequence[float],
                scale: float = 100.0, confidence: float = 0.95) -> PairedResult:
    """Per-document paired DiD ``(D - C) - (B - A)`` of scores in [0, 1], reported in percentage points
    (``scale=100``): :func:`impl.stats.difference_in_differences` on the scaled scores."""
    s = float(scale)
    return difference_in_differences([x * s for x in a], [x * s for x in b], [x * s for x in c],
                                     [x * s for x in d], confidence)


def _pr(prefix: str, r: PairedResult) -> dict[str, Any]:
    return {f"{prefix}_{k}": v for k, v in r.to_dict().items() if k not in ("confidence",)}


def summarize(
    doc_scores: Mapping[str, Mapping[tuple[str, int], Mapping[str, Any]]],
    gen_records: Mapping[str, Mapping[tuple[str, int], Any]] | None,
    keys: Iterable[tuple[str, int]],
    metric: str,
    *,
    suite: str,
    scale: float = 100.0,
    confidence: float = 0.95,
) -> dict[str, Any]:
    """One summary row of the 2x2 for ``metric`` (e.g. ``"exact_match,composite"``) over the documents
    ``keys`` (paired by document across the four arms).

    Returns:
        a dict with ``suite``, ``metric``, ``n``, the arms' mean scores in percentage points
        (``mean_A`` ...), ``B_minus_A_*`` and ``D_minus_C_*`` (paired differences), ``did_*`` (the DiD:
        mean, sd, se, ci_low, ci_high, t_stat, p_value, resolved) and, with ``gen_records``, how many
        documents have identical generated ids between arms (``tokens_equal_AB`` / ``_AC`` / ``_BD`` /
        ``_all``).

    Raises:
        KeyError: when an arm lacks a document or the metric.
        ValueError: for no documents.
    """
    keys = sorted(keys)
    if not keys:
        raise ValueError(f"suite {suite}: no documents to summarise")
    vals = {a: [float(doc_scores[a][k]["scores"][metric]) for k in keys] for a in ARM_ORDER}
    row: dict[str, Any] = {"suite": suite, "metric": metric, "n": len(keys), "scale": scale,
                           "confidence": confidence}
    for a in ARM_ORDER:
        row[f"mean_{a}"] = scale * sum(vals[a]) / len(keys)
    row.update(_pr("B_minus_A", paired_difference([scale * x for x in vals["A"]], [scale * x for x in vals["B"]],
                                                  confidence)))
    row.update(_pr("D_minus_C", paired_difference([scale * x for x in vals["C"]], [scale * x for x in vals["D"]],
                                                  confidence)))
    row.update(_pr("did", quality_did(vals["A"], vals["B"], vals["C"], vals["D"], scale, confidence)))
    if gen_records is not None:
        def g(a, k):
            r = gen_records[a][k]
            return list(r["gen_ids"] if isinstance(r, Mapping) else r.gen_ids)

        row["tokens_equal_AB"] = sum(g("A", k) == g("B", k) for k in keys)
        row["tokens_equal_AC"] = sum(g("A", k) == g("C", k) for k in keys)
        row["tokens_equal_BD"] = sum(g("B", k) == g("D", k) for k in keys)
        row["tokens_equal_all"] = sum(g("A", k) == g("B", k) == g("C", k) == g("D", k) for k in keys)
    return row


def first_token_agreement(logprobs: Mapping[str, Any], *, k: int = 5, tol: float = 0.01,
                          pairs: Sequence[tuple[str, str]] = (("B", "A"), ("C", "A"), ("D", "A"), ("D", "B"))
                          ) -> list[dict[str, Any]]:
    """Top-k first-token agreement of one prompt between arms (App. E.1, Table 9).

    For each ``(arm, reference)`` pair: the reference's top-``k`` tokens, their log-probabilities under
    both arms, the largest absolute difference, whether the argmax agrees, and ``agree`` = argmax equal
    and every top-k log-probability within ``tol`` nats. (The paper compares each served arm with its
    own in-process reference, C with A and D with B; C/D/B against A are included for the 2x2.)

    Args:
        logprobs: ``arm -> [V]`` float log-probabilities (torch tensor or sequence) of the first token.
        k: how many top tokens.
        tol: tolerance in nats.
        pairs: ``(arm, reference)`` pairs; pairs naming an absent arm are skipped.

    Returns:
        one dict per pair.
    """
    import torch

    lp = {a: torch.as_tensor(v, dtype=torch.float32) for a, v in logprobs.items()}
    rows = []
    for arm, ref in pairs:
        if arm not in lp or ref not in lp:
            continue
        top = torch.topk(lp[ref], k)
        ids = top.indices.tolist()
        ref_vals = [float(x) for x in top.values]
        arm_vals = [float(lp[arm][i]) for i in ids]
        arm_top = torch.topk(lp[arm], k).indices.tolist()
        diff = max(abs(x - y) for x, y in zip(ref_vals, arm_vals))
        argmax_equal = int(lp[arm].argmax()) == ids[0]
        rows.append({
            "arm": arm, "reference": ref, "k": k, "tol": tol, "top_ids": ids, "ref_logprobs": ref_vals,
            "arm_logprobs": arm_vals, "arm_top_ids": arm_top, "max_abs_diff": diff,
            "argmax_equal": argmax_equal, "top_ids_equal": arm_top == ids,
            "agree": bool(argmax_equal and diff <= tol),
        })
    return rows
