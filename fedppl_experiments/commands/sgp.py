"""``fedppl sgp``: federated sparse GPs on a UCI folder (DPO, CPO, FedAvg-Z, fixed Z, global VI,
FSGP).

Example::

    $ fedppl sgp --data ../shared/data/uci/concrete --split 0 --clients 10 --method dpo global \\
          --rounds 100 --json out.json
"""

from __future__ import annotations

import argparse
from typing import Any

from fedppl_experiments.commands.arguments import (
    add_methods,
    folder,
    non_negative,
    non_negative_int,
    positive_int,
)

__all__ = ["register", "run"]

# :data:`fedppl_experiments.sgp_uci.METHODS` (named here so that ``--help`` imports no JAX; a
# test keeps the two equal)
METHODS = ("dpo", "cpo", "fedavg-z", "fixed", "global", "fsgp")


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``sgp`` subcommand to ``fedppl``'s parser."""
    p = sub.add_parser("sgp", help="federated sparse GP regression on a UCI folder (PVI with DPO/"
                                   "CPO factors and an HVM over inducing locations, baselines)")
    p.add_argument("--data", required=True, type=folder,
                   help="a UCI dataset folder (data.txt, index_*.txt)")
    p.add_argument("--split", type=non_negative_int, default=0,
                   help="standard train/test split (0)")
    p.add_argument("--clients", type=positive_int, default=10, help="homogeneous clients (10)")
    add_methods(p, METHODS, ["dpo"])
    p.add_argument("--rounds", type=positive_int, default=100,
                   help="communications (sequential PVI: one client each), FedAvg rounds for "
                        "fsgp (100)")
    p.add_argument("--local-steps", type=positive_int, default=200,
                   help="Adam steps per local update (200)")
    p.add_argument("--inducing", type=positive_int, default=100,
                   help="M, inducing locations (100)")
    p.add_argument("--alpha", type=non_negative, default=None,
                   help="scale of the KL on q(Z) (default: the method's, 0.01 for dpo, 0.1 "
                        "for the others)")
    p.add_argument("--schedule", default="sequential", choices=["sequential", "synchronous"])
    p.add_argument("--max-train", type=positive_int, default=None,
                   help="subsample the training rows")


def configs(args: argparse.Namespace, methods: list[str]) -> dict:
    """The per-method configurations the flags describe."""
    from fedppl.infer.fedavg_gp import FSGPConfig
    from fedppl.infer.sparse_gps import SGPConfig

    out: dict[str, Any] = {}
    for m in methods:
        if m == "fsgp":
            out[m] = FSGPConfig(num_inducing=args.inducing, local_steps=args.local_steps)
        else:
            out[m] = SGPConfig(num_inducing=args.inducing, alpha=args.alpha,
                               local_steps=args.local_steps, schedule=args.schedule)
    return out


def run(args: argparse.Namespace) -> list[dict]:
    """Fit every method, print the table; one run per method."""
    import jax

    from fedppl_experiments import sgp_uci
    from fedppl_experiments.commands.record import run_record

    jax.config.update("jax_enable_x64", True)
    rows = sgp_uci.run(args.data, args.split, args.clients, args.method, args.rounds,
                       configs(args, args.method), seed=args.seed, max_train=args.max_train,
                       progress_bar=not args.no_progress)
    print(f"\nfederated sparse GP on {args.data}, split {args.split}, {args.clients} clients, "
          f"{args.rounds} rounds\n")
    print("| method | test log-lik | RMSE | rounds to converge | s / round |")
    print("|---|---:|---:|---:|---:|")
    for m, r in rows.items():
        print(f"| {m} | {r['log_lik']:.3f} | {r['rmse']:.3f} | {r['rounds_to_convergence']} "
              f"| {r['seconds_per_round']:.3f} |")
    config = {"data": args.data, "split": args.split, "clients": args.clients,
              "rounds": args.rounds, "local_steps": args.local_steps, "seed": args.seed,
              "max_train": args.max_train, "inducing": args.inducing}
    return [run_record(m, {**config, **({} if m == "fsgp" else {"alpha": args.alpha,
                                                                "schedule": args.schedule})},
                       {k: v for k, v in r.items() if k not in ("method", "history", "rejected")},
                       r["history"], r.get("rejected"))
            for m, r in rows.items()]
