"""Drafter training prompts: the prompt mixture the target is rolled out on (TEV App. D).

The paper trains its drafters online on target rollouts of open-perfectblend prompts (Xu et al., 2024), a
chat / math / code mixture. Offline, the data folder (``SOURCES.md``) offers two of its parts:

* ``sharegpt``: the first user turn of each ShareGPT conversation (chat, code questions among them), rendered
  ``"User: {turn}\\nAssistant:"`` for a model without a chat template and through the model's own template
  otherwise (``chat``), as the MT-Bench workload;
* ``gsm8k``: the questions of the GSM8K **train** split (the cells sample the test split, so no evaluated
  prompt is trained on), rendered exactly as the ``gsm8k`` workload renders its prompts (config keys
  ``workloads.gsm8k.template`` / ``chat``), so that the drafter sees the format it is evaluated on;
* ``math500``, ``humaneval``, ``mt_bench``: those suites have no train split, so a source is the suite's
  records **outside** its frozen sample (:func:`impl.workloads.suites.held_out_text_suite`: the seeded
  permutation's positions past ``workloads.<suite>.n_prompts``), rendered as the workload renders them
  (math: MATH-500's 500 problems less the evaluated 36; code: HumanEval's 164 less 36; chat: MT-Bench's
  80 less 36). No evaluated prompt is trained on while ``n_prompts`` does not grow.

:func:`drafter_prompt_texts` draws ``n`` prompts in the proportions of ``tev.drafter.prompt_mix`` (largest-
remainder apportionment) and interleaves the sources evenly, so every slice of the list (the held-out tail
of :func:`impl.tev.drafter.make_rollouts` included) holds each source in its share. A one-source mixture
keeps that source's file order, the rollouts of earlier runs.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Mapping

from impl.provenance import read_jsonl
from impl.workloads.suites import DEFAULT_TEMPLATES, held_out_text_suite
from impl.workloads.tokenize import tokenize_suite

__all__ = ["HELD_OUT_SOURCES", "PROMPT_SOURCES", "drafter_prompt_ids", "drafter_prompt_texts", "gsm8k_train_prompt_texts",
           "mix_counts", "sharegpt_prompt_ids", "sharegpt_prompt_texts"]

#: workload suites whose records outside the frozen sample are a prompt source (no train split)
HELD_OUT_SOURCES: tuple[str, ...] = ("math500", "humaneval", "mt_bench")
#: the prompt sources of ``tev.drafter.prompt_mix``
PROMPT_SOURCES: tuple[str, ...] = ("sharegpt", "gsm8k", *HELD_OUT_SOURCES)

#: the gsm8k workload's default rendering
GSM8K_TEMPLATE = DEFAULT_TEMPLATES["gsm8k"]


def sharegpt_prompt_texts(data_dir: str | Path, n: int | None = None, *, skip: int = 0,
                          max_chars: int | None = 2000) -> list[dict]:
    """User turns of the ShareGPT subset: ``text`` formatted ``"User: {turn}\\nAssistant:"`` (the
    ``User:/Assistant:`` format of :mod:`impl.models.corpus` and the MT-Bench template) for models
    without a chat template, and ``chat`` = the bare turn, which a model with a chat template (smollm2)
    gets through that template (:func:`impl.workloads.tokenize.tokenize_suite`, as the workloads' chat
    rows; TEV App. D rolls the target out on its own chat format).

    Args:
        data_dir: the data folder holding ``chat/sharegpt_v3_subset.jsonl``.
        n: at most this many prompts (None: all).
        skip: skip this many usable conversations first (e.g. to hold prompts out).
        max_chars: skip conversations whose first user turn is longer (None: keep all).

    Returns:
        ``[{"id", "suite": "sharegpt", "text", "chat"}]``: the first human turn of each conversation that
        has one, in file order.

    Raises:
        FileNotFoundError: the file is missing (names the path).
    """
    path = Path(data_dir) / "chat" / "sharegpt_v3_subset.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"ShareGPT subset not found: {path} (config key data_dir must point at the "
                                "folder listed in SOURCES.md)")
    out: list[dict] = []
    seen = 0
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            r = json.loads(line)
            turn = next((t["value"].strip() for t in r.get("conversations", []) if t.get("from") == "human"), "")
            if not turn or (max_chars is not None and len(turn) > max_chars):
                continue
            seen += 1
            if seen <= skip:
                continue
            out.append({"id": r.get("id", str(seen)), "suite": "sharegpt", "text": f"User: {turn}\nAssistant:",
                        "chat": turn})
            if n is not None and len(out) >= n:
                break
    return out


def gsm8k_train_prompt_texts(data_dir: str | Path, n: int | None = None, *, template: str = GSM8K_TEMPLATE,
                             chat: str | None = None) -> list[dict]:
    """Questions of the GSM8K train split, rendered as the ``gsm8k`` workload renders its (test) prompts.

    Args:
        data_dir: the data folder holding ``gsm8k/train.jsonl``.
        n: at most this many prompts, in file order (None: all 7473).
        template: ``str.format`` template over ``question`` (``workloads.gsm8k.template``).
        chat: optional user-message template over ``question`` (``workloads.gsm8k.chat``); the rows then carry
            ``chat``, which a model with a chat template gets through it.

    Returns:
        ``[{"id": "gsm8k-train-<line>", "suite": "gsm8k", "source_id", "text"(, "chat")}]``.

    Raises:
        FileNotFoundError: the file is missing (names the path).
        ValueError: a template names a field other than ``question`` (names the template).
    """
    path = Path(data_dir) / "gsm8k" / "train.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"GSM8K train split not found: {path} (config key data_dir must point at the "
                                "folder listed in SOURCES.md)")
    out: list[dict] = []
    for i, r in enumerate(read_jsonl(path)):
        if n is not None and len(out) >= n:
            break
        try:
            row = {"id": f"gsm8k-train-{i}", "suite": "gsm8k", "source_id": f"train-{i}",
                   "text": template.format(question=r["question"])}
            if chat is not None:
                row["chat"] = chat.format(question=r["question"])
        except (KeyError, IndexError) as e:
            raise ValueError(f"gsm8k prompt template {template!r} / chat {chat!r} names a field other than "
                             f"'question' ({e})") from None
        out.append(row)
    return out


def mix_counts(n: int, mix: Mapping[str, float]) -> dict[str, int]:
    """Prompts per source: ``n`` apportioned by the shares of ``mix`` (largest remainder; ties go to the
    source listed first).

    Args:
        n: total prompts, >= 0.
        mix: source -> positive share (need not sum to 1).

    Returns:
        source -> count, in ``mix``'s order, summing to ``n``.

    Raises:
        ValueError: an unknown source, a share <= 0, or an empty mix (names the source).
    """
    if not mix:
        raise ValueError("tev.drafter.prompt_mix is empty: name at least one of " + ", ".join(PROMPT_SOURCES))
    for s, w in mix.items():
        if s not in PROMPT_SOURCES:
            raise ValueError(f"tev.drafter.prompt_mix: unknown source {s!r}; choices: {', '.join(PROMPT_SOURCES)}")
        if not w > 0:
            raise ValueError(f"tev.drafter.prompt_mix.{s}: share must be > 0, got {w!r}")
    total = float(sum(mix.values()))
    exact = {s: n * w / total for s, w in mix.items()}
    counts = {s: math.floor(x) for s, x in exact.items()}
    order = sorted(mix, key=lambda s: -(exact[s] - counts[s]))  # stable: ties keep mix order
    for s in order[: n - sum(counts.values())]:
        counts[s] += 1
    return counts


def _interleave(groups: Mapping[str, list[dict]]) -> list[dict]:
    """One list with each group spread evenly: item i of a group of m sits at rank (i + 0.5) / m."""
    keyed = [((i + 0.5) / len(rows), k, i, row) for k, rows in enumerate(groups.values()) for i, row in enumerate(rows)]
    return [row for *_, row in sorted(keyed, key=lambda t: t[:3])]


def drafter_prompt_texts(data_dir: str | Path, n: int, mix: Mapping[str, float] | None = None, *,
                         workloads: Mapping[str, Mapping] | None = None, seed: int = 0) -> list[dict]:
    """The drafter's training prompts: ``n`` rows drawn from the sources of ``mix`` in its proportions,
    interleaved evenly (TEV App. D's open-perfectblend mixture, from the offline parts it has here).

    Args:
        data_dir: the data folder.
        n: prompts in all, >= 1.
        mix: source (``PROMPT_SOURCES``) -> share; None: ShareGPT alone.
        workloads: the config's ``workloads`` section: how the ``gsm8k`` source renders a question (its
            ``template`` / ``chat``), and for a :data:`HELD_OUT_SOURCES` source also its ``n_prompts`` (the
            evaluated sample it leaves out).
        seed: the run's seed (the workloads' sampling seed, so a held-out source excludes exactly the frozen
            sample).

    Returns:
        rows as :func:`sharegpt_prompt_texts` / :func:`gsm8k_train_prompt_texts` /
        :func:`impl.workloads.suites.held_out_text_suite` make them (``suite`` names the source); a
        one-source mix keeps that source's file order.

    Raises:
        ValueError: ``n < 1``, a bad mix (:func:`mix_counts`), a held-out source whose workload is not
            configured, a template naming a field its suite lacks, or a source with fewer usable prompts than
            its count (names the source and both numbers).
        FileNotFoundError: a source's file is missing.
    """
    if n < 1:
        raise ValueError(f"tev.drafter.prompts: need at least 1 prompt, got {n}")
    counts = mix_counts(n, mix or {"sharegpt": 1.0})
    workloads = workloads or {}
    groups: dict[str, list[dict]] = {}
    for s, k in counts.items():
        if k == 0:
            continue
        w = workloads.get(s) or {}
        if s == "sharegpt":
            rows = sharegpt_prompt_texts(data_dir, k)
        elif s == "gsm8k":
            rows = gsm8k_train_prompt_texts(data_dir, k, template=w.get("template") or DEFAULT_TEMPLATES[s],
                                            chat=w.get("chat"))
        else:
            if not w:
                raise ValueError(f"tev.drafter.prompt_mix.{s}: the source is {s}'s records outside its frozen sample, "
                                 f"so the config needs workloads.{s} (its n_prompts is the sample left out)")
            rows = held_out_text_suite(s, data_dir, int(w["n_prompts"]), seed,
                                       w.get("template") or DEFAULT_TEMPLATES[s], w.get("chat"), n=k)
        if len(rows) < k:
            raise ValueError(f"tev.drafter.prompt_mix.{s}: {k} prompts asked of that source, it has {len(rows)} "
                             "usable ones; lower tev.drafter.prompts or its share")
        groups[s] = rows
    return _interleave(groups)


def drafter_prompt_ids(tokenizer, data_dir: str | Path, n: int, mix: Mapping[str, float] | None = None, *,
                       max_prompt_tokens: int = 256, workloads: Mapping[str, Mapping] | None = None,
                       seed: int = 0) -> tuple[list[list[int]], list[str]]:
    """Token ids of :func:`drafter_prompt_texts`, tokenized like the workloads
    (:func:`impl.workloads.tokenize.tokenize_suite`: BOS if any, overlong prompts truncated from the left to
    ``max_prompt_tokens``; through the tokenizer's chat template for rows with ``chat`` when it has one).

    Returns:
        ``(ids, sources)``: one int list per kept prompt and the source of each (same order).
    """
    rows = drafter_prompt_texts(data_dir, n, mix, workloads=workloads, seed=seed)
    out, _ = tokenize_suite(rows, tokenizer, max_prompt_tokens)
    return [r["input_ids"] for r in out], [r["suite"] for r in out]


def sharegpt_prompt_ids(tokenizer, data_dir: str | Path, n: int | None = None, *, skip: int = 0,
                        max_prompt_tokens: int = 256) -> list[list[int]]:
    """Token ids of :func:`sharegpt_prompt_texts`, tokenized as :func:`drafter_prompt_ids` tokenizes."""
    rows = sharegpt_prompt_texts(data_dir, n, skip=skip)
    out, _ = tokenize_suite(rows, tokenizer, max_prompt_tokens)
    return [r["input_ids"] for r in out]
