"""The optional ``dex:`` config section (DEX experiments: Fig. 3, Fig. 4, Table 1): JSON schema, defaults
and cross-checks. Registered in :data:`impl.config.CONFIG_SECTIONS`; imported at validation time (also by
Snakemake at parse time), so it imports nothing heavy."""

from __future__ import annotations

from typing import Any

from ..workloads.suites import SUITES

__all__ = ["DEFAULTS", "SECTION", "check"]

_POS_INT = {"type": "integer", "minimum": 1}
_POS_NUM = {"type": "number", "exclusiveMinimum": 0}

SECTION: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["models", "workloads"],
    "description": "DEX experiments (Fig. 3, Fig. 4, Table 1); absent = no DEX rules",
    "properties": {
        "models": {"type": "array", "items": {"type": "string"}, "minItems": 1},
        "workloads": {"type": "array", "items": {"enum": list(SUITES)}, "minItems": 1},
        "n_prompts": {**_POS_INT, "description": "first n prompts of each frozen suite"},
        "max_new_tokens": _POS_INT,
        "stop_at_eos": {"type": "boolean"},
        "explorers": {"type": "array", "items": _POS_INT, "minItems": 1,
                      "description": "K of the uniform DEX-1/K sets; [] or absent = every K dividing L"},
        "exploration_sets": {"type": "array", "items": {"type": "array", "items": _POS_INT, "minItems": 1},
                             "description": "extra (non-uniform) exploration sets"},
        "dedupe": {"type": "boolean", "description": "merge repeated candidates of one slot (lossless)"},
        "single_exit": {"type": "boolean", "description": "single-exit ablation for every K > 2"},
        "distributed": {
            "type": "object",
            "additionalProperties": False,
            "description": "multi-process runs (one torch.distributed rank per explorer) on the first "
                           "dex model and workload, measuring communication per round",
            "properties": {"explorers": {"type": "array", "items": {"type": "integer", "minimum": 2}},
                           "n_prompts": _POS_INT, "max_new_tokens": _POS_INT},
        },
        "decs": {
            "type": "object",
            "additionalProperties": False,
            "properties": {"explorers": {"type": "array", "items": _POS_INT},
                           "temperatures": {"type": "array", "items": {"type": "number", "minimum": 0}}},
        },
        "adapters": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "models": {"type": "array", "items": {"type": "string"}},
                "steps": _POS_INT,
                "batch_size": _POS_INT,
                "seq_len": {"type": "integer", "minimum": 8},
                "lr": _POS_NUM,
                "position_fraction": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
                "max_chars": {"type": "integer", "minimum": 10000},
                "threads": _POS_INT,
            },
        },
        "baselines": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "tune_prompts": {**_POS_INT, "description": "prompts per workload used for tuning"},
                "self_spec": {"type": "object", "additionalProperties": False, "properties": {
                    "exit_layers": {"type": "array", "items": _POS_INT, "minItems": 1},
                    "num_speculations": {"type": "array", "items": _POS_INT, "minItems": 1}}},
                "adadecode": {"type": "object", "additionalProperties": False, "properties": {
                    "shortcut_every": _POS_INT,
                    "num_speculations": {"type": "array", "items": _POS_INT, "minItems": 1},
                    "thresholds": {"type": "array", "items": {"type": "number", "minimum": 0, "maximum": 1},
                                   "minItems": 1}}},
                "dynamic_exit": {"type": "boolean"},
                "hf_early_exit": {"type": "boolean",
                                  "description": "transformers' assistant_early_exit at the tuned "
                                                 "self_spec parameters, as a library reference arm"},
            },
        },
    },
}

DEFAULTS: dict[str, Any] = {
    "n_prompts": 8, "max_new_tokens": 64, "stop_at_eos": True, "explorers": [], "exploration_sets": [],
    "dedupe": True, "single_exit": True, "distributed": {"explorers": [2, 3], "n_prompts": 2, "max_new_tokens": 32},
    "decs": {"explorers": [4], "temperatures": [0.0, 1.0]},
    "adapters": {"models": [], "steps": 300, "batch_size": 8, "seq_len": 256, "lr": 5e-3,
                 "position_fraction": 0.25, "max_chars": 4_000_000, "threads": 2},
    "baselines": {"tune_prompts": 3,
                  "self_spec": {"exit_layers": [1, 2, 3, 4, 6], "num_speculations": [2, 4, 6, 8]},
                  "adadecode": {"shortcut_every": 2, "num_speculations": [2, 4, 6, 8],
                                "thresholds": [0.2, 0.4, 0.6, 0.8]},
                  "dynamic_exit": True, "hf_early_exit": True},
}


def check(out: dict[str, Any]) -> None:
    """Cross-checks of the ``dex`` section (names, and depths against L where every model is tiny).

    Raises:
        impl.config.ConfigError: one line naming the key.
    """
    from ..config import ConfigError

    d = out["dex"]
    for key in ("models", "adapters.models"):
        names = d["models"] if key == "models" else d["adapters"]["models"]
        for i, m in enumerate(names):
            if m not in out["models"]:
                raise ConfigError(f"config: 'dex.{key}[{i}]' names '{m}', which is not a key of 'models'")
    for i, m in enumerate(d["adapters"]["models"]):
        if m not in d["models"]:
            raise ConfigError(f"config: 'dex.adapters.models[{i}]' names '{m}', which is not in 'dex.models'")
    for i, w in enumerate(d["workloads"]):
        if w not in out["workloads"]:
            raise ConfigError(f"config: 'dex.workloads[{i}]' names '{w}', which is not a key of 'workloads'")
    if all(out["models"][m]["kind"] == "tiny" for m in d["models"]):
        L = out["tiny_arch"]["num_layers"]
        for i, k in enumerate(d["explorers"]):
            if L % k:
                raise ConfigError(f"config: 'dex.explorers[{i}]' = {k} does not divide tiny_arch.num_layers ({L})")
        for i, k in enumerate(d["distributed"]["explorers"]):
            if L % k:
                raise ConfigError(f"config: 'dex.distributed.explorers[{i}]' = {k} does not divide tiny_arch.num_layers ({L})")
        for i, k in enumerate(d["decs"]["explorers"]):
            if L % k:
                raise ConfigError(f"config: 'dex.decs.explorers[{i}]' = {k} does not divide tiny_arch.num_layers ({L})")
        for i, xs in enumerate(d["exploration_sets"]):
            if list(xs) != sorted(set(xs)) or xs[-1] != L or xs[0] < 1:
                raise ConfigError(f"config: 'dex.exploration_sets[{i}]' = {xs} must be strictly increasing depths "
                                  f"in [1, {L}] ending at L = {L}")
        for i, e in enumerate(d["baselines"]["self_spec"]["exit_layers"]):
            if not 1 <= e < L:
                raise ConfigError(f"config: 'dex.baselines.self_spec.exit_layers[{i}]' = {e} is outside [1, {L - 1}]")
    ad = d["adapters"]
    if any(out["models"][m]["kind"] == "tiny" for m in ad["models"]) and ad["seq_len"] > out["tiny_arch"]["max_position_embeddings"]:
        raise ConfigError(f"config: 'dex.adapters.seq_len' = {ad['seq_len']} exceeds "
                          f"'tiny_arch.max_position_embeddings' = {out['tiny_arch']['max_position_embeddings']}")
    need = out["max_prompt_tokens"] + d["max_new_tokens"]
    if any(out["models"][m]["kind"] == "tiny" for m in d["models"]) and need > out["tiny_arch"]["max_position_embeddings"]:
        raise ConfigError(f"config: 'max_prompt_tokens' + 'dex.max_new_tokens' = {need} exceeds "
                          f"'tiny_arch.max_position_embeddings'")
