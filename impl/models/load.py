"""Loading model and tokenizer directories (Hugging Face ``from_pretrained`` on a local path only)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer


def _check_dir(path: str | Path, what: str, builder: str | None) -> Path:
    p = Path(path)
    incomplete = what == "model" and not (p / "config.json").is_file()
    if not p.is_dir() or incomplete:
        hint = (
            f"; build it with the workflow rule '{builder}' (snakemake ... {p})"
            if builder
            else "; point the config at a local Hugging Face model directory"
        )
        raise FileNotFoundError(f"{what} directory not found or incomplete: {p}{hint}")
    return p


def load_model(path: str | Path, *, dtype: torch.dtype = torch.float32, builder: str | None = None):
    """Load a causal LM from a local Hugging Face directory, in eval mode, on CPU.

    Args:
        path: directory holding ``config.json`` and weights.
        dtype: weight dtype.
        builder: name of the workflow rule that builds the directory, quoted in the error.

    Raises:
        FileNotFoundError: naming the path (and the rule that builds it) when it is missing.
    """

    p = _check_dir(path, "model", builder)
    model = AutoModelForCausalLM.from_pretrained(p, dtype=dtype, local_files_only=True)
    model.eval()
    return model


def model_num_layers(path: str | Path, *, builder: str | None = None) -> int:
    """Number of decoder layers of a local model directory, from its ``config.json`` alone (no weights
    read: the start-up checks that run before :func:`load_model`).

    Raises:
        FileNotFoundError: as :func:`load_model`.
    """

    cfg = AutoConfig.from_pretrained(_check_dir(path, "model", builder), local_files_only=True)
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    return int(cfg.num_hidden_layers)


def load_tokenizer(path: str | Path, *, builder: str | None = None):
    """Load the tokenizer saved in a local directory (``AutoTokenizer``, local files only)."""

    p = Path(path)
    if not p.is_dir():
        _check_dir(p, "tokenizer", builder)
    return AutoTokenizer.from_pretrained(p, local_files_only=True)
