"""How close non-conjugate PVI gets to global VI, round by round: the default natural-gradient
local step against the constant-step optax solver.

Task (the one the accuracy issue was measured on): Bayesian logistic regression on scikit-learn's
breast-cancer data (30 standardised features plus a bias column, D = 31, weights ~ N(0, I)), split
homogeneously across K clients, synchronous schedule. For each guide family, K, damping and seed it
records, after every round, the worst error of q's mean (in posterior sds) and the worst relative
error of q's marginal sds against two references on the pooled data:

* ``same``: :class:`fedppl.GlobalVI` with the same solver settings (the same fixed draws), the
  point PVI's fixed point equals exactly;
* ``conv``: GlobalVI with 4096 draws, a converged global VI (its own Monte Carlo error is about a
  tenth of the 128-draw default's).

Also: K = 100 at damping 0.01 for 300 rounds (collapse, rejections, growth of the error between
rounds), and a Poisson and a probit regression on simulated data.

Run::

    python benchmarks/pvi_accuracy.py                  # the full table (about 25 min on 2 cores)
    python benchmarks/pvi_accuracy.py --quick          # one seed, K = 10, fewer rounds
    python benchmarks/pvi_accuracy.py --clients 10 --seeds 1 --table-only \
        --out benchmarks/results/pvi_accuracy_k10_timing.json   # re-time K = 10 on a quiet machine

Prints markdown tables and writes JSON (settings, machine, per-round curves) to ``--out``.
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
import numpyro
import numpyro.distributions as dist
import optax
from _provenance import stamp

import fedppl
from fedppl.guides import PVIGuide

BENCHMARK = {
    "summary": ("non-conjugate PVI against global VI on breast cancer, round by round: local "
                "step, family, damping and K; simulated Poisson and probit regressions"),
    "data": None,
    "quick": ["--quick", "--families", "fullrank", "--solvers", "natural-gradient",
              "--table-only"],
    "full": [[],
             ["--clients", "10", "--seeds", "1", "--table-only", "--out",
              "benchmarks/results/pvi_accuracy_k10_timing.json"]],
    "cost": "quick ~2.5 min; full ~35 min",
}

jax.config.update("jax_enable_x64", True)
jax.config.update("jax_cpu_enable_async_dispatch", False)

SETTINGS = [(1.0, 20), (0.5, 20), (0.1, 40)]  # (damping, rounds)


def logistic(X, y=None):
    w = numpyro.sample("w", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)


def poisson(X, y=None):
    w = numpyro.sample("w", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Poisson(jnp.exp(X @ w)), obs=y)


def probit(X, y=None):
    w = numpyro.sample("w", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        p = jax.scipy.stats.norm.cdf(X @ w)
        numpyro.sample("y", dist.Bernoulli(probs=jnp.clip(p, 1e-12, 1 - 1e-12)), obs=y)


def breast_cancer() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_breast_cancer
    from sklearn.preprocessing import StandardScaler

    X, y = load_breast_cancer(return_X_y=True)
    X = StandardScaler().fit_transform(X)
    return np.hstack([X, np.ones((len(X), 1))]), y.astype(float)


def simulated(kind: str, n: int = 2000, dim: int = 12, seed: int = 0):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, dim)) / np.sqrt(dim)
    X[:, -1] = 1.0
    w = rng.normal(size=dim)
    if kind == "poisson":
        return X, rng.poisson(np.exp(X @ w)).astype(float)
    from scipy.stats import norm
    return X, (rng.random(n) < norm.cdf(X @ w)).astype(float)


def moments(result) -> tuple[np.ndarray, np.ndarray]:
    m, c = result.mean_and_cov()
    c = np.asarray(c)
    return np.asarray(m), np.sqrt(c if c.ndim == 1 else np.diag(c))


def errors(result, ref) -> tuple[float, float]:
    (m, sd), (m0, sd0) = moments(result), ref
    return float(np.max(np.abs(m - m0) / sd0)), float(np.max(np.abs(sd / sd0 - 1)))


def make_pvi(model, family, solver, damping, draws):
    if solver == "optax":
        return fedppl.PVI(model, PVIGuide(model, family=family), "synchronous", damping,
                          solver="optax", optimizer=optax.adam(1e-2), local_steps=100,
                          num_particles=10, elbo_samples=0)
    return fedppl.PVI(model, PVIGuide(model, family=family), "synchronous", damping,
                      num_particles=draws, elbo_samples=0)


def curve(model, family, solver, clients, damping, rounds, seed, refs, draws) -> dict:
    """Run round by round (resuming from the factors), recording both errors after each."""
    pvi = make_pvi(model, family, solver, damping, draws)
    key = jax.random.key(100 + seed)
    out = {k: [] for k in ("mean_same", "sd_same", "mean_conv", "sd_conv", "seconds",
                           "rejected", "unconverged", "min_sd_ratio")}
    factors, prev_sd = None, None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(rounds):
            key, k = jax.random.split(key)
            res = pvi.run(k, clients, 1, progress_bar=False, factors=factors)
            factors = res.factors
            for name, ref in refs.items():
                em, es = errors(res, ref)
                out[f"mean_{name}"].append(em)
                out[f"sd_{name}"].append(es)
            out["seconds"].append(float(res.history["seconds"][0]))
            out["rejected"].append(len(res.rejected))
            out["unconverged"].append(len(res.unconverged))
            sd = moments(res)[1]
            out["min_sd_ratio"].append(float(np.min(sd / prev_sd)) if prev_sd is not None else 1.0)
            prev_sd = sd
    return out


def references(model, family, data, draws) -> dict:
    same = fedppl.GlobalVI(model, PVIGuide(model, family=family), num_particles=draws)
    conv = fedppl.GlobalVI(model, PVIGuide(model, family=family), num_particles=4096)
    return {"same": moments(same.run(jax.random.key(0), data)),
            "conv": moments(conv.run(jax.random.key(0), data))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--draws", type=int, default=128, help="natural-gradient fixed draws")
    ap.add_argument("--clients", type=int, nargs="+", default=[10, 100])
    ap.add_argument("--families", nargs="+", default=["fullrank", "meanfield"])
    ap.add_argument("--solvers", nargs="+", default=["natural-gradient", "optax"])
    ap.add_argument("--long-rounds", type=int, default=300)
    ap.add_argument("--table-only", action="store_true",
                    help="skip the long run and the Poisson/probit runs (e.g. to re-time a table)")
    ap.add_argument("--out", default="benchmarks/results/pvi_accuracy.json")
    args = ap.parse_args()
    if args.quick:
        args.seeds, args.clients, args.long_rounds = 1, [10], 40
    X, y = breast_cancer()
    runs, t_start = [], time.time()
    for family in args.families:
        refs = references(logistic, family, (X, y), args.draws)
        for K in args.clients:
            for seed in range(args.seeds):
                clients = fedppl.partition.homogeneous(X, y, num_clients=K, seed=seed)
                for solver in args.solvers:
                    for damping, rounds in SETTINGS:
                        if args.quick:
                            rounds = rounds // 2
                        c = curve(logistic, family, solver, clients, damping, rounds, seed, refs,
                                  args.draws)
                        runs.append({"task": "breast-cancer logistic", "family": family, "K": K,
                                     "seed": seed, "solver": solver, "damping": damping,
                                     "rounds": rounds, **c})
                        print(f"{family:9s} K={K:<3d} seed={seed} {solver:16s} "
                              f"damping={damping:<4} round {rounds}: mean err "
                              f"{c['mean_same'][-1]:.3f} (same) {c['mean_conv'][-1]:.3f} (conv), "
                              f"sd err {c['sd_same'][-1]:.3f} / {c['sd_conv'][-1]:.3f}, "
                              f"{np.median(c['seconds'][1:]):.3f} s/round", flush=True)
    long = None if args.table_only else long_run(X, y, args)
    glm = [] if args.table_only else [glm_run(kind, args) for kind in ("poisson", "probit")]
    report = {"benchmark": "pvi_accuracy", "machine": machine(), "draws": args.draws,
              "settings": SETTINGS, "runs": runs, "long": long, "glm": glm,
              "wall_seconds": time.time() - t_start}
    print_tables(runs, long, glm)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(stamp(report), indent=1))
    print(f"wrote {args.out}")


def long_run(X, y, args) -> dict:
    """K = 100, damping 0.01, full rank: no collapse, no rejection, error never jumps."""
    K = 100 if not args.quick else 10
    refs = references(logistic, "fullrank", (X, y), args.draws)
    clients = fedppl.partition.homogeneous(X, y, num_clients=K, seed=0)
    c = curve(logistic, "fullrank", "natural-gradient", clients, 0.01, args.long_rounds, 0, refs,
              args.draws)
    jumps = np.diff(c["mean_same"])
    out = {"K": K, "damping": 0.01, "rounds": args.long_rounds, **c,
           "largest_error_increase": float(np.max(jumps)) if len(jumps) else 0.0}
    print(f"long run K={K} damping 0.01: round {args.long_rounds} mean err "
          f"{c['mean_same'][-1]:.3f} / {c['mean_conv'][-1]:.3f}, sd err {c['sd_same'][-1]:.3f} / "
          f"{c['sd_conv'][-1]:.3f}, rejected {sum(c['rejected'])}, largest error increase "
          f"{out['largest_error_increase']:.2e}", flush=True)
    return out


def glm_run(kind: str, args) -> dict:
    model = poisson if kind == "poisson" else probit
    X, y = simulated(kind)
    out = {"task": f"{kind} regression (simulated, N=2000, D=12)", "runs": []}
    for family in args.families:
        refs = references(model, family, (X, y), args.draws)
        clients = fedppl.partition.homogeneous(X, y, num_clients=10, seed=0)
        for damping, rounds in SETTINGS:
            c = curve(model, family, "natural-gradient", clients, damping, rounds, 0, refs,
                      args.draws)
            out["runs"].append({"family": family, "damping": damping, "rounds": rounds, **c})
            print(f"{kind} {family} damping {damping}: mean err {c['mean_same'][-1]:.3f} / "
                  f"{c['mean_conv'][-1]:.3f}, sd err {c['sd_same'][-1]:.3f} / "
                  f"{c['sd_conv'][-1]:.3f}", flush=True)
    return out


def print_tables(runs, long, glm) -> None:
    print("\n| family | K | solver | damping | rounds | worst mean err (same / conv) | "
          "worst sd err (same / conv) | s/round |")
    print("|---|---:|---|---:|---:|---|---|---:|")
    keys = sorted({(r["family"], r["K"], r["solver"], r["damping"]) for r in runs},
                  key=lambda k: (k[0], k[1], k[2], -k[3]))
    for fam, K, solver, damping in keys:
        sel = [r for r in runs if (r["family"], r["K"], r["solver"], r["damping"]) ==
               (fam, K, solver, damping)]

        def span(key, sel=sel):
            v = [r[key][-1] for r in sel]
            return f"{min(v):.3f}-{max(v):.3f}" if len(v) > 1 else f"{v[0]:.3f}"

        sec = np.median([np.median(r["seconds"][1:]) for r in sel])
        print(f"| {fam} | {K} | {solver} | {damping} | {sel[0]['rounds']} | "
              f"{span('mean_same')} / {span('mean_conv')} | {span('sd_same')} / "
              f"{span('sd_conv')} | {sec:.3f} |")
    if long is None:
        return
    print(f"\nlong run (K={long['K']}, damping 0.01, {long['rounds']} rounds): mean err "
          f"{long['mean_same'][-1]:.3f} / {long['mean_conv'][-1]:.3f}, sd err "
          f"{long['sd_same'][-1]:.3f} / {long['sd_conv'][-1]:.3f}, rejected "
          f"{sum(long['rejected'])}, smallest one-round sd ratio {min(long['min_sd_ratio']):.3f}")
    for g_ in glm:
        for r in g_["runs"]:
            print(f"{g_['task']} {r['family']} damping {r['damping']} ({r['rounds']} rounds): "
                  f"mean err {r['mean_same'][-1]:.3f} / {r['mean_conv'][-1]:.3f}, sd err "
                  f"{r['sd_same'][-1]:.3f} / {r['sd_conv'][-1]:.3f}")


def machine() -> dict:
    import os

    return {"platform": platform.platform(), "processor": platform.processor(),
            "cpus": os.cpu_count(), "jax": jax.__version__, "backend": jax.default_backend()}


if __name__ == "__main__":
    main()
