"""Training corpus for the tiny models: GSM8K train, the ShareGPT subset, Python standard library code.

HumanEval, GSM8K test and the other evaluation suites are never used for training. Documents are
formatted like the prompt templates of the workloads (``Question:/Answer:``, ``User:/Assistant:``) so
that the tiny models see the evaluation formats. Everything is deterministic given the data folder
and the Python installation (the stdlib path and version are recorded in the corpus metadata).
"""

from __future__ import annotations

import json
import re
import sys
import sysconfig
from pathlib import Path
from typing import Iterator

from impl.workloads import DATA_DIR_HINT

SOURCES = ("gsm8k_train", "sharegpt", "python_stdlib")
_CALC = re.compile(r"<<[^>]*>>")


def need_file(path: Path) -> Path:
    """``path`` if it exists.

    Raises:
        FileNotFoundError: naming the file and the ``data_dir`` key.
    """
    if not path.exists():
        raise FileNotFoundError(
            f"training data not found: {path} (config key data_dir must point at {DATA_DIR_HINT})"
        )
    return path


def gsm8k_train_docs(data_dir: Path) -> Iterator[str]:
    """GSM8K train question/answer pairs, calculator annotations stripped."""
    with open(need_file(data_dir / "gsm8k" / "train.jsonl"), encoding="utf-8") as fh:
        for line in fh:
            r = json.loads(line)
            yield f"Question: {r['question']}\nAnswer: {_CALC.sub('', r['answer'])}"


def sharegpt_docs(data_dir: Path) -> Iterator[str]:
    """ShareGPT subset conversations as ``User: ... / Assistant: ...`` transcripts."""
    with open(need_file(data_dir / "chat" / "sharegpt_v3_subset.jsonl"), encoding="utf-8") as fh:
        for line in fh:
            r = json.loads(line)
            turns = []
            for t in r["conversations"]:
                who = "User" if t["from"] == "human" else "Assistant"
                turns.append(f"{who}: {t['value'].strip()}")
            if turns:
                yield "\n".join(turns)


def python_stdlib_docs() -> Iterator[str]:
    """Source files of this interpreter's standard library (tests and site-packages excluded),
    in sorted path order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idle_test", "site-packages", "lib2to3", "__pycache__", "turtledemo"}
    for p in sorted(root.rglob("*.py")):
        if skip.intersection(p.relative_to(root).parts):
            continue
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            yield text


def iter_source(name: str, data_dir: Path) -> Iterator[str]:
    """Documents of one corpus source (one of :data:`SOURCES`).

    Raises:
        ValueError: unknown source name. FileNotFoundError: missing data file (names the path).
    """
    if name == "gsm8k_train":
        return gsm8k_train_docs(data_dir)
    if name == "sharegpt":
        return sharegpt_docs(data_dir)
    if name == "python_stdlib":
        return python_stdlib_docs()
    raise ValueError(f"unknown corpus source {name!r}; choose from {SOURCES}")


def collect_documents(
    data_dir: str | Path, sources: list[str], max_chars_per_source: int | dict[str, int]
) -> tuple[list[str], dict]:
    """Collect documents from each source up to a character budget.

    Args:
        data_dir: the data folder (config key ``data_dir``).
        sources: names from :data:`SOURCES`.
        max_chars_per_source: character budget per source, one int for all or a mapping
            source -> int (sources missing from the mapping get 4,000,000); documents are taken in
            order until the budget is reached, the last one cut at the budget.

    Returns:
        ``(documents, meta)`` where meta maps each source to ``{"documents", "chars"}`` and records
        the Python version whose stdlib was read.
    """
    data_dir = Path(data_dir)
    docs: list[str] = []
    meta: dict = {"sources": {}, "python_version": sys.version.split()[0]}
    for name in sources:
        budget = (max_chars_per_source.get(name, 4_000_000) if isinstance(max_chars_per_source, dict)
                  else max_chars_per_source)
        used, n = 0, 0
        for doc in iter_source(name, data_dir):
            if used >= budget:
                break
            doc = doc[: budget - used]
            docs.append(doc)
            used += len(doc)
            n += 1
        meta["sources"][name] = {"documents": n, "chars": used}
    return docs, meta
