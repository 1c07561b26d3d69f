"""``fedppl cotrain``: private GP co-training between two parties (thesis Ch. 4)."""

from __future__ import annotations

import argparse
import json

__all__ = ["register", "run"]


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``cotrain`` subcommand to ``fedppl``'s parser."""
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


def run(args: argparse.Namespace) -> None:
    """Run one configuration; print each party's RMSE and epsilon; ``--json`` writes the
    result's JSON (``method``, ``summary``, ``history``, ``rejected``) with the ``config``."""
    import jax

    from fedppl.algorithms import cotraining as ct
    from fedppl.infer.base import check_rounds
    from fedppl_experiments import cotraining_study as study

    jax.config.update("jax_enable_x64", True)
    cfg = study.Config(args.combination, args.uncertainty, args.masked, not args.no_cond_indep,
                       args.r, args.n_obs, args.dp, args.seed, args.data)
    dp = study.DEFAULT_DP._replace(epsilon=args.epsilon, delta=args.delta)
    try:  # flags checked before anything runs
        check_rounds(args.rounds, "--rounds")
        check_rounds(args.n_obs, "--n-obs")
        ct.check_settings(ct.Settings(args.combination, args.uncertainty, dp))
        if args.data == "simulated" and not 0 < args.r < 1:
            raise ValueError(f"--r must lie in (0, 1), got {args.r}")
    except (TypeError, ValueError) as e:
        raise SystemExit(f"fedppl cotrain: {e}") from None
    result = study.run_config(cfg, rounds=args.rounds, dp=dp)
    print(f"\nco-training ({args.combination}, uncertainty {args.uncertainty}) on {args.data}, "
          f"{args.rounds} rounds\n")
    print("| party | RMSE before | RMSE after | epsilon |")
    print("|---|---:|---:|---:|")
    for v, (b, a) in enumerate(zip(result.rmse_before, result.rmse_after, strict=True)):
        eps = result.epsilon[v]
        print(f"| {v + 1} | {b:.3f} | {a:.3f} | {'-' if eps is None else f'{eps:.3g}'} |")
    if args.dp:
        print(f"\n(epsilon, delta): composed over each party's releases at delta={args.delta}")
    if args.json:
        out = {"config": cfg._asdict(), **result.to_json()}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {args.json}")
