"""Lookahead decoding: Jacobi iterations over a 2D window with an n-gram pool, lossless (DEX Sec. 5,
Fig. 5's speculative comparisons; harness issue 18, item 3).

Lookahead decoding needs no draft model: one forward per step runs two branches beside the current
token (the *root*, the last committed id, whose KV is not yet cached).

* **Lookahead branch.** A 2D window ``V`` of ``N - 1`` levels x ``W`` columns of guessed tokens; the
  token at level ``j``, column ``i`` guesses the position ``i + j + 1`` after the root. Column ``i`` is
  one causal chain: the root, ``V[0][0..i]``, then ``V[1][i], .., V[N-2][i]`` (the paper's Fig. 2 mask:
  a lookahead token sees the prefix, the root, the first level up to its column and the earlier
  levels of its own column). The last level's outputs are one Jacobi update: the levels shift up by
  one and the outputs become the new last level (aligned when the step commits one token; after a
  longer accepted run the window lags, which costs acceptance, never exactness).
* **n-gram pool.** Each column's trajectory ``(V[0][i], V[1][i], .., V[N-2][i], output_i)`` is an
  n-gram (``N`` tokens) stored under its first token; at most ``G`` per first token, the most recent
  first.
* **Verification branch.** Up to ``G`` n-grams whose first token is the root; each continuation
  (``N - 1`` tokens) is a chain from the root.

Every branch is a chain hanging off the root, so one step's rows form a tree and run through the
target in ONE full-depth forward with the tree's ancestor mask
(:func:`impl.tev.parents.tree_attention_mask`; position = prefix length + depth). Verification takes
the candidate with the longest prefix equal to the target's own decodes, ``y = rule(logits, position)``
row by row, plus the target's next token (the correction or bonus): every committed token is the token
AR commits under the same rule (greedy, or Gumbel-max sampling keyed by (seed, position),
:class:`impl.spec.sampling.DecodeRule`), so the output equals AR's. The KV rows of the accepted path
are kept and the others dropped (:func:`impl.tev.decode.commit_cache`).

The window starts from prompt tokens drawn with a seeded generator (the reference implementation
initialises it with random tokens); n-grams are pooled from the ``(N - 2)``-th step on, once the
levels above the first hold model outputs (pooling the random start only fills the pool with
n-grams that verification rejects).

Accounting (as every method in :mod:`impl.spec`, prompt prefill excluded): a step over ``S`` rows
charges ``layer_work = S * L`` and ``critical_layers = L`` (one full-depth pass), ``S = 1 + G'(N - 1)
+ (N - 1) W`` with ``G'`` the candidates found.

Source: Fu, Bailis, Stoica, Zhang, "Break the Sequential Dependency of LLM Inference Using Lookahead
Decoding" (ICML 2024, arXiv:2402.02057), Sec. 3 (lookahead branch, verification branch, Fig. 2 mask,
Algorithm 1); W (window), N (n-gram size), G (verified n-grams per step) as there.
"""

from __future__ import annotations

import random
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from ..models.depth import embed, num_layers, readout_logits, run_layers
from ..tev.decode import commit_cache
from ..tev.parents import tree_attention_mask
from .result import DraftVerifyResult
from .sampling import DecodeRule
from .self_spec import _check_decode_args, _check_int, _sync

__all__ = ["LookaheadStep", "LookaheadResult", "NGramPool", "StepLayout", "step_layout",
           "check_lookahead_params", "lookahead_decode"]


@dataclass
class LookaheadStep:
    """One lookahead step (one target forward).

    Attributes:
        drafted: candidate tokens verified (``G' * (N - 1)``, ``G'`` the pooled n-grams of the root).
        candidates: ``G'``.
        accepted: leading tokens of the best candidate equal to the target's decodes and committed.
        committed: tokens appended (accepted + 1, fewer only where EOS or the budget cut the step).
        rows: ``S``, the rows of the step's forward.
        layer_work: ``S * L``.
        critical_layers: ``L``.
    """

    drafted: int
    candidates: int
    accepted: int
    committed: int
    rows: int
    layer_work: int
    critical_layers: int


@dataclass(kw_only=True)
class LookaheadResult(DraftVerifyResult):
    """Output of :func:`lookahead_decode`: the :class:`~impl.spec.result.DraftVerifyResult` fields
    (``rounds`` holds one :class:`LookaheadStep` per forward; ``prefill_seconds``: ``input_ids[:-1]``
    through all layers; ``tokens`` equal AR's under the rule) plus the pool's final size."""

    pool_size: int = 0


class NGramPool:
    """The n-gram pool: continuations (``N - 1`` tokens) by first token, at most ``max_per_key`` each,
    the most recently seen first (Fu et al. Sec. 3: the pool keyed by the n-gram's first token)."""

    def __init__(self, max_per_key: int):
        self.max_per_key = int(max_per_key)
        self._by_first: dict[int, OrderedDict[tuple[int, ...], None]] = {}

    def add(self, first: int, continuation: tuple[int, ...]) -> None:
        """Store (or refresh) ``continuation`` under ``first``; the oldest entry goes beyond the cap."""
        od = self._by_first.setdefault(int(first), OrderedDict())
        if continuation in od:
            od.move_to_end(continuation)
        else:
            od[continuation] = None
            if len(od) > self.max_per_key:
                od.popitem(last=False)

    def get(self, first: int) -> list[tuple[int, ...]]:
        """The continuations stored under ``first``, most recent first."""
        od = self._by_first.get(int(first))
        return list(reversed(od)) if od else []

    def __len__(self) -> int:
        return sum(len(od) for od in self._by_first.values())


@dataclass(frozen=True)
class StepLayout:
    """The rows of one step's forward: a tree rooted at the current token.

    Attributes:
        tokens: ``S`` token ids fed (row 0: the root).
        parents: ``S`` parent rows (row 0: -1), topological.
        depths: ``S`` offsets from the root's position.
        candidate_rows: per verified candidate, its ``N - 1`` rows (a chain from the root).
        window_rows: ``[N - 1][W]`` the row of each window token.
    """

    tokens: list[int]
    parents: list[int]
    depths: list[int]
    candidate_rows: list[list[int]]
    window_rows: list[list[int]]


def step_layout(root: int, window: list[list[int]], candidates: list[tuple[int, ...]]) -> StepLayout:
    """Lay out one step: the root, the verification branch (each candidate a chain from the root), then
    the lookahead branch (the first level as a chain from the root, each later level's token a child of
    the level above in its column), as in Fu et al. Fig. 2.

    Args:
        root: the current token.
        window: ``[N - 1][W]`` token ids.
        candidates: continuations of ``N - 1`` tokens each.

    Returns:
        the :class:`StepLayout`.
    """

    tokens, parents, depths = [int(root)], [-1], [0]

    def add(tok: int, parent: int) -> int:
        tokens.append(int(tok))
        parents.append(parent)
        depths.append(depths[parent] + 1)
        return len(tokens) - 1

    cand_rows = []
    for c in candidates:
        rows, p = [], 0
        for t in c:
            p = add(t, p)
            rows.append(p)
        cand_rows.append(rows)
    levels, width = len(window), len(window[0])
    look = [[0] * width for _ in range(levels)]
    for i in range(width):
        look[0][i] = add(window[0][i], look[0][i - 1] if i else 0)
    for j in range(1, levels):
        for i in range(width):
            look[j][i] = add(window[j][i], look[j - 1][i])
    return StepLayout(tokens=tokens, parents=parents, depths=depths, candidate_rows=cand_rows, window_rows=look)


def check_lookahead_params(window: int, ngram: int, max_candidates: int) -> tuple[int, int, int]:
    """``(W, N, G)`` as ints after checking ``W >= 1``, ``N >= 2`` and ``G >= 1``.

    Raises:
        ValueError: naming the parameter.
    """
    return (_check_int("lookahead window", window, 1), _check_int("lookahead ngram", ngram, 2),
            _check_int("lookahead max_candidates", max_candidates, 1))


def _mask(model, parents: list[int], prefix_len: int, device, dtype) -> torch.Tensor:
    """The step's 4D mask ``[1, 1, S, prefix_len + S]``: boolean (True = attend) or, for eager
    attention, additive float."""
    allowed = tree_attention_mask(parents, prefix_len, device=device)
    if getattr(model.config, "_attn_implementation", None) == "eager":
        return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)
    return allowed


def _verify(layout: StepLayout, ys: dict[int, int]) -> tuple[int, int]:
    """``(best candidate, accepted)``: the candidate with the longest prefix equal to the target's
    decodes (``ys[row]``: the token the target commits after that row), the first on ties."""
    best, best_a = -1, 0
    for g, rows in enumerate(layout.candidate_rows):
        prev, a = 0, 0
        for r in rows:
            if layout.tokens[r] != ys[prev]:
                break
            a, prev = a + 1, r
        if a > best_a:
            best, best_a = g, a
    return best, best_a


@torch.inference_mode()
def lookahead_decode(
    model,
    input_ids: list[int],
    max_new_tokens: int,
    *,
    window: int = 5,
    ngram: int = 4,
    max_candidates: int = 5,
    rule: DecodeRule = DecodeRule(),
    eos_token_id: int | None = None,
    seed: int = 0,
) -> LookaheadResult:
    """Lookahead decoding, batch 1, lossless (module docstring; Fu et al. 2024, Algorithm 1).

    Args:
        model: Hugging Face causal LM (Llama/Qwen family), eval mode, any device / dtype.
        input_ids: prompt token ids (non-empty, in ``[0, V)``).
        max_new_tokens: generation budget (>= 1).
        window: W, the window's columns (lookahead positions per level).
        ngram: N, the n-gram size (the window has ``N - 1`` levels; candidates ``N - 1`` tokens).
        max_candidates: G, the most n-grams verified per step (and kept per first token).
        rule: decoding rule (greedy, or Gumbel-max sampling keyed by (seed, position)); the window's
            new level is decoded with the same rule at its positions.
        eos_token_id: stop after committing this id (None: exactly ``max_new_tokens`` tokens).
        seed: seeds the window's initial tokens (drawn from the prompt).

    Returns:
        :class:`LookaheadResult`; ``tokens`` equal :func:`impl.spec.ar.ar_decode`'s under the same rule.

    Raises:
        ValueError: empty prompt, ids outside the vocabulary, ``max_new_tokens`` < 1, bad W / N / G,
            a bad ``eos_token_id``, or a prompt + budget + window that overflows the context.
    """

    ids = _check_decode_args(model, input_ids, max_new_tokens, eos_token_id)
    W, N, G = check_lookahead_params(window, ngram, max_candidates)
    ctx = getattr(model.config, "max_position_embeddings", None)
    # the deepest row of the last step: position (P + max_new - 2) + W + N - 2 (a window token)
    if ctx is not None and len(ids) + max_new_tokens + W + N - 3 > ctx:
        raise ValueError(f"prompt of {len(ids)} tokens + {max_new_tokens} new tokens + the lookahead window "
                         f"(W={W}, N={N}) exceeds the context of {ctx}")
    L = num_layers(model)
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    rng = random.Random(seed)
    win = [[rng.choice(ids) for _ in range(W)] for _ in range(N - 1)]
    pool = NGramPool(G)
    cache = DynamicCache(config=model.config)
    tokens: list[int] = []
    steps: list[LookaheadStep] = []
    stopped = False

    _sync(device)
    t0 = time.perf_counter()
    if len(ids) > 1:
        prefix = torch.tensor([ids[:-1]], dtype=torch.long, device=device)
        run_layers(model, embed(model, prefix), 0, L, position_ids=torch.arange(len(ids) - 1, device=device)[None],
                   cache=cache)
    _sync(device)
    t_pre = time.perf_counter() - t0
    while not stopped and len(tokens) < max_new_tokens:
        n = len(ids)  # committed ids; positions 0 .. n-2 cached, ids[-1] is the root at position n-1
        root = ids[-1]
        cands = pool.get(root)[:G]
        lay = step_layout(root, win, cands)
        S = len(lay.tokens)
        x = torch.tensor([lay.tokens], dtype=torch.long, device=device)
        pos = torch.tensor([[n - 1 + d for d in lay.depths]], dtype=torch.long, device=device)
        h = run_layers(model, embed(model, x), 0, L, position_ids=pos,
                       attention_mask=_mask(model, lay.parents, n - 1, device, dtype), cache=cache)
        logits = readout_logits(model, h)[0]  # [S, V]
        # the target's decode after every verification row (root + candidates) and the last level
        last = lay.window_rows[-1]
        check = [0] + [r for rows in lay.candidate_rows for r in rows]
        rows = check + last
        decoded = rule.decode_rows(logits[rows], [n + lay.depths[r] for r in rows])
        ys = dict(zip(check, decoded[: len(check)]))
        new_level = decoded[len(check):]

        g, a = _verify(lay, ys)
        path = [0] + (lay.candidate_rows[g][:a] if g >= 0 else [])
        new = [lay.tokens[r] for r in path[1:]] + [ys[path[-1]]]
        new = new[: max_new_tokens - len(tokens)]
        if eos_token_id is not None and eos_token_id in new:
            new = new[: new.index(eos_token_id) + 1]
            stopped = True
        commit_cache(cache, n - 1, S, path)
        ids += new
        tokens += new

        # Jacobi update of the window and the n-gram pool (Fu et al. Algorithm 1)
        if len(steps) >= N - 2:
            for i in range(W):
                first = lay.tokens[lay.window_rows[0][i]]
                pool.add(first, tuple(lay.tokens[lay.window_rows[j][i]] for j in range(1, N - 1)) + (new_level[i],))
        win = [[lay.tokens[r] for r in lay.window_rows[j]] for j in range(1, N - 1)] + [list(new_level)]
        steps.append(LookaheadStep(drafted=len(cands) * (N - 1), candidates=len(cands), accepted=min(a, len(new)),
                                   committed=len(new), rows=S, layer_work=S * L, critical_layers=L))
    _sync(device)
    return LookaheadResult(tokens=tokens, stopped_at_eos=stopped, rounds=steps,
                           layer_work=sum(s.layer_work for s in steps),
                           critical_layers=sum(s.critical_layers for s in steps),
                           readout_rows=sum(s.rows for s in steps), seconds=time.perf_counter() - t0,
                           prefill_seconds=t_pre, pool_size=len(pool))
