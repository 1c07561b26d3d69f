"""``fedppl sgp``: federated sparse GPs on a UCI folder (DPO, CPO, FedAvg-Z, fixed Z, global VI,
FSGP).

Example::

    $ fedppl sgp --data ../shared/data/uci/concrete --split 0 --clients 10 --method dpo global \\
          --rounds 100 --json out.json
"""

from __future__ import annotations

import argparse
import json

__all__ = ["register", "run"]


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``sgp`` subcommand to ``fedppl``'s parser."""
    p = sub.add_parser("sgp", help="federated sparse GP regression on a UCI folder (PVI with DPO/"
                                   "CPO factors and an HVM over inducing locations, baselines)")
    p.add_argument("--data", required=True, help="a UCI dataset folder (data.txt, index_*.txt)")
    p.add_argument("--split", type=int, default=0, help="standard train/test split (0)")
    p.add_argument("--clients", type=int, default=10, help="homogeneous clients (10)")
    p.add_argument("--method", nargs="+", default=["dpo"],
                   help="dpo, cpo, fedavg-z, fixed, global, fsgp, or all")
    p.add_argument("--rounds", type=int, default=100,
                   help="communications (sequential PVI: one client each), FedAvg rounds for fsgp")
    p.add_argument("--local-steps", type=int, default=200, help="Adam steps per local update")
    p.add_argument("--inducing", type=int, default=100, help="M, inducing locations (100)")
    p.add_argument("--alpha", type=float, default=0.1, help="scale of the KL on q(Z) (0.1)")
    p.add_argument("--schedule", default="sequential", choices=["sequential", "synchronous"])
    p.add_argument("--max-train", type=int, default=None, help="subsample the training rows")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the results here")
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")


def configs(args: argparse.Namespace, methods: list[str]) -> dict:
    """The per-method configurations the flags describe."""
    from fedppl.infer.fedavg_gp import FSGPConfig
    from fedppl.infer.sparse_gps import SGPConfig

    out = {}
    for m in methods:
        if m == "fsgp":
            out[m] = FSGPConfig(num_inducing=args.inducing, local_steps=args.local_steps)
        else:
            out[m] = SGPConfig(num_inducing=args.inducing, alpha=args.alpha,
                               local_steps=args.local_steps, schedule=args.schedule)
    return out


def run(args: argparse.Namespace) -> None:
    import jax

    from fedppl_experiments import sgp_uci

    jax.config.update("jax_enable_x64", True)
    methods = list(sgp_uci.METHODS) if args.method == ["all"] else args.method
    rows = sgp_uci.run(args.data, args.split, args.clients, methods, args.rounds,
                       configs(args, methods), seed=args.seed, max_train=args.max_train,
                       progress_bar=not args.no_progress)
    print(f"\nfederated sparse GP on {args.data}, split {args.split}, {args.clients} clients, "
          f"{args.rounds} rounds\n")
    print("| method | test log-lik | RMSE | rounds to converge | s / round |")
    print("|---|---:|---:|---:|---:|")
    for m, r in rows.items():
        print(f"| {m} | {r['log_lik']:.3f} | {r['rmse']:.3f} | {r['rounds_to_convergence']} "
              f"| {r['seconds_per_round']:.3f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"data": args.data, "split": args.split, "clients": args.clients,
                       "rounds": args.rounds, "results": rows}, f, indent=1)
        print(f"\nwrote {args.json}")
