"""``fedppl svgp``: structured variational GPs on a UCI folder (SVIGP, the (alpha, Sigma) family,
Kronecker, TVGP, sum of Kronecker terms, RNVGP), trained with numpyro's SVI.

Example::

    $ fedppl svgp --data ../shared/data/uci/power-plant --method tvgp --m0 5 --q0 3 \\
          --batch-size 10 --steps 50000 --json out.json
"""

from __future__ import annotations

import argparse
import json

from fedppl_experiments.commands.arguments import folder, positive, positive_int

__all__ = ["register", "run"]


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``svgp`` subcommand to ``fedppl``'s parser."""
    p = sub.add_parser("svgp", help="structured variational GPs (SVIGP, Kronecker, TVGP, RNVGP) "
                                    "on a UCI folder, trained with numpyro's SVI")
    p.add_argument("--data", required=True, type=folder,
                   help="a UCI dataset folder (data.txt, index_*.txt)")
    p.add_argument("--method", default="tvgp",
                   choices=("svigp", "diag", "kron", "tvgp", "rnvgp", "sumkron"))
    p.add_argument("--split", type=int, default=0, help="standard train/test split (0)")
    p.add_argument("--steps", type=positive_int, default=5000, help="optimisation steps (5000)")
    p.add_argument("--batch-size", type=positive_int, default=100, help="minibatch size b (100)")
    p.add_argument("--inducing", type=positive_int, default=200,
                   help="M for svigp, diag, rnvgp (200)")
    p.add_argument("--m0", type=positive_int, default=5,
                   help="grid points per dimension for kron, tvgp, sumkron (5)")
    p.add_argument("--q0", type=positive_int, default=3, help="Tucker rank for tvgp (3)")
    p.add_argument("--terms", type=positive_int, default=1, help="Kronecker terms (sumkron)")
    p.add_argument("--optimizer", default="adam", choices=("adam", "adagrad", "sgd"))
    p.add_argument("--lr", type=positive, default=0.01, help="learning rate (0.01)")
    p.add_argument("--probes", type=positive_int, default=5, help="RNVGP: Hutchinson probes d")
    p.add_argument("--tol-first", type=positive, default=1e-3, help="RNVGP: CG tolerance eps_L")
    p.add_argument("--tol", type=positive, default=1e-6, help="RNVGP: CG tolerance eps")
    p.add_argument("--roulette", type=float, default=0.1, help="RNVGP: roulette rate beta")
    p.add_argument("--max-train", type=positive_int, default=None,
                   help="subsample the training rows")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the results here")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def run(args: argparse.Namespace) -> None:
    import jax

    from fedppl_experiments import svgp

    jax.config.update("jax_enable_x64", True)
    settings = svgp.Settings(num_inducing=args.inducing, m0=args.m0, q0=args.q0,
                             terms=args.terms, batch_size=args.batch_size, steps=args.steps,
                             optimizer=args.optimizer, learning_rate=args.lr,
                             probes=args.probes, tol_first=args.tol_first, tol=args.tol,
                             roulette=args.roulette, seed=args.seed)
    row = svgp.run(args.data, args.split, args.method, settings, max_train=args.max_train,
                   progress_bar=not args.no_progress)
    print(f"\n{args.method} on {args.data}, split {args.split}, M = {row['num_inducing']}, "
          f"{args.steps} steps of {args.optimizer} ({args.lr}), b = {args.batch_size}\n")
    print("| method | test RMSE (standardised) | test log-lik | RMSE (original units) "
          "| s / step |")
    print("|---|---:|---:|---:|---:|")
    print(f"| {args.method} | {row['rmse']:.3f} | {row['log_lik']:.3f} | "
          f"{row['rmse_original']:.3f} | {row['seconds_per_step']:.4f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"data": args.data, **row}, f, indent=1)
        print(f"\nwrote {args.json}")
