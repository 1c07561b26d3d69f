"""The ``fedppl`` command line (also ``python -m fedppl``).

The library holds no experiments: each subcommand lives in :mod:`fedppl_experiments.commands`
(the paper reproductions shipped beside the library) as a ``register`` / ``run`` pair; ``run``
returns its runs and this module writes them, so every subcommand has one JSON shape
(:data:`JSON_SCHEMA`) and one set of shared options (``--method``, ``--seed``, ``--json``,
``--no-progress``, ``--debug``).

A user error (a bad flag, path, dataset folder or value) is one line on stderr and exit status
2; any other failure is one line and exit status 1; ``--debug`` shows the traceback instead.

Example::

    $ fedppl --version
    $ fedppl demo --clients 10 --rounds 10 --plot fedppl-demo.png
    $ fedppl fedbnr --data ../shared/data/uci/power-plant --clients 10 --method avg,kd
    $ fedppl cotrain --combination noisy --uncertainty full --masked --dp --json out.json
    $ fedppl sgp --data ../shared/data/uci/concrete --split 0 --clients 10 --method dpo global
    $ fedppl mogp --study synthetic --method all --rounds 15
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from fedppl.infer.base import plain

__all__ = ["main", "build_parser", "document", "JSON_SCHEMA", "version"]

#: The one JSON shape every subcommand writes with ``--json``. Each run is a
#: :meth:`fedppl.infer.base.Result.to_json` (``method``, ``summary``, ``history``, ``rejected``)
#: plus the ``config`` it ran with; ``summary`` holds the run's final figures (test metrics,
#: seconds), ``history`` one list per column, one entry per round (or step), possibly empty.
JSON_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "fedppl command output",
    "type": "object",
    "required": ["command", "version", "arguments", "runs"],
    "additionalProperties": False,
    "properties": {
        "command": {"type": "string", "description": "the subcommand, e.g. sgp"},
        "version": {"type": "string", "description": "fedppl's version"},
        "arguments": {"type": "object", "description": "every flag's value"},
        "runs": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "required": ["method", "config", "summary", "history", "rejected"],
                "additionalProperties": False,
                "properties": {
                    "method": {"type": "string"},
                    "config": {"type": "object"},
                    "summary": {"type": "object"},
                    "history": {"type": "object", "additionalProperties": {"type": "array"}},
                    "rejected": {"type": "array", "items": {"type": "array"}},
                },
            },
        },
    },
}


def version() -> str:
    """The installed distribution's version (the package's own where not installed)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("fedppl")
    except PackageNotFoundError:  # pragma: no cover - a source tree on sys.path
        from fedppl import __version__

        return __version__


def document(command: str, args: argparse.Namespace, runs: Sequence[dict[str, Any]]
             ) -> dict[str, Any]:
    """The file ``--json`` writes: ``{command, version, arguments, runs}``."""
    arguments = {k: v for k, v in vars(args).items()
                 if k not in ("command", "debug") and not k.startswith("_")}
    return {"command": command, "version": version(), "arguments": plain(arguments),
            "runs": list(runs)}


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error (usage stays in ``--help``)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The ``fedppl`` parser: every subcommand of :mod:`fedppl_experiments.commands`, each with
    the shared options of :func:`fedppl_experiments.commands.arguments.add_common`."""
    from fedppl_experiments.commands import COMMANDS
    from fedppl_experiments.commands.arguments import add_common

    p = _Parser(prog="fedppl", description="Federated Bayesian inference. Every subcommand "
                "takes --seed, --json PATH, --no-progress and --debug; --json writes "
                "{command, version, arguments, runs: [{method, config, summary, history, "
                "rejected}, ...]}.")
    p.add_argument("--version", action="version", version=f"fedppl {version()}")
    p.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module in COMMANDS.items():
        module.register(sub)
        add_common(sub.choices[name])
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``fedppl ARGV``; 0 on success. A user error raises ``SystemExit(2)`` after one line
    on stderr, any other error ``SystemExit(1)`` (``--debug``: the exception propagates)."""
    from fedppl_experiments.commands import COMMANDS

    parser = build_parser()
    args = parser.parse_args(argv)
    prog = f"fedppl {args.command}"
    try:
        runs = COMMANDS[args.command].run(args)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(document(args.command, args, runs), f, indent=1, allow_nan=False)
            print(f"wrote {args.json}")
    except (ValueError, OSError) as e:  # bad values, paths, data files
        if args.debug:
            raise
        print(f"{prog}: error: {_one_line(e)}", file=sys.stderr)
        raise SystemExit(2) from None
    except Exception as e:
        if args.debug:
            raise
        print(f"{prog}: failed: {type(e).__name__}: {_one_line(e)} (--debug shows the "
              "traceback)", file=sys.stderr)
        raise SystemExit(1) from None
    return 0


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__
