"""What ``scripts/run.sh`` does around Snakemake: check the config it was given before any job starts,
and say where the report is once the DAG is done.

Snakemake parses ``--configfile`` itself before the workflow's own checks run, so a YAML syntax error
reaches the user as Snakemake's generic message without the line and column, and a missing file as a
traceback. :func:`check` reads every ``--configfile`` with :func:`impl.config.read_yaml`
(``FILE:LINE:COL: problem``), merges them and the ``--config KEY=VALUE`` overrides the way Snakemake
does, and validates the result with :func:`impl.config.validate_config`: one line, exit status 2.

Usage (from ``scripts/run.sh``; the arguments are the ones given to Snakemake)::

    python -m impl.launch check ARGS...
    python -m impl.launch report-path ARGS...
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Sequence

import yaml

from .config import ConfigError, read_yaml, validate_config

__all__ = ["DEFAULT_CONFIG", "check", "config_args", "merged_config", "report_path"]

#: The config the Snakefile loads when no ``--configfile`` is given.
DEFAULT_CONFIG = "configs/default.yaml"
_DRY_RUN = ("-n", "--dry-run", "--dryrun")


def config_args(argv: Sequence[str]) -> tuple[list[str], dict[str, Any]]:
    """The config files and top-level overrides in Snakemake arguments.

    ``--configfile A B`` / ``--configfiles A B`` / ``--configfile=A`` (every following word up to the next
    option), ``--config K=V ...`` / ``-C K=V`` (values parsed as YAML, as Snakemake does; the last
    value of a key wins).

    Returns:
        (files, overrides): the files in order (``[DEFAULT_CONFIG]`` when none is given) and a mapping
        of top-level keys to values.

    Raises:
        ConfigError: a ``--config`` word without ``=`` or a value that is not valid YAML.
    """
    files: list[str] = []
    overrides: dict[str, Any] = {}
    mode = None
    for a in argv:
        if a.startswith("-"):
            mode = None
            name, eq, value = a.partition("=")
            if name in ("--configfile", "--configfiles"):
                mode = "file"
                if eq:
                    files.append(value)
            elif name in ("--config", "-C"):
                mode = "config"
                if eq:
                    _override(overrides, value)
            continue
        if mode == "file":
            files.append(a)
        elif mode == "config":
            _override(overrides, a)
    return files or [DEFAULT_CONFIG], overrides


def _override(overrides: dict[str, Any], word: str) -> None:
    key, eq, value = word.partition("=")
    if not eq or not key:
        raise ConfigError(f"--config {word!r}: expected KEY=VALUE")
    try:
        overrides[key] = yaml.safe_load(value)
    except yaml.YAMLError as e:
        raise ConfigError(f"--config {key}: value {value!r} is not valid YAML: {str(e).splitlines()[0]}") from None


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """Recursive merge, dicts key by key and anything else replaced (``snakemake.utils.update_config``)."""
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def merged_config(files: Sequence[str | Path], overrides: dict[str, Any]) -> dict[str, Any]:
    """The raw config Snakemake builds: the files merged in order, then the overrides.

    Raises:
        ConfigError: a missing file, a YAML error (``FILE:LINE:COL``), a duplicated key, or a file whose
            top level is not a mapping.
    """
    cfg: dict[str, Any] = {}
    for f in files:
        raw = read_yaml(f)
        if raw is None:
            continue
        if not isinstance(raw, dict):
            raise ConfigError(f"config file {f}: the top level must be a mapping")
        cfg = _merge(cfg, raw)
    return _merge(cfg, overrides)


def check(argv: Sequence[str]) -> dict[str, Any]:
    """Validate the config that Snakemake arguments ``argv`` select (files, overrides, data paths).

    Returns:
        the validated config (defaults filled in).

    Raises:
        ConfigError: one line naming the file, line and column, or the key.
    """
    files, overrides = config_args(argv)
    return validate_config(merged_config(files, overrides))


def report_path(argv: Sequence[str]) -> str | None:
    """``<results_dir>/REPORT.md`` of the config ``argv`` selects, or None for a dry run."""
    if any(a in _DRY_RUN for a in argv):
        return None
    files, overrides = config_args(argv)
    cfg = validate_config(merged_config(files, overrides), check_paths=False)
    return f"{cfg['results_dir']}/REPORT.md"


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] not in ("check", "report-path"):
        print("usage: python -m impl.launch {check,report-path} [SNAKEMAKE ARGS...]", file=sys.stderr)
        return 2
    try:
        if args[0] == "check":
            check(args[1:])
        else:
            path = report_path(args[1:])
            if path and Path(path).is_file():
                print(f"report: {path}")
            elif path:  # a run of chosen targets builds no report
                print(f"no report yet: {path} is written by a run of the whole DAG (no target)")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
