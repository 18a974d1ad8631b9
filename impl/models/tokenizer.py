"""Byte-level BPE tokenizer for the tiny models (Hugging Face ``tokenizers``)."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

EOS = "<|endoftext|>"


def train_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: str | Path):
    """Train a byte-level BPE tokenizer and save it as a ``PreTrainedTokenizerFast`` directory.

    Args:
        texts: training documents (str).
        vocab_size: total vocabulary size including the special token (e.g. 4096).
        out_dir: directory to write (``tokenizer.json``, ``tokenizer_config.json``, ...).

    Returns:
        the ``transformers.PreTrainedTokenizerFast`` (bos = eos = pad = ``<|endoftext|>``).

    Raises:
        ValueError: if ``vocab_size`` is below 257 (256 bytes + the special token).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 257:
        raise ValueError(f"tokenizer.vocab_size must be >= 257, got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=EOS, eos_token=EOS, pad_token=EOS, unk_token=None
    )
    fast.save_pretrained(str(out_dir))
    return fast
