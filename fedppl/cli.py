"""The ``fedppl`` command line (also ``python -m fedppl``).

Example::

    $ fedppl demo --clients 10 --rounds 10 --out fedppl-demo.png
    $ fedppl fedbnr --data ../shared/data/uci/power-plant --clients 10 --variant avg kd
    $ fedppl cotrain --combination noisy --uncertainty full --masked --dp --json out.json
    $ fedppl sgp --data ../shared/data/uci/concrete --split 0 --clients 10 --method dpo global
    $ fedppl mogp --study synthetic --method all --rounds 15
"""

from __future__ import annotations

import argparse
import json
from typing import Sequence

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fedppl", description="Federated Bayesian inference")
    sub = p.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="federated Bayesian logistic regression on a built-in "
                                       "dataset: table of PVI vs global VI vs clients alone")
    demo.add_argument("--clients", type=int, default=10, help="number of clients (10)")
    demo.add_argument("--rounds", type=int, default=10, help="PVI rounds (10)")
    demo.add_argument("--local-steps", type=int, default=100,
                      help="cap on the local step's iterations per update")
    demo.add_argument("--out", default="fedppl-demo.png", help="plot file ('' for none)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--no-progress", action="store_true", help="hide progress bars")
    fb = sub.add_parser("fedbnr", help="FedBNR (random-feature GP, exact last layer) on a UCI "
                                       "folder: variants and ablations of the FedBNR paper")
    fb.add_argument("--data", required=True, help="a UCI dataset folder (data.txt, index_*.txt)")
    fb.add_argument("--clients", type=int, default=10)
    fb.add_argument("--variant", nargs="+", default=["avg"],
                    help="avg (FedBNR), kd (FedBNR-KD), central, local+local, local+global, "
                         "avg+local, kd+local, or all")
    fb.add_argument("--seed", type=int, default=0)
    fb.add_argument("--rounds", type=int, default=20, help="aggregation rounds (20)")
    fb.add_argument("--local-steps", type=int, default=20, help="full-batch steps per round")
    fb.add_argument("--kd-alpha", type=float, default=5.0)
    fb.add_argument("--json", help="write the results here")
    fb.add_argument("--no-progress", action="store_true", help="hide progress bars")
    co = sub.add_parser("cotrain", help="private GP co-training between two parties (thesis "
                                        "Ch. 4) on simulated two-view data or CCPP")
    co.add_argument("--data", default="simulated", help="'simulated' or a power-plant folder")
    co.add_argument("--combination", default="noisy", choices=["blocky", "noisy", "hybrid"])
    co.add_argument("--uncertainty", default="full", choices=["none", "marginal", "full"])
    co.add_argument("--masked", action="store_true", help="each party sees half the space")
    co.add_argument("--no-cond-indep", action="store_true",
                    help="simulated views are the same variable (not conditionally independent)")
    co.add_argument("--r", type=float, default=0.9, help="corr(x, y) of simulated views")
    co.add_argument("--n-obs", type=int, default=25, help="private labelled points per party")
    co.add_argument("--rounds", type=int, default=25)
    co.add_argument("--dp", action="store_true", help="release means with differential privacy")
    co.add_argument("--epsilon", type=float, default=1.0)
    co.add_argument("--delta", type=float, default=0.00625)
    co.add_argument("--seed", type=int, default=0)
    co.add_argument("--json", help="write the result here")
    for module in _command_modules():
        module.register(sub)
    return p


def _command_modules() -> list:
    """Subcommands that live in :mod:`fedppl.commands` (``register`` + ``run`` each)."""
    from fedppl.commands import mogp, sgp

    return [sgp, mogp]


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "demo":
        from fedppl.demo import run_demo

        run_demo(args.clients, args.rounds, args.local_steps, args.out or None, args.seed,
                 progress_bar=not args.no_progress)
    elif args.command == "fedbnr":
        _fedbnr(args)
    elif args.command == "cotrain":
        _cotrain(args)
    else:
        commands = {m.__name__.rsplit(".", 1)[-1]: m for m in _command_modules()}
        commands[args.command].run(args)
    return 0


def _cotrain(args: argparse.Namespace) -> None:
    import jax

    from fedppl.experiments import cotraining_study as study

    jax.config.update("jax_enable_x64", True)
    cfg = study.Config(args.combination, args.uncertainty, args.masked, not args.no_cond_indep,
                       args.r, args.n_obs, args.dp, args.seed, args.data)
    dp = study.DEFAULT_DP._replace(epsilon=args.epsilon, delta=args.delta)
    row = study.run_one(cfg, rounds=args.rounds, dp=dp)
    print(f"\nco-training ({args.combination}, uncertainty {args.uncertainty}) on {args.data}, "
          f"{args.rounds} rounds\n")
    print("| party | RMSE before | RMSE after | epsilon |")
    print("|---|---:|---:|---:|")
    for v, (b, a) in enumerate(zip(row["rmse_before"], row["rmse_after"])):
        eps = row["epsilon"][v]
        print(f"| {v + 1} | {b:.3f} | {a:.3f} | {'-' if eps is None else f'{eps:.3g}'} |")
    if args.dp:
        print(f"\n(epsilon, delta): composed over each party's releases at delta={args.delta}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(row, f, indent=1, default=float)
        print(f"wrote {args.json}")


def _fedbnr(args: argparse.Namespace) -> None:
    import jax

    from fedppl.experiments import fedbnr_uci

    jax.config.update("jax_enable_x64", True)
    variants = list(fedbnr_uci.VARIANTS) if args.variant == ["all"] else args.variant
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
