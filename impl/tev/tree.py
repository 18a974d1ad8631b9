"""Rooted, prefix-closed draft trees (TEV paper, Sec. 3 "Fixed-tree setup", Fig. 2).

A tree of N nodes is stored as two integer sequences of length N:

* ``parents[v]``: the parent pa(v) of node v; the root r is node 0 with ``parents[0] == -1``, and
  nodes are numbered in topological order (``0 <= parents[v] < v`` for every v >= 1), which every
  best-first or level-wise builder produces naturally and which makes cycles impossible;
* ``tokens[v]``: the incoming draft token x_v of node v (>= 0); the root's entry is the last
  committed token (the token the root's tree-forward row is fed), or -1 when not needed.

Node v represents the speculative prefix pi(v) = (x_{v_1}, ..., x_{v_d}) along its root path, with
depth d = |pi(v)| (root depth 0). Sibling tokens must be distinct (Sec. 3 and App. A: "Sibling
edges carry distinct draft tokens"), so every prefix appears at most once.

For the single target forward that verifies the tree, the root row is fed the last committed token
at position ``prefix_len`` (the committed prefix before it, of length ``prefix_len``, sits in the KV
cache), and every node v is fed x_v at position ``prefix_len + depth(v)``, attending to the whole
committed prefix, to its ancestors and to itself. Row v's logits then give p_v = p(. | c, pi(v))
(Eq. 1).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from .parents import IntSeq, ancestor_mask, depth_levels, path_to, tree_attention_mask, validate_tree
from .plan import tree_plan

__all__ = ["DraftTree", "IntSeq", "ancestor_mask", "depth_levels", "path_to", "tree_attention_mask", "validate_tree"]


@dataclass
class DraftTree:
    """A validated draft tree (TEV Sec. 3): parents, incoming tokens, children and depths.

    Attributes:
        parents: ``list[int]`` of length N, ``parents[0] == -1``, ``0 <= parents[v] < v``.
        tokens: ``list[int]`` of length N; ``tokens[0]`` is the last committed token or -1.
        children: derived, ``children[v]`` lists v's children in ascending id (insertion) order.
        depths: derived, ``depths[v] = |pi(v)|``.

    Raises:
        ValueError: from :func:`validate_tree` on construction or :meth:`add_child`.
    """

    parents: list[int]
    tokens: list[int]
    children: list[list[int]] = field(init=False, repr=False)
    depths: list[int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.parents, self.tokens, self.depths = validate_tree(self.parents, self.tokens)
        self.children = [[] for _ in self.parents]
        for v in range(1, len(self.parents)):
            self.children[self.parents[v]].append(v)

    # -- construction ------------------------------------------------------------------------

    @classmethod
    def root_only(cls, root_token: int = -1) -> "DraftTree":
        """A tree with just the root (no draft tokens; every verifier then only draws a bonus).

        Raises:
            ValueError: if ``root_token < -1``.
        """
        return cls([-1], [root_token])

    @classmethod
    def from_paths(cls, paths: Sequence[Sequence[int]], root_token: int = -1) -> "DraftTree":
        """The smallest prefix-closed tree containing every token sequence in ``paths``.

        Args:
            paths: draft continuations (token id sequences after the root); shared prefixes are
                merged, so the result is a trie. Nodes are numbered in order of first appearance.
            root_token: the last committed token, or -1.

        Raises:
            ValueError: on a negative token id.
        """
        tree = cls.root_only(root_token)
        for path in paths:
            v = 0
            for t in path:
                v = tree.child_with_token(v, int(t))
        return tree

    def child_with_token(self, v: int, token: int) -> int:
        """Return v's child carrying ``token``, adding it (as a new last node) if absent.

        Raises:
            ValueError: as :meth:`add_child`.
        """
        for u in self.children[v]:
            if self.tokens[u] == token:
                return u
        return self.add_child(v, token)

    def add_child(self, parent: int, token: int) -> int:
        """Append a new node with incoming ``token`` under ``parent``; return its id (= old N).

        Raises:
            ValueError: if ``parent`` is not a node, ``token < 0``, or a sibling already carries
                ``token`` (the message names the parent and the existing sibling).
        """
        parent, token = int(parent), int(token)
        if not 0 <= parent < len(self.parents):
            raise ValueError(f"parent {parent} is not a node of this {len(self.parents)}-node tree")
        if token < 0:
            raise ValueError(f"draft token must be >= 0, got {token}")
        for u in self.children[parent]:
            if self.tokens[u] == token:
                raise ValueError(
                    f"node {len(self.parents)}: token {token} repeats sibling node {u} under parent "
                    f"{parent} (sibling tokens must be distinct)")
        v = len(self.parents)
        self.parents.append(parent)
        self.tokens.append(token)
        self.depths.append(self.depths[parent] + 1)
        self.children.append([])
        self.children[parent].append(v)
        return v

    # -- queries -----------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.parents)

    @property
    def max_depth(self) -> int:
        """The largest node depth (0 for a root-only tree)."""
        return max(self.depths)

    def levels(self) -> list[torch.Tensor]:
        """Node ids by depth: a list of int64 tensors (see :func:`depth_levels`)."""
        return depth_levels(self.depths)

    def plan(self):
        """The verifiers' index tables of this tree (:class:`impl.tev.plan.TreePlan`), built on the
        first call and cached until the tree grows (:meth:`add_child`)."""
        cached = getattr(self, "_plan", None)
        if cached is None or len(cached) != len(self.parents):
            cached = tree_plan(self.parents, self.tokens)
            object.__setattr__(self, "_plan", cached)
        return cached

    def path_to(self, node: int) -> list[int]:
        """Node ids on the root-to-``node`` path, root first and ``node`` last.

        Raises:
            ValueError: if ``node`` is not a node of the tree.
        """
        return path_to(self.parents, node)

    def path_tokens(self, node: int) -> list[int]:
        """pi(node) (Sec. 3): the draft tokens along the root-to-``node`` path, root token excluded.

        Raises:
            ValueError: if ``node`` is not a node of the tree.
        """
        return [self.tokens[u] for u in self.path_to(node)[1:]]

    def ancestor_mask(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """Boolean ``[N, N]``: entry ``[i, j]`` is True iff j is i or an ancestor of i (see
        :func:`ancestor_mask`)."""
        return ancestor_mask(self.parents, device=device)

    def position_ids(self, prefix_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """int64 ``[1, N]`` absolute positions ``prefix_len + depth(v)`` of the tree rows.

        Raises:
            ValueError: if ``prefix_len < 0``.
        """
        if prefix_len < 0:
            raise ValueError(f"prefix_len must be >= 0, got {prefix_len}")
        return (torch.tensor(self.depths, dtype=torch.long, device=device) + prefix_len).unsqueeze(0)

    def attention_mask(self, prefix_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """4D boolean mask ``[1, 1, N, prefix_len + N]`` (see :func:`tree_attention_mask`)."""
        return tree_attention_mask(self.parents, prefix_len, device=device)

    def input_ids(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """int64 ``[1, N]`` tokens fed to the tree rows (``tokens``; the root's must be set).

        Raises:
            ValueError: if the root token is -1 (the root row needs the last committed token).
        """
        if self.tokens[0] < 0:
            raise ValueError("the root token is -1: set it to the last committed token to run the tree")
        return torch.tensor([self.tokens], dtype=torch.long, device=device)
