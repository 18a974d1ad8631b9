"""Models: loading Hugging Face directories, layer-range execution, intermediate readout, tiny-model
training (tokenizer, corpus, LayerSkip-style early-exit loss)."""

from .depth import hidden_states_by_depth, readout_logits, run_layers
from .load import load_model, load_tokenizer

__all__ = ["hidden_states_by_depth", "readout_logits", "run_layers", "load_model", "load_tokenizer"]
