"""Decoding baselines shared by the DEX and TEV experiments; AR is the reference of every method.

Depth-selection baselines of DEX Sec. 4 / App. D: LayerSkip self-speculation (:mod:`.self_spec`),
AdaDecode (:mod:`.adadecode`) and DEL (:mod:`.dynamic_exit`); each is lossless and charges its
layer work and critical-path layers per round. Library arms from transformers' ``generate``:
LayerSkip-style early exit (:mod:`.hf_early_exit`) prompt-lookup decoding (:mod:`.hf_prompt_lookup`) and assisted decoding with a draft model
(:mod:`.hf_assisted`).

Names are exported lazily (PEP 562): importing the package (e.g. for its light ``schema``
module at workflow parse time) imports no submodule; ``from impl.<pkg> import X`` imports X's module.
"""

from __future__ import annotations

from ..registry import lazy_exports

#: exported name -> the submodule that defines it
_EXPORTS = {
    'AdaDecodeResult': '.adadecode',
    'adadecode_decode': '.adadecode',
    'uniform_shortcut_layers': '.adadecode',
    'ARResult': '.ar',
    'ar_decode': '.ar',
    'DELResult': '.dynamic_exit',
    'dynamic_exit_decode': '.dynamic_exit',
    'HFEarlyExitResult': '.hf_early_exit',
    'hf_early_exit_decode': '.hf_early_exit',
    'HFAssistedResult': '.hf_assisted',
    'hf_assisted_decode': '.hf_assisted',
    'HFPromptLookupResult': '.hf_prompt_lookup',
    'hf_prompt_lookup_decode': '.hf_prompt_lookup',
    'SelfSpecResult': '.self_spec',
    'self_spec_decode': '.self_spec',
}

__all__ = ['ARResult', 'ar_decode', 'SelfSpecResult', 'self_spec_decode', 'AdaDecodeResult', 'adadecode_decode', 'uniform_shortcut_layers', 'DELResult', 'dynamic_exit_decode', 'HFEarlyExitResult', 'hf_early_exit_decode', 'HFPromptLookupResult', 'hf_prompt_lookup_decode', 'HFAssistedResult', 'hf_assisted_decode']


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
