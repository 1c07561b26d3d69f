"""``fedppl cotrain``: private GP co-training between two parties (thesis Ch. 4)."""

from __future__ import annotations

import argparse

from fedppl_experiments.commands.arguments import (
    folder,
    open_fraction,
    positive,
    positive_int,
)

__all__ = ["register", "run"]


def _data(text: str) -> str:
    """``simulated`` or an existing power-plant folder."""
    return text if text == "simulated" else folder(text)


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``cotrain`` subcommand to ``fedppl``'s parser."""
    co = sub.add_parser("cotrain", help="private GP co-training between two parties (thesis "
                                        "Ch. 4) on simulated two-view data or CCPP")
    co.add_argument("--data", default="simulated", type=_data,
                    help="'simulated' (default) or a power-plant folder")
    co.add_argument("--combination", default="noisy", choices=["blocky", "noisy", "hybrid"])
    co.add_argument("--uncertainty", default="full", choices=["none", "marginal", "full"])
    co.add_argument("--masked", action="store_true", help="each party sees half the space")
    co.add_argument("--no-cond-indep", action="store_true",
                    help="simulated views are the same variable (not conditionally independent)")
    co.add_argument("--r", type=open_fraction, default=0.9,
                    help="corr(x, y) of simulated views, in (0, 1) (0.9)")
    co.add_argument("--n-obs", type=positive_int, default=25,
                    help="private labelled points per party (25)")
    co.add_argument("--rounds", type=positive_int, default=25, help="rounds (25)")
    co.add_argument("--dp", action="store_true", help="release means with differential privacy")
    co.add_argument("--epsilon", type=positive, default=1.0, help="DP epsilon per release (1)")
    co.add_argument("--delta", type=open_fraction, default=0.00625,
                    help="DP delta, in (0, 1) (0.00625)")


def run(args: argparse.Namespace) -> list[dict]:
    """Run one configuration; print each party's RMSE and epsilon; one run."""
    import jax

    from fedppl.algorithms import cotraining as ct
    from fedppl_experiments import cotraining_study as study
    from fedppl_experiments.commands.record import run_record

    jax.config.update("jax_enable_x64", True)
    cfg = study.Config(args.combination, args.uncertainty, args.masked, not args.no_cond_indep,
                       args.r, args.n_obs, args.dp, args.seed, args.data)
    dp = study.DEFAULT_DP._replace(epsilon=args.epsilon, delta=args.delta)
    ct.check_settings(ct.Settings(args.combination, args.uncertainty, dp))
    result = study.run_config(cfg, rounds=args.rounds, dp=dp,
                              progress_bar=not args.no_progress)
    print(f"\nco-training ({args.combination}, uncertainty {args.uncertainty}) on {args.data}, "
          f"{args.rounds} rounds\n")
    print("| party | RMSE before | RMSE after | epsilon |")
    print("|---|---:|---:|---:|")
    before, after = result.rmse_before or [], result.rmse_after or []
    for v, (b, a) in enumerate(zip(before, after, strict=True)):
        eps = result.epsilon[v]
        print(f"| {v + 1} | {b:.3f} | {a:.3f} | {'-' if eps is None else f'{eps:.3g}'} |")
    if args.dp:
        print(f"\n(epsilon, delta): composed over each party's releases at delta={args.delta}")
    out = result.to_json()
    config = {**cfg._asdict(), "rounds": args.rounds,
              **({"epsilon": args.epsilon, "delta": args.delta} if args.dp else {})}
    return [run_record("cotraining", config, out["summary"], out["history"], out["rejected"])]
