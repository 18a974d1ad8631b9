"""Reproducible benchmarking and paper-replication harness for depth/tree-axis LLM decoding.

The package implements the methods of three papers (DEX, TEV/ExitTrain, vSkipper; see
``../shared/papers``) in plain PyTorch over Hugging Face models, plus the measurement,
statistics and reporting code that the Snakemake workflows call. It never imports Snakemake.
Every job a workflow rule runs is also a command: ``python -m impl --help``.
"""

__version__ = "0.1.0"
