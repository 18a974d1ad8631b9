"""DEL: self-speculative decoding with a context-aware dynamic exit layer and speculation length.

Source: Entezari Zarch, Gao, Jiang and Annavaram, "DEL: Context-Aware Dynamic Exit Layer for Efficient
Self-Speculative Decoding" (COLM 2025, arXiv:2504.05598): token-per-layer (TPL) exit selection,
shadow-token acceptance estimates for every layer, dynamic draft exiting; DEX paper Sec. 4 (DEL
baseline, run with its dynamic configuration, App. D). The draft/verify round itself is LayerSkip's
(:mod:`impl.spec.self_spec`, with KV reuse of the early layers) and is lossless for any choice of
exit layer and length, so DEL's choices only change the cost.

The exact rule implemented here (our reading of DEL; its official constants are not used):

* **Acceptance estimates.** For each candidate exit layer l, decayed counts ``m_l`` (shadow matches)
  and ``c_l`` (valid rows) give ``alpha_l = (m_l + prior_acceptance * prior_weight) /
  (c_l + prior_weight)``. After a round that accepted ``a`` drafts, the valid rows are ``0..a`` (their
  context is the committed prefix); for each, the shadow token of layer l is
  ``rule.decode(readout(h_l), position)`` from the hidden state after layer l that the round already
  computed (layers <= E while drafting, layers > E in verification), and it matches when it equals the
  final-depth token. Then ``m_l <- decay * m_l + matches_l`` and ``c_l <- decay * c_l + (a + 1)``:
  older context counts less (context awareness).
* **Token-per-layer selection.** Before each round,
  ``(E, d) = argmax_{l in exit_layers, 1 <= d <= max_speculations} TPL(l, d)`` with
  ``TPL(l, d) = (sum_{i=0}^{d} alpha_l^i) / (d * l + L)``: expected tokens committed per round
  (accepted drafts + the bonus, i.i.d. acceptance alpha_l) over the sequential layers the round costs
  (d drafts of l layers + one L-layer verification). Ties go to the smaller l, then the smaller d.
* **Dynamic draft exiting.** Drafting stops early after a draft whose confidence (max softmax
  probability of the exit-layer readout; softmax(z / T) when sampling) is below
  ``confidence_threshold``; that draft is still verified. 0 disables it; at least one token is drafted.

Accounting is LayerSkip's per round (see :mod:`impl.spec.self_spec`): ``layer_work = (k+1)*L`` and
``critical_layers = k*E + L`` for k drafted tokens; the shadow readouts are counted in
``readout_rows`` (they are LM-head work, not decoder-layer work).
"""

from __future__ import annotations

import time
from typing import Any
from dataclasses import dataclass, field

import torch

from ..models.depth import num_layers
from .sampling import DecodeRule
from .self_spec import (
    SelfSpecResult,
    SpecRound,
    _check_decode_args,
    _check_float,
    _check_int,
    _SelfSpecEngine,
    _sync,
)


@dataclass
class DELRound(SpecRound):
    """A :class:`impl.spec.self_spec.SpecRound` plus DEL's choice.

    Attributes:
        alpha: acceptance estimate alpha_E of the chosen exit layer when it was chosen.
        tpl: predicted TPL(E, planned) of the choice (tokens per sequential layer).
    """

    alpha: float
    tpl: float


@dataclass(kw_only=True)
class DELResult(SelfSpecResult):
    """Output of :func:`dynamic_exit_decode`: the fields of
    :class:`impl.spec.self_spec.SelfSpecResult` (``rounds`` holds :class:`DELRound`) plus

    Attributes:
        acceptance_estimates: final alpha_l per candidate exit layer l (1-based).
    """

    acceptance_estimates: dict[int, float] = field(default_factory=dict)


def token_per_layer(alpha: float, exit_layer: int, speculation_length: int, L: int) -> float:
    """DEL's TPL(l, d) = (sum_{i=0}^{d} alpha^i) / (d * l + L): expected committed tokens per round
    over sequential layers per round. ``alpha`` in [0, 1]; returns tokens per layer."""
    return sum(alpha ** i for i in range(speculation_length + 1)) / (speculation_length * exit_layer + L)


def check_dynamic_exit_params(L: int, exit_layers: Any, max_speculations: Any,
                              confidence_threshold: Any) -> tuple[list[int], int, float]:
    """Validate DEL parameters for an ``L``-layer model before decoding.

    Returns:
        ``(exit_layers, max_speculations, confidence_threshold)``; ``exit_layers`` sorted, every
        layer in ``[1, L-1]`` when ``None`` was given.

    Raises:
        ValueError: ``L`` < 2, empty / duplicate / out-of-range ``exit_layers``,
            ``max_speculations`` < 1, ``confidence_threshold`` outside [0, 1].
    """
    if L < 2:
        raise ValueError(f"DEL needs a model with >= 2 layers, got L={L}")
    if exit_layers is None:
        cands = list(range(1, L))
    else:
        cands = [_check_int("exit_layers entry", e, 1, L - 1) for e in exit_layers]
        if not cands:
            raise ValueError("exit_layers is empty")
        if len(set(cands)) != len(cands):
            raise ValueError(f"exit_layers {cands} has duplicates")
        cands = sorted(cands)
    dmax = _check_int("max_speculations", max_speculations, 1)
    thr = _check_float("confidence_threshold", confidence_threshold, 0.0, 1.0)
    return cands, dmax, thr


@torch.no_grad()
def dynamic_exit_decode(
    model,
    input_ids: list[int],
    max_new_tokens: int,
    *,
    exit_layers=None,
    max_speculations: int = 8,
    confidence_threshold: float = 0.5,
    decay: float = 0.9,
    prior_acceptance: float = 0.5,
    prior_weight: float = 1.0,
    rule: DecodeRule = DecodeRule(),
    eos_token_id: int | None = None,
) -> DELResult:
    """DEL dynamic-exit self-speculative decoding, batch 1, lossless (DEL method section; DEX Sec. 4).

    Args:
        model: Hugging Face causal LM (Llama/Qwen family with a shared final norm and LM head), eval.
        input_ids: prompt token ids (non-empty list of int in ``[0, V)``).
        max_new_tokens: maximum number of generated tokens (>= 1).
        exit_layers: candidate draft exit depths (1-based, in ``[1, L-1]``, distinct); None for all
            of ``1..L-1``.
        max_speculations: largest speculation length d considered (>= 1).
        confidence_threshold: dynamic draft exiting threshold in ``[0, 1]`` (module docstring).
        decay: per-round decay of the acceptance counts, in ``(0, 1]`` (1: plain running totals).
        prior_acceptance: alpha prior in ``[0, 1]`` before any evidence.
        prior_weight: pseudo-count of the prior, > 0.
        rule: final-depth decoding rule (greedy, or Gumbel-max keyed by (seed, position)).
        eos_token_id: stop after committing this id (None: never stop early).

    Returns:
        :class:`DELResult`; ``tokens`` equal :func:`impl.spec.ar.ar_decode`'s under the same rule.

    Raises:
        ValueError: empty prompt, ids outside the vocabulary, ``max_new_tokens`` < 1, context overflow,
            empty / duplicate / out-of-range ``exit_layers``, or any parameter outside its range.
    """
    L = num_layers(model)
    ids = _check_decode_args(model, input_ids, max_new_tokens, eos_token_id)
    cands, dmax, thr = check_dynamic_exit_params(L, exit_layers, max_speculations, confidence_threshold)
    beta = _check_float("decay", decay, 0.0, 1.0, lo_open=True)
    a0 = _check_float("prior_acceptance", prior_acceptance, 0.0, 1.0)
    w0 = _check_float("prior_weight", prior_weight, 0.0, float("inf"), lo_open=True)

    matches = {l: 0.0 for l in cands}
    counts = {l: 0.0 for l in cands}

    def alpha(l: int) -> float:
        return (matches[l] + a0 * w0) / (counts[l] + w0)

    eng = _SelfSpecEngine(model, ids, max_new_tokens, rule, eos_token_id)
    rx = eng.rx
    _sync(rx.device)
    t0 = time.perf_counter()
    eng.prefill()
    _sync(rx.device)
    t_pre = time.perf_counter() - t0
    rounds: list[DELRound] = []
    while not eng.done:
        best = None
        for l in cands:
            al = alpha(l)
            for d in range(1, dmax + 1):
                key = (token_per_layer(al, l, d, L), -l, -d)
                if best is None or key > best[0]:
                    best = (key, l, d, al)
        (tpl, _, _), E, d, al = best
        n = len(eng.ids)
        rec, per_layer, ys, a = eng.round(E, d, stop_below=thr if thr > 0 else None, collect=True)
        eng.rounds[-1] = DELRound(**vars(rec), alpha=al, tpl=tpl)
        rounds.append(eng.rounds[-1])
        # Shadow-token analysis over the valid rows 0..a (rows after a saw a rejected draft).
        valid = a + 1
        h = torch.stack([per_layer[i][l - 1] for l in cands for i in range(valid)])
        shadow = rule.decode_rows(rx.readout(h), [n + i for _ in cands for i in range(valid)])
        for ci, l in enumerate(cands):
            hit = sum(int(shadow[ci * valid + i] == ys[i]) for i in range(valid))
            matches[l] = beta * matches[l] + hit
            counts[l] = beta * counts[l] + valid
    _sync(rx.device)
    return DELResult(
        tokens=eng.tokens, stopped_at_eos=eng.stopped, rounds=rounds, layer_work=rx.layer_work,
        critical_layers=rx.critical_layers, readout_rows=rx.readout_rows,
        seconds=time.perf_counter() - t0, prefill_seconds=t_pre,
        acceptance_estimates={l: alpha(l) for l in cands})
