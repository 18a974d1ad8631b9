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
"""

from .skipper import (
    Action,
    Phase,
    RowMeta,
    Skipper,
    StaticDepthSkipper,
    as_run_mask,
    build_skipper,
    register_skipper,
    registered_skippers,
    request_key,
    validate_skipper,
)
from .random_skip import RandomSkip
from .routed import (
    RoutedDecoderLayer,
    RowContext,
    install_routed_layers,
    plain_forward,
    plain_greedy,
    remove_routed_layers,
    routed_context,
)
from .engine import bind_skipper, generate_greedy, routed_cb_config, rows_of_batch, unbind_skipper
from .flexidepth import (
    FlexiDepthSkipper,
    FlexiDepthTrainConfig,
    flexidepth_forward,
    load_flexidepth,
    train_and_save,
    train_flexidepth,
)
from .mode import (
    ModeController,
    ModeSwitch,
    derive_thresholds,
    generate_with_switch,
    profile_routed_cost,
)

__all__ = [
    "Action",
    "Phase",
    "RowMeta",
    "Skipper",
    "StaticDepthSkipper",
    "RandomSkip",
    "as_run_mask",
    "build_skipper",
    "register_skipper",
    "registered_skippers",
    "request_key",
    "validate_skipper",
    "RoutedDecoderLayer",
    "RowContext",
    "install_routed_layers",
    "remove_routed_layers",
    "routed_context",
    "plain_forward",
    "plain_greedy",
    "bind_skipper",
    "unbind_skipper",
    "routed_cb_config",
    "generate_greedy",
    "rows_of_batch",
    "FlexiDepthSkipper",
    "FlexiDepthTrainConfig",
    "flexidepth_forward",
    "load_flexidepth",
    "train_flexidepth",
    "train_and_save",
    "ModeSwitch",
    "ModeController",
    "generate_with_switch",
    "profile_routed_cost",
    "derive_thresholds",
]
