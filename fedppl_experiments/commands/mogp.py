"""``fedppl mogp``: pFed-Mul / pFed-St / Gaussian-VI on the synthetic or digits multi-task study.

Example::

    $ fedppl mogp --study synthetic --method pfed-mul pfed-st --rounds 20 --json out.json
    $ fedppl mogp --study digits --method all --shots 10 --rounds 30
"""

from __future__ import annotations

import argparse
import json

__all__ = ["register", "run"]

_METHODS = ("pfed-mul", "pfed-st", "gaussian-vi")


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``mogp`` subcommand to ``fedppl``'s parser."""
    p = sub.add_parser("mogp", help="federated multi-task GPs with mixed regression and "
                                    "classification (pFed-Mul, Polya-Gamma CAVI)")
    p.add_argument("--study", default="synthetic", choices=["synthetic", "digits"])
    p.add_argument("--method", nargs="+", default=["pfed-mul"],
                   help="pfed-mul, pfed-st, gaussian-vi, or all")
    p.add_argument("--shots", type=int, default=10, help="digits: shots per client per task")
    p.add_argument("--clients", type=int, default=None,
                   help="clients (synthetic: 5; digits: 20/15/10 for 10/20/50 shots)")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--variant", default=None, choices=["network", "kernel", "kernel+W", "all"],
                   help="global hyperparameter groups (synthetic: all, digits: network)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the results here")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def _methods(names: list[str]) -> list[str]:
    out = list(_METHODS) if "all" in names else names
    bad = [m for m in out if m not in _METHODS]
    if bad:
        raise SystemExit(f"unknown method(s) {bad}; choose from {list(_METHODS)} or all")
    return out


def _check_counts(args: argparse.Namespace) -> None:
    for flag, value in (("--rounds", args.rounds), ("--shots", args.shots),
                        ("--clients", args.clients)):
        if value is not None and value < 1:
            raise SystemExit(f"{flag} must be a positive integer, got {value}")


def run(args: argparse.Namespace) -> dict:
    """Run the study for each method, print a markdown table, optionally write JSON."""
    import jax
    from tqdm.auto import tqdm

    methods = _methods(args.method)
    _check_counts(args)
    jax.config.update("jax_enable_x64", True)
    rows = {}
    bar = tqdm(total=len(methods) * args.rounds, disable=args.no_progress, desc="mogp")
    for m in methods:
        bar.set_postfix_str(m)
        if args.study == "synthetic":
            from fedppl_experiments import mogp_synthetic as study

            res = study.run(m, seed=args.seed, rounds=args.rounds,
                            num_clients=args.clients or 5)
            bar.update(args.rounds)
            keep = ("cls_rmse", "cls_var", "reg_rmse", "reg_var", "rounds_to_convergence",
                    "seconds_per_round", "elbo_per_obs")
        else:
            from fedppl_experiments import mogp_digits as study

            res = study.run(m, shots=args.shots, num_clients=args.clients, rounds=args.rounds,
                            seed=args.seed, variant=args.variant or "network",
                            progress=lambda r: bar.update(1))
            keep = ("accuracy", "mse", "ece", "seconds_per_round", "acc_curve", "clients")
        rows[m] = {k: res[k] for k in keep}
    bar.close()
    cols = [k for k in rows[methods[0]] if not isinstance(rows[methods[0]][k], list)]
    print("| method | " + " | ".join(cols) + " |")
    print("|---|" + "---:|" * len(cols))
    for m, r in rows.items():
        cells = [f"{r[c]:.4g}" if isinstance(r[c], float) else str(r[c]) for c in cols]
        print(f"| {m} | " + " | ".join(cells) + " |")
    out = {"study": args.study, "shots": args.shots, "rounds": args.rounds, "seed": args.seed,
           "results": rows}
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return out
