"""Oracle EAD measurement and depth-side accounting (DEX paper, Sec. 2 and App. A)."""

from .accounting import (
    depth_ceiling,
    depth_side_speedup,
    ead_from_omega,
    exploration_workload,
    resolution,
    s_ead,
    s_x,
    s_x_lower_bound,
    selection_overhead,
    selection_trace,
    selection_workload,
    stable_ead_from_omega,
    uniform_exploration_set,
    validate_exploration_set,
)

__all__ = [
    "depth_ceiling", "depth_side_speedup", "ead_from_omega", "exploration_workload", "resolution",
    "s_ead", "s_x", "s_x_lower_bound", "selection_overhead", "selection_trace", "selection_workload",
    "stable_ead_from_omega", "uniform_exploration_set", "validate_exploration_set",
]
