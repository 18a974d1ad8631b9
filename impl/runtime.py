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

__all__ = ["config_from_args", "load_for", "pin_allocator", "run_provenance", "set_threads"]


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


# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def pin_allocator(mmap_threshold: int = 1 << 30, trim_threshold: int = (1 << 31) - 1) -> str:
    """Fix glibc's malloc thresholds for a timing run, so a step's time does not depend on what the
    steps before it allocated.

    By default glibc raises its mmap threshold to the largest block freed so far and returns heap top
    to the kernel above a trim threshold that follows it: after a step that allocated other sizes (a
    routed arm's gathered rows) the next step gets fresh pages and pays their page faults. On this
    2-core VM that made the routed all-RUN arm of the wide model's 128-request decode cell 0.935x
    upstream in one run and 1.056x in another; with the thresholds fixed, 0.993-1.002 in three runs
    (``python -m impl vskipper-bench --wide``, issue 14). Setting either parameter also turns glibc's
    dynamic adjustment off (``mallopt(3)``).

    Args:
        mmap_threshold: bytes; blocks at least this large are mmapped (default 1 GiB: every tensor of a
            step stays in the heap).
        trim_threshold: bytes of free heap top kept before it is returned to the kernel.

    Returns:
        ``"pinned mmap=<bytes> trim=<bytes>"``, or ``"default (no glibc mallopt)"`` where the C library
        has no ``mallopt`` (macOS, musl): the rows record which.
    """
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return "default (no glibc mallopt)"
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(_M_MMAP_THRESHOLD, int(mmap_threshold)) == 1 and mallopt(_M_TRIM_THRESHOLD, int(trim_threshold)) == 1
    return f"pinned mmap={int(mmap_threshold)} trim={int(trim_threshold)}" if ok else "default (mallopt refused)"


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
