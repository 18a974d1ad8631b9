"""Draft trees as parent arrays: validation, depth levels, root paths, ancestor and tree-attention masks
(TEV paper, Sec. 3 "Fixed-tree setup", Fig. 2). The array layout is described in :mod:`impl.tev.tree`;
these are the pure functions on it that the tree class, the verifiers' index tables
(:mod:`impl.tev.plan`) and the exit law share.
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["IntSeq", "ancestor_mask", "depth_levels", "path_to", "tree_attention_mask", "validate_tree"]

IntSeq = Sequence[int] | torch.Tensor


def _as_int_list(x: IntSeq, name: str) -> list[int]:
    if isinstance(x, torch.Tensor):
        if x.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(x.shape)}")
        if x.dtype.is_floating_point or x.dtype == torch.bool:
            raise ValueError(f"{name} must be an integer tensor, got {x.dtype}")
        return [int(t) for t in x.tolist()]
    out = []
    for t in x:
        if isinstance(t, bool) or int(t) != t:
            raise ValueError(f"{name} must hold integers, got {t!r}")
        out.append(int(t))
    return out


def validate_tree(parents: IntSeq, tokens: IntSeq) -> tuple[list[int], list[int], list[int]]:
    """Check that ``(parents, tokens)`` describe a valid draft tree and return its depths.

    Args:
        parents: N parent indices (list/tuple of int or a 1-D integer tensor): ``parents[0] == -1``
            (node 0 is the root) and ``0 <= parents[v] < v`` for v >= 1 (topological numbering).
        tokens: N incoming tokens; ``tokens[v] >= 0`` for v >= 1, ``tokens[0] >= -1``.

    Returns:
        ``(parents, tokens, depths)`` as plain ``list[int]`` of length N (root depth 0).

    Raises:
        ValueError: empty tree, length mismatch, non-integer entries, a root that is not node 0, a
            parent index out of topological order, a negative draft token, or two siblings carrying
            the same token (the message names the offending node).
    """
    par = _as_int_list(parents, "parents")
    tok = _as_int_list(tokens, "tokens")
    if not par:
        raise ValueError("a draft tree needs at least the root node")
    if len(par) != len(tok):
        raise ValueError(f"parents has {len(par)} entries but tokens has {len(tok)}")
    if par[0] != -1:
        raise ValueError(f"node 0 must be the root with parent -1, got parent {par[0]}")
    if tok[0] < -1:
        raise ValueError(f"root token must be a token id or -1, got {tok[0]}")
    depths = [0] * len(par)
    seen: set[tuple[int, int]] = set()
    for v in range(1, len(par)):
        p = par[v]
        if not 0 <= p < v:
            raise ValueError(
                f"node {v}: parent {p} is not an earlier node (need 0 <= parent < {v}; only the root "
                "has parent -1)")
        if tok[v] < 0:
            raise ValueError(f"node {v}: draft token must be >= 0, got {tok[v]}")
        if (p, tok[v]) in seen:
            raise ValueError(
                f"node {v}: token {tok[v]} repeats a sibling's token under parent {p} "
                "(sibling tokens must be distinct)")
        seen.add((p, tok[v]))
        depths[v] = depths[p] + 1
    return par, tok, depths


def depth_levels(depths: Sequence[int]) -> list[torch.Tensor]:
    """Node ids grouped by depth, for level-parallel passes (TEV App. B, Algorithm 1 line 4).

    Args:
        depths: N non-negative depths (root depth 0).

    Returns:
        ``list`` of length max_depth + 1; entry d is an int64 CPU tensor of the node ids at depth d,
        ascending.
    """
    d = torch.as_tensor(list(depths), dtype=torch.long)
    return [torch.nonzero(d == k).flatten() for k in range(int(d.max()) + 1)]


def path_to(parents: IntSeq, node: int) -> list[int]:
    """Root-to-``node`` node ids (root first) for a parent array with ``parents[0] == -1``.

    Raises:
        ValueError: if ``node`` is out of range or the parent chain does not reach the root.
    """
    par = parents.tolist() if isinstance(parents, torch.Tensor) else parents
    node = int(node)
    if not 0 <= node < len(par):
        raise ValueError(f"node {node} is not in a {len(par)}-node tree")
    path = [node]
    while par[path[-1]] != -1:
        nxt = int(par[path[-1]])
        if not 0 <= nxt < len(par) or len(path) >= len(par):
            raise ValueError(f"the parent chain of node {node} does not reach the root")
        path.append(nxt)
    return path[::-1]


def ancestor_mask(parents: IntSeq, device: torch.device | str = "cpu") -> torch.Tensor:
    """Ancestor-or-self matrix of a draft tree, built level by level.

    Args:
        parents: N parent indices (validated with :func:`validate_tree` rules).

    Returns:
        bool ``[N, N]``: ``[i, j]`` is True iff node j lies on the root-to-i path (j == i included).

    Raises:
        ValueError: on an invalid parent array.
    """
    par = _as_int_list(parents, "parents")
    par, _, depths = validate_tree(par, _dummy_tokens(par))
    n = len(par)
    pt = torch.tensor(par, dtype=torch.long, device=device)
    mask = torch.eye(n, dtype=torch.bool, device=device)
    for nodes in depth_levels(depths)[1:]:
        nodes = nodes.to(device)
        mask[nodes] |= mask[pt[nodes]]
    return mask


def _dummy_tokens(par: list[int]) -> list[int]:
    # distinct per node, so the sibling check cannot fire when only the parents are validated
    return [-1] + list(range(len(par) - 1))


def tree_attention_mask(parents: IntSeq, prefix_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """4D boolean attention mask for one target forward over ``[committed prefix | tree]``.

    The queries are the N tree rows; the keys are the ``prefix_len`` cached prefix positions followed
    by the N tree rows. Every tree row sees the whole prefix, its ancestors and itself (True = attend,
    the transformers 5 boolean-mask convention). Use with :meth:`DraftTree.position_ids`.

    Args:
        parents: N parent indices (root 0 with parent -1, topological order).
        prefix_len: number of committed tokens already in the KV cache (>= 0).

    Returns:
        bool ``[1, 1, N, prefix_len + N]``.

    Raises:
        ValueError: on an invalid parent array or ``prefix_len < 0``.
    """
    if prefix_len < 0:
        raise ValueError(f"prefix_len must be >= 0, got {prefix_len}")
    anc = ancestor_mask(parents, device=device)
    n = anc.shape[0]
    prefix = torch.ones(n, prefix_len, dtype=torch.bool, device=device)
    return torch.cat([prefix, anc], dim=1)[None, None]
