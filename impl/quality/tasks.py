"""lm-eval task YAMLs over the local data folder (vSkipper Sec. 4.1 "Quality", Table 5).

:func:`write_task_yamls` generates, into a run directory, one lm-eval 0.4.13 task YAML per task that
reads the local files of the data folder (``dataset_path: json`` with ``dataset_kwargs.data_files``
naming the files under ``data_dir``; nothing is downloaded). The paths are resolved from the
``data_dir`` argument at generation time (never hard-coded), so a run directory documents exactly which
files it evaluated.

Tasks (``suite -> lm-eval task names``):

- ``gsm8k`` -> ``vsk_gsm8k``: lm-eval's ``gsm8k`` task (``Question: ...\\nAnswer:``, 5-shot from the
  train split with lm-eval's seeded sampler, greedy ``generate_until`` stopping at ``Question:``), on
  ``gsm8k/test.jsonl`` with few-shot examples from ``gsm8k/train.jsonl``. Three filters are scored with
  lm-eval's ``exact_match`` (same normalisation as lm-eval): ``strict-match``, ``flexible-extract``
  and ``composite`` (strict when it parses, otherwise flexible; the paper's metric, App. E.2).
- ``bbh`` -> ``vsk_bbh_<task>`` for each BBH task file: the chain-of-thought protocol of Suzgun et
  al. with the CoT prompts shipped in the data folder (``bbh/cot-prompts/<task>.txt``, the text after
  its ``-----`` line, three exemplars) + ``\\n\\nQ: {input}\\nA: Let's think step by step.``; lm-eval's
  ``bbh_cot_fewshot`` answer filter and ``exact_match``.
- ``coqa`` -> ``vsk_coqa``: lm-eval's ``coqa`` task (one document per story, predicting the answer to
  its last question given the story and the earlier turns; ``\\nQ:`` stops; F1 and EM with the
  leave-one-out maximum over references) on the CoQA *test* set from BIG-bench
  (``coqa/coqa_test_bigbench.json``; the dev set is not in the data folder, see SOURCES.md).

The documents of a task are its test split in file order; lm-eval's ``limit`` takes the first N.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import yaml

from .scoring import BBH_ANSWER_PATTERN, GSM8K_FLEXIBLE_PATTERN, GSM8K_STRICT_PATTERN, coqa_scores

__all__ = [
    "QUALITY_SUITES",
    "PRIMARY_METRIC",
    "TaskOptions",
    "TaskSet",
    "bbh_task_names",
    "write_task_yamls",
    "coqa_doc_to_text",
    "coqa_doc_to_target",
    "coqa_process_results",
]

QUALITY_SUITES: tuple[str, ...] = ("gsm8k", "bbh", "coqa")

#: the per-document score the DiD uses, per suite: (metric, filter) as lm-eval names them (Table 5:
#: GSM8K composite exact match, BBH exact match, CoQA F1).
PRIMARY_METRIC: dict[str, tuple[str, str]] = {
    "gsm8k": ("exact_match", "composite"),
    "bbh": ("exact_match", "get-answer"),
    "coqa": ("f1", "none"),
}

_TASK_PREFIX = "vsk_"
_PKG = "impl.quality.tasks"


@dataclass(frozen=True)
class TaskOptions:
    """Options of the generated tasks.

    Attributes:
        gsm8k_num_fewshot: GSM8K few-shot examples (lm-eval's ``gsm8k``: 5).
        gsm8k_max_gen_toks: GSM8K generation budget (lm-eval's default: 256).
        bbh_subtasks: BBH task names to generate (default None: every ``bbh/tasks/*.json``).
        bbh_max_gen_toks: BBH generation budget (lm-eval's ``bbh_cot_fewshot``: 1024).
        coqa_max_gen_toks: CoQA generation budget (lm-eval's default: 256).
        fewshot_seed: informational; lm-eval's sampler is seeded by ``simple_evaluate``'s
            ``fewshot_random_seed`` (default 1234), which the runner passes through.
        datasets_cache_dir: optional ``cache_dir`` for ``datasets.load_dataset`` (default: the
            ``datasets`` cache, ``HF_DATASETS_CACHE``).
    """

    gsm8k_num_fewshot: int = 5
    gsm8k_max_gen_toks: int = 256
    bbh_subtasks: tuple[str, ...] | None = None
    bbh_max_gen_toks: int = 1024
    coqa_max_gen_toks: int = 256
    fewshot_seed: int = 1234
    datasets_cache_dir: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain-dict form (for provenance / config hashes)."""
        return {
            "gsm8k_num_fewshot": self.gsm8k_num_fewshot,
            "gsm8k_max_gen_toks": self.gsm8k_max_gen_toks,
            "bbh_subtasks": None if self.bbh_subtasks is None else list(self.bbh_subtasks),
            "bbh_max_gen_toks": self.bbh_max_gen_toks,
            "coqa_max_gen_toks": self.coqa_max_gen_toks,
            "fewshot_seed": self.fewshot_seed,
            "datasets_cache_dir": self.datasets_cache_dir,
        }

    def dataset_kwargs(self, data_files: Mapping[str, str], **extra: Any) -> dict[str, Any]:
        """``dataset_kwargs`` of a task YAML: the local files, extra loader arguments, the cache dir."""
        kw: dict[str, Any] = {"data_files": dict(data_files), **extra}
        if self.datasets_cache_dir:
            kw["cache_dir"] = str(self.datasets_cache_dir)
        return kw


@dataclass
class TaskSet:
    """The generated tasks of one run.

    Attributes:
        include_path: the folder holding the YAMLs (lm-eval ``TaskManager(include_path=...)``).
        tasks: ``suite -> [lm-eval task name, ...]`` in evaluation order.
        suite_of: ``lm-eval task name -> suite``.
        files: ``lm-eval task name -> YAML path``.
        data_files: ``lm-eval task name -> {split: local data file}``.
    """

    include_path: Path
    tasks: dict[str, list[str]] = field(default_factory=dict)
    suite_of: dict[str, str] = field(default_factory=dict)
    files: dict[str, Path] = field(default_factory=dict)
    data_files: dict[str, dict[str, str]] = field(default_factory=dict)

    @property
    def task_names(self) -> list[str]:
        """Every lm-eval task name, suites in order."""
        return [t for names in self.tasks.values() for t in names]


# -- YAML writing -------------------------------------------------------------------------------------
class _Function(str):
    """A ``!function module.name`` reference in a task YAML."""


class _Dumper(yaml.SafeDumper):
    pass


_Dumper.add_representer(_Function, lambda d, v: d.represent_scalar("!function", str(v)))


def _dump(obj: Mapping[str, Any], path: Path) -> None:
    text = yaml.dump(dict(obj), Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=1 << 30)
    path.write_text("# generated by impl.quality.tasks.write_task_yamls; do not edit\n" + text, encoding="utf-8")


def _need(path: Path, what: str, data_dir: Path) -> str:
    if not path.exists():
        raise FileNotFoundError(
            f"quality task {what}: missing {path} (data_dir={str(data_dir)!r}); point data_dir at a folder "
            "holding the files listed in SOURCES.md"
        )
    return str(path.resolve())


def _generation(until: Sequence[str], max_gen_toks: int) -> dict[str, Any]:
    return {"until": list(until), "do_sample": False, "temperature": 0.0, "max_gen_toks": int(max_gen_toks)}


def _gsm8k_yaml(data_dir: Path, opts: TaskOptions) -> tuple[dict, dict]:
    files = {
        "train": _need(data_dir / "gsm8k" / "train.jsonl", "gsm8k", data_dir),
        "test": _need(data_dir / "gsm8k" / "test.jsonl", "gsm8k", data_dir),
    }
    em = {
        "metric": "exact_match", "aggregation": "mean", "higher_is_better": True, "ignore_case": True,
        "ignore_punctuation": False, "regexes_to_ignore": [",", "\\$", "(?s).*#### ", "\\.$"],
    }
    cfg = {
        "task": f"{_TASK_PREFIX}gsm8k",
        "dataset_path": "json",
        "dataset_kwargs": opts.dataset_kwargs(files),
        "output_type": "generate_until",
        "training_split": "train",
        "fewshot_split": "train",
        "test_split": "test",
        "doc_to_text": "Question: {{question}}\nAnswer:",
        "doc_to_target": "{{answer}}",
        "metric_list": [em],
        "generation_kwargs": _generation(["Question:", "</s>", "<|im_end|>"], opts.gsm8k_max_gen_toks),
        "repeats": 1,
        "num_fewshot": int(opts.gsm8k_num_fewshot),
        "filter_list": [
            {"name": "strict-match", "filter": [
                {"function": "regex", "regex_pattern": GSM8K_STRICT_PATTERN}, {"function": "take_first"}]},
            {"name": "flexible-extract", "filter": [
                {"function": "regex", "group_select": -1, "regex_pattern": GSM8K_FLEXIBLE_PATTERN},
                {"function": "take_first"}]},
            {"name": "composite", "filter": [
                {"function": "custom", "filter_fn": _Function("impl.quality.scoring.gsm8k_composite_filter")},
                {"function": "take_first"}]},
        ],
        "metadata": {"version": 3.0, "source": "lm-eval gsm8k (5-shot) on local gsm8k/test.jsonl"},
    }
    return cfg, files


def _cot_prompt(path: Path) -> str:
    text = path.read_text(encoding="utf-8")
    lines = text.split("\n")
    for i, line in enumerate(lines):
        if line.strip() == "-----":
            return "\n".join(lines[i + 1:]).strip()
    return text.strip()


def bbh_task_names(data_dir: str | Path) -> list[str]:
    """The BBH task names available in ``data_dir`` (``bbh/tasks/*.json`` stems, sorted).

    Raises:
        FileNotFoundError: when ``bbh/tasks`` is missing.
    """
    d = Path(data_dir) / "bbh" / "tasks"
    _need(d, "bbh", Path(data_dir))
    return sorted(p.stem for p in d.glob("*.json"))


def _raw(text: str) -> str:
    """Jinja-escape literal text (lm-eval renders ``description`` as a Jinja template)."""
    if "{% endraw %}" in text:
        raise ValueError("prompt text contains '{% endraw %}' and cannot be embedded literally")
    return "{% raw %}" + text + "{% endraw %}"


def _bbh_yaml(data_dir: Path, task: str, opts: TaskOptions) -> tuple[dict, dict]:
    files = {"test": _need(data_dir / "bbh" / "tasks" / f"{task}.json", f"bbh/{task}", data_dir)}
    cot = _cot_prompt(Path(_need(data_dir / "bbh" / "cot-prompts" / f"{task}.txt", f"bbh/{task}", data_dir)))
    cfg = {
        "task": f"{_TASK_PREFIX}bbh_{task}",
        "dataset_path": "json",
        "dataset_kwargs": opts.dataset_kwargs(files, field="examples"),
        "output_type": "generate_until",
        "test_split": "test",
        "description": _raw(cot + "\n\n"),
        "doc_to_text": "Q: {{input}}\nA: Let's think step by step.",
        "doc_to_target": "{{target}}",
        "target_delimiter": "",
        "num_fewshot": 0,
        "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}],
        "generation_kwargs": _generation(["</s>", "Q:", "\n\n"], opts.bbh_max_gen_toks),
        "filter_list": [{"name": "get-answer", "filter": [
            {"function": "regex", "regex_pattern": BBH_ANSWER_PATTERN}, {"function": "take_first"}]}],
        "metadata": {"version": 4.0, "source": f"BBH CoT (bbh/cot-prompts/{task}.txt, 3 exemplars) on local data"},
    }
    return cfg, files


def _coqa_yaml(data_dir: Path, opts: TaskOptions) -> tuple[dict, dict]:
    files = {"test": _need(data_dir / "coqa" / "coqa_test_bigbench.json", "coqa", data_dir)}
    cfg = {
        "task": f"{_TASK_PREFIX}coqa",
        "dataset_path": "json",
        "dataset_kwargs": opts.dataset_kwargs(files, field="data"),
        "output_type": "generate_until",
        "test_split": "test",
        "doc_to_text": _Function(f"{_PKG}.coqa_doc_to_text"),
        "doc_to_target": _Function(f"{_PKG}.coqa_doc_to_target"),
        "process_results": _Function(f"{_PKG}.coqa_process_results"),
        "generation_kwargs": _generation(["\nQ:"], opts.coqa_max_gen_toks),
        "metric_list": [
            {"metric": "em", "aggregation": "mean", "higher_is_better": True},
            {"metric": "f1", "aggregation": "mean", "higher_is_better": True},
        ],
        "metadata": {"version": 3.0, "source": "lm-eval coqa on local coqa/coqa_test_bigbench.json (test set)"},
    }
    return cfg, files


def write_task_yamls(
    data_dir: str | Path,
    out_dir: str | Path,
    suites: Iterable[str] = QUALITY_SUITES,
    options: TaskOptions | None = None,
) -> TaskSet:
    """Generate the lm-eval task YAMLs of ``suites`` over the local files of ``data_dir``.

    Args:
        data_dir: the data folder (config key ``data_dir``; see its SOURCES.md).
        out_dir: folder to write the YAMLs into (created; existing generated YAMLs are replaced). Pass
            it to lm-eval as ``TaskManager(include_path=out_dir)`` or ``--include_path``.
        suites: any of :data:`QUALITY_SUITES`.
        options: :class:`TaskOptions` (default: the lm-eval defaults above).

    Returns:
        a :class:`TaskSet`.

    Raises:
        ValueError: for an unknown suite or BBH subtask.
        FileNotFoundError: when a needed data file is missing (the message names it and ``data_dir``).
    """
    opts = options or TaskOptions()
    data = Path(data_dir)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    suites = list(dict.fromkeys(suites))
    bad = [s for s in suites if s not in QUALITY_SUITES]
    if bad:
        raise ValueError(f"unknown quality suite(s) {bad}; choices: {', '.join(QUALITY_SUITES)}")
    ts = TaskSet(include_path=out)
    for suite in suites:
        if suite == "gsm8k":
            configs = [_gsm8k_yaml(data, opts)]
        elif suite == "coqa":
            configs = [_coqa_yaml(data, opts)]
        else:
            available = bbh_task_names(data)
            chosen = list(available if opts.bbh_subtasks is None else opts.bbh_subtasks)
            unknown = [t for t in chosen if t not in available]
            if unknown:
                raise ValueError(f"unknown BBH task(s) {unknown} in {data / 'bbh' / 'tasks'}; available: {available}")
            configs = [_bbh_yaml(data, t, opts) for t in chosen]
        for cfg, files in configs:
            name = cfg["task"]
            path = out / f"{name}.yaml"
            _dump(cfg, path)
            ts.tasks.setdefault(suite, []).append(name)
            ts.suite_of[name] = suite
            ts.files[name] = path
            ts.data_files[name] = files
    (out / "tasks.json").write_text(json.dumps(
        {"data_dir": str(data.resolve()), "options": opts.to_dict(), "tasks": ts.tasks,
         "data_files": ts.data_files}, indent=2) + "\n", encoding="utf-8")
    return ts


# -- CoQA document functions (plugged into the YAML with !function) ---------------------------------
def _coqa_turns(doc: Mapping[str, Any]) -> tuple[list[dict], dict[int, dict]]:
    questions = sorted(doc["questions"], key=lambda q: int(q["turn_id"]))
    answers = {int(a["turn_id"]): a for a in doc["answers"]}
    return questions, answers


def coqa_doc_to_text(doc: Mapping[str, Any]) -> str:
    """lm-eval's CoQA prompt for one story: the story, the earlier turns as ``Q: ...\\n\\nA: ...\\n\\n``
    and the last question followed by ``A:`` (the answer to predict)."""
    questions, answers = _coqa_turns(doc)
    text = doc["story"] + "\n\n"
    for i, q in enumerate(questions):
        text += f"Q: {q['input_text']}\n\n"
        if i < len(questions) - 1:
            a = answers.get(int(q["turn_id"]))
            text += f"A: {'' if a is None else a['input_text']}\n\n"
        else:
            text += "A:"
    return text


def coqa_doc_to_target(doc: Mapping[str, Any]) -> list[str]:
    """The reference answers of a story's last question: its answer, then each additional answer set's
    answer for that turn unless it equals (case-insensitively) one already listed (lm-eval ``coqa``)."""
    questions, answers = _coqa_turns(doc)
    turn = int(questions[-1]["turn_id"])
    main = answers.get(turn)
    refs = [main["input_text"] if main is not None else ""]
    extra = doc.get("additional_answers") or {}
    for key in sorted(extra, key=str):
        group = extra[key]
        if not group:
            continue
        for a in group:
            if int(a["turn_id"]) == turn:
                if a["input_text"].lower() not in map(str.lower, refs):
                    refs.append(a["input_text"])
                break
    return refs


def coqa_process_results(doc: Mapping[str, Any], results: Sequence[str]) -> dict[str, float]:
    """lm-eval ``process_results`` of CoQA: the first line of the stripped generation scored against
    the references with :func:`~impl.quality.scoring.coqa_scores` (``{"em", "f1"}``)."""
    pred = results[0].strip().split("\n")[0]
    return coqa_scores(coqa_doc_to_target(doc), pred)
