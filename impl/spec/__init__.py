"""Decoding baselines shared by the DEX and TEV experiments; AR is the reference of every method.

Depth-selection baselines of DEX Sec. 4 / App. D: LayerSkip self-speculation (:mod:`.self_spec`),
AdaDecode (:mod:`.adadecode`) and DEL (:mod:`.dynamic_exit`); each is lossless and charges its
layer work and critical-path layers per round.
"""

from .adadecode import AdaDecodeResult, adadecode_decode, uniform_shortcut_layers
from .ar import ARResult, ar_decode
from .dynamic_exit import DELResult, dynamic_exit_decode
from .self_spec import SelfSpecResult, self_spec_decode

__all__ = ["ARResult", "ar_decode", "SelfSpecResult", "self_spec_decode", "AdaDecodeResult", "adadecode_decode",
           "uniform_shortcut_layers", "DELResult", "dynamic_exit_decode"]
