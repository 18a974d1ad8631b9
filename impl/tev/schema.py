"""The optional ``tev:`` config section (TEV/ExitTrain experiments): JSON schema, defaults and
cross-checks. Imported by :mod:`impl.config` at validation time, so it imports nothing heavy."""

from __future__ import annotations

from typing import Any

_POS_INT = {"type": "integer", "minimum": 1}
_POS_NUM = {"type": "number", "exclusiveMinimum": 0}
_SUITES = ["gsm8k", "humaneval", "xsum", "mt_bench", "math500", "bbh", "coqa"]

SECTION: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["models", "workloads"],
    "description": "TEV / ExitTrain experiments (Tables 1-5); absent = no TEV rules",
    "properties": {
        "models": {"type": "array", "items": {"type": "string"}, "minItems": 1},
        "workloads": {"type": "array", "items": {"enum": _SUITES}, "minItems": 1},
        "n_prompts": _POS_INT,
        "max_new_tokens": _POS_INT,
        "stop_at_eos": {"type": "boolean"},
        "temperatures": {"type": "array", "items": {"type": "number", "minimum": 0}, "minItems": 1},
        "budget": _POS_INT,
        "budgets": {"type": "array", "items": _POS_INT, "description": "budget robustness (Table 5)"},
        "depth": _POS_INT,
        "drafter": {
            "type": "object", "additionalProperties": False,
            "properties": {"block_size": _POS_INT, "n_layers": _POS_INT, "prompts": {"type": "integer", "minimum": 4},
                           "prompt_max_tokens": _POS_INT, "rollout_new_tokens": _POS_INT,
                           "rollout_temperature": {"type": "number", "minimum": 0}, "steps": _POS_INT,
                           "batch_size": _POS_INT, "lr": _POS_NUM, "gamma": _POS_NUM, "threads": _POS_INT},
        },
        "exittrain": {
            "type": "object", "additionalProperties": False,
            "properties": {"steps": _POS_INT, "batch_size": _POS_INT, "tree_contexts_per_seq": _POS_INT,
                           "budget": _POS_INT, "lambda_exit": {"type": "number", "minimum": 0},
                           "target_temperature": {"type": "number", "minimum": 0}, "lr": _POS_NUM,
                           "objectives": {"type": "array", "items": {"enum": ["token", "prefix", "exit"]},
                                          "minItems": 1, "uniqueItems": True}},
        },
        "latency": {
            "type": "object", "additionalProperties": False,
            "properties": {"budgets": {"type": "array", "items": _POS_INT, "minItems": 1}, "trees": _POS_INT,
                           "temperature": {"type": "number", "exclusiveMinimum": 0}, "repeats": _POS_INT},
        },
    },
}

DEFAULTS: dict[str, Any] = {
    "n_prompts": 6, "max_new_tokens": 64, "stop_at_eos": True, "temperatures": [0.0, 1.0], "budget": 64,
    "budgets": [32, 64, 128], "depth": 8,
    "drafter": {"block_size": 8, "n_layers": 2, "prompts": 200, "prompt_max_tokens": 96, "rollout_new_tokens": 64,
                "rollout_temperature": 0.0, "steps": 300, "batch_size": 8, "lr": 2e-3, "gamma": 4.0, "threads": 1},
    "exittrain": {"steps": 100, "batch_size": 4, "tree_contexts_per_seq": 2, "budget": 64, "lambda_exit": 64.0,
                  "target_temperature": 1.0, "lr": 3e-4, "objectives": ["token", "prefix", "exit"]},
    "latency": {"budgets": [32, 64, 128], "trees": 30, "temperature": 1.0, "repeats": 3},
}


def check(cfg: dict[str, Any]) -> None:
    """Cross-checks of the ``tev`` section (model and workload names, depth vs block size).

    Raises:
        impl.config.ConfigError: one line naming the key.
    """
    from ..config import ConfigError

    t = cfg["tev"]
    for i, m in enumerate(t["models"]):
        if m not in cfg["models"]:
            raise ConfigError(f"config: 'tev.models[{i}]' names '{m}', which is not a key of 'models'")
    for i, w in enumerate(t["workloads"]):
        if w not in cfg["workloads"]:
            raise ConfigError(f"config: 'tev.workloads[{i}]' names '{w}', which is not a key of 'workloads'")
    if t["depth"] > t["drafter"]["block_size"]:
        raise ConfigError(f"config: 'tev.depth' = {t['depth']} exceeds 'tev.drafter.block_size' = "
                          f"{t['drafter']['block_size']} (a tree is at most one drafted block deep)")
    need = cfg["max_prompt_tokens"] + t["max_new_tokens"]
    if any(cfg["models"][m]["kind"] == "tiny" for m in t["models"]) and need > cfg["tiny_arch"]["max_position_embeddings"]:
        raise ConfigError("config: 'max_prompt_tokens' + 'tev.max_new_tokens' exceeds 'tiny_arch.max_position_embeddings'")
