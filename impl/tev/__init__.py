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
the initialisation, the rollouts (``drafter.make_rollouts``) and the data order, as does Draft-OPD
(``opd``: forward KL to the target on blocks replayed from where verification rejected the draft).

Names are exported lazily (PEP 562): importing the package (e.g. for its light ``schema``
module at workflow parse time) imports no submodule; ``from impl.<pkg> import X`` imports X's module.
"""

from __future__ import annotations

from ..registry import lazy_exports

#: exported name -> the submodule that defines it
_EXPORTS = {
    'best_first_tree': '.builder',
    'chain_tree': '.builder',
    'FixedDrafter': '.decode',
    'TEVResult': '.decode',
    'commit_cache': '.decode',
    'tev_decode': '.decode',
    'BlockDrafter': '.drafter',
    'DrafterConfig': '.drafter',
    'DrafterTrainConfig': '.drafter',
    'RolloutData': '.drafter',
    'drafter_dir_for': '.drafter',
    'evaluate_drafter': '.drafter',
    'make_rollouts': '.drafter',
    'drafter_prompt_ids': '.prompts',
    'drafter_prompt_texts': '.prompts',
    'sharegpt_prompt_ids': '.prompts',
    'sharegpt_prompt_texts': '.prompts',
    'target_features': '.drafter',
    'train_drafter': '.drafter',
    'batched_greedy_rollouts': '.drafter',
    'curve_steps': '.drafter',
    'check_target_probs': '.exit_law',
    'exit_law': '.exit_law',
    'expected_block_length': '.exit_law',
    'residual_distribution': '.exit_law',
    'target_coverage': '.exit_law',
    'forward_kl_loss': '.opd',
    'replay_anchors': '.opd',
    'rollout_target_logits': '.opd',
    'OBJECTIVES': '.train',
    'ExitTrainConfig': '.train',
    'evaluate_decoding': '.train',
    'evaluate_trees': '.train',
    'exit_loss': '.train',
    'prefix_weights': '.train',
    'train_exittrain': '.train',
    'tree_target_logits': '.train',
    'DraftTree': '.tree',
    'ancestor_mask': '.tree',
    'path_to': '.tree',
    'tree_attention_mask': '.tree',
    'validate_tree': '.tree',
    'VERIFIERS': '.verify',
    'greedy_follow': '.verify',
    'predraw_follow': '.verify',
    'sequential_residual': '.verify',
    'tev': '.verify',
}

__all__ = ['batched_greedy_rollouts', 'BlockDrafter', 'DraftTree', 'DrafterConfig', 'DrafterTrainConfig', 'ExitTrainConfig', 'OBJECTIVES', 'RolloutData', 'FixedDrafter', 'TEVResult', 'best_first_tree', 'chain_tree', 'commit_cache', 'curve_steps', 'drafter_dir_for', 'drafter_prompt_ids', 'drafter_prompt_texts', 'evaluate_decoding', 'evaluate_drafter', 'evaluate_trees', 'exit_loss', 'forward_kl_loss', 'make_rollouts', 'prefix_weights', 'replay_anchors', 'rollout_target_logits', 'sharegpt_prompt_ids', 'sharegpt_prompt_texts', 'target_features', 'tev_decode', 'train_drafter', 'train_exittrain', 'tree_target_logits', 'VERIFIERS', 'ancestor_mask', 'check_target_probs', 'exit_law', 'expected_block_length', 'greedy_follow', 'path_to', 'predraw_follow', 'residual_distribution', 'sequential_residual', 'target_coverage', 'tev', 'tree_attention_mask', 'validate_tree']


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
