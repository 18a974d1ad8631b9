"""Models: loading Hugging Face directories, layer-range execution, intermediate readout, tiny-model
training (tokenizer, corpus, LayerSkip-style early-exit loss).

Names are exported lazily (PEP 562): importing the package (e.g. for its light ``schema``
module at workflow parse time) imports no submodule; ``from impl.<pkg> import X`` imports X's module.
"""

from __future__ import annotations

from ..registry import lazy_exports

#: exported name -> the submodule that defines it
_EXPORTS = {
    'hidden_states_by_depth': '.depth',
    'readout_logits': '.depth',
    'run_layers': '.depth',
    'load_model': '.load',
    'load_tokenizer': '.load',
}

__all__ = ['hidden_states_by_depth', 'readout_logits', 'run_layers', 'load_model', 'load_tokenizer']


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
