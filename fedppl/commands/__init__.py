"""Subcommands of the ``fedppl`` CLI, one module each with ``register(subparsers)`` and ``run(args)``."""
