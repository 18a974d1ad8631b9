"""Oracle EAD measurement and depth-side accounting (DEX paper, Sec. 2 and App. A).

Names are exported lazily (PEP 562): importing the package (e.g. for its light ``schema``
module at workflow parse time) imports no submodule; ``from impl.<pkg> import X`` imports X's module.
"""

from __future__ import annotations

from ..registry import lazy_exports

#: exported name -> the submodule that defines it
_EXPORTS = {
    'depth_ceiling': '.accounting',
    'depth_side_speedup': '.accounting',
    'ead_from_omega': '.accounting',
    'exploration_workload': '.accounting',
    'resolution': '.accounting',
    's_ead': '.accounting',
    's_x': '.accounting',
    's_x_lower_bound': '.accounting',
    'selection_overhead': '.accounting',
    'selection_trace': '.accounting',
    'selection_workload': '.accounting',
    'stable_ead_from_omega': '.accounting',
    'uniform_exploration_set': '.accounting',
    'validate_exploration_set': '.accounting',
}

__all__ = ['depth_ceiling', 'depth_side_speedup', 'ead_from_omega', 'exploration_workload', 'resolution', 's_ead', 's_x', 's_x_lower_bound', 'selection_overhead', 'selection_trace', 'selection_workload', 'stable_ead_from_omega', 'uniform_exploration_set', 'validate_exploration_set']


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
