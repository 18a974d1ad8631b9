"""Tiny Llama-architecture model configuration (DESIGN.md "Models")."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TinyArch:
    """Architecture of a tiny Llama model (config section ``tiny_arch``).

    Attributes:
        num_layers: decoder layers L (>= 12 so that K in {2, 3, 4, 6, 12} partitions exist).
        hidden_size: model width h.
        num_heads: attention heads (hidden_size must be divisible by it).
        intermediate_size: MLP width.
        max_position_embeddings: context length in tokens.
    """

    num_layers: int = 12
    hidden_size: int = 128
    num_heads: int = 4
    intermediate_size: int = 352
    max_position_embeddings: int = 1024

    def to_hf_config(self, vocab_size: int, eos_token_id: int):
        """A ``transformers.LlamaConfig`` with tied embeddings and the given vocabulary.

        Raises:
            ValueError: if hidden_size is not divisible by num_heads.
        """
        from transformers import LlamaConfig

        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"tiny_arch.hidden_size ({self.hidden_size}) must be divisible by "
                f"tiny_arch.num_heads ({self.num_heads})"
            )
        return LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_heads,
            max_position_embeddings=self.max_position_embeddings,
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
            bos_token_id=eos_token_id,
            eos_token_id=eos_token_id,
            pad_token_id=eos_token_id,
            attn_implementation="sdpa",
        )
