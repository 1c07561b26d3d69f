"""How noisy and how biased the clients' local marginal-likelihood estimates of the check are.

With local sites, each client of :meth:`fedppl.PVIResult.check` estimates
``log p(y_k | theta) = log int p(y_k, z_k | theta) dz_k`` by importance sampling from a Laplace
approximation (:func:`fedppl.algorithms.importance.laplace_log_marginal`) and states the
variance of each estimate. This measures, on the hierarchical logistic regression of
``benchmarks/ep_hierarchical.py`` (25 clients, 42 local coordinates each: two groups of an
intercept and 20 slopes), at fixed global values (the simulation's truth, and the truth with
every group scale doubled), for several ``local_draws`` ``M``:

* the sd over repeated estimates (independent local draws) of each client's estimate (median
  over clients) and of the sum over clients (what enters a weight);
* the mean of that sum: its change with ``M`` is the estimator's downward bias (the largest
  ``M`` is the reference);
* the sd the clients state (square root of their summed stated variances, mean over repeats).

Run::

    python benchmarks/local_marginal_noise.py                  # M = 32, 64, 256, 1024
    python benchmarks/local_marginal_noise.py --draws 32 64 --repeats 5

Prints a table and writes JSON to ``--out`` (default
``benchmarks/results/local_marginal_noise.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import numpyro

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ep_hierarchical as eh
from _provenance import stamp

import fedppl
from fedppl.algorithms import importance as imp

BENCHMARK = {
    "summary": ("noise and bias of the clients' local marginal-likelihood estimates in the check, "
                "against the number of local draws M"),
    "data": None,
    "quick": ["--draws", "32", "64", "--repeats", "2"],
    "full": [[]],
    "cost": "quick ~1 min; full ~5 min",
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draws", type=int, nargs="+", default=[32, 64, 256, 1024])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results/local_marginal_noise.json")
    args = ap.parse_args()
    _, truth, clients = eh.simulate(args.seed)
    ng = eh.n_groups()
    guide = fedppl.PVIGuide(eh.model, eh.GLOBAL, family="fullrank").setup(*clients.client(0),
                                                                          n_groups=ng)
    theta = np.concatenate([truth["mu"], np.log(truth["sigma"])])
    wide = theta.copy()
    wide[len(truth["mu"]):] += np.log(2.0)
    K = clients.num_clients
    rows = []
    for M in args.draws:
        fn = imp.client_log_lik(partial(eh.model, n_groups=ng), guide, M, 10, 64)
        batched = jax.jit(jax.vmap(fn, (None, None, 0, 0, 0)))
        for name, th in (("truth", theta), ("scales x2", wide)):
            draws = jnp.tile(jnp.asarray(th)[None], (args.repeats, 1))
            t0 = time.perf_counter()
            out = batched(draws, None, clients.stacked, clients.mask,
                          jax.random.split(jax.random.key(M), K))
            values = np.asarray(out.log_lik)          # (K, repeats)
            stated = np.asarray(out.variance).sum(0)  # (repeats,)
            rows.append({"local_draws": M, "theta": name,
                         "client_sd_median": float(np.median(values.std(1))),
                         "sum_sd": float(values.sum(0).std()),
                         "sum_mean": float(values.sum(0).mean()),
                         "stated_sum_sd": float(np.sqrt(stated.mean())),
                         "seconds": time.perf_counter() - t0})
            print(rows[-1], flush=True)
    for name in ("truth", "scales x2"):
        ref = [r for r in rows if r["theta"] == name][-1]["sum_mean"]
        for r in rows:
            if r["theta"] == name:
                r["bias_vs_largest"] = r["sum_mean"] - ref
    print("\n| theta | M | client sd (median) | sum sd | stated sum sd | sum mean - largest M's |")
    print("|---|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: (r["theta"], r["local_draws"])):
        print(f"| {r['theta']} | {r['local_draws']} | {r['client_sd_median']:.3f} "
              f"| {r['sum_sd']:.3f} | {r['stated_sum_sd']:.3f} | {r['bias_vs_largest']:+.2f} |")
    out = {"settings": vars(args), "rows": rows,
           "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(),
                       "jax": jax.__version__, "numpyro": numpyro.__version__,
                       "float64": bool(jax.config.jax_enable_x64)}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(stamp(out), indent=1) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
