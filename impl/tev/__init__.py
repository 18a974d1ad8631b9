"""TEV / ExitTrain: draft trees, the canonical exit law and exact fixed-tree verifiers (TEV paper,
Secs. 2-4, App. A-B).

A draft tree (``tree``) is verified by one target forward that yields p_v at every node; the exit law
(``exit_law``) w(v) = P(v) rho(v) says where target continuations leave the tree, and every exact
saturated verifier (``verify``: predraw-and-follow, sequential residual, TEV) returns an accepted path
and a bonus token with exactly that law, so E[block length] = 1 + C_p(T).

The decoding pipeline (Sec. 2): a DFlash-style block drafter conditioned on target features
(``drafter``, with its rollout training), DDTree's best-first builder or a DFlash chain (``builder``),
and the batch-1 loop drafter -> builder -> one target tree forward -> verifier -> KV commit
(``decode.tev_decode``), exact against AR at T = 0 and in distribution at T > 0.

ExitTrain (Sec. 5-6.2; ``train``): the drafter is fine-tuned with L_tok + lambda L_exit, where
L_exit (Eq. 14, App. C.2 row form) reweights the draft likelihood of every node of the tree the
current drafter builds by its detached exit mass w(v); token-only and prefix-weighted controls share
the initialisation, the rollouts (``drafter.make_rollouts``) and the data order.
"""

from .builder import best_first_tree, chain_tree
from .decode import FixedDrafter, TEVResult, commit_cache, tev_decode
from .drafter import (
    BlockDrafter,
    DrafterConfig,
    DrafterTrainConfig,
    RolloutData,
    drafter_dir_for,
    evaluate_drafter,
    make_rollouts,
    sharegpt_prompt_ids,
    sharegpt_prompt_texts,
    target_features,
    train_drafter,
)
from .exit_law import (
    check_target_probs,
    exit_law,
    expected_block_length,
    residual_distribution,
    target_coverage,
)
from .train import (
    OBJECTIVES,
    ExitTrainConfig,
    evaluate_decoding,
    evaluate_trees,
    exit_loss,
    prefix_weights,
    train_exittrain,
    tree_target_logits,
)
from .tree import DraftTree, ancestor_mask, path_to, tree_attention_mask, validate_tree
from .verify import VERIFIERS, greedy_follow, predraw_follow, sequential_residual, tev

__all__ = [
    "BlockDrafter",
    "DraftTree",
    "DrafterConfig",
    "DrafterTrainConfig",
    "ExitTrainConfig",
    "OBJECTIVES",
    "RolloutData",
    "FixedDrafter",
    "TEVResult",
    "best_first_tree",
    "chain_tree",
    "commit_cache",
    "drafter_dir_for",
    "evaluate_decoding",
    "evaluate_drafter",
    "evaluate_trees",
    "exit_loss",
    "make_rollouts",
    "prefix_weights",
    "sharegpt_prompt_ids",
    "sharegpt_prompt_texts",
    "target_features",
    "tev_decode",
    "train_drafter",
    "train_exittrain",
    "tree_target_logits",
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
