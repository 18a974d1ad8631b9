"""TEV / ExitTrain: draft trees, the canonical exit law and exact fixed-tree verifiers (TEV paper,
Secs. 2-4, App. A-B).

A draft tree (``tree``) is verified by one target forward that yields p_v at every node; the exit law
(``exit_law``) w(v) = P(v) rho(v) says where target continuations leave the tree, and every exact
saturated verifier (``verify``: predraw-and-follow, sequential residual, TEV) returns an accepted path
and a bonus token with exactly that law, so E[block length] = 1 + C_p(T).
"""

from .exit_law import (
    check_target_probs,
    exit_law,
    expected_block_length,
    residual_distribution,
    target_coverage,
)
from .tree import DraftTree, ancestor_mask, path_to, tree_attention_mask, validate_tree
from .verify import VERIFIERS, greedy_follow, predraw_follow, sequential_residual, tev

__all__ = [
    "DraftTree",
    "VERIFIERS",
    "ancestor_mask",
    "check_target_probs",
    "exit_law",
    "expected_block_length",
    "greedy_follow",
    "path_to",
    "predraw_follow",
    "residual_distribution",
    "sequential_residual",
    "target_coverage",
    "tev",
    "tree_attention_mask",
    "validate_tree",
]
