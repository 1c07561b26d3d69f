"""``fedppl fedbnr``: FedBNR variants and ablations on a UCI folder."""

from __future__ import annotations

import argparse
import json

from fedppl_experiments.commands.arguments import non_negative, positive_int

__all__ = ["register", "run"]


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``fedbnr`` subcommand to ``fedppl``'s parser."""
    fb = sub.add_parser("fedbnr", help="FedBNR (random-feature GP, exact last layer) on a UCI "
                                       "folder: variants and ablations of the FedBNR paper")
    fb.add_argument("--data", required=True, help="a UCI dataset folder (data.txt, index_*.txt)")
    fb.add_argument("--clients", type=positive_int, default=10)
    fb.add_argument("--variant", nargs="+", default=["avg"],
                    help="avg (FedBNR), kd (FedBNR-KD), central, local+local, local+global, "
                         "avg+local, kd+local, or all")
    fb.add_argument("--seed", type=int, default=0)
    fb.add_argument("--rounds", type=positive_int, default=20, help="aggregation rounds (20)")
    fb.add_argument("--local-steps", type=positive_int, default=20,
                    help="full-batch steps per round")
    fb.add_argument("--kd-alpha", type=non_negative, default=5.0)
    fb.add_argument("--json", help="write the results here")
    fb.add_argument("--no-progress", action="store_true", help="hide progress bars")


def run(args: argparse.Namespace) -> None:
    import jax

    from fedppl_experiments import fedbnr_uci

    variants = list(fedbnr_uci.VARIANTS) if args.variant == ["all"] else args.variant
    unknown = [v for v in variants if v not in fedbnr_uci.VARIANTS]
    if unknown:
        raise SystemExit(f"fedppl fedbnr: unknown variants {unknown}; choose from "
                         f"{sorted(fedbnr_uci.VARIANTS)} or all")
    jax.config.update("jax_enable_x64", True)
    rows = fedbnr_uci.run(args.data, args.clients, variants, seed=args.seed, rounds=args.rounds,
                          local_steps=args.local_steps, kd_alpha=args.kd_alpha,
                          progress_bar=not args.no_progress)
    print(f"\nFedBNR on {args.data}, {args.clients} clients, seed {args.seed}\n")
    print("| variant | RMSE | test log-lik | ECE | MCE | Brier | rounds | kernel s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for v, r in rows.items():
        print(f"| {v} | {r['rmse']:.3f} | {r['log_lik']:.3f} | {r['ece']:.3f} | {r['mce']:.3f} "
              f"| {r['brier']:.3f} | {r['rounds']} | {r['kernel_seconds']:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"data": args.data, "clients": args.clients, "seed": args.seed,
                       "rounds": args.rounds, "local_steps": args.local_steps, "results": rows},
                      f, indent=1)
        print(f"\nwrote {args.json}")
