"""Typed config sections: one pydantic v2 model per section is the one source of its keys, bounds and
defaults. :func:`section_schema` generates the JSON schema that :func:`impl.config.validate_config`
checks (so errors keep their one key-path notation, ``tev.drafter.steps``), :func:`section_defaults`
the defaults merged under the user's values, and ``Model.model_validate(cfg[name])`` the typed object
a command reads (``t.drafter.steps``, not ``cfg["tev"]["drafter"]["steps"]``).

Imports pydantic only (no torch): Snakemake reads the schemas at parse time.
"""

from __future__ import annotations

import copy
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError

__all__ = ["Section", "section_schema", "section_defaults", "strict_value", "typed_section"]


class Section(BaseModel):
    """Base of every typed config section: unknown keys are errors (as in the JSON schema), values are
    immutable once validated.

    ``optional_keys`` names fields whose absence means something (a sub-section that is off unless
    given, or a mapping a user's value replaces whole): :func:`section_defaults` leaves them out of
    the defaults merged under the user's values; the section's ``check`` fills them in where needed.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    optional_keys: ClassVar[tuple[str, ...]] = ()


_SUBSCHEMA = ("items", "additionalProperties", "not", "propertyNames", "contains", "if", "then", "else")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")


def _clean(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """One schema node with pydantic's ``$ref`` inlined and its ``title`` labels dropped (only schema
    keywords are rewritten: a section field named ``title`` keeps its name)."""
    if "$ref" in node:
        target = _clean(defs[node["$ref"].rsplit("/", 1)[-1]], defs)
        return {**target, **_clean({k: v for k, v in node.items() if k != "$ref"}, defs)}
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in ("title", "$defs"):
            continue
        if key == "properties":
            out[key] = {name: _clean(sub, defs) for name, sub in value.items()}
        elif key in _SUBSCHEMA and isinstance(value, dict):
            out[key] = _clean(value, defs)
        elif key in _SUBSCHEMA_LISTS:
            out[key] = [_clean(sub, defs) for sub in value]
        else:
            out[key] = copy.deepcopy(value)
    return _ordered(_fold_null(out))


_FIRST = ("enum", "const", "type")
_LAST = ("allOf", "anyOf", "oneOf", "not", "if", "then", "else")


def _ordered(node: dict[str, Any]) -> dict[str, Any]:
    """Keywords in the order a validator should report them: the instance's type first, combinators
    last (pydantic sorts keys alphabetically; the first error at a key path is the one a user sees)."""
    head = [k for k in _FIRST if k in node]
    tail = [k for k in _LAST if k in node]
    mid = [k for k in node if k not in _FIRST and k not in _LAST]
    return {k: node[k] for k in head + mid + tail}


def _fold_null(node: dict[str, Any]) -> dict[str, Any]:
    """``X | None`` arrives as ``anyOf: [X, {"type": "null"}]``; fold it into X with ``type: [t, "null"]``
    (the same instances validate, X's other keywords ignore null) so that an error inside X names its
    own key path (``vskipper.quality.served.point``), not only the union's."""
    branches = node.get("anyOf")
    if isinstance(branches, list) and branches and all(set(b) == {"type"} and isinstance(b["type"], str)
                                                       for b in branches):
        # a union of bare types (str | int): one type list, whose error names the types
        return {**{k: v for k, v in node.items() if k != "anyOf"}, "type": [b["type"] for b in branches]}
    if not isinstance(branches, list) or len(branches) != 2 or {"type": "null"} not in branches:
        return node
    other = next(b for b in branches if b != {"type": "null"})
    if not isinstance(other.get("type"), str) or "anyOf" in other:
        return node
    rest = {k: v for k, v in node.items() if k != "anyOf"}
    out = {**other, **rest, "type": [other["type"], "null"]}
    if "enum" in out:  # enum constrains null too
        out["enum"] = [None, *out["enum"]]
    return out


def section_schema(model: type[BaseModel], *, description: str | None = None) -> dict[str, Any]:
    """The JSON schema (draft 2020-12) of a section model, self-contained (pydantic's ``$defs``
    references inlined, so it can sit under ``properties.<name>`` of the whole config's schema), without
    pydantic's titles; ``additionalProperties: false`` on every object (``extra="forbid"``).

    Raises:
        KeyError: a ``$ref`` to a definition pydantic did not emit (a bug of the model).
    """
    raw = model.model_json_schema(mode="validation")
    out = _clean(raw, raw.get("$defs", {}))
    if description is not None:
        out["description"] = description
    return out


def _dump(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, (list, tuple)):
        return [_dump(v) for v in value]
    return copy.deepcopy(value)


def section_defaults(model: type[BaseModel]) -> dict[str, Any]:
    """``{key: default}`` of every field of ``model`` that has a default (nested sections as plain
    mappings, in JSON form): what :func:`impl.config.validate_config` merges under the user's values.
    Required fields and the model's ``optional_keys`` have no entry."""
    out: dict[str, Any] = {}
    skip = set(getattr(model, "optional_keys", ()))
    for name, field in model.model_fields.items():
        if field.is_required() or name in skip:
            continue
        value = field.default_factory() if field.default_factory is not None else field.default
        out[name] = _dump(value)
    return out


def typed_section(cfg: dict[str, Any], name: str, model: type[BaseModel], *, why: str = "") -> Any:
    """The validated config's section ``name`` as a ``model`` object.

    Raises:
        SystemExit: the config has no such section (one line; ``why`` is appended).
    """
    if name not in cfg:
        raise SystemExit(f"error: the config has no '{name}' section{why}")
    return model.model_validate(cfg[name])


def strict_value(tp: Any, value: Any, where: str) -> Any:
    """``value`` checked against the type annotation ``tp`` (pydantic, strict: ``"8"`` is not an int, ``1``
    is not a bool, ``2.5`` is not an int; an int is a float), for a typed field outside a section (a
    dataclass field given on the command line or in JSON).

    Returns:
        the value as pydantic validated it.

    Raises:
        ValueError: ``"<where>: <pydantic's message>, got <value>"``.
    """
    try:
        return TypeAdapter(tp, config=ConfigDict(strict=True, arbitrary_types_allowed=True)).validate_python(value)
    except ValidationError as e:
        raise ValueError(f"{where}: {e.errors()[0]['msg']}, got {value!r}") from None
