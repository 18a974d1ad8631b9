"""Configuration: validation of the YAML config against the JSON schema generated from the typed
section models (core: :mod:`impl.schema`; method sections: ``impl/<family>/schema.py``), and typed
views of its sections.

Configs flow one way (ARCHITECTURE.md): YAML -> :func:`validate_config` (JSON schema, one-line errors
naming the key) -> rule params -> the typed objects. The same validator runs in
``workflows/common.smk`` before any job starts and in every ``python -m impl`` command.
"""

from __future__ import annotations

import copy
import json
import math
import os
import string
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from .models.corpus import need_file
from .models.tiny import TinyArch
from .registry import Registry
from .schema import CoreConfig, Ead
from .sections import section_defaults, section_schema
from .workloads import DATA_DIR_HINT, FIELDS, check_data

#: the JSON schema of the core sections, generated from :class:`impl.schema.CoreConfig` (the method
#: sections are added by :func:`full_schema`)
SCHEMA: dict[str, Any] = {"$schema": "https://json-schema.org/draft/2020-12/schema",
                          **section_schema(CoreConfig, description=None), "title": "impl harness configuration"}
#: defaults of the core sections (merged under the user's values), from :class:`impl.schema.CoreConfig`
DEFAULTS: dict[str, Any] = section_defaults(CoreConfig)
#: defaults of the ``ead`` section (required, so merged on its own), from :class:`impl.schema.Ead`
EAD_DEFAULTS: dict[str, Any] = {k: v for k, v in section_defaults(Ead).items() if v is not None}


class ConfigError(ValueError):
    """A configuration problem, with a one-line message naming the key or path and the fix."""


# Method families own their optional config section: a module exposing SECTION (JSON schema of the
# section), DEFAULTS (merged under the user's values) and check(cfg) (cross-references; raises
# ConfigError). Such modules must import nothing heavy (no torch): Snakemake imports them at parse time.
CONFIG_SECTIONS: Registry = Registry("config section")
CONFIG_SECTIONS.register("dex", "impl.dex.schema")
CONFIG_SECTIONS.register("tev", "impl.tev.schema")
CONFIG_SECTIONS.register("vskipper", "impl.vskipper.schema")


def _section_module(name: str):
    return CONFIG_SECTIONS[name]


def _plugin_schemas() -> dict[str, Any]:
    return {name: CONFIG_SECTIONS[name].SECTION for name in CONFIG_SECTIONS}


def _drop_null_optionals(cfg: dict) -> dict:
    """``cfg`` without the sections' optional keys given as null (a section module's ``OPTIONAL_KEYS``: keys
    whose absence means off or the default), so that an overlay's ``key: null`` turns off what an earlier
    config file set. Other nulls stay (where null is a value, e.g. ``vskipper.sglang.max_total_tokens``)."""
    out = dict(cfg)
    for name in CONFIG_SECTIONS:
        sec = out.get(name)
        keys = getattr(_section_module(name), "OPTIONAL_KEYS", ())
        if isinstance(sec, dict) and any(k in sec and sec[k] is None for k in keys):
            out[name] = {k: v for k, v in sec.items() if not (k in keys and v is None)}
    return out


def _merge(defaults: dict, cfg: dict) -> dict:
    out = copy.deepcopy(defaults)
    for k, v in cfg.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def _key_path(err: jsonschema.ValidationError) -> str:
    parts = list(err.absolute_path)
    if err.validator == "additionalProperties" and isinstance(err.instance, dict):
        allowed = set(err.schema.get("properties", {}))
        extra = sorted(set(err.instance) - allowed)
        if extra:
            parts.append(extra[0])
    elif err.validator == "propertyNames":
        parts.append(str(err.instance))
    return _join_key(parts) or "<top level>"


def _join_key(parts: list[Any]) -> str:
    """Key path in the one notation of every config error: ``ead.nested_chains[0]``, ``models.tiny-ls.kind``."""
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


def full_schema() -> dict[str, Any]:
    """The JSON schema of the whole config: :data:`SCHEMA` plus the sections method families declare
    (:data:`CONFIG_SECTIONS`)."""
    schema = copy.deepcopy(SCHEMA)
    schema["properties"].update(_plugin_schemas())
    return schema


def validate_config(cfg: dict[str, Any], *, check_paths: bool = True) -> dict[str, Any]:
    """Validate a raw config mapping and return it with defaults filled in.

    The environment variable ``IMPL_DATA_DIR``, when set, overrides ``data_dir`` (where the datasets
    are on this machine). Checks, in order: the JSON schema (unknown keys, wrong types, out-of-range
    values); prompt templates (fields must exist for their suite); cross-key
    references (``ead.models`` must name entries of ``models``, ``ead.workloads`` entries of
    ``workloads``); and, if ``check_paths``, the data files each workload and the corpus need and the
    directories of ``kind: pretrained`` models.

    Raises:
        ConfigError: one line naming the offending key or path and how to fix it.
    """
    if not isinstance(cfg, dict):
        raise ConfigError("config: top level must be a mapping")
    _check_finite(cfg, "")
    cfg = _drop_null_optionals(cfg)
    validator = jsonschema.Draft202012Validator(full_schema())
    errors = sorted(validator.iter_errors(cfg), key=lambda e: (len(list(e.absolute_path)), str(e.absolute_path)))
    if errors:
        e = errors[0]
        key = _key_path(e)
        if e.validator == "additionalProperties":
            msg = f"unknown key '{key}' (allowed here: {', '.join(sorted(e.schema.get('properties', {})))})"
        elif e.validator == "propertyNames":
            msg = f"invalid name '{key}': {e.message}"
        else:
            msg = f"bad value for '{key}': {e.message}"
        if e.validator == "required" and not list(e.absolute_path):  # a top-level key missing: an overlay alone?
            msg += (" (an overlay such as configs/sglang.yaml is merged onto a full config: "
                    "--configfile configs/default.yaml <overlay>)")
        raise ConfigError(f"config: {msg}")
    out = _merge(DEFAULTS, cfg)
    for name, m in out["models"].items():  # a GGUF source is converted into models_dir/<name> unless a path is given
        if "gguf" in m and "path" not in m:
            m["path"] = str(Path(out["models_dir"]) / name)
    out["ead"] = _merge(EAD_DEFAULTS, out["ead"])
    for name in CONFIG_SECTIONS:
        if name in out:
            mod = _section_module(name)
            out[name] = _merge(mod.DEFAULTS, out[name])
    env_data = os.environ.get("IMPL_DATA_DIR")
    if env_data:  # the environment names where the datasets are on this machine
        out["data_dir"] = env_data

    for suite, w in out["workloads"].items():
        for key in ("template", "chat"):
            if key not in w:
                continue
            try:
                names = {f for _, f, _, _ in string.Formatter().parse(w[key]) if f is not None}
            except ValueError as e:
                raise ConfigError(f"config: bad value for 'workloads.{suite}.{key}': {e}") from None
            unknown = sorted(n for n in names if n.split(".")[0].split("[")[0] not in FIELDS[suite])
            if unknown:
                raise ConfigError(
                    f"config: 'workloads.{suite}.{key}' uses unknown field(s) {unknown}; "
                    f"available: {', '.join(FIELDS[suite])}")
    for i, m in enumerate(out["ead"]["models"]):
        if m not in out["models"]:
            raise ConfigError(f"config: 'ead.models[{i}]' names '{m}', which is not a key of 'models' ({', '.join(out['models'])})")
    for i, w in enumerate(out["ead"]["workloads"]):
        if w not in out["workloads"]:
            raise ConfigError(f"config: 'ead.workloads[{i}]' names '{w}', which is not a key of 'workloads'")
    comp = out["ead"].get("compare")
    if comp:
        for role in ("baseline", "treatment"):
            if comp[role] not in out["ead"]["models"]:
                raise ConfigError(f"config: 'ead.compare.{role}' names '{comp[role]}', which is not in 'ead.models'")
        kinds = {out["models"][comp[r]]["kind"] for r in ("baseline", "treatment")}
        # shared contexts are token ids: one tokenizer. Tiny models share the DAG's; a pretrained pair is
        # taken to be one family (e.g. Llama 2 and its LayerSkip fine-tune); a tiny and a pretrained model never
        comp.setdefault("shared", len(kinds) == 1)
        if comp["shared"] and len(kinds) > 1:
            raise ConfigError("config: 'ead.compare.shared' needs one tokenizer for both models (shared contexts are "
                              f"token ids); '{comp['baseline']}' and '{comp['treatment']}' are a tiny and a pretrained "
                              "model: set shared: false")
    n_ead = out["ead"].get("n_prompts")
    if isinstance(n_ead, dict):
        for m in n_ead:
            if m not in out["ead"]["models"]:
                raise ConfigError(f"config: 'ead.n_prompts' names '{m}', which is not in 'ead.models'")
    tiny_ctx = out["tiny_arch"]["max_position_embeddings"]
    caps = {"max_prompt_tokens": out["max_prompt_tokens"],
            **{f"workloads.{s}.max_prompt_tokens": w["max_prompt_tokens"] for s, w in out["workloads"].items()
               if w.get("max_prompt_tokens") is not None}}
    key = max(caps, key=caps.get)
    need = caps[key] + max(out["ead"]["max_new_tokens"], out["ar_bench"]["max_new_tokens"])
    if any(m["kind"] == "tiny" for m in out["models"].values()) and need > tiny_ctx:
        raise ConfigError(
            f"config: '{key}' + max new tokens = {need} exceeds 'tiny_arch.max_position_embeddings' "
            f"= {tiny_ctx}; lower {key} or raise the context")
    # Chains are checked against L here when every measured model is tiny (L known from tiny_arch);
    # for pretrained models L is known only once loaded, and chains whose K do not divide L are
    # reported as not applicable in the tables.
    all_tiny = all(out["models"][m]["kind"] == "tiny" for m in out["ead"]["models"])
    L = out["tiny_arch"]["num_layers"]
    for i, chain in enumerate(out["ead"]["nested_chains"]):
        if list(chain) != sorted(set(chain)) or (all_tiny and any(L % k for k in chain)):
            raise ConfigError(
                f"config: 'ead.nested_chains[{i}]' = {chain} must be strictly increasing explorer counts K"
                + (f" that divide tiny_arch.num_layers ({L})" if all_tiny else ""))
    ctx = out["tiny_arch"]["max_position_embeddings"]
    if any(m["kind"] == "tiny" for m in out["models"].values()) and out["training"]["seq_len"] > ctx:
        raise ConfigError(f"config: 'training.seq_len' = {out['training']['seq_len']} exceeds "
                          f"'tiny_arch.max_position_embeddings' = {ctx} (the tiny models' context)")
    for name in CONFIG_SECTIONS:
        if name in out:
            _section_module(name).check(out)
    if check_paths:
        check_config_paths(out)
    return out


def check_config_paths(cfg: dict[str, Any]) -> None:
    """Check the data files and pretrained model directories a validated config needs.

    Raises:
        ConfigError: naming the missing path and the key that points at it.
    """
    data_dir = Path(cfg["data_dir"])
    if not data_dir.is_dir():
        src = " (from IMPL_DATA_DIR)" if os.environ.get("IMPL_DATA_DIR") else ""
        raise ConfigError(
            f"config: 'data_dir' = {data_dir}{src} is not a folder; point it (or the environment variable "
            f"IMPL_DATA_DIR) at {DATA_DIR_HINT}")
    for suite in cfg["workloads"]:
        try:
            check_data(suite, data_dir)
        except FileNotFoundError as e:
            raise ConfigError(f"config: workloads.{suite}: {e}") from None
    if any(m["kind"] == "tiny" for m in cfg["models"].values()):
        need = {"gsm8k_train": "gsm8k/train.jsonl", "sharegpt": "chat/sharegpt_v3_subset.jsonl"}
        for src in cfg["corpus"]["sources"]:
            if src in need:
                try:
                    need_file(data_dir / need[src])
                except FileNotFoundError as e:
                    raise ConfigError(f"config: corpus.sources ({src}): {e}") from None
    for name, m in cfg["models"].items():
        if m["kind"] == "pretrained" and "gguf" in m:
            # built by the DAG (rule convert_<name>); the source must be there (a one-line error otherwise)
            from .models.gguf import GGUFError, GGUFSource

            try:
                GGUFSource.from_config(m["gguf"]).locate()
            except GGUFError as e:
                raise ConfigError(f"config: models.{name}.gguf: {e}") from None
            continue
        if m["kind"] == "pretrained" and not (Path(m["path"]) / "config.json").is_file():
            raise ConfigError(
                f"config: 'models.{name}.path' = {m['path']} is not a Hugging Face model directory "
                "(no config.json); download the weights on a machine with access and set the path")


class _DuplicateKey(yaml.constructor.ConstructorError):
    pass


class _StrictLoader(yaml.SafeLoader):
    """YAML safe loader that refuses a key given twice in one mapping (PyYAML keeps the last silently)."""

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, Any] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                first = seen.get(key)
            except TypeError:  # unhashable key: let PyYAML report it
                continue
            if first is not None:
                raise _DuplicateKey(None, None, f"key {key!r} given twice (first at line {first.line + 1})",
                                    key_node.start_mark)
            seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: str | Path) -> Any:
    """Parse a YAML config file strictly: duplicated keys are errors; errors name line and column.

    Raises:
        ConfigError: the file is missing, unreadable, not valid YAML (``FILE:LINE:COL: problem``), or
            holds a key twice in one mapping.
    """
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    try:
        return yaml.load(p.read_text(encoding="utf-8"), Loader=_StrictLoader)  # noqa: S506 (a SafeLoader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{p}:{mark.line + 1}:{mark.column + 1}" if mark else str(p)
        what = "; ".join(x for x in (e.context, e.problem) if x) or str(e).splitlines()[0]
        if isinstance(e, _DuplicateKey):
            raise ConfigError(f"config file {where}: {what}") from None
        raise ConfigError(f"config file {where}: not valid YAML: {what}") from None
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {p} is not valid YAML: {str(e).splitlines()[0]}") from None


def _check_finite(obj: Any, where: str) -> None:
    """Refuse NaN / infinity anywhere in a config (YAML ``.nan``, ``.inf``): no setting means them."""
    if isinstance(obj, float) and not math.isfinite(obj):
        raise ConfigError(f"config: bad value for '{where or '<top>'}': {obj!r} is not a finite number")
    if isinstance(obj, dict):
        for k, v in obj.items():
            _check_finite(v, _join_key([where, k]) if where else str(k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            _check_finite(v, f"{where}[{i}]")


def load_config(path: str | Path, *, check_paths: bool = True) -> dict[str, Any]:
    """Read a YAML config file (:func:`read_yaml`) and validate it (see :func:`validate_config`).

    Raises:
        ConfigError: missing/unparsable file, a duplicated key, or an invalid config (one line, naming the
            key).
    """
    raw = read_yaml(path)
    return validate_config(raw or {}, check_paths=check_paths)


def config_from_json(text: str) -> dict[str, Any]:
    """Parse a validated config passed as JSON (how workflow rules hand the config to commands)."""
    return validate_config(json.loads(text), check_paths=False)


ADAPTED_SUFFIX = "+ad"


def variant_name(model: str, adapted: bool) -> str:
    """Name of a DEX model variant: the model name, or ``<model>+ad`` with its inducing adapters."""
    return model + ADAPTED_SUFFIX if adapted else model


def ead_prompt_limit(cfg: dict[str, Any], model: str) -> int | None:
    """EAD / AR-bench prompts per suite for ``model`` (``ead.n_prompts``), or None for the whole suite."""
    n = cfg["ead"].get("n_prompts")
    return n.get(model) if isinstance(n, dict) else n


def split_variant(variant: str) -> tuple[str, bool]:
    """Inverse of :func:`variant_name`: ``(model, adapted)``."""
    if variant.endswith(ADAPTED_SUFFIX):
        return variant[: -len(ADAPTED_SUFFIX)], True
    return variant, False


def model_dir(cfg: dict[str, Any], name: str) -> Path:
    """Directory of model ``name``: ``models_dir/name`` for tiny models, ``path`` for pretrained."""
    m = cfg["models"][name]
    return Path(m["path"]) if m["kind"] == "pretrained" else Path(cfg["models_dir"]) / name


def train_config(cfg: dict[str, Any], name: str):
    """Typed :class:`impl.models.train.TrainConfig` for tiny model ``name``."""
    from .models.train import EarlyExit, TrainConfig

    ee = cfg["models"][name].get("early_exit", {"enabled": False})
    return TrainConfig(**cfg["training"], seed=cfg["seed"], early_exit=EarlyExit(**ee))


def tiny_arch(cfg: dict[str, Any]):
    """Typed :class:`impl.models.tiny.TinyArch` of the config."""

    return TinyArch(**cfg["tiny_arch"])
