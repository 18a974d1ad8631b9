"""Tiny Llama-architecture model configuration (DESIGN.md "Models")."""

from __future__ import annotations

from dataclasses import dataclass

from ..schema import TinyArch as _TinyArchSection

#: the ``tiny_arch`` section's defaults (:class:`impl.schema.TinyArch`): the one source of the defaults below
_A = _TinyArchSection()


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

    num_layers: int = _A.num_layers
    hidden_size: int = _A.hidden_size
    num_heads: int = _A.num_heads
    intermediate_size: int = _A.intermediate_size
    max_position_embeddings: int = _A.max_position_embeddings

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
