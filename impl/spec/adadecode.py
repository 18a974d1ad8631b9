"""AdaDecode: adaptive layer parallelism with deferred deep layers, a lossless baseline of DEX.

Source: Wei, Chen, Zhu and Meng, "AdaDecode: Accelerating LLM Decoding with Adaptive Layer
Parallelism" (ICML 2025, arXiv:2506.03700), method section (early prediction at intermediate
layers, deferred layer computation run in parallel with later tokens, final verification with
rollback); DEX paper Sec. 4 and App. D
(shortcut layers uniform across depth, grid over speculation length and confidence threshold). As in
DEX App. D, the intermediate states are read out with the model's shared final norm + LM head
(:func:`impl.models.depth.readout_logits`), not with separately trained heads.

State: each processed position p has a computed depth ``c_p`` (layers whose KV exist). A position
whose step exited early at layer l has ``c_p = l`` and its next token is *pending* (emitted, not yet
verified). ``c`` is non-increasing along positions, so the positions still missing layer j always form
a suffix.

One step feeds the newest token ``x_{n-1}`` and runs layer by layer; at layer j the batch is every
position with ``c_p = j - 1`` (the new token plus the pending positions whose deferred layer j is now
needed, because the new token attends to their layer-j KV). At each shortcut layer ``j < L`` the new
token's readout is tested: if ``max softmax prob > threshold`` (strict) and fewer than
``max_speculations`` tokens are pending, ``rule.decode(readout_j, n)`` is emitted early and the step
ends at layer j (deeper layers of every row are deferred). Otherwise the step reaches layer L, which
completes every pending position: their final-depth decodes are compared in order with the early
tokens; at the first mismatch the final token replaces the early one, everything after it is dropped
and the KV cache is cropped (rollback). This is the *verification round*. When ``max_new_tokens``
tokens have been emitted, or EOS was emitted early, a flush step (no new token) runs the pending
positions' deferred layers to L and verifies them.

Every committed token is a final-depth decode of the committed prefix, so the output equals AR's
under the same :class:`impl.spec.sampling.DecodeRule` (greedy or position-keyed Gumbel-max).

Layer-work accounting (prompt prefill excluded; see :mod:`impl.spec.self_spec`):

* ``layer_work``: token-layer evaluations, deferred layers and rolled-back rows included. Every
  committed position costs L eventually; rollbacks add the partial work of the discarded positions.
* ``critical_layers``: per step, the number of layers it runs (the batched deferred layers ride along
  in the same layer calls): the exit layer l for an early step, L for a full step, ``L - min c`` for a
  flush step.
* ``readout_rows``: shortcut readouts of the new token plus the final readouts of verified rows.
"""

from __future__ import annotations

import time
from typing import Any
from dataclasses import dataclass

import torch

from ..models.depth import num_layers
from .sampling import DecodeRule
from .result import DraftVerifyResult
from .self_spec import _check_decode_args, _check_float, _check_int, _confidence, _Runner, _sync


@dataclass
class AdaRound:
    """One AdaDecode verification round: the steps since the previous full-depth (or flush) step,
    ending with one.

    Attributes:
        drafted: early-emitted tokens closed by this round's verification (all that were pending: the
            ones compared with the final-depth decode and any discarded after the first mismatch).
        accepted: leading early tokens equal to the final-depth decode (<= drafted).
        exit_layers: the shortcut layer each drafted token exited at (1-based), in order.
        committed: tokens verified and kept (accepted, plus the final token of the full step or the
            correction after a mismatch; EOS may cut it).
        steps: forwards in the round (early steps + the closing full or flush step).
        layer_work: token-layer evaluations of the round.
        critical_layers: sequential layers of the round.
    """

    drafted: int
    accepted: int
    exit_layers: list[int]
    committed: int
    steps: int
    layer_work: int
    critical_layers: int


@dataclass(kw_only=True)
class AdaDecodeResult(DraftVerifyResult):
    """Output of :func:`adadecode_decode`: the :class:`~impl.spec.result.DraftVerifyResult` fields
    (``rounds`` holds :class:`AdaRound`; ``tokens`` equal AR's under the rule)."""

    @property
    def early_tokens(self) -> int:
        """Tokens emitted early (verified or rolled back)."""
        return sum(r.drafted for r in self.rounds)


def uniform_shortcut_layers(L: int, stride: int) -> list[int]:
    """Shortcut layers uniform across depth: ``stride, 2*stride, ..`` below L (DEX App. D uses stride 8
    on 48 layers, 10 on 80). Raises ValueError unless ``1 <= stride < L``."""
    _check_int("stride", stride, 1, L - 1)
    return list(range(stride, L, stride))


def check_adadecode_params(L: int, shortcut_layers: Any, threshold: Any,
                           max_speculations: Any) -> tuple[list[int], float, int]:
    """Validate AdaDecode parameters for an ``L``-layer model before decoding.

    Returns:
        ``(shortcut_layers, threshold, max_speculations)``: sorted ints, float, int.

    Raises:
        ValueError: empty / unsorted / out-of-range (outside ``[1, L-1]``) ``shortcut_layers``,
            ``threshold`` outside [0, 1], ``max_speculations`` < 1; the message names the parameter.
    """
    try:
        shortcuts = [int(x) if not isinstance(x, bool) and int(x) == x else None for x in shortcut_layers]
    except (TypeError, ValueError):
        raise ValueError(f"shortcut_layers must be a sequence of ints, got {shortcut_layers!r}") from None
    if not shortcuts or None in shortcuts:
        raise ValueError(f"shortcut_layers must be a non-empty sequence of ints, got {shortcut_layers!r}")
    if any(b <= a for a, b in zip(shortcuts, shortcuts[1:])):
        raise ValueError(f"shortcut_layers {shortcuts} must be strictly increasing")
    if shortcuts[0] < 1 or shortcuts[-1] > L - 1:
        raise ValueError(f"shortcut_layers {shortcuts} must lie in [1, {L - 1}] (L={L})")
    thr = _check_float("threshold", threshold, 0.0, 1.0)
    cap = _check_int("max_speculations", max_speculations, 1)
    return shortcuts, thr, cap


@torch.no_grad()
def adadecode_decode(
    model,
    input_ids: list[int],
    max_new_tokens: int,
    *,
    shortcut_layers,
    threshold: float,
    max_speculations: int,
    rule: DecodeRule = DecodeRule(),
    eos_token_id: int | None = None,
) -> AdaDecodeResult:
    """AdaDecode, batch 1, lossless (AdaDecode method section; DEX Sec. 4, App. D).

    Args:
        model: Hugging Face causal LM (Llama/Qwen family with a shared final norm and LM head), eval.
        input_ids: prompt token ids (non-empty list of int in ``[0, V)``).
        max_new_tokens: maximum number of generated tokens (>= 1).
        shortcut_layers: strictly increasing 1-based depths in ``[1, L-1]`` where early prediction is
            tried (e.g. :func:`uniform_shortcut_layers`).
        threshold: confidence threshold in ``[0, 1]``; a token is emitted early iff the max probability
            of its readout (softmax(z), or softmax(z / T) when sampling) is strictly greater. 0 emits at
            the first shortcut whenever allowed; 1 never emits early (plain AR).
        max_speculations: most pending (emitted, unverified) tokens, >= 1; at the cap the next token
            runs to full depth, which verifies all of them.
        rule: final-depth decoding rule; early tokens use it on the shortcut logits, same position.
        eos_token_id: stop after committing this id (None: never stop early).

    Returns:
        :class:`AdaDecodeResult` (accounting in the module docstring).

    Raises:
        ValueError: empty prompt, ids outside the vocabulary, ``max_new_tokens`` < 1, context overflow,
            empty / unsorted / out-of-range ``shortcut_layers``, ``threshold`` outside [0, 1],
            ``max_speculations`` < 1, bad ``eos_token_id``.
    """
    L = num_layers(model)
    ids = _check_decode_args(model, input_ids, max_new_tokens, eos_token_id)
    shortcuts, thr, cap = check_adadecode_params(L, shortcut_layers, threshold, max_speculations)
    short = set(shortcuts)

    rx = _Runner(model)
    _sync(rx.device)
    t0 = time.perf_counter()
    P = len(ids)
    if P > 1:
        rx.run(rx.embed(ids[:-1]), 0, L, pos0=0)
    rx.reset_counters()
    _sync(rx.device)
    t_pre = time.perf_counter() - t0

    seq = list(ids)            # prompt + emitted tokens (verified prefix, then pending ones)
    verified = P               # seq[:verified] is final
    depth: dict[int, int] = {}      # position -> computed depth c_p, for positions with c_p < L
    hid: dict[int, torch.Tensor] = {}  # position -> [1, 1, H] hidden after layer c_p
    exit_of: dict[int, int] = {}    # pending position -> shortcut layer its next token exited at
    rounds: list[AdaRound] = []
    stopped = False
    acc = {"steps": 0, "w": 0, "c": 0, "exits": []}

    def emitted() -> int:
        return len(seq) - P

    while True:
        all_verified = verified == len(seq)
        if all_verified and (stopped or emitted() >= max_new_tokens):
            break
        # Flush (no new token) once the budget is emitted or EOS was emitted early, still unverified.
        new = all_verified or not (emitted() >= max_new_tokens
                                   or (eos_token_id is not None and seq[-1] == eos_token_id))
        w0, c0 = rx.layer_work, rx.critical_layers
        pending = len(depth)
        if new:
            pn = len(seq) - 1
            depth[pn] = 0
            hid[pn] = rx.embed([seq[-1]])
        j = min(depth.values())
        early = None
        while j < L:
            rows = [p for p in sorted(depth) if depth[p] == j]
            assert rows == list(range(rows[0], rows[0] + len(rows))), "open positions must be a suffix"
            out = rx.run(torch.cat([hid[p] for p in rows], dim=1), j, j + 1, pos0=rows[0])
            for i, p in enumerate(rows):
                hid[p] = out[:, i : i + 1]
                depth[p] = j + 1
            j += 1
            if new and j in short and pending < cap:
                logits = rx.readout(hid[pn][0, 0])
                if _confidence(logits, rule) > thr:
                    early = (rule.decode(logits, pn + 1), j)
                    break
        acc["steps"] += 1
        acc["w"] += rx.layer_work - w0
        acc["c"] += rx.critical_layers - c0
        if early is not None:
            tok, layer = early
            seq.append(tok)
            exit_of[pn] = layer
            acc["exits"].append(layer)
            continue
        # Full-depth (or flush) step: every open position is at depth L; verify in order.
        order = sorted(depth)
        ys = rule.decode_rows(rx.readout(torch.cat([hid[p] for p in order], dim=1)[0]),
                              [p + 1 for p in order])
        drafted = sum(1 for p in order if p in exit_of)
        accepted = 0
        for p, y in zip(order, ys):
            if p in exit_of:                  # early token seq[p+1] under test
                if seq[p + 1] == y:
                    accepted += 1
                    continue
                del seq[p + 1:]               # rollback: drop the early token and all after it
                seq.append(y)
                rx.crop(p + 1)
                break
            seq.append(y)                     # the new token's final-depth decode
        depth.clear()
        hid.clear()
        exit_of.clear()
        # Cut at the first committed EOS.
        new_part = seq[verified:]
        if eos_token_id is not None and eos_token_id in new_part:
            del seq[verified + new_part.index(eos_token_id) + 1:]
            stopped = True
        committed = len(seq) - verified
        verified = len(seq)
        rounds.append(AdaRound(drafted=drafted, accepted=accepted, exit_layers=acc["exits"],
                               committed=committed, steps=acc["steps"], layer_work=acc["w"],
                               critical_layers=acc["c"]))
        acc = {"steps": 0, "w": 0, "c": 0, "exits": []}

    _sync(rx.device)
    return AdaDecodeResult(
        tokens=seq[P:], stopped_at_eos=stopped, rounds=rounds, layer_work=rx.layer_work,
        critical_layers=rx.critical_layers, readout_rows=rx.readout_rows,
        seconds=time.perf_counter() - t0, prefill_seconds=t_pre)
