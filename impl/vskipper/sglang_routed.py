"""Routed vSkipper arms on upstream SGLang: the model directory and the launch (harness side).

:mod:`impl.vskipper.sglang_model` is the out-of-tree model SGLang serves; this module, which never imports
SGLang, prepares what that server reads: a model directory whose ``config.json`` names
``VSkipperLlamaForCausalLM`` and carries the skip policy, and the :class:`~impl.serving.sglang_server.SGLangLaunch`
that registers the package (``SGLANG_EXTERNAL_MODEL_PACKAGE``) with this repository on the server's path.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any, Mapping

from impl.serving.sglang_server import SGLangLaunch

__all__ = ["ARCHITECTURE", "PACKAGE", "write_routed_model_dir", "routed_launch"]

#: the class name SGLang looks up in the checkpoint's ``architectures``
ARCHITECTURE = "VSkipperLlamaForCausalLM"
#: the package SGLang imports model classes from (``SGLANG_EXTERNAL_MODEL_PACKAGE``)
PACKAGE = "impl.vskipper.sglang_model"
_LLAMA = ("LlamaForCausalLM",)


def write_routed_model_dir(model_dir: str | os.PathLike, out_dir: str | os.PathLike, policy: str,
                           kwargs: Mapping[str, Any] | None = None, *, stats_path: str | os.PathLike | None = None) -> Path:
    """Write ``out_dir``: the files of ``model_dir`` as symbolic links, and its ``config.json`` with
    ``architectures = ["VSkipperLlamaForCausalLM"]`` and a ``vskipper`` entry (``policy``, ``kwargs``,
    ``stats_path``; :mod:`impl.vskipper.sglang_model.vskipper_llama`).

    Args:
        model_dir: a Hugging Face Llama-family directory (``architectures`` ``LlamaForCausalLM``).
        out_dir: the routed directory to write (created; its previous links and config are replaced).
        policy: a skip-policy name of :func:`impl.vskipper.skipper.build_skipper` (``random``, ``flexidepth``...).
        kwargs: the policy's arguments, JSON-serialisable (RandomSkip: ``routed_layers``, ``r``, ``d``,
            ``seed``; FlexiDepth: ``checkpoint``, an absolute path).
        stats_path: optional JSON file the server rewrites after every routed step with its
            (RUN, Project-Only) counts per phase.

    Returns:
        ``out_dir`` as a Path.

    Raises:
        FileNotFoundError: when ``model_dir`` has no ``config.json``.
        ValueError: for a model that is not ``LlamaForCausalLM`` or ``kwargs`` that are not JSON.
    """
    src, out = Path(model_dir).resolve(), Path(out_dir)
    cfg_path = src / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{src}: no config.json (a Hugging Face model directory is needed)")
    cfg = json.loads(cfg_path.read_text())
    archs = cfg.get("architectures") or []
    if not archs or archs[0] not in _LLAMA:
        raise ValueError(f"{src}: vSkipper on SGLang serves LlamaForCausalLM checkpoints, got architectures {archs}")
    spec = {"policy": str(policy), "kwargs": dict(kwargs or {})}
    if stats_path is not None:
        spec["stats_path"] = str(Path(stats_path).resolve())
    try:
        json.dumps(spec, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"vSkipper policy arguments must be plain JSON: {e}") from e
    out.mkdir(parents=True, exist_ok=True)
    for f in sorted(src.iterdir()):
        if f.name == "config.json":
            continue
        link = out / f.name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(f)
    cfg["architectures"] = [ARCHITECTURE]
    cfg["vskipper"] = spec
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out


def routed_launch(launch: SGLangLaunch) -> SGLangLaunch:
    """``launch`` with the vSkipper model package registered (its ``model_dir`` must be a directory from
    :func:`write_routed_model_dir`)."""
    return replace(launch, external_model_package=PACKAGE)
