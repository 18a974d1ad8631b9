"""Decoding methods behind one interface, for the ``decode`` command and the experiment rules.

Each method is built from a model and its parameters and decodes one prompt into a result row:
token ids, per-token metrics and timings. :func:`decode_prompts` runs a method over a prompt file
and checks every output against AR under the same decoding rule, writing the verdict into the rows.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from tqdm import tqdm

from .dex import DEXDecoder, ReferenceExecutor
from .ead.accounting import uniform_exploration_set, validate_exploration_set
from .models.adapters import select_adapters
from .models.depth import num_layers
from .registry import Registry
from .spec.adadecode import adadecode_decode, check_adadecode_params
from .spec.ar import ar_decode
from .spec.dynamic_exit import check_dynamic_exit_params, dynamic_exit_decode
from .spec.hf_early_exit import check_hf_early_exit_params, hf_early_exit_decode
from .models.load import load_model
from .spec.hf_assisted import check_hf_assisted, hf_assisted_decode
from .spec.hf_prompt_lookup import check_hf_prompt_lookup_params, hf_prompt_lookup_decode
from .spec.lookahead import check_lookahead_params, lookahead_decode
from .spec.pearl import check_pearl, pearl_decode
from .spec.sampling import DecodeRule
from .spec.self_spec import check_self_spec_params, self_spec_decode
from .tev.decode import tev_decode
from .tev.drafter import BlockDrafter

BASELINE_PARAMS = {
    "self_spec": ("exit_layer", "num_speculations"),
    "adadecode": ("shortcut_layers", "threshold", "num_speculations"),
    "dynamic_exit": ("exit_layers", "num_speculations", "confidence_threshold"),
    "lookahead": ("window", "ngram", "max_candidates", "seed"),
    "dflash_chain": ("drafter", "depth"),
    "pearl": ("draft", "gamma"),
}


def parse_exploration_set(text: str | None, explorers: int | None, L: int) -> tuple[int, ...]:
    """Exploration set from ``"4,8,12"`` or a uniform DEX-1/K set from ``explorers``.

    Raises:
        ValueError: both or neither given, a malformed list, or an invalid set / K (see
            :func:`impl.ead.accounting.validate_exploration_set`).
    """

    if (text is None) == (explorers is None):
        raise ValueError("give exactly one of an exploration set (e.g. 4,8,12) or a number of explorers K")
    if explorers is not None:
        return uniform_exploration_set(L, explorers)
    try:
        xs = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"exploration set {text!r} is not a comma-separated list of depths") from None
    return validate_exploration_set(xs, L)


#: the decoding methods by name: builders ``(model, rule, params, adapters, L) -> decode function``
METHODS: Registry[Callable[..., Callable[[list[int], int, int | None], dict]]] = Registry("method")


def build_method(name: str, model, rule: DecodeRule, params: dict[str, Any],
                 adapters: dict | None = None) -> Callable[[list[int], int, int | None], dict]:
    """A function ``(input_ids, max_new_tokens, eos_token_id) -> row fields`` for method ``name``
    (a name of :data:`METHODS`).

    Every method's fields include ``token_ids``, ``seconds`` (wall time of the decode, s),
    ``stopped_at_eos`` and ``critical_layers_total``: the depth-side critical path of the whole
    generation in decoder layers (DEX Prop. 7 accounting: layers that must run one after another;
    AR charges L per token).

    Baselines (DEX Sec. 4, App. D): ``self_spec`` (LayerSkip self-speculation: ``exit_layer``,
    ``num_speculations``), ``adadecode`` (``shortcut_layers``, ``threshold``, ``num_speculations``),
    ``dynamic_exit`` (DEL: optional ``exit_layers``, ``num_speculations``, ``confidence_threshold``).
    Library reference: ``hf_early_exit`` (transformers' ``generate(assistant_early_exit=...)``, greedy
    only: ``exit_layer``, ``num_speculations``; :mod:`impl.spec.hf_early_exit`); ``hf_prompt_lookup``
    (transformers' prompt-lookup decoding, greedy only: ``num_tokens``, optional
    ``max_matching_ngram_size``, default 2; :mod:`impl.spec.hf_prompt_lookup`); ``hf_assisted``
    (transformers' assisted decoding with a draft model over the same vocabulary, greedy only:
    ``assistant`` (a model directory), ``num_assistant_tokens``; :mod:`impl.spec.hf_assisted`).
    Draft-free speculation: ``lookahead`` (Lookahead decoding, Fu et al. 2024: ``window`` W, ``ngram`` N,
    ``max_candidates`` G, optional ``seed`` of the window's start; greedy or sampled;
    :mod:`impl.spec.lookahead`). Trained draft head: ``dflash_chain`` (TEV's DFlash-style block
    drafter, ``drafter`` a directory saved by :meth:`impl.tev.drafter.BlockDrafter.save`, drafting a
    chain of ``depth`` tokens verified in one target pass: the EAGLE-style arm of DEX Fig. 5; greedy
    only; :func:`impl.tev.decode.tev_decode` with ``tree_mode="chain"``). Parallel draft-and-verify:
    ``pearl`` (PEARL, Liu et al. 2025: ``draft`` a model directory over the same vocabulary, ``gamma``
    the window; greedy or sampled; single-process executor whose rows add ``projected_seconds``, the
    two-device time; :mod:`impl.spec.pearl`).

    Params (DEX): ``exploration_set`` (tuple of depths), ``decs`` (bool), ``single_exit`` (bool),
    ``dedupe`` (bool); ``adapters``: inducing adapters by depth (DEX App. C.2), the ones at the
    non-final depths of the exploration set are used.

    Raises:
        ValueError: unknown method or parameters, or an exploration set without adapters at some of
            its non-final depths when adapters are given.
    """

    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; choose from {', '.join(METHODS)}")
    return METHODS[name](model, rule, params, adapters, num_layers(model))


@METHODS.register("ar")
def _ar(model, rule: DecodeRule, params: dict, adapters, L: int):
    def run_ar(ids, n, eos):
        t0 = time.perf_counter()
        r = ar_decode(model, ids, n, eos_token_id=eos, rule=rule)
        return {"token_ids": r.tokens, "seconds": time.perf_counter() - t0,
                "stopped_at_eos": r.stopped_at_eos, "critical_layers_total": L * len(r.tokens)}
    return run_ar


@METHODS.register("dex")
def _dex(model, rule: DecodeRule, params: dict, adapters, L: int):
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


def _check_names(name: str, params: dict, allowed: tuple[str, ...], required: tuple[str, ...]) -> None:
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise ValueError(f"{name}: unknown parameter(s) {unknown}; allowed: {', '.join(allowed)}")
    missing = [k for k in required if k not in params]
    if missing:
        raise ValueError(f"{name}: missing parameter(s) {missing}; needs {', '.join(required)}")


def _spec_row(call):
    """Decode function of a speculative baseline: its result as row fields."""
    def run_baseline(ids, n, eos):
        t0 = time.perf_counter()
        r = call(ids, n, eos)
        return {"token_ids": r.tokens, "seconds": time.perf_counter() - t0, "stopped_at_eos": r.stopped_at_eos,
                "critical_layers_total": r.critical_layers, "layer_work_total": r.layer_work,
                "spec_rounds": len(r.rounds), "drafted": sum(x.drafted for x in r.rounds),
                "accepted": sum(x.accepted for x in r.rounds)}
    return run_baseline


@METHODS.register("self_spec")
def _self_spec(model, rule: DecodeRule, params: dict, adapters, L: int):
    _check_names("self_spec", params, BASELINE_PARAMS["self_spec"], ("exit_layer", "num_speculations"))
    # every value checked once here, before any prompt is decoded (the decoders check again)
    check_self_spec_params(L, params["exit_layer"], params["num_speculations"])
    return _spec_row(lambda ids, n, eos: self_spec_decode(
        model, ids, n, exit_layer=params["exit_layer"], num_speculations=params["num_speculations"],
        rule=rule, eos_token_id=eos))


@METHODS.register("adadecode")
def _adadecode(model, rule: DecodeRule, params: dict, adapters, L: int):
    _check_names("adadecode", params, BASELINE_PARAMS["adadecode"], ("shortcut_layers", "threshold", "num_speculations"))
    check_adadecode_params(L, params["shortcut_layers"], params["threshold"], params["num_speculations"])
    return _spec_row(lambda ids, n, eos: adadecode_decode(
        model, ids, n, shortcut_layers=params["shortcut_layers"], threshold=params["threshold"],
        max_speculations=params["num_speculations"], rule=rule, eos_token_id=eos))


@METHODS.register("dynamic_exit")
def _dynamic_exit(model, rule: DecodeRule, params: dict, adapters, L: int):
    _check_names("dynamic_exit", params, BASELINE_PARAMS["dynamic_exit"], ())
    check_dynamic_exit_params(L, params.get("exit_layers"), params.get("num_speculations", 8),
                              params.get("confidence_threshold", 0.5))
    kw = {k: params[k] for k in ("exit_layers", "confidence_threshold") if k in params}
    if "num_speculations" in params:
        kw["max_speculations"] = params["num_speculations"]
    return _spec_row(lambda ids, n, eos: dynamic_exit_decode(model, ids, n, rule=rule, eos_token_id=eos, **kw))


@METHODS.register("hf_early_exit")
def _hf_early_exit(model, rule: DecodeRule, params: dict, adapters, L: int):
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


@METHODS.register("hf_prompt_lookup", aliases=("prompt_lookup",))
def _hf_prompt_lookup(model, rule: DecodeRule, params: dict, adapters, L: int):
    _check_names("hf_prompt_lookup", params, ("num_tokens", "max_matching_ngram_size"), ("num_tokens",))
    if rule.temperature != 0:
        raise ValueError("hf_prompt_lookup runs greedy only (transformers' sampler draws its own noise, so its "
                         "samples cannot be compared token for token with AR's)")
    ngram = params.get("max_matching_ngram_size", 2)
    check_hf_prompt_lookup_params(params["num_tokens"], ngram)

    def run_lookup(ids, n, eos):
        r = hf_prompt_lookup_decode(model, ids, n, num_tokens=params["num_tokens"], max_matching_ngram_size=ngram,
                                    eos_token_id=eos)
        return {"token_ids": r.tokens, "seconds": r.seconds, "stopped_at_eos": r.stopped_at_eos,
                "critical_layers_total": r.critical_layers, "verify_passes": r.verify_passes}
    return run_lookup


@METHODS.register("hf_assisted", aliases=("assisted",))
def _hf_assisted(model, rule: DecodeRule, params: dict, adapters, L: int):
    _check_names("hf_assisted", params, ("assistant", "num_assistant_tokens"), ("assistant", "num_assistant_tokens"))
    if rule.temperature != 0:
        raise ValueError("hf_assisted runs greedy only (transformers' sampler draws its own noise, so its "
                         "samples cannot be compared token for token with AR's)")
    a = params["assistant"]
    assistant = a if hasattr(a, "generate") else load_model(a, dtype=next(model.parameters()).dtype)
    assistant = assistant.to(next(model.parameters()).device).eval()
    check_hf_assisted(model, assistant, params["num_assistant_tokens"])

    def run_assisted(ids, n, eos):
        r = hf_assisted_decode(model, assistant, ids, n, num_assistant_tokens=params["num_assistant_tokens"],
                               eos_token_id=eos)
        return {"token_ids": r.tokens, "seconds": r.seconds, "stopped_at_eos": r.stopped_at_eos,
                "critical_layers_total": r.critical_layers, "target_passes": r.target_passes,
                "draft_passes": r.draft_passes, "draft_layers_total": r.draft_layers}
    return run_assisted


@METHODS.register("lookahead")
def _lookahead(model, rule: DecodeRule, params: dict, adapters, L: int):
    _check_names("lookahead", params, BASELINE_PARAMS["lookahead"], ("window", "ngram", "max_candidates"))
    W, N, G = check_lookahead_params(params["window"], params["ngram"], params["max_candidates"])
    seed = params.get("seed", 0)
    return _spec_row(lambda ids, n, eos: lookahead_decode(model, ids, n, window=W, ngram=N, max_candidates=G,
                                                          rule=rule, eos_token_id=eos, seed=seed))



@METHODS.register("dflash_chain", aliases=("trained_head",))
def _dflash_chain(model, rule: DecodeRule, params: dict, adapters, L: int):
    _check_names("dflash_chain", params, BASELINE_PARAMS["dflash_chain"], ("drafter", "depth"))
    if rule.temperature != 0:
        raise ValueError("dflash_chain runs greedy here (at T > 0 TEV's verifiers are exact in distribution, "
                         "not token for token with AR; the TEV cells cover that)")
    d = params["drafter"]
    drafter = d if hasattr(d, "block_size") else BlockDrafter.load(d, model)
    depth = params["depth"]
    H = int(drafter.block_size)
    if isinstance(depth, bool) or not isinstance(depth, int) or not 1 <= depth <= H:
        raise ValueError(f"dflash_chain: depth={depth!r} must be an int in [1, the drafter's block size {H}]")

    n_draft_layers = int(drafter.config.n_layers)

    def run_chain(ids, n, eos):
        t0 = time.perf_counter()
        r = tev_decode(model, drafter, ids, n, budget=depth, depth=depth, verifier="tev", temperature=0.0,
                       eos_token_id=eos, tree_mode="chain")
        return {"token_ids": r.tokens, "seconds": time.perf_counter() - t0, "stopped_at_eos": r.stopped_at_eos,
                # per round: the drafter's block pass (its own layers, the target's width) + one target pass
                "critical_layers_total": (L + n_draft_layers) * r.rounds, "spec_rounds": r.rounds,
                "drafted": sum(r.tree_sizes),
                "accepted": sum(min(t - 1, c) for t, c in zip(r.taus, r.committed))}
    return run_chain



@METHODS.register("pearl")
def _pearl(model, rule: DecodeRule, params: dict, adapters, L: int):
    _check_names("pearl", params, BASELINE_PARAMS["pearl"], ("draft", "gamma"))
    d = params["draft"]
    draft = d if hasattr(d, "generate") else load_model(d, dtype=next(model.parameters()).dtype)
    draft = draft.to(next(model.parameters()).device).eval()
    g = check_pearl(model, draft, params["gamma"])

    def run_pearl(ids, n, eos):
        r = pearl_decode(model, draft, ids, n, gamma=g, rule=rule, eos_token_id=eos)
        kinds = [x.kind for x in r.rounds]
        return {"token_ids": r.tokens, "seconds": r.seconds, "stopped_at_eos": r.stopped_at_eos,
                "critical_layers_total": r.critical_layers, "layer_work_total": r.layer_work,
                "projected_seconds": r.projected_seconds, "prefill_seconds": r.prefill_seconds,
                "critical_path_seconds": r.projected_seconds,  # the two-device time, as DEX's K-device one
                "spec_rounds": len(r.rounds), "drafted": sum(x.drafted for x in r.rounds),
                "accepted": sum(x.accepted for x in r.rounds), "target_passes": r.target_passes,
                "draft_passes": r.draft_passes, "rounds_by_kind": {k: kinds.count(k) for k in sorted(set(kinds))}}
    return run_pearl


def decode_prompts(model, tokenizer, prompts: list[dict], method: str, params: dict, rule: DecodeRule,
                   max_new_tokens: int, eos_token_id: int | None, *, check_ar: bool = True,
                   progress: bool = False, adapters: dict | None = None) -> list[dict]:
    """Decode every prompt row with ``method``; rows carry ``id`` and ``input_ids`` or ``text``.

    Returns one row per prompt with the method's fields, ``n_new_tokens`` and ``ar_match`` (the ids
    equal AR's under the same rule; None when ``check_ar`` is False). A prompt that is empty, has
    neither ``input_ids`` nor ``text``, or does not fit the context yields a row with ``error``.
    """

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
