"""DEX: lossless depth exploration decoding (DEX paper, Sec. 3, Algorithms 1-2, App. B-C).

K depth explorers own the stages (d_{k-1}, d_k] of an exploration set X; each round every live slot
advances one stage (depth expansion) and every new candidate opens a slot at the next position
(position expansion); when the anchor slot reaches the final depth its token is committed, the
shallowest matching anchor candidate selects the branch to keep, and the rest collapses.
"""

from .decoder import DEXDecoder, DEXResult, TokenMetrics
from .reference import ReferenceExecutor

__all__ = ["DEXDecoder", "DEXResult", "TokenMetrics", "ReferenceExecutor"]
