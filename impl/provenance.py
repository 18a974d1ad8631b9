"""Provenance stamps and atomic result files.

Every result row carries who/what/where produced it (DESIGN.md, "Results"): run id, git sha and
dirty flag, config hash, seed, device, dtype and library versions. Every result file is written to a
temporary name beside its destination and renamed when complete, so a partial file never satisfies
a Snakemake rule.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import os
import platform
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

import numpy as np

_REPO_ROOT = Path(__file__).resolve().parent.parent


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", *args], cwd=_REPO_ROOT, capture_output=True, text=True, timeout=10, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def git_state() -> tuple[str, bool]:
    """Return ``(sha, dirty)`` of the repository holding this package.

    ``sha`` is ``"unknown"`` outside a git checkout (then ``dirty`` is True: nothing vouches for
    the code). Untracked files do not count as dirty; modified tracked files do.
    """
    sha = _git("rev-parse", "HEAD")
    if not sha:
        return "unknown", True
    status = _git("status", "--porcelain", "--untracked-files=no")
    return sha, bool(status)


@functools.cache
def process_git_state() -> tuple[str, bool]:
    """:func:`git_state` as of this process's first call, then fixed: the commit whose code the
    process imported. ``python -m impl`` calls it before any command runs, so a commit made while a
    long job runs (a DAG job can take an hour) does not relabel that job's rows."""
    return git_state()


def config_hash(config: Mapping[str, Any]) -> str:
    """SHA-256 (first 16 hex digits) of the canonical JSON form of a config mapping."""
    blob = json.dumps(config, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def provenance(
    config: Mapping[str, Any] | None = None,
    *,
    seed: int | None = None,
    device: str = "cpu",
    dtype: str = "float32",
    run_id: str | None = None,
) -> dict[str, Any]:
    """Provenance fields stamped on every result row.

    Args:
        config: the (validated) configuration the run used; hashed, not copied.
        seed: the run's seed (int), or None where no randomness is involved.
        device: torch device string the work ran on.
        dtype: torch dtype name of the model weights.
        run_id: identifier shared by all rows of one invocation; a fresh UUID4 hex if None.

    Returns:
        dict with keys run_id, git_sha, git_dirty, config_hash, seed, device, dtype,
        torch_version, transformers_version, python_version, host.
    """
    import torch
    import transformers

    sha, dirty = process_git_state()
    return {
        "run_id": run_id or uuid.uuid4().hex[:12],
        "git_sha": sha,
        "git_dirty": dirty,
        "config_hash": config_hash(config or {}),
        "seed": seed,
        "device": device,
        "dtype": dtype,
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "python_version": platform.python_version(),
        "host": platform.node(),
    }


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; rename it onto ``path`` only on success.

    Works for files and directories: a directory output replaces an existing directory whole (a rerun of
    a training replaces its checkpoint). On an exception the temporary is removed and ``path`` is left
    untouched, so a rule never sees a partial output.

    Raises:
        IsADirectoryError: a file output whose ``path`` is an existing directory (the directory is kept;
            the command-line boundary refuses it before any work: :func:`impl.argtypes.output_file`).
    """
    dest = Path(path)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent))
    target = tmp / dest.name
    try:
        yield target
        if dest.is_dir() and not dest.is_symlink():
            if not target.is_dir():
                raise IsADirectoryError(f"{dest} is an existing directory; refusing to replace it with a file")
            shutil.rmtree(dest)
        os.replace(target, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def strict_json(obj: Any, **kw) -> str:
    """``json.dumps`` that always yields strict JSON (RFC 8259): non-finite floats become ``null``.

    Python's default writes ``NaN`` / ``Infinity``, which strict parsers (``jq``, browsers, pandas with
    ``engine="pyarrow"``) reject. The common path (no such float) costs one ``dumps``.
    """
    try:
        return json.dumps(obj, allow_nan=False, default=_json_default, **kw)
    except ValueError:
        return json.dumps(_finite(obj), allow_nan=False, default=_json_default, **kw)


def _finite(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, Mapping):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    if hasattr(obj, "tolist") and not isinstance(obj, (str, bytes)):  # numpy / torch scalars and arrays
        return _finite(obj.tolist())
    return obj


def write_jsonl(path: str | os.PathLike, rows: Iterable[Mapping[str, Any]]) -> int:
    """Write rows as strict JSON Lines atomically (non-finite floats as ``null``); return the row count."""
    n = 0
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(strict_json(row, ensure_ascii=False) + "\n")
            n += 1
    return n


def write_json(path: str | os.PathLike, obj: Any) -> None:
    """Write one strict JSON document atomically (indented, keys sorted, non-finite floats as ``null``)."""
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as fh:
        fh.write(strict_json(obj, indent=2, sort_keys=True, ensure_ascii=False))
        fh.write("\n")


def write_text(path: str | os.PathLike, text: str) -> None:
    """Write a text file atomically."""
    with atomic_path(path) as tmp:
        Path(tmp).write_text(text, encoding="utf-8")


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Read a JSON Lines file.

    Raises:
        FileNotFoundError: naming the path.
        ValueError: naming the path and line number of a malformed line.
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"no such JSONL file: {p}")
    rows = []
    with open(p, encoding="utf-8") as fh:
        for i, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{p}:{i}: malformed JSON line ({e.msg})") from None
    return rows


def _json_default(obj: Any) -> Any:
    try:
        if isinstance(obj, np.generic):
            return obj.item()
        if isinstance(obj, np.ndarray):
            return obj.tolist()
    except ImportError:  # pragma: no cover
        pass
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"not JSON serializable: {type(obj).__name__}")
