"""One source of defaults: the TEV training dataclasses take the ``tev`` section's defaults
(:mod:`impl.tev.schema`), and ``from_section`` turns a validated section into them without
copying fields by hand."""

from dataclasses import fields
from pathlib import Path

import pytest

from impl.config import load_config
from impl.tev.drafter import DrafterConfig, DrafterTrainConfig
from impl.tev.schema import DEFAULTS, SECTION, TevSection, tev_section
from impl.tev.train import ExitTrainConfig

ROOT = Path(__file__).resolve().parents[1]


def _shared(dc, section: dict) -> dict:
    names = {f.name for f in fields(dc)}
    return {k: v for k, v in section.items() if k in names}


def test_dataclass_defaults_are_the_schema_defaults():
    e = ExitTrainConfig()
    shared = _shared(ExitTrainConfig, DEFAULTS["exittrain"])
    assert set(shared) >= {"steps", "batch_size", "lambda_exit", "lr", "budget", "target_temperature"}
    assert {k: getattr(e, k) for k in shared} == shared
    assert e.gamma == DEFAULTS["drafter"]["gamma"]
    d = DrafterTrainConfig()
    shared = _shared(DrafterTrainConfig, DEFAULTS["drafter"])
    assert set(shared) >= {"steps", "batch_size", "lr", "gamma", "rollout_new_tokens"}
    assert {k: getattr(d, k) for k in shared} == shared
    assert (DrafterConfig().block_size, DrafterConfig().n_layers) == (DEFAULTS["drafter"]["block_size"],
                                                                      DEFAULTS["drafter"]["n_layers"])


@pytest.mark.parametrize("name", ["default.yaml", "smoke.yaml"])
def test_from_section_follows_the_config(name):
    cfg = load_config(ROOT / "configs" / name, check_paths=False)
    t = cfg["tev"]
    typed = tev_section(cfg)
    assert typed.model_dump(mode="json") == t  # the typed object holds exactly the validated section
    e = ExitTrainConfig.from_section(typed, seed=7, eval_prompts=0)
    for k in ("steps", "batch_size", "tree_contexts_per_seq", "budget", "lambda_exit", "target_temperature", "lr"):
        assert getattr(e, k) == t["exittrain"][k], k
    assert (e.gamma, e.seed, e.eval_prompts) == (t["drafter"]["gamma"], 7, 0)
    d = DrafterTrainConfig.from_section(typed.drafter, seed=7)
    for k in ("steps", "batch_size", "lr", "gamma", "rollout_new_tokens", "rollout_temperature", "heldout_fraction"):
        assert getattr(d, k) == t["drafter"][k], k
    assert (d.drafter.block_size, d.drafter.n_layers, d.seed) == (t["drafter"]["block_size"], t["drafter"]["n_layers"], 7)


def test_from_section_overrides_win():
    t = TevSection.model_validate({"models": ["m"], "workloads": ["gsm8k"], "exittrain": {"lr": 0.5},
                                   "drafter": {"gamma": 2.0}})
    e = ExitTrainConfig.from_section(t, lr=0.25)
    assert (e.lr, e.gamma, e.steps) == (0.25, 2.0, DEFAULTS["exittrain"]["steps"])


def test_schema_and_defaults_come_from_the_model():
    """The JSON schema the config check uses is generated from the pydantic model: self-contained
    (no $ref), closed objects, the model's bounds; DEFAULTS are the model's field defaults."""
    import json

    assert "$ref" not in json.dumps(SECTION) and "$defs" not in SECTION
    assert SECTION["required"] == ["models", "workloads"] and SECTION["additionalProperties"] is False
    d = SECTION["properties"]["drafter"]
    assert d["additionalProperties"] is False and d["properties"]["prompts"]["minimum"] == 4
    assert SECTION["properties"]["exittrain"]["properties"]["objectives"]["uniqueItems"] is True
    assert DEFAULTS == TevSection.model_validate({"models": ["m"], "workloads": ["gsm8k"]}).model_dump(
        mode="json", exclude={"models", "workloads"})


@pytest.mark.parametrize("patch,key", [({"drafter": {"steps": 0}}, "tev.drafter.steps"),
                                       ({"exittrain": {"objectives": ["exit", "exit"]}}, "tev.exittrain.objectives"),
                                       ({"latency": {"temperature": 0}}, "tev.latency.temperature"),
                                       ({"drafter": {"stepz": 3}}, "tev.drafter.stepz"),
                                       ({"drafter": {"prompt_mix": {"alpaca": 1.0}}}, "tev.drafter.prompt_mix"),
                                       ({"drafter": {"prompt_mix": {"gsm8k": 0}}}, "tev.drafter.prompt_mix")])
def test_bad_values_name_the_key(tmp_path, patch, key):
    import yaml

    from impl.config import ConfigError

    cfg = yaml.safe_load((ROOT / "configs" / "smoke.yaml").read_text())
    for sub, vals in patch.items():
        cfg["tev"].setdefault(sub, {}).update(vals)
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump(cfg))
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(f, check_paths=False)
