"""The federated SMC sampler on the hierarchical logistic regression of ``ep_hierarchical.py``
against pooled NUTS (issue "The pooled posterior for hierarchical models, federated").

Task (``benchmarks/ep_hierarchical.py``): 40 groups, 20 inputs, 20 rows per group, 25 clients
holding one or two groups each; 42 global coordinates (21 means, 21 log group scales), each
client's local sites the non-centred effects of its groups (42 coordinates). The reference is
pooled NUTS on all the data (4 chains, ``--ref-samples`` draws each after ``--ref-warmup``).

Starts (``--starts``): ``pvi`` (``fedppl.PVI`` with a full-rank guide and its defaults,
``--pvi-rounds`` rounds: its ``q`` and the clients' private guides), ``ep`` (``fedppl.EP`` with
its defaults, ``--ep-rounds`` rounds), ``prior`` (the prior's Gaussian in the unconstrained
space), ``nuts`` (a diagnostic, not a federated start: the Gaussian of pooled NUTS's draws,
with PVI's private guides where ``--load-starts`` has them), ``draws`` (a diagnostic: the
particles are a second pooled NUTS run's draws, at temperature 1 from the first round). From each,
``result.refine(key, clients)`` with the sampler's defaults (``fedppl.SMC``: 1000 particles in
10 islands, 64 local draws...) and ``--rounds`` rounds at most, driven round by round here
so that every round's errors are recorded:

* ``mean_err``: the worst ``|mean - mean_ref| / sd_ref`` over the 42 coordinates (the
  issue's target: 0.1); ``sd_err``: the worst ``|sd / sd_ref - 1|`` (target: 0.1);
* ``stated_mean_mcse``: the sampler's own Monte Carlo error of the mean, the worst over the
  coordinates in reference sds (from the islands), beside ``mean_err``;
* per round: temperature, stage, ESS of the reweighting, its k-hat, acceptance, unique
  particles, ``local_sd`` (the sd of the clients' summed log-likelihood estimates, the
  sampler's diagnostic of their noise), the bytes each client sends and is sent, seconds.

Run::

    python benchmarks/smc_hierarchical.py                       # seed 0, from PVI
    python benchmarks/smc_hierarchical.py --seeds 3 --starts pvi,prior,ep --past-done
    python benchmarks/smc_hierarchical.py --quick                # a smoke run
    python benchmarks/smc_hierarchical.py --starts ep --save-starts /tmp/starts
    python benchmarks/smc_hierarchical.py --starts ep --load-starts /tmp/starts --inflate 1.5

(``--save-starts``/``--load-starts``: a folder for each start's ``q`` and local guides, so that
sampler settings can be compared from one EP run, which takes 24 minutes.) Each start's and
each run's final mean and sd per coordinate are in the JSON.

Prints a table and writes JSON to ``--out`` (default
benchmarks/results/smc_hierarchical.json).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import subprocess
import sys
import time
import warnings
from datetime import date
from pathlib import Path

import jax
import numpy as np
import numpyro

import fedppl

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ep_hierarchical as eh
from _provenance import stamp
from _walk_options import add_walk_options, walk_settings
from ep_vs_pvi import errors

from fedppl.algorithms.smc_kernels import fit

BENCHMARK = {
    "summary": ("the federated SMC sampler on ep_hierarchical's logistic regression against "
                "pooled NUTS, round by round, from PVI, EP or the prior"),
    "data": None,
    "quick": ["--quick"],
    "full": [[],
             ["--past-done", "--pool-steps", "16", "--out",
              "benchmarks/results/smc_hierarchical_pool_steps16.json"],
             ["--past-done", "--gradient", "--out",
              "benchmarks/results/smc_hierarchical_gradient.json"],
             ["--past-done", "--gradient", "--persistence", "0.9", "--rw-target", "0.5",
              "--out", "benchmarks/results/smc_hierarchical_persistence09.json"],
             ["--past-done", "--gradient", "--persistence", "0.97", "--uniform-step", "0.05",
              "--rw-target", "0.5", "--out",
              "benchmarks/results/smc_hierarchical_persistence097_carried.json"],
             ["--past-done", "--gradient", "--persistence", "0.97", "--uniform-step", "0.05",
              "--rw-target", "0.8", "--out",
              "benchmarks/results/smc_hierarchical_persistence097_rw08.json"],
             ["--past-done", "--crank-nicolson", "--out",
              "benchmarks/results/smc_hierarchical_crank_nicolson.json"],
             ["--past-done", "--starts", "ep", "--out",
              "benchmarks/results/smc_hierarchical_ep.json"],
             ["--past-done", "--independent", "0.1", "--out",
              "benchmarks/results/smc_hierarchical_independent01.json"],
             ["--past-done", "--particles", "2000", "--rounds", "40", "--out",
              "benchmarks/results/smc_hierarchical_particles2000.json"],
             ["--past-done", "--starts", "nuts", "--rounds", "30", "--out",
              "benchmarks/results/smc_hierarchical_nuts_start.json"],
             ["--past-done", "--starts", "nuts", "--rounds", "30", "--particles", "2000",
              "--out", "benchmarks/results/smc_hierarchical_nuts_start_particles2000.json"],
             ["--past-done", "--starts", "draws", "--rounds", "20", "--out",
              "benchmarks/results/smc_hierarchical_nuts_draws.json"]],
    "cost": "quick ~3 min; full ~25-45 min per file (from EP ~55 min: EP takes 24)",
}

jax.config.update("jax_enable_x64", True)


def _carrying(clients, seed: int, q, local):
    """A PVI result (one round) made to carry another Gaussian ``q`` and local guides."""
    guide = fedppl.PVIGuide(eh.model, eh.GLOBAL, family="fullrank")
    res = fedppl.PVI(eh.model, guide, elbo_samples=0).run(
        jax.random.key(seed), clients, 1, progress_bar=False, n_groups=eh.n_groups())
    res.q, res.local = (res.guide.prior, None) if q is None else (q, local)
    return res


def _saved(name: str, seed: int, args):
    """A start's ``(q, local guides, seconds)`` saved in ``--load-starts``, or None."""
    path = Path(args.load_starts) / f"{name}_seed{seed}.pkl" if args.load_starts else None
    if path is None or not path.exists():
        return None
    with open(path, "rb") as f:
        return pickle.load(f)


def start_result(name: str, clients, seed: int, args, ref=None):
    """The federated answer the sampler starts from, and the seconds it took (from
    ``--load-starts`` when a saved one is there). ``nuts`` is a diagnostic, not a federated
    start: the Gaussian of pooled NUTS's own draws ``ref`` (with PVI's local guides where a
    saved PVI start is loaded), so that what the sampler does at the target is seen apart from
    how far it must travel. ``draws`` goes further: ``ref`` is then a second, independent pooled
    NUTS run, and :func:`sample` puts the particles at its draws at temperature 1 from the first
    round (no tempering), so that only the moves act."""
    if name in ("nuts", "draws"):
        q = fedppl.families.gaussian.FullGaussian.from_moments(ref.mean(0), np.cov(ref.T))
        pvi = _saved("pvi", seed, args)
        return _carrying(clients, seed, q, None if pvi is None else pvi[1]), 0.0
    saved = _saved(name, seed, args)
    if saved is not None:
        q, local, seconds = saved
        return _carrying(clients, seed, q, local), seconds
    guide = fedppl.PVIGuide(eh.model, eh.GLOBAL, family="fullrank")
    t0 = time.perf_counter()
    if name == "pvi":
        res = fedppl.PVI(eh.model, guide, elbo_samples=0).run(
            jax.random.key(seed), clients, args.pvi_rounds, progress_bar=False,
            n_groups=eh.n_groups())
    elif name == "ep":
        res = fedppl.EP(eh.model, guide).run(jax.random.key(seed), clients, args.ep_rounds,
                                             progress_bar=False, n_groups=eh.n_groups())
    else:  # the prior's Gaussian base, no local guides
        res = _carrying(clients, seed, None, None)
    return res, time.perf_counter() - t0


def _moments(mean, cov) -> dict:
    """A mean and covariance as the JSON's per-coordinate mean and sd."""
    return {"mean": np.asarray(mean).tolist(), "sd": np.sqrt(np.diag(np.asarray(cov))).tolist()}


def at_draws(state, draws: np.ndarray):
    """The sampler's first state with its particles at ``draws`` and its temperature 1."""
    theta = jax.numpy.asarray(draws, state.server.theta.dtype)
    centre, chol = fit(theta)
    return state._replace(server=state.server._replace(
        theta=theta, proposal=theta, beta=jax.numpy.ones_like(state.server.beta),
        centre=centre, chol=chol))


def sample(res, clients, seed: int, ref_mean, ref_sd, args, draws=None) -> dict:
    """``refine`` with the sampler's defaults, round by round: every round's row, and the
    final particles' errors beside the sampler's own Monte Carlo error (final: where the
    stopping rule fired, if it did; ``last``: the per-coordinate moments after the last round)."""
    settings = {"num_particles": args.particles, "islands": args.islands}
    if args.local_draws:
        settings["local_draws"] = args.local_draws
    if args.pool_steps is not None:
        settings["pool_steps"] = args.pool_steps
    settings.update(walk_settings(args))
    if args.inflate is not None:
        settings["inflate"] = args.inflate
    if args.independent is not None:
        settings["independent"] = args.independent
    smc = fedppl.SMC(eh.model, res.guide, res.q, local=res.local, **settings)
    rule = smc._tol_rule(None)
    state = smc.init(jax.random.key(100 + seed), clients, n_groups=eh.n_groups())
    if draws is not None:
        state = at_draws(state, draws)
    rows, done_at = [], None
    K = clients.num_clients
    for _ in range(args.rounds):
        state, info = smc.update(state)
        theta = np.asarray(state.server.theta, np.float64)
        me, se = errors(theta.mean(0), np.cov(theta.T), ref_mean, ref_sd)
        rows.append({"round": info["round"], "beta": info["beta"], "stage": info["stage"],
                     "ess": info["ess"], "khat": info["khat"], "accepted": info["accepted"],
                     "refreshed": info["refreshed"], "unique": info["unique"],
                     "local_sd": info["local_sd"],
                     "renewed": info["renewed"], "done": info["done"],
                     "bytes_up_per_client": info["bytes_up"] / K,
                     "bytes_down_per_client": info["bytes_down"] / K,
                     "seconds": info["seconds"], "mean_err": me, "sd_err": se})
        print(f"    round {info['round']}: beta {info['beta']:.3f} ess {info['ess']:.2f} "
              f"accepted {info['accepted']:.2f} renewed {info['renewed']:.2f} "
              f"errors {me:.3f} / {se:.3f} ({info['seconds']:.1f} s)", flush=True)
        if rule is not None and rule([info]) and done_at is None:
            done_at = info["round"]
            at_done = theta.copy()
            if not args.past_done:
                break
    result = smc._started(state).result(state, {k: np.asarray([r[k] for r in rows])
                                                for k in ("round", "beta")}, [])
    last = _moments(theta.mean(0), np.cov(theta.T))  # after the last round
    if done_at is not None and args.past_done:  # the answer the defaults give: at that round
        result.particles = at_done
    mc = result.mcse()
    moments = result.mean_and_cov()
    me, se = errors(*moments, ref_mean, ref_sd)
    return {"rounds": rows, "final": {
        "rounds": done_at or len(rows), "stopped_by_rule": done_at is not None,
        "reached": result.reached, "renewed": result.renewed, "local_sd": rows[-1]["local_sd"],
        "mean_err": me, "sd_err": se, **_moments(*moments), "last": last,
        "stated_mean_mcse": float(np.max(mc["mean"] / ref_sd)),
        "stated_sd_mcse": float(np.max(mc["sd"] / ref_sd)),
        "seconds_per_round": float(np.median([r["seconds"] for r in rows[1:]]))
        if len(rows) > 1 else float("nan"),
        "first_round_seconds": rows[0]["seconds"],
        "bytes_up_per_client_per_round": rows[-1]["bytes_up_per_client"],
        "bytes_down_per_client_per_round": rows[-1]["bytes_down_per_client"],
        "within_target": bool(me <= 0.1 and se <= 0.1),
        "first_round_within_target": next((r["round"] for r in rows
                                           if r["mean_err"] <= 0.1 and r["sd_err"] <= 0.1),
                                          None)}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--starts", default="pvi",
                    help="comma-separated: pvi, ep, prior; diagnostics: nuts (pooled NUTS's "
                         "Gaussian), draws (another NUTS run's draws, temperature 1)")
    ap.add_argument("--rounds", type=int, default=50, help="the sampler's rounds at most")
    ap.add_argument("--pvi-rounds", type=int, default=20)
    ap.add_argument("--ep-rounds", type=int, default=8)
    ap.add_argument("--particles", type=int, default=1000)
    ap.add_argument("--islands", type=int, default=10)
    ap.add_argument("--local-draws", type=int, default=0, help="0: the sampler's default")
    ap.add_argument("--pool-steps", type=int, default=None,
                    help="each particle's independence steps over its island's proposals per "
                         "round (default: the sampler's)")
    add_walk_options(ap)
    ap.add_argument("--independent", type=float, default=None,
                    help="the share of independence proposals (default: the sampler's)")
    ap.add_argument("--inflate", type=float, default=None,
                    help="the start's covariance times this (default: the sampler's)")
    ap.add_argument("--ref-warmup", type=int, default=1000)
    ap.add_argument("--ref-samples", type=int, default=2000)
    ap.add_argument("--past-done", action="store_true",
                    help="go on to --rounds after the sampler's own stopping rule fires (the "
                         "round it fired is recorded)")
    ap.add_argument("--save-starts", default=None,
                    help="a folder: save each start's q and local guides there")
    ap.add_argument("--load-starts", default=None,
                    help="a folder: take each start from there where saved (its seconds too)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default="benchmarks/results/smc_hierarchical.json")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.pvi_rounds, args.ep_rounds = 3, 2, 1
        args.particles, args.islands, args.local_draws = 200, 4, 8
        args.ref_warmup, args.ref_samples = 200, 200
    warnings.simplefilter("ignore", RuntimeWarning)  # PVI's round log (kept in its history)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    results: dict = {
        "command": " ".join(sys.argv), "date": date.today().isoformat(), "commit": commit,
        "settings": vars(args) | {"groups": eh.J, "inputs": eh.D, "clients": eh.K},
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(),
                    "device": str(jax.devices()[0]), "jax": jax.__version__,
                    "numpyro": numpyro.__version__},
        "seeds": []}
    t_all = time.perf_counter()

    def save():
        results["wall_seconds"] = time.perf_counter() - t_all
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(stamp(results), f, indent=1)

    for seed in range(args.first_seed, args.first_seed + args.seeds):
        pooled, _, clients = eh.simulate(seed)
        guide = fedppl.PVIGuide(eh.model, eh.GLOBAL, family="fullrank").setup(
            *clients.client(0), n_groups=eh.n_groups())
        t0 = time.perf_counter()
        ref = eh.pooled_nuts(pooled, guide, seed, args.ref_samples, args.ref_warmup)
        ref_mean, ref_sd = ref.mean(0), ref.std(0, ddof=1)
        run = {"seed": seed, "pooled_nuts_seconds": time.perf_counter() - t0,
               "reference": {"mean": ref_mean.tolist(), "sd": ref_sd.tolist()}, "starts": {}}
        results["seeds"].append(run)
        for name in args.starts.split(","):
            draws = None
            if name == "draws":  # a second pooled NUTS run: its draws are the particles
                other = eh.pooled_nuts(pooled, guide, seed + 1000, args.ref_samples,
                                       args.ref_warmup)
                rng = np.random.default_rng(seed)
                draws = other[rng.choice(len(other), args.particles, replace=False)]
            res, seconds = start_result(name, clients, seed, args,
                                        ref if draws is None else draws)
            if args.save_starts:  # the start's q and local guides, to run the sampler again
                Path(args.save_starts).mkdir(parents=True, exist_ok=True)
                with open(Path(args.save_starts) / f"{name}_seed{seed}.pkl", "wb") as f:
                    pickle.dump(jax.device_get((res.q, res.local, seconds)), f)
            moments = res.mean_and_cov()
            me, se = errors(*moments, ref_mean, ref_sd)
            print(f"seed {seed}, from {name} ({seconds:.0f} s): errors {me:.3f} / {se:.3f}",
                  flush=True)
            out = sample(res, clients, seed, ref_mean, ref_sd, args, draws)
            out["start"] = {"seconds": seconds, "mean_err": me, "sd_err": se,
                            **_moments(*moments)}
            run["starts"][name] = out
            save()
    save()
    print("\n| seed | start | start errors | rounds | reached, renewed | mean err (stated MC) "
          "| sd err | s/round | KB up / down per client per round |")
    print("|---|---|---|---|---|---|---|---|---|")
    for run in results["seeds"]:
        for name, out in run["starts"].items():
            f, s = out["final"], out["start"]
            print(f"| {run['seed']} | {name} | {s['mean_err']:.2f} / {s['sd_err']:.2f} | "
                  f"{f['rounds']} | {f['reached']}, {f['renewed']:.2f} | {f['mean_err']:.3f} "
                  f"({f['stated_mean_mcse']:.3f}) | {f['sd_err']:.3f} | "
                  f"{f['seconds_per_round']:.1f} | {f['bytes_up_per_client_per_round'] / 1e3:.0f} "
                  f"/ {f['bytes_down_per_client_per_round'] / 1e3:.0f} |")
    print(f"wrote {args.out} ({results['wall_seconds']:.0f} s)")


if __name__ == "__main__":
    main()
