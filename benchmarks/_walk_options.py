"""The federated SMC sampler's walk options, shared by its benchmarks (``smc_hierarchical`` and
``smc_breadth``): :func:`add_walk_options` puts them on a parser, :func:`walk_settings` turns the
parsed ones into keyword arguments for ``fedppl.SMC`` or ``result.refine`` (only those given, so
the sampler's own defaults hold otherwise)."""

from __future__ import annotations

import argparse

__all__ = ["add_walk_options", "walk_settings"]

#: the float-valued options: (flag, the sampler's keyword, help)
_FLOATS = (
    ("--persistence", "persistence",
     "the share of the walk's momentum kept from round to round (default: the sampler's, 0)"),
    ("--uniform-step", "uniform_step",
     "the step of each particle's carried acceptance uniform (default: the sampler's, 0: a "
     "fresh uniform each round)"),
    ("--rw-target", "rw_target", "the walk's acceptance target (default: the sampler's)"),
)


def add_walk_options(ap: argparse.ArgumentParser) -> None:
    """``--gradient``, ``--crank-nicolson``, ``--persistence``, ``--uniform-step`` and
    ``--rw-target``."""
    ap.add_argument("--gradient", action="store_true",
                    help="the sampler's gradient moves (the walk kicked by the gradient; "
                         "default: off)")
    ap.add_argument("--crank-nicolson", action="store_true",
                    help="the walk as Crank-Nicolson steps around the particles' Gaussian fit "
                         "(default: off)")
    for flag, name, text in _FLOATS:
        ap.add_argument(flag, dest=name, type=float, default=None, help=text)


def walk_settings(args: argparse.Namespace) -> dict:
    """The given walk options as the sampler's keyword arguments.

    >>> ap = argparse.ArgumentParser()
    >>> add_walk_options(ap)
    >>> walk_settings(ap.parse_args(["--gradient", "--persistence", "0.9"]))
    {'gradient': True, 'persistence': 0.9}
    """
    out: dict = {"gradient": True} if args.gradient else {}
    if getattr(args, "crank_nicolson", False):
        out["crank_nicolson"] = True
    out.update({name: getattr(args, name) for _, name, _ in _FLOATS
                if getattr(args, name) is not None})
    return out
