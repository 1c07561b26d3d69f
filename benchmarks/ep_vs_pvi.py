"""Federated EP against pooled NUTS, PVI and one-shot subposterior merges (issue 19).

Task: Bayesian logistic regression on scikit-learn's breast-cancer data (30 standardised
features, ``fedppl.models.logistic_regression`` adds its own bias: D = 31, prior N(0, I)), split
homogeneously across K = 10 clients. The reference is pooled NUTS (numpyro ``MCMC``, 4 chains,
``--ref-samples`` draws each, on all the data). After every round it records, for q over the
flat (w, b):

* ``mean_err``: the worst ``|mean_q - mean_ref| / sd_ref`` over the 31 coordinates;
* ``sd_err``: the worst ``|sd_q / sd_ref - 1|``;
* ``seconds``: the round's wall time (the first includes compilation).

Methods: ``EP`` (:class:`fedppl.EP`, full-rank sites, synchronous, NUTS tilted, damping
``--damping``) and ``EP decaying`` (:func:`fedppl.algorithms.ep.decaying_damping` from
``--damping`` to ``--decay-to``), each with also the average of q's natural parameters over the
last 5 rounds (``avg5``: averages some of the sites' Monte Carlo noise out); ``PVI``
(``fedppl.PVI`` default: mean-field guide, sequential schedule, natural-gradient local step) and
``PVI fullrank`` (full-rank guide, synchronous, damping 0.5); the one-shot merges of numpyro
(``hmc_util.parametric`` and ``consensus``) of the clients' subposteriors
``p(theta)^(1/K) p(y_k | theta)``, sampled by the same NUTS as EP's tilted distributions. The
issue's target: mean_err <= 0.05 and sd_err <= 0.05 within 20 rounds.

Run::

    python benchmarks/ep_vs_pvi.py                       # 1 seed, 20 rounds
    python benchmarks/ep_vs_pvi.py --seeds 3 --num-samples 2000
    python benchmarks/ep_vs_pvi.py --quick               # a smoke run (3 rounds, few draws)

Prints a table and writes JSON to ``--out`` (default benchmarks/results/ep_vs_pvi.json).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from numpyro.infer import MCMC, NUTS
from numpyro.infer.hmc_util import consensus, parametric

import fedppl
from fedppl.algorithms import ep
from fedppl.families import gaussian as g
from fedppl.models import logistic_regression as model

jax.config.update("jax_enable_x64", True)


def load(num_clients: int, seed: int):
    from sklearn.datasets import load_breast_cancer  # type: ignore[import-untyped]

    X, y = load_breast_cancer(return_X_y=True)
    X = (X - X.mean(0)) / X.std(0)
    return X, y.astype(float), fedppl.partition.homogeneous(X, y.astype(float), num_clients,
                                                             seed=seed)


def flat(guide: fedppl.PVIGuide, draws: dict) -> np.ndarray:
    """Draws keyed by site, as the guide's flat unconstrained vectors (identity transforms)."""
    layout = guide._require_setup()
    n = len(next(iter(draws.values())))
    return np.concatenate([np.asarray(draws[s.name]).reshape(n, -1) for s in layout.sites], 1)


def pooled_nuts(X, y, guide, seed: int, num_samples: int) -> np.ndarray:
    mcmc = MCMC(NUTS(model, dense_mass=True), num_warmup=1000, num_samples=num_samples,
                num_chains=4, chain_method="sequential", progress_bar=False)
    mcmc.run(jax.random.key(1000 + seed), X, y)
    return flat(guide, mcmc.get_samples())


def errors(mean, cov, ref_mean, ref_sd) -> tuple[float, float]:
    mean, cov = np.asarray(mean), np.asarray(cov)
    sd = np.sqrt(np.diag(cov) if cov.ndim == 2 else cov)
    return (float(np.max(np.abs(mean - ref_mean) / ref_sd)),
            float(np.max(np.abs(sd / ref_sd - 1))))


def curve(method, clients, rounds: int, seed: int, ref_mean, ref_sd, keep: int = 0):
    """Per-round errors and seconds of a front, and the natural parameters of the last ``keep``
    rounds' q."""
    state = method.init(jax.random.key(seed), clients)
    rows, qs = [], []
    for _ in range(rounds):
        state, info = method.update(state)
        m, c = g.to_moments(state.server.q)
        me, se = errors(m, c, ref_mean, ref_sd)
        row = {"round": info["round"], "mean_err": me, "sd_err": se, "seconds": info["seconds"],
               "rejected": info["rejected"]}
        for k in ("rhat", "ess", "mc_error"):
            if k in info:
                row[k] = float(np.nanmax(info[k]) if k != "ess" else np.nanmin(info[k]))
        rows.append(row)
        qs.append(state.server.q)
    return rows, qs[-keep:] if keep else []


def averaged(qs) -> tuple[jax.Array, jax.Array]:
    mean_nat = jax.tree_util.tree_map(lambda *x: jnp.mean(jnp.stack(x), 0), *qs)
    return g.to_moments(mean_nat)


def merges(clients, guide, num_warmup, num_samples, num_chains, seed, ref_mean, ref_sd):
    """numpyro's parametric and consensus merges of the clients' subposteriors."""
    K = clients.num_clients
    solver = ep.TiltedNUTS(model, guide, num_warmup, num_samples, num_chains)
    prior = guide._require_prior()
    sub_prior = g.scale(prior, 1.0 / K)
    t0 = time.perf_counter()
    draws = jax.jit(jax.vmap(lambda d, m, k: solver.draws(sub_prior, prior, d, m, k)))(
        clients.stacked, clients.mask, jax.random.split(jax.random.key(seed), K))
    draws = np.asarray(draws).reshape(K, -1, guide._require_setup().dim)
    seconds = time.perf_counter() - t0
    subs = [d for d in draws]
    out = {}
    m, c = parametric(subs)
    out["parametric"] = dict(zip(("mean_err", "sd_err"), errors(m, c, ref_mean, ref_sd),
                                 strict=True), seconds=seconds)
    merged = np.asarray(consensus(subs, num_draws=len(subs[0])))
    out["consensus"] = dict(zip(("mean_err", "sd_err"),
                                errors(merged.mean(0), np.cov(merged.T), ref_mean, ref_sd),
                                strict=True), seconds=seconds)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--num-warmup", type=int, default=500)
    ap.add_argument("--num-samples", type=int, default=1000)
    ap.add_argument("--num-chains", type=int, default=4)
    ap.add_argument("--damping", type=float, default=0.5)
    ap.add_argument("--decay-to", type=float, default=0.1,
                    help="also run EP with damping decaying from --damping towards this (rate "
                         "0.8 per round; ep-stan: min(1/K, 0.2)); 0: skip it")
    ap.add_argument("--ref-samples", type=int, default=5000)
    ap.add_argument("--no-pvi", action="store_true")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default="benchmarks/results/ep_vs_pvi.json")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.num_warmup, args.num_samples, args.ref_samples = 3, 200, 200, 1000
    warnings.simplefilter("ignore", RuntimeWarning)  # the round log's notes, kept in the JSON
    results: dict = {"settings": vars(args), "machine": platform.platform(), "seeds": []}
    for seed in range(args.seeds):
        X, y, clients = load(args.clients, seed)
        guide = fedppl.PVIGuide(model, family="fullrank").setup(*clients.client(0))
        t0 = time.perf_counter()
        ref = pooled_nuts(X, y, guide, seed, args.ref_samples)
        ref_seconds = time.perf_counter() - t0
        ref_mean, ref_sd = ref.mean(0), ref.std(0, ddof=1)
        run: dict = {"seed": seed, "pooled_nuts_seconds": ref_seconds, "methods": {}}
        variants = {"EP": args.damping}
        if args.decay_to:
            variants["EP decaying"] = ep.decaying_damping(args.damping, args.decay_to, 0.8)
        for name, rho in variants.items():
            method = fedppl.EP(model, guide, "synchronous", rho, num_warmup=args.num_warmup,
                               num_samples=args.num_samples, num_chains=args.num_chains)
            rows, last = curve(method, clients, args.rounds, seed, ref_mean, ref_sd, keep=5)
            run["methods"][name] = rows
            me, se = errors(*averaged(last), ref_mean, ref_sd)
            run["methods"][f"{name} avg5"] = [{"round": rows[-1]["round"], "mean_err": me,
                                               "sd_err": se, "seconds": float("nan")}]
        if not args.no_pvi:
            run["methods"]["PVI"] = curve(fedppl.PVI(model, fedppl.PVIGuide(model),
                                                     elbo_samples=0), clients, args.rounds,
                                          seed, ref_mean, ref_sd)[0]
            run["methods"]["PVI fullrank"] = curve(
                fedppl.PVI(model, fedppl.PVIGuide(model, family="fullrank"), "synchronous", 0.5,
                           elbo_samples=0), clients, args.rounds, seed, ref_mean, ref_sd)[0]
        run["merges"] = merges(clients, guide, args.num_warmup, args.num_samples,
                               args.num_chains, seed, ref_mean, ref_sd)
        results["seeds"].append(run)
        table(run, args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"wrote {args.out}")


def table(run: dict, args) -> None:
    decay = f" (EP decaying: to {args.decay_to})" if args.decay_to else ""
    print(f"\nseed {run['seed']}: K = {args.clients}, EP damping {args.damping}{decay}, "
          f"{args.num_chains} x {args.num_samples} draws ({args.num_warmup} warm-up) per client; "
          f"pooled NUTS 4 x {args.ref_samples} ({run['pooled_nuts_seconds']:.0f} s)")
    print("| method | round | worst mean err (sd) | worst sd err | s/round (median) |")
    print("|---|---|---|---|---|")
    for name, rows in run["methods"].items():
        secs = np.median([r["seconds"] for r in rows[1:]]) if len(rows) > 1 else float("nan")
        first_ok = next((r["round"] for r in rows if r["mean_err"] <= 0.05
                         and r["sd_err"] <= 0.05), None)
        for row in [r for r in rows if r["round"] in (1, 2, 5, 10, 15) or r is rows[-1]]:
            print(f"| {name} | {row['round']} | {row['mean_err']:.3f} | {row['sd_err']:.3f} | "
                  f"{secs:.2f} |")
        print(f"| {name}: first round within target | {first_ok} | | | |")
    for name, m in run["merges"].items():
        print(f"| {name} (one shot) | - | {m['mean_err']:.3f} | {m['sd_err']:.3f} | "
              f"{m['seconds']:.1f} |")


if __name__ == "__main__":
    main()
