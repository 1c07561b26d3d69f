"""The federated SMC sampler (``result.refine(key, clients)``: the sampler where the model has
local sites or the check flags ``q``) beside PVI, against pooled NUTS, on tasks other than the
hierarchical logistic regression of ``smc_hierarchical.py``:

* ``breast-cancer``: ``ep_vs_pvi.py``'s Bayesian logistic regression (D = 31, the 80% training
  split homogeneously over ``--clients`` K = 10 or 100), PVI full rank (synchronous, damping
  0.5, 20 rounds), then ``refine(method="smc")`` (no local sites: exact log-likelihoods). The
  target: within the reference's own Monte Carlo error;
* ``funnels``: classic centred and non-centred hierarchical models with weakly identified
  scales, eight-schools-like data (16 groups, each two observations with a known sd between 13
  and 25: as informative as eight schools' one with sd 9 to 18), the groups on clients holding
  one or two each: ``mu ~ N(0, 5)``, ``tau ~
  HalfCauchy(5)`` or ``LogNormal(1, 1)``, ``theta_j ~ N(mu, tau)`` (centred) or ``theta_j = mu
  + tau eta_j``, ``eta_j ~ N(0, 1)`` (non-centred), ``y_j ~ N(theta_j, sigma_j)``; the group
  effects local. PVI full rank (the defaults, 30 rounds), then ``refine`` with its defaults.
  The target: within 0.1 sd and 10% of NUTS in ``(mu, log tau)``.

References: pooled NUTS (numpyro, 4 chains; the funnels' reference on the non-centred model,
whose posterior of ``(mu, tau)`` is the same, with ``target_accept_prob`` 0.95). Reported per
task: PVI's errors, the sampler's errors beside its own Monte Carlo error, rounds, seconds per
round, and the reference's Monte Carlo error (``sd_ref / sqrt(ESS)``, the worst coordinate).

Run::

    python benchmarks/smc_breadth.py --tasks breast-cancer --clients 10
    python benchmarks/smc_breadth.py --tasks breast-cancer --clients 100 \\
        --out benchmarks/results/smc_breadth_k100.json
    python benchmarks/smc_breadth.py --tasks funnels --out benchmarks/results/smc_funnels.json
    python benchmarks/smc_breadth.py --gradient --out benchmarks/results/smc_breadth_gradient.json
    python benchmarks/smc_breadth.py --gradient --persistence 0.97 --uniform-step 0.05 \
        --rw-target 0.5 --out benchmarks/results/smc_breadth_persistence.json
    python benchmarks/smc_breadth.py --quick

Prints a table and writes JSON to ``--out`` (default benchmarks/results/smc_breadth.json).
"""

from __future__ import annotations

import argparse
import json
import os
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
import numpyro.distributions as dist
from numpyro.diagnostics import effective_sample_size
from numpyro.infer import MCMC, NUTS

import fedppl

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ep_vs_pvi as bc
from _provenance import stamp
from _walk_options import add_walk_options, walk_settings

BENCHMARK = {
    "summary": ("the federated SMC sampler beside PVI against pooled NUTS on breast cancer (K = "
                "10, 100) and on centred and non-centred funnels"),
    "data": None,
    "quick": ["--quick", "--tasks", "breast-cancer"],
    "full": [[],
             ["--tasks", "breast-cancer", "--clients", "100", "--out",
              "benchmarks/results/smc_breadth_k100.json"],
             ["--gradient", "--out", "benchmarks/results/smc_breadth_gradient.json"],
             ["--gradient", "--persistence", "0.97", "--uniform-step", "0.05", "--rw-target",
              "0.5", "--out", "benchmarks/results/smc_breadth_persistence.json"]],
    "cost": "quick ~1 min (breast cancer); full ~10 min",
}

jax.config.update("jax_enable_x64", True)

# eight schools' standard errors, twice over (16 groups)
SIGMA = np.array([15.0, 10.0, 16.0, 11.0, 9.0, 11.0, 10.0, 18.0] * 2)


def funnel(gid, sigma, y=None, *, n_groups, scale="halfcauchy", centred=True):
    """Random effects with a weakly identified scale (``scale``: ``"halfcauchy"`` or
    ``"lognormal"``), centred or non-centred."""
    mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
    prior = dist.HalfCauchy(5.0) if scale == "halfcauchy" else dist.LogNormal(1.0, 1.0)
    tau = numpyro.sample("tau", prior)
    with numpyro.plate("groups", n_groups):
        if centred:
            theta = numpyro.sample("theta", dist.Normal(mu, tau))
        else:
            theta = mu + tau * numpyro.sample("eta", dist.Normal(0.0, 1.0))
    with numpyro.plate("data", gid.shape[0]):
        numpyro.sample("y", dist.Normal(theta[gid], sigma), obs=y)


def funnel_data(seed: int, per_client: int):
    """16 groups, two observations each (sd ``SIGMA * sqrt(2)``), on 16 / per_client clients
    (groups numbered from 0 on each client)."""
    rng = np.random.default_rng(seed)
    J = len(SIGMA)
    theta = 4.0 + 5.0 * rng.normal(size=J)
    gid = np.repeat(np.arange(J), 2)
    sigma = np.sqrt(2.0) * SIGMA[gid]
    y = theta[gid] + sigma * rng.normal(size=2 * J)
    parts = []
    for k in range(J // per_client):
        rows = (gid >= k * per_client) & (gid < (k + 1) * per_client)
        parts.append((gid[rows] - k * per_client, sigma[rows], y[rows]))
    return (gid, sigma, y), fedppl.Clients.from_list(parts)


def unconstrained_mu_tau(draws: dict) -> np.ndarray:
    return np.stack([np.asarray(draws["mu"]), np.log(np.asarray(draws["tau"]))], 1)


def reference(model, args_, kwargs, num_samples: int, seed: int, to_flat) -> tuple:
    mcmc = MCMC(NUTS(model, target_accept_prob=0.95, dense_mass=True), num_warmup=1000,
                num_samples=num_samples, num_chains=4, chain_method="sequential",
                progress_bar=False)
    mcmc.run(jax.random.key(1000 + seed), *args_, **kwargs)
    draws = to_flat(mcmc.get_samples())
    ess = np.asarray(effective_sample_size(draws.reshape(4, -1, draws.shape[1])))
    return draws.mean(0), draws.std(0, ddof=1), ess


def scores(mean, cov, ref_mean, ref_sd, ref_ess, mcse=None) -> dict:
    me, se = bc.errors(mean, cov, ref_mean, ref_sd)
    out = {"mean_err": me, "sd_err": se,
           "reference_mc": float(np.max(1 / np.sqrt(ref_ess)))}  # in reference sds
    if mcse is not None:
        mc = np.sqrt(mcse["mean"] ** 2 + ref_sd**2 / ref_ess)
        z = np.abs(np.asarray(mean) - ref_mean) / mc
        out.update(stated_mean_mcse=float(np.max(mcse["mean"] / ref_sd)),
                   worst_z=float(z.max()), within_mc=bool(z.max() <= 3))
    return out


def sampled(res, clients, seed: int, ref, args, **model_kwargs) -> dict:
    """``refine`` with the defaults (the sampler is forced where it would not be chosen, to
    measure it): its errors, its own Monte Carlo error, rounds, seconds."""
    extra = walk_settings(args)  # refine passes them on to the sampler
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UserWarning)
        out = res.refine(jax.random.key(100 + seed), clients, num_rounds=args.rounds,
                         progress_bar=False, **extra, **model_kwargs)
        forced = not hasattr(out, "particles")
        if forced:  # the check passed q: the importance refinement was chosen; measure both
            imp = out
            out = res.refine(jax.random.key(100 + seed), clients, num_rounds=args.rounds,
                             method="smc", progress_bar=False, **extra, **model_kwargs)
    wall = time.perf_counter() - t0
    h = out.history
    row = scores(*out.mean_and_cov(), *ref, mcse=out.mcse())
    row.update(rounds=out.num_rounds, reached=out.reached, renewed=out.renewed,
               chosen=out.chosen or "forced (the check passed q)", wall_seconds=wall,
               seconds_per_round=float(np.median(h["seconds"][1:])) if out.num_rounds > 1
               else float(h["seconds"][0]),
               bytes_up_per_client_per_round=float(h["bytes_up"][-1]) / clients.num_clients,
               bytes_down_per_client_per_round=float(h["bytes_down"][-1]) / clients.num_clients,
               stages=int(h["stage"][-1]), local_sd=out.local_sd,
               warnings=[str(w.message)[:200] for w in caught])
    if forced:
        row["importance"] = scores(*imp.mean_and_cov(), *ref)
        row["importance"].update(khat=imp.khat, rounds=imp.num_rounds)
    return row


def breast_cancer(args) -> dict:
    X, y, _, clients = bc.load(args.clients, args.seed)
    guide = fedppl.PVIGuide(bc.model, family="fullrank").setup(*clients.client(0))
    t0 = time.perf_counter()
    ref = reference(bc.model, (X, y), {}, args.ref_samples, args.seed,
                    lambda d: bc.flat(guide, d))
    out = {"task": f"breast cancer, K = {args.clients}", "reference_seconds":
           time.perf_counter() - t0}
    pvi = fedppl.PVI(bc.model, fedppl.PVIGuide(bc.model, family="fullrank"), "synchronous",
                     0.5, elbo_samples=0)
    res = pvi.run(jax.random.key(args.seed), clients, num_rounds=args.pvi_rounds,
                  progress_bar=False)
    out["pvi"] = scores(*res.mean_and_cov(), *ref)
    out["smc"] = sampled(res, clients, args.seed, ref, args)
    return out


def funnels(args) -> list[dict]:
    rows = []
    for scale in ("halfcauchy", "lognormal"):
        for centred in (True, False):
            for per_client in (1, 2):
                pooled, clients = funnel_data(args.seed, per_client)
                kw = {"scale": scale, "centred": centred}
                t0 = time.perf_counter()
                ref = reference(funnel, pooled, {"n_groups": len(SIGMA), "scale": scale,
                                                 "centred": False},
                                args.ref_samples, args.seed, unconstrained_mu_tau)
                ref_seconds = time.perf_counter() - t0
                local = ("theta",) if centred else ("eta",)
                guide = fedppl.PVIGuide(funnel, local_sites=local, family="fullrank")
                res = fedppl.PVI(funnel, guide).run(
                    jax.random.key(args.seed), clients, args.pvi_rounds, progress_bar=False,
                    n_groups=per_client, **kw)
                row = {"task": f"{'centred' if centred else 'non-centred'} {scale}, "
                               f"{per_client} group(s) per client",
                       "scale": scale, "centred": centred, "groups_per_client": per_client,
                       "reference_seconds": ref_seconds,
                       "pvi": scores(*res.mean_and_cov(), *ref)}
                row["smc"] = sampled(res, clients, args.seed, ref, args)
                print(f"  {row['task']}: PVI {row['pvi']['mean_err']:.2f} / "
                      f"{row['pvi']['sd_err']:.2f}, SMC {row['smc']['mean_err']:.3f} / "
                      f"{row['smc']['sd_err']:.3f} ({row['smc']['rounds']} rounds)", flush=True)
                rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", default="breast-cancer,funnels")
    ap.add_argument("--clients", type=int, default=10, help="K for breast cancer")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pvi-rounds", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=50, help="the sampler's rounds at most")
    ap.add_argument("--ref-samples", type=int, default=5000)
    add_walk_options(ap)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default="benchmarks/results/smc_breadth.json")
    args = ap.parse_args()
    if args.quick:
        args.pvi_rounds, args.rounds, args.ref_samples = 3, 4, 300
    warnings.simplefilter("ignore", RuntimeWarning)  # PVI's round log (kept in its history)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    results: dict = {
        "command": " ".join(sys.argv), "date": date.today().isoformat(), "commit": commit,
        "settings": vars(args),
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(),
                    "device": str(jax.devices()[0]), "jax": jax.__version__,
                    "numpyro": numpyro.__version__},
        "rows": []}
    t_all = time.perf_counter()

    def save():
        results["wall_seconds"] = time.perf_counter() - t_all
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(stamp(results), f, indent=1)

    tasks = args.tasks.split(",")
    if "breast-cancer" in tasks:
        results["rows"].append(breast_cancer(args))
        save()
    if "funnels" in tasks:
        results["rows"].extend(funnels(args))
        save()
    save()
    print("\n| task | PVI mean / sd err | sampler mean / sd err (its MC error) | reference MC "
          "| rounds | s/round | chosen |")
    print("|---|---|---|---|---|---|---|")
    for r in results["rows"]:
        p, s = r["pvi"], r["smc"]
        print(f"| {r['task']} | {p['mean_err']:.3f} / {p['sd_err']:.3f} | {s['mean_err']:.3f} / "
              f"{s['sd_err']:.3f} ({s['stated_mean_mcse']:.3f}) | {s['reference_mc']:.3f} | "
              f"{s['rounds']} | {s['seconds_per_round']:.2f} | {s['chosen'][:40]} |")
    print(f"wrote {args.out} ({results['wall_seconds']:.0f} s)")


if __name__ == "__main__":
    main()
