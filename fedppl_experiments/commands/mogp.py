"""``fedppl mogp``: pFed-Mul / pFed-St / Gaussian-VI on the synthetic or digits multi-task study.

Example::

    $ fedppl mogp --study synthetic --method pfed-mul pfed-st --rounds 20 --json out.json
    $ fedppl mogp --study digits --method all --shots 10 --rounds 30
"""

from __future__ import annotations

import argparse

from fedppl_experiments.commands.arguments import add_methods, positive_int

__all__ = ["register", "run"]

# :data:`fedppl_experiments.mogp_synthetic.METHODS` and ``mogp_digits.METHODS`` (named here so
# that ``--help`` imports no JAX; a test keeps them equal)
METHODS = ("pfed-mul", "pfed-st", "gaussian-vi")


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``mogp`` subcommand to ``fedppl``'s parser."""
    p = sub.add_parser("mogp", help="federated multi-task GPs with mixed regression and "
                                    "classification (pFed-Mul, Polya-Gamma CAVI)")
    p.add_argument("--study", default="synthetic", choices=["synthetic", "digits"])
    add_methods(p, METHODS, ["pfed-mul"])
    p.add_argument("--shots", type=positive_int, default=10,
                   help="digits: shots per client per task (10)")
    p.add_argument("--clients", type=positive_int, default=None,
                   help="clients (synthetic: 5; digits: 20/15/10 for 10/20/50 shots)")
    p.add_argument("--rounds", type=positive_int, default=20, help="rounds (20)")
    groups = ["network", "kernel", "kernel+W", "all"]
    p.add_argument("--hyper", default=None, choices=groups,
                   help="global hyperparameter groups (synthetic: all, digits: network)")
    p.add_argument("--variant", dest="hyper", default=argparse.SUPPRESS, choices=groups,
                   help=argparse.SUPPRESS)  # the old name


def _one(args: argparse.Namespace, method: str, bar) -> tuple[dict, dict, dict]:
    """(config, summary, history) of one method's run."""
    if args.study == "synthetic":
        from fedppl_experiments import mogp_synthetic as synthetic

        clients = args.clients or 5
        res = synthetic.run(method, seed=args.seed, rounds=args.rounds, num_clients=clients)
        bar.update(args.rounds)
        summary = {k: res[k] for k in ("cls_rmse", "cls_var", "reg_rmse", "reg_var",
                                       "rounds_to_convergence", "seconds_per_round")}
        history = {"round": list(range(1, args.rounds + 1)),
                   "elbo_per_obs": res["elbo_per_obs"]}
        return {"clients": clients, "hyper": "all"}, summary, history
    from fedppl_experiments import mogp_digits as digits

    hyper = args.hyper or "network"
    res = digits.run(method, shots=args.shots, num_clients=args.clients, rounds=args.rounds,
                     seed=args.seed, variant=hyper, progress=lambda r: bar.update(1))
    summary = {k: res[k] for k in ("accuracy", "mse", "ece", "seconds_per_round")}
    history = {"round": list(range(1, args.rounds + 1)), "accuracy": res["acc_curve"]}
    return {"clients": res["clients"], "shots": args.shots, "hyper": hyper}, summary, history


def run(args: argparse.Namespace) -> list[dict]:
    """Run the study for each method, print a markdown table; one run per method."""
    import jax
    from tqdm.auto import tqdm

    from fedppl_experiments.commands.record import run_record

    jax.config.update("jax_enable_x64", True)
    runs = []
    bar = tqdm(total=len(args.method) * args.rounds, disable=args.no_progress, desc="mogp")
    for m in args.method:
        bar.set_postfix_str(m)
        config, summary, history = _one(args, m, bar)
        runs.append(run_record(m, {"study": args.study, "rounds": args.rounds,
                                   "seed": args.seed, **config}, summary, history))
    bar.close()
    cols = list(runs[0]["summary"])
    print("| method | " + " | ".join(cols) + " |")
    print("|---|" + "---:|" * len(cols))
    for r in runs:
        cells = [f"{v:.4g}" if isinstance(v, float) else str(v)
                 for v in (r["summary"][c] for c in cols)]
        print(f"| {r['method']} | " + " | ".join(cells) + " |")
    return runs
