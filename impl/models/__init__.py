"""Models: loading Hugging Face directories, layer-range execution, intermediate readout, tiny-model
training (tokenizer, corpus, LayerSkip-style early-exit loss).

Names are exported lazily (PEP 562): importing the package (e.g. for its light ``schema``
module at workflow parse time) imports no submodule; ``from impl.<pkg> import X`` imports X's module.
"""

from __future__ import annotations

import importlib

#: exported name -> the submodule that defines it
_EXPORTS = {
    'hidden_states_by_depth': '.depth',
    'readout_logits': '.depth',
    'run_layers': '.depth',
    'load_model': '.load',
    'load_tokenizer': '.load',
}

__all__ = ['hidden_states_by_depth', 'readout_logits', 'run_layers', 'load_model', 'load_tokenizer']


def __getattr__(name: str):
    try:
        module = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
