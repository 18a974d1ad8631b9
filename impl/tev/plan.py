"""Per-tree index tables for the verifiers, built once when a draft tree is fixed (TEV App. B,
Algorithm 1; DDTree's builder likewise returns its child maps with the tree).

The verifier stage (TEV App. D.1, Table 3) starts after the target tree forward; everything that
depends only on the tree's shape and tokens is known earlier, when the builder finishes. A
:class:`TreePlan` holds those tables so that the hot path of each verifier does no per-node Python
work:

* ``edge_parents`` / ``edge_tokens`` (int64 ``[N - 1]``): pa(u) and x_u of every non-root node, the
  gather indices of the edge probabilities q(u) = p_{pa(u)}(x_u) (Algorithm 1, line 7);
* ``ancestors`` (int64 ``[D, N]``, D the tree's maximum depth): row k holds the k-th ancestor of every
  node (row 0: the node itself) while that ancestor is a non-root node, and 0 (the root) above it.
  With e(0) = 1 and e(u) = q(u), the prefix probability P(v) = prod_k e(ancestors[k, v]) (Eq. 2) is
  one gather and one reduction over all nodes at once; the table itself is built by D whole-array
  gathers (level-parallel pointer chasing), not node by node;
* ``children`` / ``child_tokens``: each node's children (ascending id) and their tokens A(v)
  (ascending token id), the drafted tokens the residual bonus law p_v^res removes (Eq. 7);
* ``child_map``: ``(parent, token) -> child`` for predraw's follow step (DDTree).

Plans are read-only; :meth:`impl.tev.tree.DraftTree.plan` caches one per tree.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .parents import IntSeq, validate_tree


@dataclass(frozen=True, eq=False)
class TreePlan:
    """Index tables of one fixed draft tree (see the module docstring).

    Attributes:
        parents, tokens: ``list[int]`` of length N (validated; ``parents[0] == -1``).
        edge_parents, edge_tokens: int64 ``[N - 1]``, ``parents[1:]`` and ``tokens[1:]``.
        ancestors: int64 ``[D, N]``: ``ancestors[k, v]`` is v's k-th ancestor (k = 0: v) if it is not
            the root, else 0; D = max depth (0 rows for a root-only tree).
        children: ``list[list[int]]``, children of each node in ascending id order.
        child_tokens: ``list[np.ndarray]``, int64 tokens of those children, ascending (empty at a leaf).
        child_map: ``dict[(parent, token), child]`` over the N - 1 edges.
    """

    parents: list[int]
    tokens: list[int]
    edge_parents: np.ndarray
    edge_tokens: np.ndarray
    ancestors: np.ndarray
    children: list[list[int]]
    child_tokens: list[np.ndarray]
    child_map: dict[tuple[int, int], int]
    _flat: dict[int, np.ndarray] = field(default_factory=dict, repr=False)

    def __len__(self) -> int:
        return len(self.parents)

    def edge_flat(self, v_size: int) -> np.ndarray:
        """int64 ``[N - 1]`` flat indices ``pa(u) * V + x_u`` of the edges in a C-contiguous ``[N, V]``
        row matrix (one ``take`` gathers the edge probabilities); computed once per V and cached."""
        flat = self._flat.get(v_size)
        if flat is None:
            flat = self._flat[v_size] = self.edge_parents * v_size + self.edge_tokens
        return flat


def tree_plan(parents: IntSeq, tokens: IntSeq) -> TreePlan:
    """Build the :class:`TreePlan` of a draft tree (validated first).

    Args:
        parents, tokens: the tree (see :mod:`impl.tev.tree`), N entries each.

    Returns:
        :class:`TreePlan`. Cost O(N D) in D whole-array numpy gathers plus one pass to list the
        children, paid once per tree, before (and outside) the verifier stage.

    Raises:
        ValueError: an invalid tree (see :func:`impl.tev.tree.validate_tree`).
    """
    par, tok, _ = validate_tree(parents, tokens)
    n = len(par)
    pa = np.asarray(par, dtype=np.int64)
    tk = np.asarray(tok, dtype=np.int64)
    up = pa.copy()
    up[0] = 0  # the root's "parent" is the root: a chain that reaches it stays there
    rows = []
    cur = np.arange(n, dtype=np.int64)
    while cur.any():  # row k: the k-th ancestor of every node, 0 once past the root's children
        rows.append(cur)
        cur = up[cur]
    ancestors = np.stack(rows) if rows else np.zeros((0, n), dtype=np.int64)
    children: list[list[int]] = [[] for _ in range(n)]
    for u in range(1, n):
        children[par[u]].append(u)
    child_tokens = [np.sort(tk[c]) if c else np.zeros(0, dtype=np.int64) for c in children]
    child_map = dict(zip(zip(par[1:], tok[1:]), range(1, n)))
    return TreePlan(par, tok, pa[1:].copy(), tk[1:].copy(), ancestors, children, child_tokens, child_map)
