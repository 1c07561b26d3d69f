"""``fedppl fedbnr``: FedBNR variants and ablations on a UCI folder."""

from __future__ import annotations

import argparse

from fedppl_experiments.commands.arguments import add_methods, folder, non_negative, positive_int

__all__ = ["register", "run"]

# the variants of :data:`fedppl_experiments.fedbnr_uci.VARIANTS` (named here so that ``--help``
# imports no JAX; a test keeps the two equal)
METHODS = ("avg", "kd", "central", "local+local", "local+global", "avg+local", "kd+local")


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``fedbnr`` subcommand to ``fedppl``'s parser."""
    fb = sub.add_parser("fedbnr", help="FedBNR (random-feature GP, exact last layer) on a UCI "
                                       "folder: variants and ablations of the FedBNR paper")
    fb.add_argument("--data", required=True, type=folder,
                    help="a UCI dataset folder (data.txt, index_*.txt)")
    fb.add_argument("--clients", type=positive_int, default=10, help="clients (10)")
    add_methods(fb, METHODS, ["avg"], aliases=["--variant"])
    fb.add_argument("--rounds", type=positive_int, default=20, help="aggregation rounds (20)")
    fb.add_argument("--local-steps", type=positive_int, default=20,
                    help="full-batch steps per round (20)")
    fb.add_argument("--kd-alpha", type=non_negative, default=5.0, help="KD weight (5)")


def run(args: argparse.Namespace) -> list[dict]:
    """Run the variants, print the table; one run per variant."""
    import jax

    from fedppl_experiments import fedbnr_uci
    from fedppl_experiments.commands.record import run_record

    jax.config.update("jax_enable_x64", True)
    rows = fedbnr_uci.run(args.data, args.clients, args.method, seed=args.seed,
                          rounds=args.rounds, local_steps=args.local_steps,
                          kd_alpha=args.kd_alpha, progress_bar=not args.no_progress,
                          keep_history=True)
    print(f"\nFedBNR on {args.data}, {args.clients} clients, seed {args.seed}\n")
    print("| variant | RMSE | test log-lik | ECE | MCE | Brier | rounds | kernel s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for v, r in rows.items():
        print(f"| {v} | {r['rmse']:.3f} | {r['log_lik']:.3f} | {r['ece']:.3f} | {r['mce']:.3f} "
              f"| {r['brier']:.3f} | {r['rounds']} | {r['kernel_seconds']:.1f} |")
    config = {"data": args.data, "clients": args.clients, "seed": args.seed,
              "rounds": args.rounds, "local_steps": args.local_steps, "kd_alpha": args.kd_alpha}
    return [run_record(v, {**config, "kernel": fedbnr_uci.VARIANTS[v][0],
                           "last_layer": fedbnr_uci.VARIANTS[v][1]},
                       {k: x for k, x in r.items() if k not in ("history", "rejected")},
                       r.get("history"), r.get("rejected"))
            for v, r in rows.items()]
