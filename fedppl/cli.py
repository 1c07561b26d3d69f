"""The ``fedppl`` command line: ``fedppl demo`` (also ``python -m fedppl demo``).

Example::

    $ fedppl demo --clients 10 --rounds 10 --out fedppl-demo.png
"""

from __future__ import annotations

import argparse
from typing import Sequence

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fedppl", description="Federated Bayesian inference")
    sub = p.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="federated Bayesian logistic regression on a built-in "
                                       "dataset: table of PVI vs global VI vs clients alone")
    demo.add_argument("--clients", type=int, default=10, help="number of clients (10)")
    demo.add_argument("--rounds", type=int, default=10, help="PVI rounds (10)")
    demo.add_argument("--local-steps", type=int, default=200, help="optimiser steps per update")
    demo.add_argument("--out", default="fedppl-demo.png", help="plot file ('' for none)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--no-progress", action="store_true", help="hide progress bars")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "demo":
        from fedppl.demo import run_demo

        run_demo(args.clients, args.rounds, args.local_steps, args.out or None, args.seed,
                 progress_bar=not args.no_progress)
    return 0
