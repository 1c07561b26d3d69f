"""Seconds per round of the federated SMC sampler against the number of particles N and of
clients K, on one device (every client and every particle in one compiled round of the embedded
runtime).

Task: random-intercept logistic regression, ``y ~ Bernoulli(logit(x'w + tau z_j))``, 5 inputs,
``z_j ~ N(0, 1)`` local (one group per client, 20 rows each), so each client's log-likelihood per
particle is a Laplace-importance estimate over its own intercept with ``--local-draws`` draws;
7 global coordinates (w, log tau, and the intercept's mean). ``--no-local`` times the same
model with the intercepts dropped (exact log-likelihoods, no local sites).

Each (N, K) runs ``--rounds`` rounds from the prior's Gaussian; reported: the first round (with
compilation) and the median of the later ones, the bytes per client per round, and the
temperature reached (a check that the rounds did work).

Run::

    python benchmarks/smc_scale.py                            # N 1000-16000, K 10-1000 (CPU)
    python benchmarks/smc_scale.py --quick
    python benchmarks/smc_scale.py --out benchmarks/results/smc_scale_gpu.json   # on a GPU

Prints a table and writes JSON to ``--out`` (default benchmarks/results/smc_scale.json).
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
from _provenance import stamp

import fedppl

BENCHMARK = {
    "summary": ("the SMC sampler's seconds per round against particles N and clients K (linear in "
                "N x K)"),
    "data": None,
    "quick": ["--quick"],
    "full": [[]],
    "cost": "quick ~1 min; full ~16 min",
}

jax.config.update("jax_enable_x64", True)

D, ROWS = 5, 20


def model(X, y=None, *, local=True):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([D]).to_event(1))
    b = numpyro.sample("b", dist.Normal(0.0, 1.0))
    tau = numpyro.sample("tau", dist.HalfNormal(1.0))
    logits = X @ w + b
    if local:
        z = numpyro.sample("z", dist.Normal(0.0, 1.0))
        logits = logits + tau * z
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=logits), obs=y)


def clients_of(K: int, seed: int = 0) -> fedppl.Clients:
    rng = np.random.default_rng(seed)
    w = rng.normal(size=D)
    parts = []
    for _ in range(K):
        X = rng.normal(size=(ROWS, D))
        p = 1 / (1 + np.exp(-(X @ w + 0.5 + 0.8 * rng.normal())))
        parts.append((X, (rng.uniform(size=ROWS) < p).astype(float)))
    return fedppl.Clients.from_list(parts)


def time_one(N: int, K: int, args) -> dict:
    clients = clients_of(K)
    local = not args.no_local
    sites = ["w", "b", "tau"]
    guide = fedppl.PVIGuide(model, global_sites=sites if local else None, family="fullrank")
    guide.setup(*clients.client(0), local=local)
    smc = fedppl.SMC(model, guide, guide.prior, num_particles=N, islands=10,
                     local_draws=args.local_draws)
    state = smc.init(jax.random.key(0), clients, local=local)
    seconds, beta, up, down = [], 0.0, 0.0, 0.0
    for _ in range(args.rounds):
        state, info = smc.update(state)
        seconds.append(info["seconds"])
        beta, up, down = info["beta"], info["bytes_up"] / K, info["bytes_down"] / K
    return {"particles": N, "clients": K, "first_round_seconds": seconds[0],
            "seconds_per_round": float(np.median(seconds[1:])),
            "particle_client_evaluations_per_second": N * K / float(np.median(seconds[1:])),
            "bytes_up_per_client": up, "bytes_down_per_client": down, "beta": beta}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--particles", type=int, nargs="+", default=[1000, 4000, 16000])
    ap.add_argument("--clients", type=int, nargs="+", default=[10, 100, 1000])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--local-draws", type=int, default=64)
    ap.add_argument("--max-evaluations", type=float, default=2e6,
                    help="skip (N, K) with N * K above this (CPU memory and time)")
    ap.add_argument("--no-local", action="store_true")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default="benchmarks/results/smc_scale.json")
    args = ap.parse_args()
    if args.quick:
        args.particles, args.clients, args.rounds, args.local_draws = [200, 400], [4, 8], 3, 8
    warnings.simplefilter("ignore", UserWarning)  # "not finished": a few rounds on purpose
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    results: dict = {
        "command": " ".join(sys.argv), "date": date.today().isoformat(), "commit": commit,
        "settings": vars(args),
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(),
                    "device": str(jax.devices()[0]), "jax": jax.__version__,
                    "numpyro": numpyro.__version__},
        "rows": []}
    t0 = time.perf_counter()
    for n_clients in args.clients:
        for n_particles in args.particles:
            if n_particles * n_clients > args.max_evaluations:
                print(f"N = {n_particles}, K = {n_clients}: skipped (N K above "
                      "--max-evaluations)", flush=True)
                continue
            row = time_one(n_particles, n_clients, args)
            results["rows"].append(row)
            print(f"N = {n_particles}, K = {n_clients}: {row['seconds_per_round']:.3f} s/round "
                  f"(first {row['first_round_seconds']:.1f} s), beta {row['beta']:.3f}", flush=True)
            results["wall_seconds"] = time.perf_counter() - t0
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(stamp(results), indent=1))
    print("\n| N | K | s / round | first round (s) | particle-clients / s | KB up / down per "
          "client |")
    print("|---|---|---|---|---|---|")
    for r in results["rows"]:
        print(f"| {r['particles']} | {r['clients']} | {r['seconds_per_round']:.3f} | "
              f"{r['first_round_seconds']:.1f} | "
              f"{r['particle_client_evaluations_per_second']:.3g} | "
              f"{r['bytes_up_per_client'] / 1e3:.0f} / {r['bytes_down_per_client'] / 1e3:.0f} |")
    print(f"wrote {args.out} ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
