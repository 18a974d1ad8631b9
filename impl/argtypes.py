"""Command-line argument types and the parser every ``python -m impl...`` command uses.

Bad arguments are refused before any model is loaded or any token decoded, with one line naming the
argument (``error: argument --temperature: must be a finite number >= 0, got 'nan'``), instead of a
traceback later or, worse, a run that goes through: ``--temperature nan`` used to decode token 0 at
every position in every arm (so AR equality still held) and wrote ``NaN`` into the rows.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Callable, NoReturn

__all__ = ["ArgumentParser", "fraction", "json_object", "nonneg_float", "nonneg_int", "output_file", "port",
           "positive_float", "positive_int", "temperature", "usage_error"]


class ArgumentParser(argparse.ArgumentParser):
    """argparse with one-line errors: ``<prog>: error: <message> (see --help)``, exit status 2.

    Sub-parsers made through ``add_subparsers`` inherit the class, so every sub-command behaves alike.
    """

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)


def _number(kind: type, text: str) -> float | int:
    try:
        value = kind(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, got {text!r}")
    if kind is float and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def _bounded(kind: type, lo: float, *, strict: bool = False, hi: float | None = None) -> Callable[[str], float]:
    if kind is int:
        what = "an integer"
    else:
        what = "a finite number"
    rel = ">" if strict else ">="
    rng = f"{rel} {lo:g}" + (f" and <= {hi:g}" if hi is not None else "")

    def parse(text: str):
        try:
            value = _number(kind, text)
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(f"must be {what} {rng}, got {text!r}") from None
        if (value <= lo if strict else value < lo) or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(f"must be {what} {rng}, got {text!r}")
        return value

    parse.__name__ = f"{kind.__name__}{rel}{lo:g}"  # argparse names the type in some messages
    return parse


positive_int = _bounded(int, 1)
"""Integer >= 1 (counts: threads, tokens, prompts, repetitions, explorers)."""
nonneg_int = _bounded(int, 0)
"""Integer >= 0 (seeds, warm-up counts)."""
positive_float = _bounded(float, 0.0, strict=True)
"""Finite float > 0 (timeouts, in seconds)."""
nonneg_float = _bounded(float, 0.0)
"""Finite float >= 0."""
temperature = _bounded(float, 0.0)
"""Sampling temperature: finite float >= 0 (0 = greedy). ``nan`` and ``inf`` are refused."""
fraction = _bounded(float, 0.0, hi=1.0)
"""Finite float in [0, 1] (RandomSkip fractions)."""
port = _bounded(int, 0, hi=65535)
"""TCP port, 0 (any free port) to 65535."""


def json_object(text: str) -> dict:
    """A JSON object given on the command line (``--params '{"gamma": 4}'``).

    Raises:
        argparse.ArgumentTypeError: not valid JSON (with the decoder's position), or JSON that is not an
            object; argparse turns it into one line naming the argument, exit status 2.
    """
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object ({{...}}), got {type(value).__name__}")
    return value


def output_file(text: str) -> str:
    """A file the command will write (``--out rows.jsonl``, ``--summary s.json``): refused when it names an
    existing directory, before any work, since writing the file would have to replace the whole folder
    (:func:`impl.provenance.atomic_path` refuses that too, as the last guard). A missing parent folder is
    fine (it is created).

    Raises:
        argparse.ArgumentTypeError: empty, or an existing directory.
    """
    if not text:
        raise argparse.ArgumentTypeError("expected a file path, got ''")
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is an existing directory; give the path of the file to write")
    return text


def usage_error(message: str) -> NoReturn:
    """Refuse a combination of arguments the parser cannot check alone: ``error: <message>`` on stderr,
    exit status 2 (argparse's status for bad usage), before any model is loaded."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)
