"""Federated EP on a hierarchical logistic regression against pooled NUTS, PVI and one-shot
merges (issue "Federated EP", the hierarchical task).

Data: ep-stan's default simulation: J = 40 groups, D = 20 inputs (x ~ N(0, 1)), 20 observations
per group; each group has its own intercept and slopes, ``(alpha_j, beta_j) ~ N(mu, sigma^2)``
per coordinate, with ``mu`` (intercept mean and 20 slope means) and ``sigma`` (21 group scales)
global. Group ``j`` goes to client ``j % 25``: 25 clients, 15 with two groups and 10 with one
(each client renumbers its groups from 0; ``n_groups = 2`` everywhere, a client with one group
carries an effect no observation depends on, which fedppl marginalises out exactly).
``--inputs`` and ``--clients`` change D and K (``n_groups`` is then the most groups a client
holds).

Model (one signature for pooled NUTS and fedppl): ``mu ~ N(0, 1)`` (21), ``sigma ~ LogNormal(0,
1)`` (21: Gaussian in the unconstrained space, as :class:`fedppl.EP` needs), per group a
non-centred ``z_j ~ N(0, I_21)`` with coefficients ``mu + sigma * z_j``, ``y ~ Bernoulli(logits)``.

Reference: pooled NUTS (numpyro ``MCMC``, 4 chains x ``--ref-samples``, 1000 warm-up, diagonal
mass matrix: 882 coordinates) on all the data with ``n_groups = 40``. Errors over the 42 global
coordinates in the unconstrained space, ``(mu, log sigma)``:

* ``mean_err``: the worst ``|mean_q - mean_ref| / sd_ref``;
* ``sd_err``: the worst ``|sd_q / sd_ref - 1|``.

The issue's target for EP: mean_err <= 0.1 and sd_err <= 0.1.

Methods: ``EP`` (:class:`fedppl.EP`, full-rank sites, synchronous, default decaying damping, NUTS
tilted distributions over each client's ``(theta, z_k)``: 42 + 42 coordinates), also with the
average of q's natural parameters over its last 5 rounds (``EP avg5``); ``PVI``
(:class:`fedppl.PVI` with a full-rank guide and its defaults: sequential, damping 1,
natural-gradient local step, each client's joint Gaussian over ``(theta, z_k)``); the
one-shot ``consensus`` and ``parametric`` merges of the clients' subposteriors
``p(theta)^(1/K) p(y_k | theta)`` (:class:`fedppl.OneShot`: the prior's Gaussian in the
unconstrained space to the power ``1 / K``, sampled by the same NUTS as EP's tilted
distributions, local sites jointly; the committed JSON's merges were measured with an earlier
hand-written call of numpyro's ``hmc_util`` merges on the same subposterior draws).

EP's settings default to fedppl's (Stein's estimator, 4 x 500 draws after 300 warm-up steps,
``max_rhat`` 1.05, two extensions); ``--init-pvi N`` starts EP from N PVI rounds. The one-shot
merges run with ``max_rhat=inf``; when most subposteriors did not mix, ``OneShot`` refuses and
the refusal is recorded. The measured tables and what they show are on the ep_hierarchical
benchmark page of the docs.

Run::

    python benchmarks/ep_hierarchical.py --rounds 8 --no-pvi       # EP defaults, from the prior
    python benchmarks/ep_hierarchical.py --rounds 8 --no-pvi --no-merges --init-pvi 4
    python benchmarks/ep_hierarchical.py --inputs 2 --clients 5 --no-pvi --no-merges
    python benchmarks/ep_hierarchical.py --quick          # a smoke run (2 rounds, few draws)

Prints a table and writes JSON to ``--out`` (default benchmarks/results/ep_hierarchical.json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from numpyro.infer import MCMC, NUTS

import fedppl
from fedppl.families import gaussian as g

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _provenance import stamp
from ep_vs_pvi import averaged, curve, errors

BENCHMARK = {
    "summary": ("federated EP on a hierarchical logistic regression (J = 40 groups, D = 20, K = "
                "25) against pooled NUTS, PVI and one-shot merges, round by round"),
    "data": None,
    "quick": ["--quick", "--inputs", "2", "--clients", "5", "--no-merges"],
    "full": [[],
             ["--rounds", "8", "--no-pvi", "--out",
              "benchmarks/results/ep_hierarchical_defaults.json"],
             ["--rounds", "8", "--no-pvi", "--no-merges", "--init-pvi", "4", "--out",
              "benchmarks/results/ep_hierarchical_defaults_initpvi.json"]],
    "cost": "quick ~1 min (D = 2, K = 5); full ~35 min per file",
}

jax.config.update("jax_enable_x64", True)

J, D, N_PER_GROUP, K = 40, 20, 20, 25  # --inputs and --clients change D and K
GLOBAL = ("mu", "sigma")


def n_groups() -> int:
    """Each client's number of group slots: the most groups any client holds."""
    return -(-J // K)


def model(X, gid, y=None, *, n_groups):
    """Hierarchical logistic regression, random intercept and slopes, non-centred."""
    P = X.shape[1] + 1
    mu = numpyro.sample("mu", dist.Normal(0.0, 1.0).expand([P]).to_event(1))
    sigma = numpyro.sample("sigma", dist.LogNormal(0.0, 1.0).expand([P]).to_event(1))
    with numpyro.plate("groups", n_groups):
        z = numpyro.sample("z", dist.Normal(0.0, 1.0).expand([P]).to_event(1))
    coef = mu + sigma * z  # (n_groups, P): intercept, then slopes
    c = coef[gid]
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=c[:, 0] + jnp.sum(X * c[:, 1:], -1)), obs=y)


def simulate(seed: int):
    """The pooled data (X, gid, y), the true global values, and the clients."""
    rng = np.random.default_rng(seed)
    P = D + 1
    mu = np.concatenate([[0.3], rng.normal(0.0, 0.5, D)])
    sigma = np.concatenate([[1.0], np.exp(rng.normal(np.log(0.5), 0.25, D))])
    coef = mu + sigma * rng.normal(size=(J, P))
    gid = np.repeat(np.arange(J), N_PER_GROUP)
    X = rng.normal(size=(J * N_PER_GROUP, D))
    f = coef[gid, 0] + np.sum(X * coef[gid, 1:], 1)
    y = (rng.uniform(size=len(f)) < 1 / (1 + np.exp(-f))).astype(float)
    parts = []
    for k in range(K):
        groups = [j for j in range(J) if j % K == k]
        rows = np.isin(gid, groups)
        local = np.searchsorted(groups, gid[rows])  # renumbered 0..n_k - 1
        parts.append((X[rows], local, y[rows]))
    return (X, gid, y), {"mu": mu, "sigma": sigma}, fedppl.Clients.from_list(parts)


def unconstrained(guide: fedppl.PVIGuide, draws: dict) -> np.ndarray:
    """Draws of the global sites as the guide's flat unconstrained vectors (log sigma)."""
    layout = guide.layout_or_raise()
    n = len(next(iter(draws.values())))
    cols = []
    for s in layout.sites:
        v = np.asarray(draws[s.name]).reshape(n, -1)
        cols.append(np.log(v) if s.name == "sigma" else v)
    return np.concatenate(cols, 1)


def pooled_nuts(pooled, guide, seed: int, num_samples: int, num_warmup: int) -> np.ndarray:
    X, gid, y = pooled
    mcmc = MCMC(NUTS(model), num_warmup=num_warmup, num_samples=num_samples, num_chains=4,
                chain_method="sequential", progress_bar=False)
    mcmc.run(jax.random.key(1000 + seed), X, gid, y, n_groups=J,
             extra_fields=("diverging", "num_steps"))
    extra = mcmc.get_extra_fields()
    print(f"pooled NUTS: {int(np.sum(extra['diverging']))} divergences, mean tree size "
          f"{float(np.mean(extra['num_steps'])):.0f}", flush=True)
    return unconstrained(guide, mcmc.get_samples())


def merges(clients, num_warmup, num_samples, num_chains, seed, ref_mean, ref_sd):
    """The one-shot consensus and parametric merges (:class:`fedppl.OneShot`, one sampled run:
    consensus is its q, parametric the product of its sites). Every client's subposterior
    enters, mixed or not (``max_rhat=inf``), as numpyro's merges take them."""
    shot = fedppl.OneShot(model, fedppl.PVIGuide(model, GLOBAL, family="fullrank"), "consensus",
                          num_warmup=num_warmup, num_samples=num_samples, num_chains=num_chains,
                          max_rhat=float("inf"))
    t0 = time.perf_counter()
    try:
        res = shot.run(jax.random.key(seed), clients, n_groups=n_groups())
    except RuntimeError as e:  # most subposteriors did not mix: OneShot refuses to merge them
        return {"refused": {"message": str(e), "seconds": time.perf_counter() - t0}}
    seconds = time.perf_counter() - t0
    rhat = float(np.nanmax(res.history["rhat"]))
    sites = jax.tree_util.tree_map(lambda x: x.sum(0), res.factors)
    return {name: dict(zip(("mean_err", "sd_err"), errors(*g.to_moments(q), ref_mean, ref_sd),
                           strict=True), seconds=seconds, max_rhat=rhat)
            for name, q in (("parametric", g.product(shot.guide.prior, sites)),
                            ("consensus", res.q))}


def main() -> None:
    global D, K
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--inputs", type=int, default=D, help="D, the inputs (ep-stan's 20)")
    ap.add_argument("--clients", type=int, default=K, help="K, the clients (25)")
    ap.add_argument("--first-seed", type=int, default=0, help="seeds first-seed, ...")
    ap.add_argument("--rounds", type=int, default=20, help="EP's rounds")
    ap.add_argument("--pvi-rounds", type=int, default=None, help="PVI's (default: --rounds)")
    ap.add_argument("--num-warmup", type=int, default=300, help="EP's NUTS (fedppl's default)")
    ap.add_argument("--num-samples", type=int, default=500, help="EP's NUTS (fedppl's default)")
    ap.add_argument("--num-chains", type=int, default=4)
    ap.add_argument("--damping", default="decaying",
                    help="EP's damping: 'decaying' (fedppl's default, ep-stan's schedule: 0.5 "
                         "towards min(1/K, 0.2) = 0.04) or a number in (0, 1]")
    ap.add_argument("--estimator", default="stein", choices=("sample", "stein"),
                    help="EP's tilted-moment estimator (fedppl's default: stein)")
    ap.add_argument("--extensions", type=int, default=2,
                    help="EP: extra sampler stages for a client whose chains did not mix "
                         "(fedppl's default 2)")
    ap.add_argument("--max-rhat", type=float, default=1.05,
                    help="EP: a client whose tilted r-hat exceeds this skips its update "
                         "(fedppl's default 1.05; inf: every client updates)")
    ap.add_argument("--merge-warmup", type=int, default=None, help="default: --num-warmup")
    ap.add_argument("--merge-samples", type=int, default=None, help="default: --num-samples")
    ap.add_argument("--ref-warmup", type=int, default=1000)
    ap.add_argument("--ref-samples", type=int, default=2000)
    ap.add_argument("--init-pvi", type=int, default=0, metavar="N",
                    help="start EP from the factors of N rounds of PVI with local latent sites "
                         "(0: from the prior)")
    ap.add_argument("--no-pvi", action="store_true")
    ap.add_argument("--no-merges", action="store_true")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default="benchmarks/results/ep_hierarchical.json")
    args = ap.parse_args()
    D, K = args.inputs, args.clients
    if args.quick:
        args.rounds, args.num_warmup, args.num_samples = 2, 100, 100
        args.ref_warmup, args.ref_samples = 200, 200
    args.pvi_rounds = args.rounds if args.pvi_rounds is None else args.pvi_rounds
    args.merge_warmup = args.num_warmup if args.merge_warmup is None else args.merge_warmup
    args.merge_samples = args.num_samples if args.merge_samples is None else args.merge_samples
    warnings.simplefilter("ignore", RuntimeWarning)  # the round log's notes, kept in the JSON
    results: dict = {
        "settings": vars(args) | {"groups": J, "inputs": D, "per_group": N_PER_GROUP,
                                  "clients": K},
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(),
                    "jax": jax.__version__, "numpyro": numpyro.__version__,
                    "float64": bool(jax.config.jax_enable_x64)},
        "seeds": []}
    t_all = time.perf_counter()

    def save():  # after every method: a partial run leaves its numbers
        results["wall_seconds"] = time.perf_counter() - t_all
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(stamp(results), f, indent=1)

    for seed in range(args.first_seed, args.first_seed + args.seeds):
        pooled, truth, clients = simulate(seed)
        guide = fedppl.PVIGuide(model, GLOBAL, family="fullrank").setup(*clients.client(0),
                                                                         n_groups=n_groups())
        assert [s.name for s in guide.layout_or_raise().sites] == list(GLOBAL)
        t0 = time.perf_counter()
        ref = pooled_nuts(pooled, guide, seed, args.ref_samples, args.ref_warmup)
        ref_seconds = time.perf_counter() - t0
        ref_mean, ref_sd = ref.mean(0), ref.std(0, ddof=1)
        run: dict = {"seed": seed, "pooled_nuts_seconds": ref_seconds,
                     "truth": {k: v.tolist() for k, v in truth.items()},
                     "reference": {"mean": ref_mean.tolist(), "sd": ref_sd.tolist()},
                     "methods": {}, "merges": {}}
        results["seeds"].append(run)
        P = D + 1
        print(f"seed {seed}: pooled NUTS {ref_seconds:.0f} s; posterior sd of mu "
              f"{ref_sd[:P].min():.2f}-{ref_sd[:P].max():.2f}, of log sigma "
              f"{ref_sd[P:].min():.2f}-{ref_sd[P:].max():.2f}", flush=True)
        if not args.no_merges:
            run["merges"] = merges(clients, args.merge_warmup, args.merge_samples,
                                   args.num_chains, seed, ref_mean, ref_sd)
            print("  merges:", run["merges"], flush=True)
            save()
        method = fedppl.EP(model, fedppl.PVIGuide(model, GLOBAL, family="fullrank"),
                           num_warmup=args.num_warmup, num_samples=args.num_samples,
                           num_chains=args.num_chains, max_rhat=args.max_rhat,
                           estimator=args.estimator, extensions=args.extensions,
                           damping=(args.damping if args.damping == "decaying"
                                    else float(args.damping)))
        start = None
        if args.init_pvi:
            pvi = fedppl.PVI(model, fedppl.PVIGuide(model, GLOBAL, family="fullrank"),
                             elbo_samples=0)
            t0 = time.perf_counter()
            start = pvi.run(jax.random.key(seed), clients, args.init_pvi, progress_bar=False,
                            n_groups=n_groups()).factors
            run["init_pvi_seconds"] = time.perf_counter() - t0
            print(f"  EP starts from {args.init_pvi} PVI rounds "
                  f"({run['init_pvi_seconds']:.0f} s)", flush=True)
        rows, last = curve(method, clients, args.rounds, seed, ref_mean, ref_sd, keep=5,
                           factors=start, name="EP", n_groups=n_groups())
        run["methods"]["EP"] = rows
        m_last, c_last = g.to_moments(last[-1])  # which coordinates are off, in sd
        sd_last = np.sqrt(np.diag(np.asarray(c_last)))
        run["ep_last"] = {"mean": np.asarray(m_last).tolist(), "sd": sd_last.tolist()}
        ratio = sd_last / ref_sd
        print(f"  EP's last sd / pooled NUTS sd: mu {ratio[:P].min():.2f}-{ratio[:P].max():.2f}, "
              f"log sigma {ratio[P:].min():.2f}-{ratio[P:].max():.2f}", flush=True)
        me, se = errors(*averaged(last), ref_mean, ref_sd)
        run["methods"]["EP avg5"] = [{"round": rows[-1]["round"], "mean_err": me,
                                      "sd_err": se, "seconds": float("nan")}]
        save()
        if not args.no_pvi:
            pvi = fedppl.PVI(model, fedppl.PVIGuide(model, GLOBAL, family="fullrank"),
                             elbo_samples=0)
            run["methods"]["PVI"] = curve(pvi, clients, args.pvi_rounds, seed, ref_mean,
                                          ref_sd, name="PVI", n_groups=n_groups())[0]
            save()
        table(run, args)
    save()
    print(f"wrote {args.out} ({results['wall_seconds']:.0f} s)")


def table(run: dict, args) -> None:
    print(f"\nseed {run['seed']}: J = {J} groups, D = {D}, {N_PER_GROUP} obs/group, K = {K} "
          f"clients; EP {args.num_chains} x {args.num_samples} draws ({args.num_warmup} warm-up) "
          f"per client, damping {args.damping}, max r-hat {args.max_rhat}; "
          f"pooled NUTS 4 x {args.ref_samples} "
          f"({run['pooled_nuts_seconds']:.0f} s)")
    print("| method | round | worst mean err (sd) | worst sd err | s/round (median, excl. 1st) "
          "| updates applied | clients extended |")
    print("|---|---|---|---|---|---|---|")
    for name, rows in run["methods"].items():
        secs = np.median([r["seconds"] for r in rows[1:]]) if len(rows) > 1 else float("nan")
        first_ok = next((r["round"] for r in rows if r["mean_err"] <= 0.1
                         and r["sd_err"] <= 0.1), None)
        for row in [r for r in rows if r["round"] in (1, 2, 5, 10, 15) or r is rows[-1]]:
            applied = (f"{row['clients_mixed']}/{row['clients_active']}"
                       if "clients_active" in row else "")
            print(f"| {name} | {row['round']} | {row['mean_err']:.3f} | {row['sd_err']:.3f} | "
                  f"{secs:.2f} | {applied} | {row.get('clients_extended', '')} |")
        print(f"| {name}: first round within 0.1 / 10% | {first_ok} | | | | | |")
    for name, m in run["merges"].items():
        if name == "refused":
            print(f"| one-shot merges: refused ({m['seconds']:.0f} s) | | | | |\n{m['message']}")
            continue
        print(f"| {name} (one shot; {args.num_chains} x {args.merge_samples}) | - | "
              f"{m['mean_err']:.3f} | {m['sd_err']:.3f} | {m['seconds']:.1f} (total) |")


if __name__ == "__main__":
    main()
