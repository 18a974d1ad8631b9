"""What every ``python -m impl`` command does before its work: read the validated config named by its
arguments, set the torch thread count, load a model directory in the config's dtype and device.

Shared by :mod:`impl.cli` and the families' command modules (``impl/<family>/commands.py``), so no
command module reaches into another's private helpers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .config import config_from_json, load_config
from .provenance import provenance
from .schema import core_config

__all__ = ["config_from_args", "load_for", "run_provenance", "set_threads"]


def config_from_args(args) -> dict[str, Any]:
    """The validated config of a command: ``--config-json TEXT`` / ``@FILE`` (what workflow rules pass)
    or ``--config FILE.yaml``.

    Raises:
        ConfigError: an invalid config (one line naming the key); SystemExit: neither option given.
    """

    if getattr(args, "config_json", None):
        text = args.config_json
        if text.startswith("@"):
            text = Path(text[1:]).read_text(encoding="utf-8")
        return config_from_json(text)
    if getattr(args, "config", None):
        return load_config(args.config)
    raise SystemExit("error: pass --config FILE.yaml (or --config-json)")


def set_threads(cfg: dict[str, Any]) -> None:
    """``torch.set_num_threads`` to the config's ``threads``."""
    import torch

    torch.set_num_threads(core_config(cfg).threads)


def run_provenance(cfg: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """The provenance fields of a command's rows (:func:`impl.provenance.provenance`): the config's hash,
    its seed, device and dtype, plus ``extra`` fields."""

    core = core_config(cfg)
    return {**provenance(cfg, seed=core.seed, device=core.device, dtype=core.dtype), **extra}


def load_for(cfg: dict[str, Any], model_dir: str | Path):
    """The model directory loaded in the config's ``dtype`` on its ``device``, eval mode.

    Raises:
        FileNotFoundError: naming the directory and the rule that builds it.
    """
    import torch

    from .models.load import load_model

    core = core_config(cfg)
    model = load_model(model_dir, dtype=getattr(torch, core.dtype), builder="train_model")
    return model.to(core.device)
