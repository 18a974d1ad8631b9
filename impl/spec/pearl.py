"""PEARL: parallel speculative decoding with adaptive draft length, lossless (DEX Sec. 5, Fig. 5's
speculative comparisons; harness issue 18, item 2). Single-process reference executor with the two
devices' timeline measured per round.

PEARL runs the draft model and the target on two devices at once and overlaps their work in two ways
(Liu et al. 2025, Sec. 3):

* **Pre-verify** (the drafting phase). While the draft model drafts ``gamma`` tokens ``d_1..d_gamma``
  from the last committed token (the *root*), the target runs the root alone and decides ``y_1``, the
  token after it. If ``d_1 != y_1`` the target's token is committed at once and the rest of the
  drafting is dropped (a wrong first draft costs one draft step, not ``gamma``); otherwise the block
  ``d_1..d_gamma`` goes to verification with ``d_1`` already accepted.
* **Post-verify** (the verification phase). While the target verifies the block in one forward, the
  draft model keeps drafting ``e_1..e_gamma`` after ``d_gamma`` as if the whole block were accepted.
  If it is, and ``e_1`` equals the target's token after ``d_gamma``, the next round verifies
  ``e_1..e_gamma`` straight away (no drafting wait: the draft length grows by ``gamma`` a round);
  otherwise the accepted prefix and the target's correction are committed and the next round
  pre-verifies.

Every committed token is either a draft equal to the target's decode at its position or the target's
own decode, under the same rule (greedy, or Gumbel-max sampling keyed by (seed, position),
:class:`impl.spec.sampling.DecodeRule`), so the output equals AR's. Both models keep their KV caches
in step with the committed ids (rejected rows cropped).

This executor runs the two devices' work one after the other and times each part, so a round's
two-device time is the overlap the schedule allows (module :data:`TIMELINE`):

* pre-verify, first draft rejected: ``max(target(root), draft step 1)``;
* pre-verify, first draft accepted: ``max(target(root), draft step 1) + draft steps 2..gamma``;
* post-verify: ``max(target(block), draft steps of the next block)``.

``projected_seconds`` sums these (prefill excluded, no communication: two ranks add their transfer of
``gamma`` token ids per round); ``seconds`` is the measured one-device wall time.

Accounting (as every method in :mod:`impl.spec`, prompt prefill excluded): ``layer_work`` counts target
token-layers and draft token-layers alike; ``critical_layers`` follows the two-device schedule in
layers: per round ``max(L, L_d)`` (pre-verify, rejected), ``max(L, L_d) + (gamma - 1) L_d``
(pre-verify, accepted), ``max(L, gamma L_d)`` (post-verify), ``L_d`` the draft's layers.

Source: Liu, Xu, ... "PEARL: Parallel Speculative Decoding with Adaptive Draft Length" (ICLR 2025,
arXiv:2408.11850), Sec. 3.1-3.3 (pre-verify, post-verify, Algorithm 1).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from ..models.depth import num_layers
from .result import DraftVerifyResult
from .sampling import DecodeRule
from .self_spec import _check_decode_args, _check_int, _sync

__all__ = ["TIMELINE", "PearlRound", "PearlResult", "PostVerdict", "check_pearl", "continuation_length", "pearl_decode",
           "post_verify"]

#: the round kinds and their two-device time (module docstring)
TIMELINE = {
    "pre_reject": "max(target(root), draft step 1)",
    "pre_accept": "max(target(root), draft step 1) + draft steps 2..gamma",
    "post": "max(target(block), draft steps of the next block)",
}


@dataclass
class PearlRound:
    """One PEARL round.

    Attributes:
        kind: ``pre_reject``, ``pre_accept`` or ``post`` (:data:`TIMELINE`).
        drafted: draft tokens this round's target pass verified (pre-verify: 1; post-verify: the
            block's tokens after its first, which a pre-verify or the previous round verified).
        accepted: of those, the ones equal to the target's decodes and committed.
        committed: tokens appended.
        target_seconds, draft_seconds: measured time of the round's target pass and draft steps [s].
        projected_seconds: the round's two-device time (:data:`TIMELINE`) [s].
        layer_work: target + draft token-layers of the round.
        critical_layers: the round's two-device critical path in layers (module docstring).
    """

    kind: str
    drafted: int
    accepted: int
    committed: int
    target_seconds: float
    draft_seconds: float
    projected_seconds: float
    layer_work: int
    critical_layers: int


@dataclass(kw_only=True)
class PearlResult(DraftVerifyResult):
    """Output of :func:`pearl_decode`: the :class:`~impl.spec.result.DraftVerifyResult` fields
    (``rounds`` holds :class:`PearlRound`; ``tokens`` equal AR's under the rule) plus

    Attributes:
        projected_seconds: the two-device time of every round (prefill excluded) [s].
        target_passes, draft_passes: forwards of each model after the prefill.
    """

    projected_seconds: float = 0.0
    target_passes: int = 0
    draft_passes: int = 0


class _Model:
    """One model and its KV cache: forward of new tokens at the next positions, crop, timing."""

    def __init__(self, model):
        self.model = model
        self.cache = DynamicCache(config=model.config)
        self.n = 0  # cached positions
        self.device = next(model.parameters()).device
        self.L = num_layers(model)
        self.passes = 0
        self.layer_work = 0

    def forward(self, tokens: list[int]) -> tuple[torch.Tensor, float]:
        """Logits ``[len(tokens), V]`` (float32) of ``tokens`` at positions ``n..n+len-1``, and the
        pass's seconds."""
        _sync(self.device)
        t0 = time.perf_counter()
        x = torch.tensor([tokens], dtype=torch.long, device=self.device)
        pos = torch.arange(self.n, self.n + len(tokens), device=self.device)[None]
        logits = self.model(input_ids=x, position_ids=pos, cache=self.cache, use_cache=True).logits[0]
        _sync(self.device)
        self.n += len(tokens)
        self.passes += 1
        self.layer_work += self.L * len(tokens)
        return logits.float(), time.perf_counter() - t0

    def crop(self, n: int) -> None:
        """Keep the first ``n`` cached positions (transformers 5: ``crop`` takes minus the rows to drop)."""
        if n < self.n:
            self.cache.crop(n - self.n)
            self.n = n


def check_pearl(target, draft, gamma) -> int:
    """``gamma`` as an int >= 1 after checking that ``draft`` is a separate model over the target's
    vocabulary.

    Raises:
        ValueError: naming what is wrong.
    """
    if draft is target:
        raise ValueError("pearl: the draft must be a separate model (a layer-truncated copy: dex.draft)")
    v_t = target.get_output_embeddings().weight.shape[0]
    v_d = draft.get_output_embeddings().weight.shape[0]
    if v_t != v_d:
        raise ValueError(f"pearl: the draft's vocabulary ({v_d} ids) is not the target's ({v_t})")
    return _check_int("pearl gamma", gamma, 1)


class _Committed:
    """The committed ids of one decode and their budget, which both PEARL executors keep the same way:
    ``ids`` (prompt + committed), ``tokens`` (committed only), ``stopped`` (an EOS was committed)."""

    def __init__(self, ids: list[int], max_new: int, eos):
        self.ids, self.max_new, self.eos = list(ids), max_new, eos
        self.tokens: list[int] = []
        self.stopped = False

    @property
    def done(self) -> bool:
        return self.stopped or len(self.tokens) >= self.max_new

    def _commit(self, new: list[int]) -> int:
        """Append ``new`` cut to the budget and after the first EOS; returns how many were committed."""
        new = new[: self.max_new - len(self.tokens)]
        if self.eos is not None and self.eos in new:
            new = new[: new.index(self.eos) + 1]
            self.stopped = True
        self.ids += new
        self.tokens += new
        return len(new)


class _Pearl(_Committed):
    """The committed ids and both models; invariant between rounds: both caches hold every committed
    position but the last (the root), except that in post-verify mode the draft also holds the block
    up to its last token and the block is pending."""

    def __init__(self, target, draft, ids: list[int], max_new: int, gamma: int, rule: DecodeRule, eos):
        super().__init__(ids, max_new, eos)
        self.t, self.d = _Model(target), _Model(draft)
        self.gamma, self.rule = gamma, rule
        self.rounds: list[PearlRound] = []
        self.block: list[int] | None = None  # post-verify: the block to verify, its first token verified

    def prefill(self) -> None:
        if len(self.ids) > 1:
            self.t.forward(self.ids[:-1])
            self.d.forward(self.ids[:-1])
        self.t.passes = self.d.passes = self.t.layer_work = self.d.layer_work = 0

    def _draft(self, first: int, k: int) -> tuple[list[int], list[float]]:
        """``k`` draft tokens after ``first`` (fed at the draft's next position), and each step's seconds."""
        out, secs, tok = [], [], first
        for _ in range(k):
            logits, s = self.d.forward([tok])
            tok = self.rule.decode(logits[-1], self.d.n)
            out.append(tok)
            secs.append(s)
        return out, secs

    def round(self) -> None:
        if self.block is None:
            self._pre_verify()
        else:
            self._post_verify()

    def _pre_verify(self) -> None:
        L, Ld, g = self.t.L, self.d.L, self.gamma
        n = len(self.ids)
        w0 = self.t.layer_work + self.d.layer_work
        logits, t_t = self.t.forward([self.ids[-1]])  # the target decides the token after the root
        y1 = self.rule.decode(logits[-1], n)
        d1, s1 = self._draft(self.ids[-1], 1)
        if d1[0] != y1:
            c = self._commit([y1])
            self.rounds.append(PearlRound("pre_reject", 1, 0, c, t_t, s1[0], max(t_t, s1[0]),
                                          self.t.layer_work + self.d.layer_work - w0, max(L, Ld)))
            return
        k = min(g, self.max_new - len(self.tokens)) - 1  # drafts beyond d_1 that could still be committed
        stop = self.eos is not None and d1[0] == self.eos
        rest, secs = self._draft(d1[0], k) if k > 0 and not stop else ([], [])
        block = d1 + rest
        if len(block) == 1:  # nothing left to verify: d_1 is the last token of the budget, or EOS
            self.d.crop(n)
            c = self._commit(block)
            self.rounds.append(PearlRound("pre_accept", 1, 1, c, t_t, s1[0], max(t_t, s1[0]),
                                          self.t.layer_work + self.d.layer_work - w0, max(L, Ld)))
            return
        self.block = block  # d_1 verified; the draft holds the root .. d_{k}, d_{k+1} pending
        self.rounds.append(PearlRound("pre_accept", 1, 1, 0, t_t, s1[0] + sum(secs), max(t_t, s1[0]) + sum(secs),
                                      self.t.layer_work + self.d.layer_work - w0, max(L, Ld) + len(secs) * Ld))

    def _post_verify(self) -> None:
        L, Ld, g = self.t.L, self.d.L, self.gamma
        block = self.block
        n = len(self.ids)  # the target holds n positions: ..root; the block follows
        w0 = self.t.layer_work + self.d.layer_work
        logits, t_t = self.t.forward(block)
        ys = self.rule.decode_rows(logits, [n + 1 + i for i in range(len(block))])  # ys[i]: after block[i]
        # the draft keeps drafting after the block's last token as if all of it were accepted
        k = continuation_length(g, self.max_new, len(self.tokens), len(block))
        nxt, secs = self._draft(block[-1], k) if k > 0 else ([], [])
        v = post_verify(block, ys, nxt, len(self.tokens), self.max_new)
        if v.keep is not None:
            self.t.crop(n + v.keep)
            self.d.crop(n + v.keep)
        self.block = v.next_block
        c = self._commit(v.new)
        if self.stopped or len(self.tokens) >= self.max_new:
            self.block = None
        # committed drafts only (EOS or the budget may cut the block)
        accepted = min(v.accepted, max(c - 1, 0)) if self.block is None else v.accepted
        self.rounds.append(PearlRound("post", v.drafted, accepted, c, t_t, sum(secs), max(t_t, sum(secs)),
                                      self.t.layer_work + self.d.layer_work - w0, max(L, len(secs) * Ld)))


def continuation_length(gamma: int, max_new: int, n_tokens: int, block_len: int) -> int:
    """Draft tokens the post-verify continuation drafts after a block of ``block_len`` tokens: ``gamma``,
    or fewer where the budget (``max_new`` minus the ``n_tokens`` committed and the block) ends first."""
    room = max_new - n_tokens - block_len
    return min(gamma, room) if room > 0 else 0


@dataclass(frozen=True)
class PostVerdict:
    """What a post-verify round decides (:func:`post_verify`).

    Attributes:
        new: tokens to commit (EOS and the budget may still cut them).
        next_block: the block the next round verifies (the draft's continuation), or None (pre-verify).
        keep: block tokens whose KV both caches keep (crop both to ``n + keep``, ``n`` the committed
            length before the round), or None (keep everything).
        drafted, accepted: draft tokens the target's pass checked, and those it accepted.
    """

    new: list[int]
    next_block: list[int] | None
    keep: int | None
    drafted: int
    accepted: int


def post_verify(block: list[int], ys: list[int], nxt: list[int], n_tokens: int, max_new: int) -> PostVerdict:
    """PEARL's post-verify decision (Liu et al. 2025, Sec. 3.2; Algorithm 1's verification phase).

    Args:
        block: the verified block ``d_1..d_m`` (``d_1`` already accepted by pre-verify or the previous
            round).
        ys: the target's decodes after each block token (``ys[i]`` follows ``block[i]``), length m.
        nxt: the draft's continuation ``e_1..e_k`` after ``d_m`` (may be empty).
        n_tokens, max_new: tokens committed before the round and the budget.

    Returns:
        :class:`PostVerdict`: the accepted prefix and the target's correction on a rejection or when
        ``e_1`` differs from the target's token after ``d_m`` (then pre-verify); the whole block, with
        ``e_1..e_k`` verified next, otherwise. Every committed token is a target decode, so the output
        equals AR's.
    """
    a = 1
    while a < len(block) and block[a] == ys[a - 1]:
        a += 1
    drafted, accepted = len(block) - 1, a - 1
    if a == len(block) and nxt:  # the draft's next block starts with e_1: checked against the target here
        drafted += 1
        accepted += int(nxt[0] == ys[-1])
    if a < len(block) or not nxt or nxt[0] != ys[-1]:
        # a rejection in the block, or the draft's next block starts wrong: commit and pre-verify
        return PostVerdict(block[:a] + [ys[a - 1]], None, a, drafted, accepted)
    if len(nxt) == 1 and n_tokens + len(block) + 1 >= max_new:
        return PostVerdict(block + nxt, None, None, drafted, accepted)  # e_1 (verified) ends the budget
    # all accepted; the draft's e_1 equals the target's next token: verify e_1..e_k next
    return PostVerdict(block, nxt, None, drafted, accepted)


@torch.inference_mode()
def pearl_decode(
    target,
    draft,
    input_ids: list[int],
    max_new_tokens: int,
    *,
    gamma: int,
    rule: DecodeRule = DecodeRule(),
    eos_token_id: int | None = None,
) -> PearlResult:
    """PEARL, batch 1, lossless; the two devices' overlap measured per round (module docstring).

    Args:
        target: Hugging Face causal LM, eval mode.
        draft: a smaller causal LM over the same vocabulary (e.g. :func:`impl.models.draft.truncated_draft`),
            on the target's device.
        input_ids: prompt token ids (non-empty, in ``[0, V)``).
        max_new_tokens: generation budget (>= 1).
        gamma: the draft window (tokens drafted per drafting phase and per post-verify continuation).
        rule: decoding rule of both models (greedy, or Gumbel-max sampling keyed by (seed, position)).
        eos_token_id: stop after committing this id (None: exactly ``max_new_tokens`` tokens).

    Returns:
        :class:`PearlResult`; ``tokens`` equal :func:`impl.spec.ar.ar_decode`'s under the same rule.

    Raises:
        ValueError: a bad prompt / budget / ``eos_token_id`` / ``gamma``, a draft that is the target or
            has another vocabulary, or a prompt + budget that overflows the context (no model is fed a
            position past ``prompt + max_new_tokens - 1``, as in AR).
    """

    ids = _check_decode_args(target, input_ids, max_new_tokens, eos_token_id)
    g = check_pearl(target, draft, gamma)
    eng = _Pearl(target, draft, ids, max_new_tokens, g, rule, eos_token_id)
    _sync(eng.t.device)
    t0 = time.perf_counter()
    eng.prefill()
    _sync(eng.t.device)
    t_pre = time.perf_counter() - t0
    while not eng.done:
        eng.round()
    _sync(eng.t.device)
    return PearlResult(tokens=eng.tokens, stopped_at_eos=eng.stopped, rounds=eng.rounds,
                       layer_work=sum(r.layer_work for r in eng.rounds),
                       critical_layers=sum(r.critical_layers for r in eng.rounds),
                       readout_rows=0, seconds=time.perf_counter() - t0, prefill_seconds=t_pre,
                       projected_seconds=sum(r.projected_seconds for r in eng.rounds),
                       target_passes=eng.t.passes, draft_passes=eng.d.passes)
