"""``fedppl demo``: federated logistic regression on a built-in dataset (the quickstart's model,
on real data)."""

from __future__ import annotations

import argparse

from fedppl_experiments.commands.arguments import positive_int

__all__ = ["register", "run"]


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``demo`` subcommand to ``fedppl``'s parser."""
    demo = sub.add_parser("demo", help="federated Bayesian logistic regression on a built-in "
                                       "dataset: table of PVI vs global VI vs clients alone")
    demo.add_argument("--clients", type=positive_int, default=10, help="number of clients (10)")
    demo.add_argument("--rounds", type=positive_int, default=10, help="PVI rounds (10)")
    demo.add_argument("--local-steps", type=positive_int, default=100,
                      help="cap on the local step's iterations per update")
    demo.add_argument("--plot", default="fedppl-demo.png", metavar="PATH",
                      help="plot file ('' for none; fedppl-demo.png)")
    demo.add_argument("--out", dest="plot", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    demo.add_argument("--runtime", default="embedded",
                      choices=("embedded", "flower", "flower-deployment"),
                      help="who runs PVI's rounds: this process (embedded), Flower's Simulation "
                           "Engine (flower) or a local SuperLink and SuperNodes "
                           "(flower-deployment); needs the flower extra")
    demo.add_argument("--ppl", default="numpyro", choices=("numpyro", "pyro"),
                      help="the probabilistic programming language the models are written in: "
                           "the NumPyro core (numpyro) or the Pyro port (pyro; needs the pyro "
                           "extra, embedded runtime only)")


def run(args: argparse.Namespace) -> list[dict]:
    """Print the table, write the plot; one run per table row."""
    from fedppl_experiments.commands.record import run_record

    if args.ppl == "pyro":  # the same comparison in the Pyro port
        if args.runtime != "embedded":
            raise ValueError("the Pyro demo runs on the embedded runtime only")
        from fedppl_experiments.demo_pyro import run_demo_pyro

        rows = run_demo_pyro(args.clients, args.rounds, args.local_steps, args.plot or None,
                             args.seed, not args.no_progress)
    else:
        from fedppl_experiments.demo import run_demo

        rows = run_demo(args.clients, args.rounds, args.local_steps, args.plot or None,
                        args.seed, progress_bar=not args.no_progress, runtime=args.runtime)
    config = {"clients": args.clients, "rounds": args.rounds, "local_steps": args.local_steps,
              "seed": args.seed, "runtime": args.runtime, "ppl": args.ppl}
    return [run_record(r.method, config, {"accuracy": r.accuracy, "log_lik": r.log_lik,
                                          "elbo": r.elbo, "rounds": r.rounds,
                                          "seconds": r.seconds}, r.history, r.rejected)
            for r in rows]
