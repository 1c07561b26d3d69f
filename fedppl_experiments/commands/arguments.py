"""Argument types and options every subcommand shares: a bad flag is refused by argparse, naming
the flag, before anything runs (the checks are :mod:`fedppl.validation`'s).

Example::

    >>> import argparse
    >>> p = argparse.ArgumentParser()
    >>> _ = p.add_argument("--rounds", type=positive_int)
    >>> p.parse_args(["--rounds", "3"]).rounds
    3
    >>> add_methods(p, ("dpo", "cpo", "global"), default=["dpo"])
    >>> p.parse_args(["--method", "dpo,global", "cpo"]).method
    ['dpo', 'global', 'cpo']
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["positive_int", "non_negative_int", "non_negative", "positive", "fraction",
           "open_fraction", "folder", "output_file", "add_methods", "add_common"]


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


def non_negative_int(text: str) -> int:
    """A whole number >= 0 (a split index)."""
    value = _number(text, int)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {text!r}")
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


def open_fraction(text: str) -> float:
    value = _number(text)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"must lie in (0, 1), got {text!r}")
    return value


def folder(text: str) -> str:
    """An existing directory (a UCI dataset folder)."""
    if not Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"no such folder: {text!r}")
    return text


def output_file(text: str) -> str:
    """A file to write, in an existing folder (checked before anything runs)."""
    parent = Path(text).expanduser().resolve().parent
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"no such folder: {str(parent)!r}")
    return text


class _Methods(argparse.Action):
    """``--method a b`` and ``--method a,b`` (repeatable; ``all`` for every choice), checked
    against the choices here so that a typo is refused at parse time, naming the flag."""

    def __init__(self, option_strings, dest, choices: Sequence[str] = (), **kwargs: Any):
        self.names = tuple(choices)
        super().__init__(option_strings, dest, nargs="+", **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        words = [w for v in values for w in str(v).split(",") if w]
        if "all" in words:
            words = list(self.names)
        bad = [w for w in words if w not in self.names]
        if bad or not words:
            raise argparse.ArgumentError(self, f"invalid choice {', '.join(map(repr, bad))} "
                                               f"(choose from {', '.join(self.names)}, or all)")
        # repeated flags (and their old spellings) add up; a name given twice runs once
        given = f"_{self.dest}_given"
        old = list(getattr(namespace, self.dest)) if getattr(namespace, given, False) else []
        setattr(namespace, given, True)
        setattr(namespace, self.dest, list(dict.fromkeys(old + words)))


def add_methods(p: argparse.ArgumentParser, choices: Sequence[str], default: list[str],
                aliases: Sequence[str] = ()) -> None:
    """The ``--method`` option every subcommand with methods has: a list (spaces, commas or
    repeats; ``all``); ``aliases`` are older spellings kept working but hidden from ``--help``."""
    p.add_argument("--method", action=_Methods, choices=choices, default=list(default),
                   metavar="METHOD",
                   help=f"{', '.join(choices)}, or all; several by spaces or commas "
                        f"({', '.join(default)})")
    for alias in aliases:
        p.add_argument(alias, action=_Methods, choices=choices, dest="method",
                       default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def add_common(p: argparse.ArgumentParser) -> None:
    """The options every subcommand has, with one meaning each."""
    p.add_argument("--seed", type=int, default=0, help="random seed (0)")
    p.add_argument("--json", metavar="PATH", default=None, type=output_file,
                   help="write the runs here as JSON: {command, version, arguments, runs}")
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                   help="show the traceback of an error")
