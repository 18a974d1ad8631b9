"""Draft-tree builders from position-wise draft marginals (TEV paper, Sec. 2 "We instantiate DFlash
with DDTree's cumulative-score best-first builder", Sec. 5; DDTree, Ringel and Romano 2026).

Both builders take the drafter's ``[H, V]`` block logits (row k = marginal of depth k + 1, see
:mod:`impl.tev.drafter`) and return a :class:`impl.tev.tree.DraftTree` whose nodes are numbered in
creation order (parents before children) with distinct sibling tokens.

* :func:`best_first_tree` (DDTree): the B non-root nodes with the highest cumulative draft
  log-probability, grown best-first with a heap. A node at depth d carries a token of row d - 1;
  its score is the sum of the row log-probabilities along its root path. Because every row is sorted
  and log-probabilities are <= 0, a child never outscores its parent and a later sibling never
  outscores an earlier one, so the heap only needs, per popped node, its next sibling and its first
  child: the result is the best prefix-closed set of B prefixes under the factorised score.
* :func:`chain_tree` (DFlash): the single chain of per-row argmax tokens.
"""

from __future__ import annotations

import heapq
import math

import torch

from .tree import DraftTree


def _check(marginals: torch.Tensor, depth: int, what: str) -> torch.Tensor:
    if not isinstance(marginals, torch.Tensor) or marginals.dim() != 2 or not marginals.dtype.is_floating_point:
        shape = tuple(marginals.shape) if isinstance(marginals, torch.Tensor) else type(marginals).__name__
        raise ValueError(f"marginals must be a floating [H, V] tensor, got {shape}")
    if isinstance(depth, bool) or not isinstance(depth, int) or not 0 <= depth <= marginals.shape[0]:
        raise ValueError(f"{what} must be an int in [0, H={marginals.shape[0]}], got {depth!r}")
    lp = torch.log_softmax(marginals[:depth].detach().to(device="cpu", dtype=torch.float64), dim=-1)
    if bool(torch.isnan(lp).any()):
        raise ValueError("marginals contain NaN (or a row that is -inf everywhere)")
    return lp


def best_first_tree(marginals: torch.Tensor, budget: int, depth: int, root_token: int = -1,
                    return_scores: bool = False):
    """DDTree's best-first builder over cumulative draft log-probabilities.

    Candidates are ``(parent, rank)``: the parent's rank-th most likely token at row
    ``depth(parent)``, scored ``score(parent) + logq_{depth(parent)}(token)`` (score(root) = 0). The
    heap starts with ``(root, 0)``; popping a candidate creates its node and pushes its next sibling
    ``(parent, rank + 1)`` and, below depth ``depth``, its first child ``(node, 0)``. Ties in score
    are broken by smaller depth, then smaller token id, then earlier parent, so the tree is a
    deterministic function of the marginals (rows are sorted with a stable sort: equal
    log-probabilities keep ascending token id). Tokens of probability 0 are never drafted.

    Args:
        marginals: float ``[H, V]`` draft logits or log-probabilities (rows are log-softmaxed in
            float64 on CPU); row k is the marginal of depth k + 1.
        budget: B >= 0, the number of non-root nodes (fewer only if the finite-probability
            candidates run out).
        depth: maximum depth, ``0 <= depth <= H`` (0 gives the root-only tree).
        root_token: the last committed token (the root row's input) or -1.
        return_scores: also return the cumulative log-probability of every node (root 0.0).

    Returns:
        :class:`DraftTree` (nodes in pop order, so parents precede children and scores are
        non-increasing), or ``(tree, scores)`` with ``scores`` a ``list[float]`` of length N.

    Raises:
        ValueError: marginals not a floating 2-D tensor or containing NaN, ``depth`` outside
            ``[0, H]``, ``budget < 0``.
    """
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        raise ValueError(f"budget must be an int >= 0, got {budget!r}")
    lp = _check(marginals, depth, "depth")
    parents, tokens, scores = [-1], [int(root_token)], [0.0]
    if budget == 0 or depth == 0:
        tree = DraftTree(parents, tokens)
        return (tree, scores) if return_scores else tree
    k = min(budget, lp.shape[1])
    vals, idx = torch.sort(lp, dim=-1, descending=True, stable=True)
    vals, idx = vals[:, :k].tolist(), idx[:, :k].tolist()
    heap: list[tuple[float, int, int, int, int]] = []

    def push(parent: int, d: int, rank: int) -> None:
        # candidate: rank-th token of row d-1 under ``parent`` (a node at depth d - 1)
        if rank < k:
            s = scores[parent] + vals[d - 1][rank]
            if s > -math.inf:
                heapq.heappush(heap, (-s, d, idx[d - 1][rank], parent, rank))

    push(0, 1, 0)
    while heap and len(parents) <= budget:
        neg, d, tok, parent, rank = heapq.heappop(heap)
        node = len(parents)
        parents.append(parent)
        tokens.append(tok)
        scores.append(-neg)
        push(parent, d, rank + 1)
        if d < depth:
            push(node, d + 1, 0)
    tree = DraftTree(parents, tokens)
    return (tree, scores) if return_scores else tree


def chain_tree(marginals: torch.Tensor, length: int, root_token: int = -1) -> DraftTree:
    """DFlash-style chain: the argmax token of rows 0..length-1 (ties to the lowest id).

    Args:
        marginals: float ``[H, V]`` draft logits or log-probabilities.
        length: number of chain nodes, ``0 <= length <= H``.
        root_token: the last committed token or -1.

    Returns:
        :class:`DraftTree` with nodes ``0 -> 1 -> ... -> length``.

    Raises:
        ValueError: as :func:`best_first_tree` (``length`` outside ``[0, H]``).
    """
    lp = _check(marginals, length, "length")
    toks = lp.argmax(-1).tolist() if length else []
    return DraftTree([-1] + list(range(length)), [int(root_token)] + [int(t) for t in toks])
