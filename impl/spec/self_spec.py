"""LayerSkip self-speculative decoding (LSSD), a lossless depth-selection baseline of DEX.

Source: Elhoushi et al., "LayerSkip: Enabling Early Exit Inference and Self-Speculative Decoding"
(ACL 2024, arXiv:2404.16710), method section on self-speculative decoding (self-drafting,
self-verification, and reuse of the single KV cache and of the exit layer's states);
DEX paper Sec. 4 ("Baselines and setup", LSSD) and App. D (grid: exit layer x speculation length).

One round, with committed prefix ``x_0 .. x_{n-1}`` (all L layers of positions ``0 .. n-2`` cached,
``x_{n-1}`` not yet processed):

1. **Draft.** ``x_{n-1}, d_0, .., d_{k-2}`` are fed one at a time through layers ``1..E`` with the
   early layers' KV cache, and ``d_i = rule.decode(readout_E, n + i)`` (shared final norm + LM head,
   :func:`impl.models.depth.readout_logits`).
2. **Verify.** The last draft ``d_{k-1}`` is run through layers ``1..E``; then layers ``E+1..L`` run
   once over all ``k + 1`` rows ``[x_{n-1}, d_0, .., d_{k-1}]`` starting from their saved layer-E
   hidden states. Layers ``1..E`` of drafted tokens are therefore computed exactly once: their KV,
   written during drafting, is reused by the verifier (LayerSkip's KV-cache reuse).
3. **Accept.** ``y_i = rule.decode(final_logits_i, n + i)`` for ``i = 0..k``; the longest prefix with
   ``d_i == y_i`` is accepted, plus ``y_a`` (the correction, or the bonus token when all k match).
   With greedy decoding, or Gumbel-max sampling whose noise is a pure function of (seed, position)
   (:class:`impl.spec.sampling.DecodeRule`), every committed token is exactly the token AR commits.
   The KV entries of rejected rows are cropped from every layer.

Layer-work accounting (what every method in ``impl.spec`` charges; prompt prefill excluded):

* ``layer_work``: token-layer evaluations, i.e. each decoder layer applied to one token row counts 1,
  rejected rows included. Per LSSD round with ``k`` drafts: ``k*E`` (drafting) + ``E`` (early layers
  of the last draft) + ``(k+1)*(L-E)`` (deep verification) = ``(k+1)*L``. AR charges ``L`` per token.
* ``critical_layers``: sequential depth, i.e. each forward over a layer range counts its number of
  layers once, however many rows it batches. Per LSSD round: ``k*E + L`` (the denominator of DEL's
  token-per-layer metric and the selection-cost shape of DEX Eq. 4). AR charges ``L`` per token, so
  ``L*T / critical_layers`` is the depth-side speedup in the accounting of DEX Eq. 12.
* ``readout_rows``: rows passed through the final norm + LM head (not decoder layers; reported so
  that readout overhead is visible).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from transformers import DynamicCache

from ..models.depth import embed, num_layers, readout_logits, run_layers
from .ar import check_prompt_ids
from .result import DraftVerifyResult
from .sampling import DecodeRule

# --------------------------------------------------------------------------------------------------
# Shared helpers (also used by impl.spec.adadecode and impl.spec.dynamic_exit)
# --------------------------------------------------------------------------------------------------


def _check_int(name: str, value, lo: int, hi: int | None = None) -> int:
    """``value`` as an int in ``[lo, hi]``; ValueError naming ``name`` otherwise (bools rejected)."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        rng = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise ValueError(f"{name}={value} is outside {rng}")
    return value


def _check_float(name: str, value, lo: float, hi: float, *, lo_open: bool = False) -> float:
    """``value`` as a float in ``[lo, hi]`` (``(lo, hi]`` when ``lo_open``); ValueError otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    v = float(value)
    if not (lo < v if lo_open else lo <= v) or not v <= hi or v != v:
        raise ValueError(f"{name}={value} is outside {'(' if lo_open else '['}{lo}, {hi}]")
    return v


def _check_decode_args(model, input_ids, max_new_tokens, eos_token_id) -> list[int]:
    """Validate the arguments every decoder shares; returns the prompt as a list of ints.

    Raises:
        ValueError: empty prompt or ids outside the vocabulary (:func:`check_prompt_ids`),
            ``max_new_tokens`` < 1, prompt + new tokens beyond ``config.max_position_embeddings``, or an
            ``eos_token_id`` outside the vocabulary.
    """
    ids = list(input_ids)
    check_prompt_ids(model, ids)
    _check_int("max_new_tokens", max_new_tokens, 1)
    ctx = getattr(model.config, "max_position_embeddings", None)
    if ctx is not None and len(ids) + max_new_tokens > ctx:
        raise ValueError(
            f"prompt of {len(ids)} tokens + {max_new_tokens} new tokens exceeds the context of {ctx}")
    if eos_token_id is not None:
        _check_int("eos_token_id", eos_token_id, 0, model.config.vocab_size - 1)
    return ids


def _confidence(logits: torch.Tensor, rule) -> float:
    """Max probability of the distribution the rule decodes from: softmax(z) when greedy,
    softmax(z / T) when sampling. ``logits`` ``[V]``; returns a float in (0, 1]."""
    z = logits.float()
    if not getattr(rule, "greedy", True):
        z = z / rule.temperature
    return float(torch.softmax(z, dim=-1).max())


def _causal_mask(model, past: int, n: int, dtype: torch.dtype, device) -> torch.Tensor:
    """4D mask ``[1, 1, n, past + n]`` for n query rows at positions ``past .. past+n-1`` over a cache
    of ``past`` entries: boolean (True = attend) or, for eager attention, additive float."""
    allowed = torch.ones(n, past + n, dtype=torch.bool, device=device)
    allowed[:, past:] = torch.tril(torch.ones(n, n, dtype=torch.bool, device=device))
    allowed = allowed[None, None]
    if getattr(model.config, "_attn_implementation", None) == "eager":
        out = torch.zeros(allowed.shape, dtype=dtype, device=device)
        return out.masked_fill(~allowed, torch.finfo(dtype).min)
    return allowed


class _Runner:
    """Batch-1 layer-range executor over one KV cache whose layers may hold different lengths.

    Every forward goes through :func:`impl.models.depth.run_layers` with an explicit causal mask sized
    for the cache length of the layers it runs (those must agree), and is charged to the counters:
    ``layer_work += rows * layers``, ``critical_layers += layers``.
    """

    def __init__(self, model):
        self.model = model
        self.L = num_layers(model)
        self.cache = DynamicCache(config=model.config)
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.layer_work = 0
        self.critical_layers = 0
        self.readout_rows = 0

    def length(self, layer: int) -> int:
        """Cached entries of 0-based decoder layer ``layer``."""
        return self.cache.layers[layer].get_seq_length()

    def embed(self, tokens: list[int]) -> torch.Tensor:
        return embed(self.model, torch.tensor([tokens], dtype=torch.long, device=self.device))

    def run(self, hidden: torch.Tensor, start: int, end: int, pos0: int,
            on_layer: Callable[[int, torch.Tensor], None] | None = None) -> torch.Tensor:
        """Run layers ``start+1..end`` on ``hidden`` ``[1, S, H]`` whose rows sit at absolute positions
        ``pos0 .. pos0+S-1``; the cache of those layers must hold exactly positions ``0 .. pos0-1``."""
        S = hidden.shape[1]
        if end <= start or S == 0:
            return hidden
        lens = {self.length(i) for i in range(start, end)}
        if lens != {pos0}:
            raise RuntimeError(f"cache lengths {sorted(lens)} of layers {start + 1}..{end} != position {pos0}")
        pos = torch.arange(pos0, pos0 + S, device=self.device).unsqueeze(0)
        mask = _causal_mask(self.model, pos0, S, hidden.dtype, self.device)
        out = run_layers(self.model, hidden, start, end, position_ids=pos, attention_mask=mask,
                         cache=self.cache, on_layer=on_layer)
        self.layer_work += S * (end - start)
        self.critical_layers += end - start
        return out

    def readout(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[..., V]`` (float32) of pre-norm hidden states ``[..., H]``."""
        self.readout_rows += hidden.numel() // hidden.shape[-1]
        return readout_logits(self.model, hidden).float()

    def crop(self, length: int) -> None:
        """Keep only positions ``0 .. length-1`` in every layer."""
        for layer in self.cache.layers:
            extra = layer.get_seq_length() - length
            if extra > 0:
                layer.crop(-extra)

    def reset_counters(self) -> None:
        self.layer_work = self.critical_layers = self.readout_rows = 0


def _sync(device) -> None:
    if getattr(device, "type", "cpu") == "cuda":
        torch.cuda.synchronize(device)


# --------------------------------------------------------------------------------------------------
# Records and results
# --------------------------------------------------------------------------------------------------


@dataclass
class SpecRound:
    """One draft-and-verify round of LSSD or DEL.

    Attributes:
        drafted: draft tokens verified this round (k; 0 when the round is a plain full-depth step).
        accepted: leading drafts equal to the final-depth decode (0 <= accepted <= drafted).
        exit_layer: draft exit depth E (1-based layers).
        committed: tokens appended to the output (accepted + 1, fewer only when EOS cut the round).
        planned: speculation length planned before drafting (before the ``max_new_tokens`` cap and,
            for DEL, before the confidence stop).
        layer_work: token-layer evaluations of the round (``(drafted + 1) * L``).
        critical_layers: sequential layers of the round (``drafted * E + L``).
    """

    drafted: int
    accepted: int
    exit_layer: int
    committed: int
    planned: int
    layer_work: int
    critical_layers: int


@dataclass(kw_only=True)
class SelfSpecResult(DraftVerifyResult):
    """Output of :func:`self_spec_decode`: the :class:`~impl.spec.result.DraftVerifyResult` fields
    (``rounds`` holds :class:`SpecRound`; ``prefill_seconds`` is ``input_ids[:-1]`` through all layers;
    ``tokens`` equal AR's under the rule)."""


# --------------------------------------------------------------------------------------------------
# The shared draft-and-verify engine (LSSD; DEL drives it with its own choices per round)
# --------------------------------------------------------------------------------------------------


class _SelfSpecEngine:
    """Committed state + one LSSD round at a time. Invariant between rounds: every layer caches
    positions ``0 .. n-2`` of the ``n`` committed ids (prompt + generated); ``ids[-1]`` is pending."""

    def __init__(self, model, ids: list[int], max_new_tokens: int, rule, eos_token_id):
        self.model, self.rule, self.eos = model, rule, eos_token_id
        self.rx = _Runner(model)
        self.L = self.rx.L
        self.ids = list(ids)
        self.P = len(ids)
        self.max_new = max_new_tokens
        self.tokens: list[int] = []
        self.stopped = False
        self.rounds: list[SpecRound] = []

    def prefill(self) -> None:
        if self.P > 1:
            with torch.no_grad():
                self.rx.run(self.rx.embed(self.ids[:-1]), 0, self.L, pos0=0)
        self.rx.reset_counters()

    @property
    def done(self) -> bool:
        return self.stopped or len(self.tokens) >= self.max_new

    @torch.no_grad()
    def round(self, E: int, k: int, *, stop_below: float | None = None, collect: bool = False):
        """Draft up to ``k`` tokens at exit layer ``E`` (capped so that no more than ``max_new_tokens``
        are committed; stopping after a draft equal to EOS, or, when ``stop_below`` is set, after a draft
        whose confidence is below it), verify, commit, crop.

        Returns:
            ``(record, per_layer, ys, accepted)``: the :class:`SpecRound`; when ``collect``, a list
            (one entry per row ``0..drafted``) of ``[L-1, H]`` hidden states after layers ``1..L-1``
            (else None); the final-depth decodes ``ys`` of every row; the accepted count.
        """
        rx, L, rule = self.rx, self.L, self.rule
        w0, c0 = rx.layer_work, rx.critical_layers
        n = len(self.ids)
        k_cap = min(k, self.max_new - len(self.tokens) - 1)
        rows_early: list[dict[int, torch.Tensor]] = []
        h_exit: list[torch.Tensor] = []
        drafts: list[int] = []
        tok = self.ids[-1]
        for i in range(k_cap):
            rec: dict[int, torch.Tensor] = {}
            h = rx.run(rx.embed([tok]), 0, E, pos0=n - 1 + i,
                       on_layer=(lambda d, hh, rec=rec: rec.__setitem__(d, hh[0, -1])) if collect else None)
            rows_early.append(rec)
            h_exit.append(h)
            logits = rx.readout(h[0, -1])
            tok = rule.decode(logits, n + i)
            drafts.append(tok)
            if self.eos is not None and tok == self.eos:
                break
            if stop_below is not None and _confidence(logits, rule) < stop_below:
                break
        k_r = len(drafts)
        # Verification: early layers for the last row only, then the deep layers for all rows.
        rec_last: dict[int, torch.Tensor] = {}
        h_last = rx.run(rx.embed([tok]), 0, E, pos0=n - 1 + k_r,
                        on_layer=(lambda d, hh: rec_last.__setitem__(d, hh[0, -1])) if collect else None)
        rows_early.append(rec_last)
        deep: dict[int, torch.Tensor] = {}
        hf = rx.run(torch.cat(h_exit + [h_last], dim=1), E, L, pos0=n - 1,
                    on_layer=(lambda d, hh: deep.__setitem__(d, hh[0])) if collect else None)
        ys = rule.decode_rows(rx.readout(hf[0]), [n + i for i in range(k_r + 1)])
        a = 0
        while a < k_r and drafts[a] == ys[a]:
            a += 1
        new = drafts[:a] + [ys[a]]
        rx.crop(n + a)
        if self.eos is not None and self.eos in new:
            new = new[: new.index(self.eos) + 1]
            self.stopped = True
        self.ids.extend(new)
        self.tokens.extend(new)
        record = SpecRound(drafted=k_r, accepted=a, exit_layer=E, committed=len(new), planned=k,
                           layer_work=rx.layer_work - w0, critical_layers=rx.critical_layers - c0)
        self.rounds.append(record)
        per_layer = None
        if collect:
            per_layer = []
            for i in range(k_r + 1):
                hs = [rows_early[i][d] if d <= E else deep[d][i] for d in range(1, L)]
                per_layer.append(torch.stack(hs) if hs else torch.empty(0))
        return record, per_layer, ys, a


# --------------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------------


def check_self_spec_params(L: int, exit_layer: Any, num_speculations: Any) -> tuple[int, int]:
    """Validate LayerSkip self-speculation parameters for an ``L``-layer model before decoding.

    Returns:
        ``(exit_layer, num_speculations)`` as ints.

    Raises:
        ValueError: ``L`` < 2, ``exit_layer`` outside ``[1, L-1]``, ``num_speculations`` < 1, or a
            non-integer value; the message names the parameter.
    """
    if L < 2:
        raise ValueError(f"self-speculation needs a model with >= 2 layers, got L={L}")
    return _check_int("exit_layer", exit_layer, 1, L - 1), _check_int("num_speculations", num_speculations, 1)


@torch.no_grad()
def self_spec_decode(
    model,
    input_ids: list[int],
    max_new_tokens: int,
    *,
    exit_layer: int,
    num_speculations: int,
    rule: DecodeRule = DecodeRule(),
    eos_token_id: int | None = None,
) -> SelfSpecResult:
    """LayerSkip self-speculative decoding, batch 1, lossless (LayerSkip; DEX Sec. 4, App. D).

    Args:
        model: Hugging Face causal LM (Llama/Qwen family: ``.model.layers``, shared final norm and LM
            head), eval mode, any device/dtype.
        input_ids: prompt token ids (non-empty list of int in ``[0, V)``).
        max_new_tokens: maximum number of generated tokens (>= 1).
        exit_layer: draft exit depth E in ``[1, L-1]`` (1-based count of early layers).
        num_speculations: drafts per round k (>= 1); the last rounds draft fewer so that no more than
            ``max_new_tokens`` tokens are committed.
        rule: final-depth decoding rule (greedy, or Gumbel-max sampling keyed by (seed, position)); the
            drafts are decoded from the exit-layer logits with the same rule and position.
        eos_token_id: stop after committing this id (None: never stop early).

    Returns:
        :class:`SelfSpecResult`; ``tokens`` equal :func:`impl.spec.ar.ar_decode`'s under the same rule.
        Accounting per round: ``layer_work = (k+1)*L``, ``critical_layers = k*E + L`` (module docstring).

    Raises:
        ValueError: empty prompt, ids outside the vocabulary, ``max_new_tokens`` < 1, context overflow,
            ``exit_layer`` outside ``[1, L-1]``, ``num_speculations`` < 1, bad ``eos_token_id``.
        TypeError: a model without ``.model.layers`` / final norm / LM head.
    """
    L = num_layers(model)
    ids = _check_decode_args(model, input_ids, max_new_tokens, eos_token_id)
    E, k = check_self_spec_params(L, exit_layer, num_speculations)
    eng = _SelfSpecEngine(model, ids, max_new_tokens, rule, eos_token_id)
    _sync(eng.rx.device)
    t0 = time.perf_counter()
    eng.prefill()
    _sync(eng.rx.device)
    t_pre = time.perf_counter() - t0
    while not eng.done:
        eng.round(E, k)
    _sync(eng.rx.device)
    return SelfSpecResult(
        tokens=eng.tokens, stopped_at_eos=eng.stopped, rounds=eng.rounds,
        layer_work=eng.rx.layer_work, critical_layers=eng.rx.critical_layers,
        readout_rows=eng.rx.readout_rows, seconds=time.perf_counter() - t0, prefill_seconds=t_pre)
