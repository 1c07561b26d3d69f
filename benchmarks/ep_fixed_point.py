"""Where EP's fixed point sits on a hierarchical scale, with exact tilted moments (issue
"Federated EP", the hierarchical task).

``benchmarks/ep_hierarchical.py`` finds fedppl's EP on the hierarchical logistic regression
13-17% too narrow in its weakest group scale from five clients on, and exact with one client. This
script asks whether that is the sampler or EP itself. It removes the sampler: the model has two
global coordinates, so each tilted distribution's mean and covariance are computed by quadrature
on a dense grid (:class:`QuadratureTilted`, a :class:`~fedppl.algorithms.ep.TiltedSolver` that
:class:`fedppl.EP` runs in place of NUTS, through the same client step, server, damping and
round log). The exact posterior comes from the same grid on the pooled data.

Model: Gaussian random intercepts with the group effects integrated out. Group ``j`` has ``n``
observations of noise sd ``s``; its mean ``ybar_j ~ N(mu, sigma^2 + s^2 / n)``, with ``mu ~ N(0,
1)`` and ``sigma ~ LogNormal(0, 1)`` (Gaussian in ``log sigma``, the unconstrained coordinate
EP's sites live in). ``J`` groups, homogeneously split over ``K`` clients (one site each). With
``s^2 / n`` about 0.25 a group mean is as informative as 20 logistic observations.

Errors are those of ``ep_hierarchical.py``, over ``(mu, log sigma)``: ``mean_err`` the worst
``|mean_q - mean| / sd``, ``sd_ratio`` of ``log sigma`` (the weakly identified scale) and of
``mu``.

Run::

    python benchmarks/ep_fixed_point.py                  # K = 1, 2, 5, 10, 25, 40; 3 sigmas
    python benchmarks/ep_fixed_point.py --nuts 25        # also fedppl.EP with NUTS at K = 25
                                                         # (--nuts-sigmas; both estimators)

Prints a table and writes JSON to ``--out`` (default benchmarks/results/ep_fixed_point.json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist

import fedppl
from fedppl.algorithms import ep
from fedppl.families import gaussian as g

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _provenance import stamp
from ep_vs_pvi import errors as worst_errors

BENCHMARK = {
    "summary": ("where EP's fixed point sits on a hierarchical scale with exact tilted moments "
                "(no sampler), against K and the group scale; optionally fedppl.EP with NUTS"),
    "data": None,
    "quick": ["--clients", "1", "5", "--rounds", "20"],
    "full": [["--nuts", "25"]],
    "cost": "quick ~1 min; full ~20 min",
}

jax.config.update("jax_enable_x64", True)


def model(X, y=None):
    """Group means ``y`` with their sampling variances ``X[:, 0]``; random intercepts
    integrated out."""
    mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
    sigma = numpyro.sample("sigma", dist.LogNormal(0.0, 1.0))
    with numpyro.plate("groups", X.shape[0]):
        numpyro.sample("y", dist.Normal(mu, jnp.sqrt(sigma**2 + X[:, 0])), obs=y)


def grid_moments(log_density, centre, sd, points: int, width: float):
    """Mean and covariance of ``exp(log_density)`` on a ``points x points`` grid spanning
    ``centre +- width * sd``, and the largest share of its mass on the grid's border (how far
    the box cuts the tails off)."""
    u = jnp.linspace(-width, width, points)
    a, b = jnp.meshgrid(u, u, indexing="ij")
    pts = centre + jnp.stack([a.ravel(), b.ravel()], 1) * sd
    logp = jax.vmap(log_density)(pts)
    w = jax.nn.softmax(logp)
    mean = w @ pts
    c = pts - mean
    cov = (c * w[:, None]).T @ c
    w2 = w.reshape(points, points)
    edge = jnp.max(jnp.stack([w2[0].sum(), w2[-1].sum(), w2[:, 0].sum(), w2[:, -1].sum()]))
    return mean, cov, edge


class QuadratureTilted(NamedTuple):
    """The tilted moments of a two-coordinate model by quadrature: a grid over ``q``'s mean
    +- ``width`` of its sds per coordinate. Exact to the grid's resolution, no Monte Carlo."""

    model: object
    guide: fedppl.PVIGuide
    points: int = 401
    width: float = 12.0
    max_rhat: float = float("inf")

    def moments(self, cavity, q, data, mask, rng_key, alpha=1.0, local=None):
        log_f = ep.log_factor(self.model, self.guide, data, mask, alpha)
        m, S = g.to_moments(g.to_full(q))
        mean, cov, _ = grid_moments(lambda t: g.log_prob(cavity, t) + log_f(t), m,
                                    jnp.sqrt(jnp.diagonal(S)), self.points, self.width)
        nan = jnp.full((), jnp.nan, mean.dtype)
        return ep.TiltedMoments(g.FullGaussian.from_moments(mean, cov), nan, nan, nan,
                                jnp.asarray(0))


class QuadratureEP(fedppl.EP):
    """:class:`fedppl.EP` with :class:`QuadratureTilted` in place of NUTS."""

    def _solver(self, clients, model, model_kwargs):
        guide, share = self._prepare(clients, model_kwargs)
        if share is not None:
            raise ValueError("the quadrature solver needs a Gaussian prior in the unconstrained "
                             "space")
        self._ep_solver = QuadratureTilted(model, guide)
        return self._ep_solver, None


def simulate(J: int, sigma: float, noise_var: float, seed: int):
    rng = np.random.default_rng(seed)
    mu = 0.3
    ybar = mu + sigma * rng.normal(size=J) + np.sqrt(noise_var) * rng.normal(size=J)
    return np.full((J, 1), noise_var), ybar


def exact_posterior(X, y, guide):
    """Mean and covariance of the pooled posterior over ``(mu, log sigma)``, by quadrature:
    a coarse grid over the prior finds it, a fine one measures it."""
    pooled = fedppl.partition.homogeneous(X, y, num_clients=1, seed=0)
    data = tuple(a[0] for a in pooled.stacked)
    log_f = ep.log_factor(model, guide, data, pooled.mask[0])
    prior = guide.prior_or_raise()

    def log_post(t):
        return g.log_prob(prior, t) + log_f(t)

    mean, cov, _ = grid_moments(log_post, jnp.zeros(2), jnp.ones(2), 801, 8.0)
    mean, cov, edge = grid_moments(log_post, mean, jnp.sqrt(jnp.diagonal(cov)), 801, 12.0)
    return np.asarray(mean), np.asarray(cov), float(edge)


def errors(q_mean, q_cov, mean, cov) -> dict:
    """``ep_vs_pvi.py``'s worst mean error, and each coordinate's sd ratio."""
    sd, sd_q = np.sqrt(np.diag(cov)), np.sqrt(np.diag(q_cov))
    return {"mean_err": worst_errors(q_mean, q_cov, mean, sd)[0],
            "sd_ratio_mu": float(sd_q[0] / sd[0]), "sd_ratio_log_sigma": float(sd_q[1] / sd[1]),
            "mean_err_log_sigma": float((q_mean[1] - mean[1]) / sd[1])}


def run_ep(ep_obj, X, y, K: int, rounds: int, seed: int):
    clients = fedppl.partition.homogeneous(X, y, num_clients=K, seed=seed)
    t0 = time.perf_counter()
    res = ep_obj.run(jax.random.key(seed), clients, num_rounds=rounds, progress_bar=False)
    m, S = res.mean_and_cov()
    return np.asarray(m), np.asarray(S), time.perf_counter() - t0, res


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--groups", type=int, default=40)
    p.add_argument("--sigmas", type=float, nargs="+", default=[1.0, 0.5, 0.3],
                   help="true group scales (smaller: the scale is less identified)")
    p.add_argument("--noise-var", type=float, default=0.25,
                   help="s^2 / n, the sampling variance of a group mean")
    p.add_argument("--clients", type=int, nargs="+", default=[1, 2, 5, 10, 25, 40])
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--damping", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--nuts", type=int, nargs="*", default=[],
                   help="also run fedppl.EP with NUTS at these K (--nuts-estimators)")
    p.add_argument("--nuts-sigmas", type=float, nargs="*", default=[0.3],
                   help="the true sigmas at which --nuts runs")
    p.add_argument("--nuts-rounds", type=int, default=40)
    p.add_argument("--nuts-damping", default="decaying",
                   help="fedppl.EP's damping for the NUTS runs: a number or 'decaying'")
    p.add_argument("--nuts-estimators", nargs="+", default=["sample", "stein"],
                   choices=["sample", "stein"])
    p.add_argument("--nuts-samples", type=int, default=2000)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" /
                                        "ep_fixed_point.json"))
    return p.parse_args()


def main() -> None:
    args = parse()
    guide = fedppl.PVIGuide(model, family="fullrank")
    rows = []
    for sigma in args.sigmas:
        X, y = simulate(args.groups, sigma, args.noise_var, args.seed)
        guide.setup(X, y)
        mean, cov, edge = exact_posterior(X, y, guide)
        sd = np.sqrt(np.diag(cov))
        print(f"sigma = {sigma}: posterior mean {mean.round(3)}, sd {sd.round(3)} "
              f"(border mass {edge:.1e})")
        for K in args.clients:
            quad = QuadratureEP(model, fedppl.PVIGuide(model, family="fullrank"),
                                damping=1.0 if K == 1 else args.damping)
            m, S, secs, res = run_ep(quad, X, y, K, 2 if K == 1 else args.rounds, args.seed)
            moved = float(np.nanmax(res.history["site_change"][-1]))
            rows.append({"sigma": sigma, "K": K, "tilted": "quadrature", "rounds":
                         res.num_rounds, "last_site_change": moved, "seconds": secs,
                         "posterior_sd": sd.tolist(), **errors(m, S, mean, cov)})
            print(f"  K = {K:3d} quadrature: " + _line(rows[-1]))
        damping = (args.nuts_damping if args.nuts_damping == "decaying" else
                   float(args.nuts_damping))
        for K, est in [(K, e) for K in args.nuts for e in args.nuts_estimators
                       if sigma in args.nuts_sigmas]:
            nuts = fedppl.EP(model, fedppl.PVIGuide(model, family="fullrank"),
                             num_samples=args.nuts_samples // 4, num_chains=4,
                             damping=damping, estimator=est, max_rhat=float("inf"))
            m, S, secs, res = run_ep(nuts, X, y, K, args.nuts_rounds, args.seed)
            rows.append({"sigma": sigma, "K": K, "tilted": f"NUTS, {est} moments",
                         "rounds": res.num_rounds, "seconds": secs,
                         "posterior_sd": sd.tolist(), **errors(m, S, mean, cov)})
            print(f"  K = {K:3d} NUTS ({est}): " + _line(rows[-1]))
    out = {"measured": "EP's fixed point with exact (quadrature) tilted moments against the "
                       "exact posterior, Gaussian random-intercept model",
           "machine": {"platform": platform.platform(), "processor": platform.processor(),
                       "cpus": os.cpu_count(), "jax": jax.__version__,
                       "numpyro": numpyro.__version__, "backend": jax.default_backend()},
           "settings": vars(args), "rows": rows, "table_markdown": table(rows)}
    print()
    print(out["table_markdown"])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(stamp(out), indent=1))
    print(f"\nwrote {args.out}")


def _line(r: dict) -> str:
    return (f"sd ratio log sigma {r['sd_ratio_log_sigma']:.3f}, mu {r['sd_ratio_mu']:.3f}, "
            f"worst mean error {r['mean_err']:.3f} sd")


def table(rows: list[dict]) -> str:
    lines = ["| true sigma (posterior sd of log sigma) | K | tilted moments | sd ratio, log sigma "
             "| sd ratio, mu | worst mean error (sd) |", "|---|---:|---|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['sigma']} ({r['posterior_sd'][1]:.2f}) | {r['K']} | {r['tilted']} | "
                     f"{r['sd_ratio_log_sigma']:.3f} | {r['sd_ratio_mu']:.3f} | "
                     f"{r['mean_err']:.3f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
