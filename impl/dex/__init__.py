"""DEX: lossless depth exploration decoding (DEX paper, Sec. 3, Algorithms 1-2, App. B-C).

K depth explorers own the stages (d_{k-1}, d_k] of an exploration set X; each round every live slot
advances one stage (depth expansion) and every new candidate opens a slot at the next position
(position expansion); when the anchor slot reaches the final depth its token is committed, the
shallowest matching anchor candidate selects the branch to keep, and the rest collapses.

Names are exported lazily (PEP 562): importing the package (e.g. for its light ``schema``
module at workflow parse time) imports no submodule; ``from impl.<pkg> import X`` imports X's module.
"""

from __future__ import annotations

from ..registry import lazy_exports

#: exported name -> the submodule that defines it
_EXPORTS = {
    'DEXDecoder': '.decoder',
    'DEXResult': '.decoder',
    'TokenMetrics': '.decoder',
    'ReferenceExecutor': '.reference',
}

__all__ = ['DEXDecoder', 'DEXResult', 'TokenMetrics', 'ReferenceExecutor']


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
