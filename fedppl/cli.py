"""The ``fedppl`` command line (also ``python -m fedppl``).

The library holds no experiments: each subcommand lives in :mod:`fedppl_experiments.commands`
(the paper reproductions shipped beside the library) as a ``register`` / ``run`` pair.

Example::

    $ fedppl demo --clients 10 --rounds 10 --out fedppl-demo.png
    $ fedppl fedbnr --data ../shared/data/uci/power-plant --clients 10 --variant avg kd
    $ fedppl cotrain --combination noisy --uncertainty full --masked --dp --json out.json
    $ fedppl sgp --data ../shared/data/uci/concrete --split 0 --clients 10 --method dpo global
    $ fedppl mogp --study synthetic --method all --rounds 15
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    from fedppl_experiments.commands import COMMANDS

    p = argparse.ArgumentParser(prog="fedppl", description="Federated Bayesian inference")
    sub = p.add_subparsers(dest="command", required=True)
    for module in COMMANDS.values():
        module.register(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    from fedppl_experiments.commands import COMMANDS

    args = _parser().parse_args(argv)
    COMMANDS[args.command].run(args)
    return 0
