"""Argument types every subcommand shares: a bad flag is refused by argparse, naming the flag,
before anything runs (the checks are :mod:`fedppl.validation`'s).

Example::

    >>> import argparse
    >>> p = argparse.ArgumentParser()
    >>> _ = p.add_argument("--rounds", type=positive_int)
    >>> p.parse_args(["--rounds", "3"]).rounds
    3
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

__all__ = ["positive_int", "non_negative", "positive", "fraction", "folder"]


def _number(text: str, kind=float):
    try:
        return kind(text)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None


def positive_int(text: str) -> int:
    """A whole number >= 1 (``--rounds 0`` or ``--clients 2.5`` is refused)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def non_negative(text: str) -> float:
    value = _number(text)
    if not (value >= 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a non-negative finite number, got {text!r}")
    return value


def positive(text: str) -> float:
    value = _number(text)
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a positive finite number, got {text!r}")
    return value


def fraction(text: str) -> float:
    value = _number(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text!r}")
    return value


def folder(text: str) -> str:
    """An existing directory (a UCI dataset folder)."""
    if not Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"no such folder: {text!r}")
    return text
