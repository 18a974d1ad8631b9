"""Frozen prompt suites: load the offline datasets and render seeded prompt samples.

The datasets live in a data folder (config key ``data_dir``; canonical read-only copies in
``../shared/data``) whose files, schemas and quirks are described in its ``SOURCES.md``.

Source: DEX-harness issue 2, item 4 (workloads).
"""

from __future__ import annotations

import json
import random
import re
import string
from pathlib import Path
from typing import Any

from impl.provenance import read_jsonl

SUITES: tuple[str, ...] = ("gsm8k", "humaneval", "xsum", "mt_bench", "math500", "bbh", "coqa")

DATA_FILES: dict[str, list[str]] = {
    "gsm8k": ["gsm8k/test.jsonl"],
    "humaneval": ["humaneval/HumanEval.jsonl"],
    "xsum": ["xsum/test_1000.jsonl"],
    "mt_bench": ["mt_bench/question.jsonl"],
    "math500": ["math500/test.jsonl"],
    "bbh": ["bbh/tasks", "bbh/cot-prompts"],
    "coqa": ["coqa/coqa_test_bigbench.json"],
}

FIELDS: dict[str, tuple[str, ...]] = {
    "gsm8k": ("question", "answer"),
    "humaneval": ("prompt", "entry_point"),
    "xsum": ("document", "summary"),
    "mt_bench": ("turn1", "turn2", "category"),
    "math500": ("problem", "answer", "subject"),
    "bbh": ("input", "target", "task", "cot_prompt"),
    "coqa": ("story", "question", "history", "answer"),
}

DEFAULT_TEMPLATES: dict[str, str] = {
    "gsm8k": "Question: {question}\nAnswer:",
    "humaneval": "{prompt}",
    "xsum": "Document: {document}\nSummary:",
    "mt_bench": "User: {turn1}\nAssistant:",
    "math500": "Problem: {problem}\nSolution:",
    "bbh": "{cot_prompt}\n\nQ: {input}\nA: Let's think step by step.",
    "coqa": "{story}\n\n{history}Q: {question}\nA:",
}

_CALC_RE = re.compile(r"<<[^<>]*>>")


def _check_suite(suite: str) -> None:
    if suite not in SUITES:
        raise ValueError(f"unknown suite {suite!r}; choices: {', '.join(SUITES)}")


#: where the datasets are, for error messages: the config default is relative to the working directory
#: (a checkout beside the datasets), so a clone elsewhere sets IMPL_DATA_DIR (``source scripts/data_dir.sh``)
DATA_DIR_HINT = ("the folder holding the files listed in SOURCES.md: ../shared/data beside the checkout, or set "
                 "IMPL_DATA_DIR (source scripts/data_dir.sh falls back to /work/shared/data, this workplace's copies)")


def check_data(suite: str, data_dir: str | Path) -> None:
    """Check that every file (or folder) ``suite`` needs exists under ``data_dir``.

    Args:
        suite (str): one of ``SUITES``.
        data_dir (str | os.PathLike): the data folder (config key ``data_dir``).

    Raises:
        ValueError: ``suite`` is not one of ``SUITES``.
        FileNotFoundError: a needed path is missing; the one-line message names the path, the
            config key ``data_dir``, and how to fix it.

    Source: DEX-harness issue 2, item 4 (workloads).
    """
    _check_suite(suite)
    root = Path(data_dir)
    for rel in DATA_FILES[suite]:
        p = root / rel
        if not p.exists():
            raise FileNotFoundError(
                f"suite {suite!r}: missing {p} (config key data_dir={str(data_dir)!r}); point "
                f"data_dir at {DATA_DIR_HINT}"
            )


def _str_fields(d: dict[str, Any]) -> dict[str, str]:
    return {k: ("" if v is None else str(v)) for k, v in d.items()}


def _load_gsm8k(root: Path) -> list[dict]:
    out = []
    for i, r in enumerate(read_jsonl(root / "gsm8k/test.jsonl")):
        answer = _CALC_RE.sub("", r["answer"])
        out.append({"source_id": f"test-{i}", "fields": {"question": r["question"], "answer": answer}})
    return out


def _load_humaneval(root: Path) -> list[dict]:
    return [
        {"source_id": r["task_id"], "fields": {"prompt": r["prompt"], "entry_point": r["entry_point"]}}
        for r in read_jsonl(root / "humaneval/HumanEval.jsonl")
    ]


def _load_xsum(root: Path) -> list[dict]:
    return [
        {"source_id": str(r["id"]), "fields": {"document": r["document"], "summary": r["summary"]}}
        for r in read_jsonl(root / "xsum/test_1000.jsonl")
    ]


def _load_mt_bench(root: Path) -> list[dict]:
    out = []
    for r in read_jsonl(root / "mt_bench/question.jsonl"):
        turns = list(r["turns"]) + ["", ""]
        out.append(
            {
                "source_id": str(r["question_id"]),
                "fields": {"turn1": turns[0], "turn2": turns[1], "category": r["category"]},
            }
        )
    return out


def _load_math500(root: Path) -> list[dict]:
    return [
        {
            "source_id": r["unique_id"],
            "fields": {"problem": r["problem"], "answer": r["answer"], "subject": r["subject"]},
        }
        for r in read_jsonl(root / "math500/test.jsonl")
    ]


def _cot_prompt(path: Path) -> str:
    text = path.read_text(encoding="utf-8")
    lines = text.split("\n")
    for i, line in enumerate(lines):
        if line.strip() == "-----":
            return "\n".join(lines[i + 1 :]).strip()
    return text.strip()


def _load_bbh(root: Path) -> list[dict]:
    out = []
    for task_path in sorted((root / "bbh/tasks").glob("*.json")):
        task = task_path.stem
        cot_path = root / "bbh/cot-prompts" / f"{task}.txt"
        if not cot_path.is_file():
            raise FileNotFoundError(
                f"suite 'bbh': missing {cot_path} (config key data_dir={str(root)!r}); point "
                f"data_dir at {DATA_DIR_HINT}"
            )
        cot = _cot_prompt(cot_path)
        examples = json.loads(task_path.read_text(encoding="utf-8"))["examples"]
        for i, ex in enumerate(examples):
            out.append(
                {
                    "source_id": f"{task}/{i}",
                    "fields": {"input": ex["input"], "target": str(ex["target"]), "task": task,
                               "cot_prompt": cot},
                }
            )
    return out


def _load_coqa(root: Path) -> list[dict]:
    data = json.loads((root / "coqa/coqa_test_bigbench.json").read_text(encoding="utf-8"))["data"]
    out = []
    for story in data:
        answers = {a["turn_id"]: a["input_text"] for a in story["answers"]}
        history = ""
        for q in story["questions"]:
            tid = q["turn_id"]
            answer = answers.get(tid, "")
            out.append(
                {
                    "source_id": f"{story['id']}/{tid}",
                    "fields": {"story": story["story"], "question": q["input_text"],
                               "history": history, "answer": answer},
                }
            )
            history += f"Q: {q['input_text']}\nA: {answer}\n"
    return out


_LOADERS = {
    "gsm8k": _load_gsm8k,
    "humaneval": _load_humaneval,
    "xsum": _load_xsum,
    "mt_bench": _load_mt_bench,
    "math500": _load_math500,
    "bbh": _load_bbh,
    "coqa": _load_coqa,
}


def load_records(suite: str, data_dir: str | Path) -> list[dict]:
    """Load every record of ``suite`` in file order.

    Args:
        suite (str): one of ``SUITES``.
        data_dir (str | os.PathLike): the data folder (config key ``data_dir``).

    Returns:
        list of ``{"source_id": str, "fields": dict[str, str]}``; the field names per suite are
        ``FIELDS[suite]`` (gsm8k answers have their ``<<...>>`` calculator annotations removed;
        bbh is ordered by task name, then example index; coqa has one record per question).

    Raises:
        ValueError: unknown suite, or a malformed JSONL line.
        FileNotFoundError: a needed file is missing (see ``check_data``).

    Source: DEX-harness issue 2, item 4 (workloads).
    """
    check_data(suite, data_dir)
    records = _LOADERS[suite](Path(data_dir))
    for r in records:
        r["fields"] = _str_fields(r["fields"])
    return records


def _template_fields(template: str) -> list[str]:
    names = []
    for _, name, _, _ in string.Formatter().parse(template):
        if name is None:
            continue
        root = re.split(r"[.\[]", name, maxsplit=1)[0]
        names.append(root)
    return names


def build_text_suite(
    suite: str, data_dir: str | Path, n_prompts: int, seed: int, template: str, chat: str | None = None
) -> list[dict]:
    """Seeded sample of ``n_prompts`` records of ``suite`` rendered through ``template``.

    The sample is the first ``n_prompts`` entries of a seeded permutation of the records
    (``random.Random(f"{suite}:{seed}").shuffle``), kept in permutation order, so samples are nested:
    raising ``n_prompts`` appends prompts and leaves the first ones (and their ids) unchanged, and
    rules that evaluate "the first n prompts" of a suite see a random sample, not the file's head.
    All records are taken (in file order) when ``n_prompts`` is at least the suite size. Same
    inputs give identical rows.

    Args:
        suite (str): one of ``SUITES``.
        data_dir (str | os.PathLike): the data folder (config key ``data_dir``).
        n_prompts (int): number of prompts, >= 1.
        seed (int): sampling seed.
        template (str): ``str.format`` template over the suite's fields (``FIELDS[suite]``).
        chat (str | None): optional user-message template over the same fields; rows then carry it as
            ``chat`` and models with a chat template are prompted through it (``tokenize_suite``).

    Returns:
        list of ``{"id": f"{suite}-{k:04d}", "suite", "source_id", "text"}`` rows (plus ``chat``).

    Raises:
        ValueError: unknown suite; ``n_prompts < 1``; the template names a field the suite lacks
            (or positional fields), the message naming suite, field and available fields.
        FileNotFoundError: a needed data file is missing (see ``check_data``).

    Source: DEX-harness issue 2, item 4 (workloads).
    """
    _check_suite(suite)
    if isinstance(n_prompts, bool) or not isinstance(n_prompts, int) or n_prompts < 1:
        raise ValueError(f"n_prompts must be an int >= 1, got {n_prompts!r}")
    _check_templates(suite, template, chat)
    records = load_records(suite, data_dir)
    idx = list(range(len(records))) if n_prompts >= len(records) else _sample_order(suite, len(records), seed)[:n_prompts]
    return [_render(suite, f"{suite}-{k:04d}", records[i], template, chat) for k, i in enumerate(idx)]


def held_out_text_suite(
    suite: str, data_dir: str | Path, n_evaluated: int, seed: int, template: str, chat: str | None = None,
    n: int | None = None,
) -> list[dict]:
    """The records of ``suite`` that :func:`build_text_suite` with ``n_evaluated`` prompts and ``seed`` does
    not sample: positions ``n_evaluated, n_evaluated + 1, ...`` of the same seeded permutation, rendered
    the same way. Training data for a drafter of the suite's distribution with no evaluated prompt in it.

    Since samples are nested, these rows stay outside the evaluated sample as long as the suite's
    ``n_prompts`` stays at most ``n_evaluated``.

    Args:
        suite, data_dir, seed, template, chat: as :func:`build_text_suite`.
        n_evaluated: the suite's evaluated prompt count (``workloads.<suite>.n_prompts``), >= 1.
        n: at most this many rows (None: all the rest).

    Returns:
        list of ``{"id": f"{suite}-heldout-{k:04d}", "suite", "source_id", "text"}`` rows (plus ``chat``);
        empty when ``n_evaluated`` covers the suite.

    Raises:
        ValueError: unknown suite, ``n_evaluated < 1``, a negative ``n`` or a bad template (as
            :func:`build_text_suite`).
        FileNotFoundError: a needed data file is missing.
    """
    _check_suite(suite)
    if isinstance(n_evaluated, bool) or not isinstance(n_evaluated, int) or n_evaluated < 1:
        raise ValueError(f"n_evaluated must be an int >= 1, got {n_evaluated!r}")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
        raise ValueError(f"n must be None or an int >= 0, got {n!r}")
    _check_templates(suite, template, chat)
    records = load_records(suite, data_dir)
    if n_evaluated >= len(records):
        return []
    rest = _sample_order(suite, len(records), seed)[n_evaluated:]
    rest = rest if n is None else rest[:n]
    return [_render(suite, f"{suite}-heldout-{k:04d}", records[i], template, chat) for k, i in enumerate(rest)]


def _sample_order(suite: str, n_records: int, seed: int) -> list[int]:
    """The seeded permutation of a suite's record indices that :func:`build_text_suite` samples from."""
    order = list(range(n_records))
    random.Random(f"{suite}:{seed}").shuffle(order)
    return order


def _check_templates(suite: str, template: str, chat: str | None) -> None:
    available = FIELDS[suite]
    for name in _template_fields(template) + (_template_fields(chat) if chat else []):
        if name == "" or name.isdigit() or name not in available:
            raise ValueError(
                f"template for suite {suite!r} names unknown field {{{name}}}; available fields: "
                f"{', '.join(available)}"
            )


def _render(suite: str, row_id: str, rec: dict, template: str, chat: str | None) -> dict:
    return {
        "id": row_id,
        "suite": suite,
        "source_id": rec["source_id"],
        "text": template.format(**rec["fields"]),
        **({"chat": chat.format(**rec["fields"])} if chat else {}),
    }
