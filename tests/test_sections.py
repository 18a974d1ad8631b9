"""Typed config sections (impl/sections.py): the JSON schema and the defaults of a section are
generated from its pydantic models, and a validated config's section round-trips through them."""

import json
from pathlib import Path

import pytest
from pydantic import Field

from impl.config import ConfigError, load_config
from impl.dex.schema import DexSection, dex_section
from impl.sections import Section, section_defaults, section_schema
from impl.tev.schema import TevSection, tev_section
from impl.vskipper.schema import VskipperSection, vskipper_section

ROOT = Path(__file__).resolve().parents[1]
TYPED = {"dex": (DexSection, dex_section), "tev": (TevSection, tev_section),
         "vskipper": (VskipperSection, vskipper_section)}


class _Inner(Section):
    title: str = "kept"  # a field named like pydantic's schema label
    n: int = Field(3, ge=1)


class _Outer(Section):
    name: str
    inner: _Inner = Field(default_factory=_Inner)
    xs: list[_Inner] = []


def test_schema_is_self_contained_and_closed():
    s = section_schema(_Outer, description="d")
    assert "$defs" not in s and "$ref" not in json.dumps(s) and s["description"] == "d"
    assert s["required"] == ["name"] and s["additionalProperties"] is False
    inner = s["properties"]["inner"]
    assert inner["additionalProperties"] is False and set(inner["properties"]) == {"title", "n"}
    assert inner["properties"]["n"]["minimum"] == 1
    assert s["properties"]["xs"]["items"]["properties"]["n"]["minimum"] == 1
    assert section_defaults(_Outer) == {"inner": {"title": "kept", "n": 3}, "xs": []}


@pytest.mark.parametrize("name", sorted(TYPED))
def test_section_schema_and_defaults_come_from_the_model(name):
    import importlib

    model, _ = TYPED[name]
    mod = importlib.import_module(f"impl.{name}.schema")
    assert mod.SECTION == section_schema(model, description=model.__doc__.strip())
    assert mod.DEFAULTS == section_defaults(model)
    assert "$ref" not in json.dumps(mod.SECTION) and '{"type": "null"}' not in json.dumps(mod.SECTION)


@pytest.mark.parametrize("config", ["default.yaml", "smoke.yaml"])
@pytest.mark.parametrize("name", sorted(TYPED))
def test_validated_section_round_trips(config, name):
    cfg = load_config(ROOT / "configs" / config, check_paths=False)
    model, get = TYPED[name]
    typed = get(cfg)
    # the typed object holds exactly the validated section (absent optional sub-sections stay unset)
    assert isinstance(typed, model) and typed.model_dump(mode="json", exclude_unset=True) == cfg[name]


def test_missing_section_is_one_line():
    with pytest.raises(SystemExit, match="no 'dex' section"):
        dex_section({})


def test_dex_explorers_may_be_empty(tmp_path):
    """``dex.explorers: []`` means every K dividing L (the documented default) and is accepted."""
    import yaml

    cfg = yaml.safe_load((ROOT / "configs" / "smoke.yaml").read_text())
    cfg["dex"]["explorers"] = []
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump(cfg))
    assert load_config(f, check_paths=False)["dex"]["explorers"] == []
    cfg["dex"]["adapters"] = {"position_fraction": 1.5}
    f.write_text(yaml.safe_dump(cfg))
    with pytest.raises(ConfigError, match=r"dex\.adapters\.position_fraction"):
        load_config(f, check_paths=False)


def test_vskipper_bench_settings_are_config_keys(tmp_path):
    """Every setting the vskipper-bench command reads from ``vskipper.bench`` is a key of the schema
    (a user can write it), and a bad value names its key."""
    import yaml

    from impl.vskipper.commands import BENCH_DEFAULTS
    from impl.vskipper.schema import SECTION

    # every key but "models" (which models the rule times, not a setting of one run)
    assert set(SECTION["properties"]["bench"]["properties"]) - {"models"} == set(BENCH_DEFAULTS)
    cfg = yaml.safe_load((ROOT / "configs" / "smoke.yaml").read_text())
    cfg["vskipper"]["bench"] = dict(BENCH_DEFAULTS)
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump(cfg))
    assert load_config(f, check_paths=False)["vskipper"]["bench"]["decode_requests"] == [32, 128]
    cfg["vskipper"]["bench"]["wide_heads"] = 0
    f.write_text(yaml.safe_dump(cfg))
    with pytest.raises(ConfigError, match=r"vskipper\.bench\.wide_heads"):
        load_config(f, check_paths=False)


def test_optional_subsections_are_not_defaults_and_null_unions_name_the_key(tmp_path):
    """vskipper.quality / cross_model / devices / bench / load_points are absent unless given (or filled
    by the section's check); an error inside an optional mapping names the sub-key."""
    import yaml

    from impl.vskipper.schema import DEFAULTS, SECTION

    assert not {"quality", "cross_model", "devices", "bench", "load_points"} & set(DEFAULTS)
    assert SECTION["properties"]["quality"]["properties"]["served"]["type"] == ["object", "null"]
    assert SECTION["properties"]["knee"]["properties"]["requests"]["type"] == ["integer", "null"]
    cfg = yaml.safe_load((ROOT / "configs" / "smoke.yaml").read_text())
    cfg["vskipper"].setdefault("quality", {"tasks": ["gsm8k"]})["served"] = {"point": "9bad"}
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump(cfg))
    with pytest.raises(ConfigError, match=r"vskipper\.quality\.served\.point"):
        load_config(f, check_paths=False)
    cfg["vskipper"]["quality"]["served"] = None  # null = no served-at-knee pass
    cfg["vskipper"]["bench"] = {"hybrid": None}  # null is not a bench setting
    f.write_text(yaml.safe_dump(cfg))
    with pytest.raises(ConfigError, match=r"vskipper\.bench\.hybrid"):
        load_config(f, check_paths=False)
