"""vSkipper: per-token RUN / Project-Only layer skipping inside a continuous-batching engine.

- :mod:`.skipper`: the skipper interface (actions, row metadata, base class, registry, start-up
  validation, the static-depth plugin example) - vSkipper Sec. 3, 3.4, App. A;
- :mod:`.random_skip`: RandomSkip, the seeded-hash mock policy (Sec. 4.4);
- :mod:`.routed`: routed execution of one Llama/Qwen3 decoder layer (Sec. 3.1-3.2), in plain
  PyTorch and inside the engine;
- :mod:`.engine`: the binding to transformers' continuous batching and a greedy helper for routed
  and dense modes;
- :mod:`.flexidepth`: the FlexiDepth-style trained gate (router + SwiGLU adapter per routed layer),
  its checkpoint and its stage-1 training (Sec. 3.1, 3.4);
- :mod:`.mode`: the profitability-aware mode switch, the routed-cost profile and the threshold rule
  (Sec. 3.3).

Names are exported lazily (PEP 562): importing the package (e.g. for its light ``schema``
module at workflow parse time) imports no submodule; ``from impl.<pkg> import X`` imports X's module.
"""

from __future__ import annotations

from ..registry import lazy_exports

#: exported name -> the submodule that defines it
_EXPORTS = {
    'Action': '.skipper',
    'Phase': '.skipper',
    'RowMeta': '.skipper',
    'Skipper': '.skipper',
    'StaticDepthSkipper': '.skipper',
    'as_run_mask': '.skipper',
    'build_skipper': '.skipper',
    'register_skipper': '.skipper',
    'registered_skippers': '.skipper',
    'request_key': '.skipper',
    'validate_skipper': '.skipper',
    'RandomSkip': '.random_skip',
    'RoutedDecoderLayer': '.routed',
    'RowContext': '.routed',
    'install_routed_layers': '.routed',
    'plain_forward': '.routed',
    'plain_greedy': '.routed',
    'remove_routed_layers': '.routed',
    'routed_context': '.routed',
    'bind_skipper': '.engine',
    'generate_greedy': '.engine',
    'routed_cb_config': '.engine',
    'rows_of_batch': '.engine',
    'unbind_skipper': '.engine',
    'FlexiDepthSkipper': '.flexidepth',
    'FlexiDepthTrainConfig': '.flexidepth',
    'flexidepth_forward': '.flexidepth',
    'load_flexidepth': '.flexidepth',
    'train_and_save': '.flexidepth',
    'train_flexidepth': '.flexidepth',
    'ModeController': '.mode',
    'ModeSwitch': '.mode',
    'derive_thresholds': '.mode',
    'generate_with_switch': '.mode',
    'profile_routed_cost': '.mode',
}

__all__ = ['Action', 'Phase', 'RowMeta', 'Skipper', 'StaticDepthSkipper', 'RandomSkip', 'as_run_mask', 'build_skipper', 'register_skipper', 'registered_skippers', 'request_key', 'validate_skipper', 'RoutedDecoderLayer', 'RowContext', 'install_routed_layers', 'remove_routed_layers', 'routed_context', 'plain_forward', 'plain_greedy', 'bind_skipper', 'unbind_skipper', 'routed_cb_config', 'generate_greedy', 'rows_of_batch', 'FlexiDepthSkipper', 'FlexiDepthTrainConfig', 'flexidepth_forward', 'load_flexidepth', 'train_flexidepth', 'train_and_save', 'ModeSwitch', 'ModeController', 'generate_with_switch', 'profile_routed_cost', 'derive_thresholds']


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
