"""Decoding methods behind one interface, for the ``decode`` command and the experiment rules.

Each method is built from a model and its parameters and decodes one prompt into a result row:
token ids, per-token metrics and timings. :func:`decode_prompts` runs a method over a prompt file
and checks every output against AR under the same decoding rule, writing the verdict into the rows.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from .spec.ar import ar_decode
from .spec.sampling import DecodeRule

METHODS = ("ar", "dex", "self_spec", "adadecode", "dynamic_exit", "hf_early_exit")
BASELINE_PARAMS = {
    "self_spec": ("exit_layer", "num_speculations"),
    "adadecode": ("shortcut_layers", "threshold", "num_speculations"),
    "dynamic_exit": ("exit_layers", "num_speculations", "confidence_threshold"),
}


def parse_exploration_set(text: str | None, explorers: int | None, L: int) -> tuple[int, ...]:
    """Exploration set from ``"4,8,12"`` or a uniform DEX-1/K set from ``explorers``.

    Raises:
        ValueError: both or neither given, a malformed list, or an invalid set / K (see
            :func:`impl.ead.accounting.validate_exploration_set`).
    """
    from .ead.accounting import uniform_exploration_set, validate_exploration_set

    if (text is None) == (explorers is None):
        raise ValueError("give exactly one of an exploration set (e.g. 4,8,12) or a number of explorers K")
    if explorers is not None:
        return uniform_exploration_set(L, explorers)
    try:
        xs = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"exploration set {text!r} is not a comma-separated list of depths") from None
    return validate_exploration_set(xs, L)


def build_method(name: str, model, rule: DecodeRule, params: dict[str, Any],
                 adapters: dict | None = None) -> Callable[[list[int], int, int | None], dict]:
    """A function ``(input_ids, max_new_tokens, eos_token_id) -> row fields`` for method ``name``.

    Every method's fields include ``token_ids``, ``seconds`` (wall time of the decode, s),
    ``stopped_at_eos`` and ``critical_layers_total``: the depth-side critical path of the whole
    generation in decoder layers (DEX Prop. 7 accounting: layers that must run one after another;
    AR charges L per token).

    Baselines (DEX Sec. 4, App. D): ``self_spec`` (LayerSkip self-speculation: ``exit_layer``,
    ``num_speculations``), ``adadecode`` (``shortcut_layers``, ``threshold``, ``num_speculations``),
    ``dynamic_exit`` (DEL: optional ``exit_layers``, ``num_speculations``, ``confidence_threshold``).
    Library reference: ``hf_early_exit`` (transformers' ``generate(assistant_early_exit=...)``, greedy
    only: ``exit_layer``, ``num_speculations``; :mod:`impl.spec.hf_early_exit`).

    Params (DEX): ``exploration_set`` (tuple of depths), ``decs`` (bool), ``single_exit`` (bool),
    ``dedupe`` (bool); ``adapters``: inducing adapters by depth (DEX App. C.2), the ones at the
    non-final depths of the exploration set are used.

    Raises:
        ValueError: unknown method or parameters, or an exploration set without adapters at some of
            its non-final depths when adapters are given.
    """
    from .models.depth import num_layers

    L = num_layers(model)
    if name == "ar":
        def run_ar(ids, n, eos):
            t0 = time.perf_counter()
            r = ar_decode(model, ids, n, eos_token_id=eos, rule=rule)
            return {"token_ids": r.tokens, "seconds": time.perf_counter() - t0,
                    "stopped_at_eos": r.stopped_at_eos, "critical_layers_total": L * len(r.tokens)}
        return run_ar
    if name == "dex":
        from .dex import DEXDecoder, ReferenceExecutor

        from .models.adapters import select_adapters

        X = tuple(params["exploration_set"])
        K = len(X)
        branch = {0, K - 1} if params.get("single_exit") else None
        used = select_adapters(adapters, X)

        def run_dex(ids, n, eos):
            ex = ReferenceExecutor(model, X, rule=rule, adapters=used)
            dec = DEXDecoder(ex, decs=bool(params.get("decs")), branch_stages=branch,
                             dedupe=bool(params.get("dedupe")))
            t0 = time.perf_counter()
            r = dec.decode(ids, n, eos_token_id=eos)
            return {
                "token_ids": r.tokens,
                "seconds": time.perf_counter() - t0,
                "stopped_at_eos": r.stopped_at_eos,
                "critical_path_seconds": r.critical_path_seconds,
                "prefill_seconds": r.prefill_seconds,
                "sequential_seconds": r.sequential_seconds,
                "profile": r.profile,
                "rounds": [m.rounds for m in r.metrics],
                "match_index": [m.match_index for m in r.metrics],
                "match_depth": [m.match_depth for m in r.metrics],
                "critical_layers": [m.critical_layers for m in r.metrics],
                "critical_layers_total": sum(m.critical_layers for m in r.metrics),
                "round_seconds": r.round_seconds,
                "adapters": bool(used),
                "max_lattice": [max(m.lattice_sizes) for m in r.metrics],
                "etks": [m.etks for m in r.metrics],
                "exploration_set": list(X),
            }
        return run_dex
    if name == "hf_early_exit":
        from .spec.hf_early_exit import check_hf_early_exit_params, hf_early_exit_decode

        unknown = sorted(set(params) - {"exit_layer", "num_speculations"})
        missing = [k for k in ("exit_layer", "num_speculations") if k not in params]
        if unknown or missing:
            raise ValueError(f"hf_early_exit: unknown {unknown} / missing {missing} parameter(s); "
                             "needs exit_layer, num_speculations")
        if rule.temperature != 0:
            raise ValueError("hf_early_exit runs greedy only (transformers' sampler draws its own noise, so its "
                             "samples cannot be compared token for token with AR's)")
        check_hf_early_exit_params(L, params["exit_layer"], params["num_speculations"])

        def run_hf(ids, n, eos):
            r = hf_early_exit_decode(model, ids, n, exit_layer=params["exit_layer"],
                                     num_speculations=params["num_speculations"], eos_token_id=eos)
            return {"token_ids": r.tokens, "seconds": r.seconds, "stopped_at_eos": r.stopped_at_eos,
                    "critical_layers_total": r.critical_layers, "draft_passes": r.draft_passes,
                    "verify_passes": r.verify_passes}
        return run_hf
    if name in BASELINE_PARAMS:
        unknown = sorted(set(params) - set(BASELINE_PARAMS[name]))
        if unknown:
            raise ValueError(f"{name}: unknown parameter(s) {unknown}; allowed: {', '.join(BASELINE_PARAMS[name])}")
        required = {"self_spec": ("exit_layer", "num_speculations"),
                    "adadecode": ("shortcut_layers", "threshold", "num_speculations")}.get(name, ())
        missing = [k for k in required if k not in params]
        if missing:
            raise ValueError(f"{name}: missing parameter(s) {missing}; needs {', '.join(required)}")
        # every value checked once here, before any prompt is decoded (the decoders check again)
        if name == "self_spec":
            from .spec.self_spec import check_self_spec_params

            check_self_spec_params(L, params["exit_layer"], params["num_speculations"])
        elif name == "adadecode":
            from .spec.adadecode import check_adadecode_params

            check_adadecode_params(L, params["shortcut_layers"], params["threshold"], params["num_speculations"])
        else:
            from .spec.dynamic_exit import check_dynamic_exit_params

            check_dynamic_exit_params(L, params.get("exit_layers"), params.get("num_speculations", 8),
                                      params.get("confidence_threshold", 0.5))
        if name == "self_spec":
            from .spec.self_spec import self_spec_decode

            call = lambda ids, n, eos: self_spec_decode(  # noqa: E731
                model, ids, n, exit_layer=params["exit_layer"], num_speculations=params["num_speculations"],
                rule=rule, eos_token_id=eos)
        elif name == "adadecode":
            from .spec.adadecode import adadecode_decode

            call = lambda ids, n, eos: adadecode_decode(  # noqa: E731
                model, ids, n, shortcut_layers=params["shortcut_layers"], threshold=params["threshold"],
                max_speculations=params["num_speculations"], rule=rule, eos_token_id=eos)
        else:
            from .spec.dynamic_exit import dynamic_exit_decode

            kw = {k: params[k] for k in ("exit_layers", "confidence_threshold") if k in params}
            if "num_speculations" in params:
                kw["max_speculations"] = params["num_speculations"]
            call = lambda ids, n, eos: dynamic_exit_decode(model, ids, n, rule=rule, eos_token_id=eos, **kw)  # noqa: E731

        def run_baseline(ids, n, eos):
            t0 = time.perf_counter()
            r = call(ids, n, eos)
            return {"token_ids": r.tokens, "seconds": time.perf_counter() - t0, "stopped_at_eos": r.stopped_at_eos,
                    "critical_layers_total": r.critical_layers, "layer_work_total": r.layer_work,
                    "spec_rounds": len(r.rounds), "drafted": sum(x.drafted for x in r.rounds),
                    "accepted": sum(x.accepted for x in r.rounds)}
        return run_baseline
    raise ValueError(f"unknown method {name!r}; choose from {', '.join(METHODS)}")


def decode_prompts(model, tokenizer, prompts: list[dict], method: str, params: dict, rule: DecodeRule,
                   max_new_tokens: int, eos_token_id: int | None, *, check_ar: bool = True,
                   progress: bool = False, adapters: dict | None = None) -> list[dict]:
    """Decode every prompt row with ``method``; rows carry ``id`` and ``input_ids`` or ``text``.

    Returns one row per prompt with the method's fields, ``n_new_tokens`` and ``ar_match`` (the ids
    equal AR's under the same rule; None when ``check_ar`` is False). A prompt that is empty, has
    neither ``input_ids`` nor ``text``, or does not fit the context yields a row with ``error``.
    """
    from tqdm import tqdm

    run = build_method(method, model, rule, params, adapters)
    rows = []
    for p in tqdm(prompts, desc=method, disable=not progress, mininterval=5):
        base = {"prompt_id": p.get("id"), "suite": p.get("suite"), "method": method,
                "params": {k: (list(v) if isinstance(v, tuple) else v) for k, v in params.items()},
                "temperature": rule.temperature, "seed": rule.seed, "max_new_tokens": max_new_tokens}
        ids = p.get("input_ids")
        if ids is None and isinstance(p.get("text"), str):
            ids = tokenizer(p["text"], add_special_tokens=False)["input_ids"]
            if ids and tokenizer.bos_token_id is not None:
                ids = [tokenizer.bos_token_id] + ids
        if not ids:
            rows.append({**base, "error": "empty prompt (no input_ids and no non-empty text)"})
            continue
        try:
            out = run(list(ids), max_new_tokens, eos_token_id)
            ref = ar_decode(model, list(ids), max_new_tokens, eos_token_id=eos_token_id, rule=rule).tokens \
                if check_ar and method != "ar" else None
        except ValueError as e:
            rows.append({**base, "error": str(e)})
            continue
        rows.append({**base, **out, "n_prompt_tokens": len(ids), "n_new_tokens": len(out["token_ids"]),
                     "ar_match": (out["token_ids"] == ref) if ref is not None else (True if method == "ar" else None)})
    return rows


__all__ = ["METHODS", "BASELINE_PARAMS", "build_method", "decode_prompts", "parse_exploration_set"]
