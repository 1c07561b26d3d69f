"""``fedppl svgp``: structured variational GPs on a UCI folder (SVIGP, the (alpha, Sigma) family,
Kronecker, TVGP, sum of Kronecker terms, RNVGP), trained with numpyro's SVI.

Example::

    $ fedppl svgp --data ../shared/data/uci/power-plant --method tvgp --m0 5 --q0 3 \\
          --batch-size 10 --steps 50000 --json out.json
"""

from __future__ import annotations

import argparse

from fedppl_experiments.commands.arguments import (
    add_methods,
    folder,
    non_negative,
    non_negative_int,
    positive,
    positive_int,
)

__all__ = ["register", "run"]

# :data:`fedppl_experiments.svgp.METHODS` (named here so that ``--help`` imports no JAX; a test
# keeps the two equal)
METHODS = ("svigp", "diag", "rnvgp", "kron", "tvgp", "sumkron")


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``svgp`` subcommand to ``fedppl``'s parser."""
    p = sub.add_parser("svgp", help="structured variational GPs (SVIGP, Kronecker, TVGP, RNVGP) "
                                    "on a UCI folder, trained with numpyro's SVI")
    p.add_argument("--data", required=True, type=folder,
                   help="a UCI dataset folder (data.txt, index_*.txt)")
    add_methods(p, METHODS, ["tvgp"])
    p.add_argument("--split", type=non_negative_int, default=0,
                   help="standard train/test split (0)")
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
    p.add_argument("--roulette", type=non_negative, default=0.1,
                   help="RNVGP: roulette rate beta")
    p.add_argument("--max-train", type=positive_int, default=None,
                   help="subsample the training rows")


def run(args: argparse.Namespace) -> list[dict]:
    """Fit and score every method, print the table; one run per method (its history: the
    loss every ``steps // 100`` steps)."""
    import jax

    from fedppl_experiments import svgp
    from fedppl_experiments.commands.record import run_record

    jax.config.update("jax_enable_x64", True)
    settings = svgp.Settings(num_inducing=args.inducing, m0=args.m0, q0=args.q0,
                             terms=args.terms, batch_size=args.batch_size, steps=args.steps,
                             optimizer=args.optimizer, learning_rate=args.lr,
                             probes=args.probes, tol_first=args.tol_first, tol=args.tol,
                             roulette=args.roulette, seed=args.seed)
    rows = [svgp.run(args.data, args.split, m, settings, max_train=args.max_train,
                     progress_bar=not args.no_progress) for m in args.method]
    print(f"\n{', '.join(args.method)} on {args.data}, split {args.split}, {args.steps} steps "
          f"of {args.optimizer} ({args.lr}), b = {args.batch_size}\n")
    print("| method | M | test RMSE (standardised) | test log-lik | RMSE (original units) "
          "| s / step |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['method']} | {r['num_inducing']} | {r['rmse']:.3f} | {r['log_lik']:.3f} | "
              f"{r['rmse_original']:.3f} | {r['seconds_per_step']:.4f} |")
    runs = []
    for r in rows:
        curve = r["loss_curve"]
        every = max(1, args.steps // 100)  # svgp.run keeps every (steps // 100)-th loss
        config = {"data": args.data, "split": args.split, "max_train": args.max_train,
                  **r["settings"]}
        summary = {k: v for k, v in r.items()
                   if k not in ("method", "split", "settings", "loss_curve")}
        runs.append(run_record(r["method"], config, summary,
                               {"step": [1 + i * every for i in range(len(curve))],
                                "loss": curve}))
    return runs
