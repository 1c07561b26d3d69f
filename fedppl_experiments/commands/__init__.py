"""The experiment subcommands of the ``fedppl`` command line (``register`` + ``run`` each)."""

from fedppl_experiments.commands import cotrain, demo, fedbnr, mogp, sgp, svgp

COMMANDS = {"demo": demo, "fedbnr": fedbnr, "cotrain": cotrain, "sgp": sgp, "mogp": mogp,
            "svgp": svgp}

__all__ = ["COMMANDS"]
