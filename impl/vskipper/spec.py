"""The skipper-spec grammar: a compact string (or mapping) naming a registered skip policy and its
parameters, as the server's ``--skipper`` flag, the config's ``vskipper`` section and the experiment
commands write it (``randomskip:r=0.5,d=0.5``, ``flexidepth:DIR``, ``static:n_run=4,layers=6-11``,
``NAME:k=v,...`` for any policy registered with :func:`~impl.vskipper.skipper.register_skipper`).
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any, Mapping

from .skipper import SKIPPERS, Skipper, build_skipper

__all__ = ["check_skipper_spec", "describe_skipper", "parse_layers", "parse_literal", "parse_skipper_spec"]


def parse_layers(text: str, num_layers: int) -> list[int]:
    """Parse a layer list: ``+``-separated items, each an index or an inclusive range ``a-b``
    (e.g. ``"6-11"``, ``"0+2+4-7"``).

    Raises:
        ValueError: for a malformed item, an empty list, or an index outside ``[0, num_layers)``.
    """
    out: list[int] = []
    for item in str(text).replace(" ", "").split("+"):
        if not item:
            continue
        try:
            if "-" in item:
                a, b = item.split("-", 1)
                out.extend(range(int(a), int(b) + 1))
            else:
                out.append(int(item))
        except ValueError:
            raise ValueError(f"bad layer item {item!r} in {text!r} (use e.g. '6-11' or '0+2+4-7')") from None
    if not out:
        raise ValueError(f"empty layer list {text!r}")
    bad = [x for x in out if not 0 <= x < num_layers]
    if bad:
        raise ValueError(f"layers {bad} outside the model's {num_layers} layers")
    return sorted(set(out))


def parse_literal(v: str):
    """A ``KEY=VALUE`` value as int, float, bool, None or (else) the string itself."""
    low = v.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for cast in (int, float):
        try:
            return cast(v)
        except ValueError:
            pass
    return v


def _kv(rest: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in rest.split(","):
        item = item.strip()
        if not item:
            continue
        if "=" not in item:
            raise ValueError(f"skipper parameter {item!r} is not KEY=VALUE")
        k, v = item.split("=", 1)
        out[k.strip()] = v.strip()
    return out


def _num_layers(model) -> int | None:
    if model is None:
        return None
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return int(cfg.num_hidden_layers)


def _name_and_params(spec: Any) -> tuple[str, dict[str, Any]]:
    """``(canonical registered name, parameters)`` of a string or mapping spec."""
    if isinstance(spec, Mapping):
        kw = dict(spec)
        name = str(kw.pop("name", "")).strip().lower()
    else:
        s = str(spec).strip()
        if not s:
            raise ValueError("empty skipper spec")
        if Path(s).is_dir() and (Path(s) / "flexidepth.json").is_file():
            name, rest = "flexidepth", s
        else:
            name, _, rest = s.partition(":")
            name = name.strip().lower()
        rest = rest.strip()
        if rest and "=" not in rest and "," not in rest:
            kw = {"checkpoint": rest}
        else:
            kw = {k: parse_literal(v) for k, v in _kv(rest).items()}
    if not name:
        raise ValueError(f"skipper spec {spec!r} has no name")
    return SKIPPERS.canonical(name), kw  # RegistryError (a ValueError) lists the registered names


def parse_skipper_spec(spec: Any, model=None, *, num_layers: int | None = None) -> Skipper:
    """Build a skip policy from a compact spec, through the skipper registry
    (:data:`~impl.vskipper.skipper.SKIPPERS`: any registered name or alias).

    Accepted forms:

    - a :class:`~impl.vskipper.skipper.Skipper` (returned as is);
    - ``"NAME:k=v,..."``: the policy registered as ``NAME`` built with the parameters, values parsed as
      int / float / bool / None / str (:func:`parse_literal`). ``layers=L`` (:func:`parse_layers`
      syntax, e.g. ``6-11``) becomes the policy's ``routed_layers``; a policy that takes
      ``routed_layers`` gets, when none is given, the second half of the model's layers (FlexiDepth
      routes the last 16 of 32). A policy whose factory names a ``model`` parameter receives ``model``.
      One value without ``=`` is the ``checkpoint`` (``flexidepth:DIR``). Examples:
      ``randomskip:r=0.5,d=0.5[,seed=S][,layers=L][,layer_choice=per_row|fixed]`` (also ``random:``),
      ``flexidepth:DIR`` / ``flexidepth:checkpoint=DIR``, ``static:n_run=N[,layers=L]`` (also
      ``static-depth:``);
    - a bare FlexiDepth checkpoint directory;
    - a mapping ``{"name": NAME, **kwargs}`` (values used as they are).

    Args:
        spec: the spec.
        model: the causal LM the policy is for (number of layers for the default ``routed_layers``,
            device / dtype and shape checks for checkpoints).
        num_layers: the number of layers when no ``model`` is given (the start-up check,
            :func:`check_skipper_spec`).

    Raises:
        ValueError: for an empty or malformed spec, missing or unknown parameters, or an unknown name.
        FileNotFoundError: for a missing checkpoint directory.
    """
    if isinstance(spec, Skipper):
        return spec
    name, kw = _name_and_params(spec)
    factory = SKIPPERS.get_entry(name)
    params = inspect.signature(factory).parameters
    L = _num_layers(model) if model is not None else num_layers
    if "layers" in kw:
        raw = kw.pop("layers")
        kw["routed_layers"] = ([int(x) for x in raw] if isinstance(raw, (list, tuple))
                               else parse_layers(str(raw), L if L is not None else 1 << 30))
    elif "routed_layers" in params and "routed_layers" not in kw:
        if L is None:
            raise ValueError(f"skipper {name!r}: pass layers=... or a model (default: the second half)")
        kw["routed_layers"] = list(range(L // 2, L))
    if "model" in params and "model" not in kw:
        kw["model"] = model
    _check_params(name, params, kw)
    try:
        return build_skipper(name, **kw)
    except TypeError as exc:  # a constructor that takes **kwargs and refuses one of them
        raise ValueError(f"skipper {name!r}: bad parameters {sorted(kw)} ({exc})") from None


def _check_params(name: str, params: Mapping[str, inspect.Parameter], kw: Mapping[str, Any]) -> None:
    """Name the missing and the unknown parameters of a spec against the policy's constructor."""
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    named = {k: p for k, p in params.items() if p.kind in kinds}
    missing = [k for k, p in named.items() if p.default is inspect.Parameter.empty and k not in kw]
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    unknown = [] if takes_any else sorted(k for k in kw if k not in named)
    if missing or unknown:
        shown = ["layers" if k == "routed_layers" else k for k in named]
        parts = ([f"missing {', '.join(missing)}"] if missing else []) + ([f"unknown {', '.join(unknown)}"] if unknown else [])
        raise ValueError(f"skipper {name!r}: {'; '.join(parts)} (its parameters: {', '.join(shown)})")


def check_skipper_spec(spec: Any, num_layers: int) -> None:
    """Validate a skipper spec before any weights are loaded (the server's and the commands' start-up
    check): grammar, registered name, parameters and their ranges, layer indices against
    ``num_layers``. A policy built without the model (RandomSkip, static) is built once and
    dropped; a policy that needs the model (FlexiDepth) gets its checkpoint
    directory checked, and its shapes are checked when :func:`parse_skipper_spec` binds it.

    Raises:
        ValueError: as :func:`parse_skipper_spec`; FileNotFoundError: for a missing checkpoint directory.
    """
    if spec is None or isinstance(spec, Skipper):
        return
    name, kw = _name_and_params(spec)
    if "model" in inspect.signature(SKIPPERS.get_entry(name)).parameters:
        ckpt = kw.get("checkpoint")
        if ckpt is not None and not Path(str(ckpt)).is_dir():
            raise FileNotFoundError(f"skipper {name!r}: checkpoint directory not found: {ckpt}")
        return
    parse_skipper_spec(spec, num_layers=num_layers)


def describe_skipper(sk: Skipper | None) -> dict | None:
    """JSON-able summary of a bound policy (class, routed layers, repr, skip ratio), or None."""
    if sk is None:
        return None
    out = {"class": type(sk).__name__, "routed_layers": list(sk.routed_layers), "repr": sk.extra_repr()}
    ratio = getattr(sk, "skip_ratio", None)
    if isinstance(ratio, (int, float)):
        out["skip_ratio"] = float(ratio)
    return out


