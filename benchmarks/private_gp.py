"""Private FSGP and FedBNR: test RMSE and log-likelihood against epsilon and the data size.

The guides' examples made larger (``docs/guide/fsgp.md``, ``docs/guide/fedbnr.md``):
``y = sin(2x) + 0.1 noise`` on ``x ~ U(-2, 2)`` (sd of y 0.71), N training points dealt
homogeneously to 3 clients, 500 test points. FSGP: 8 inducing points from N(0, I), 10 FedAvg
rounds of 200 Adam steps (1e-2), bounds ``feature_bound=1, target_bound=2``. FedBNR: plain
random Fourier features (20 frequencies), the shared kernel, 5 rounds of 10 local steps, the
last layer at the last round, bounds ``feature_bound=1.5, target_bound=2``. Both at
``delta = 1e-5``, epsilon calibrated for the releases the run plans (FSGP one, FedBNR one per
evaluation). ``inf``: the same run without privacy.

Per (method, N, epsilon), the median over ``--repeats`` seeds (data, partition and key) of the
test RMSE of the predictive mean, the mean test log-likelihood under the noise-aware predictive
(``predict``'s default) and of the naive one (``noise_aware=False``), the median |mean| of the
predictive at the test points, and how many scatter eigenvalues the server raised to zero; for
FSGP also the test RMSE of the plug-in posterior of the same noised statistics (the one that
treats them as exact, what ``predict`` gave before the noise-aware likelihood).

    python benchmarks/private_gp.py                  # 5 seeds, about 8 min on 2 cores
    python benchmarks/private_gp.py --quick          # one seed, N 120, epsilon 1 and inf

Prints a markdown table; writes JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
import warnings
from datetime import date
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _provenance import stamp

import fedppl
from fedppl.algorithms import fsgp
from fedppl.models.random_features import URKSpec

BENCHMARK = {
    "summary": ("private FSGP and FedBNR: test RMSE and log-likelihood against epsilon and the "
                "data size N (medians of 5 seeds)"),
    "data": None,
    "quick": ["--quick"],
    "full": [[]],
    "cost": "quick ~1 min; full ~8 min",
}

jax.config.update("jax_enable_x64", True)

EPSILONS = [1.0, 2.0, 8.0, math.inf]
SIZES = [120, 1000, 3000]
DELTA = 1e-5
NUM_CLIENTS = 3


def data(n: int, seed: int) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    X = rng.uniform(-2, 2, (n + 500, 1))
    y = np.sin(2 * X[:, 0]) + 0.1 * rng.normal(size=n + 500)
    return X[:n], y[:n], X[n:], y[n:]


def privacy(epsilon: float, feature_bound: float) -> fedppl.PrivateStatistics | None:
    if math.isinf(epsilon):
        return None
    return fedppl.PrivateStatistics(feature_bound=feature_bound, target_bound=2.0,
                                    epsilon=epsilon, delta=DELTA)


def fit(method: str, n: int, epsilon: float, seed: int) -> tuple[object, np.ndarray, np.ndarray]:
    """The fitted result and its test inputs and targets."""
    X, y, X_test, y_test = data(n, seed)
    clients = fedppl.partition.homogeneous(X, y, NUM_CLIENTS, seed=seed)
    key = jax.random.key(seed)
    if method == "FSGP":
        front = fedppl.FSGP(num_inducing=8, optimizer=optax.adam(1e-2),
                            init_inducing="random-normal", privacy=privacy(epsilon, 1.0))
        return front.run(key, clients, num_rounds=10, progress_bar=False), X_test, y_test
    spec = URKSpec(input_dim=1, feature_widths=(), shift_widths=(), num_samples=20)
    front = fedppl.FedBNR(spec, kernel="avg", local_steps=10, eval_every=5,
                          privacy=privacy(epsilon, 1.5))
    return front.run(key, clients, 5, progress_bar=False), X_test, y_test


def scores(result, X_test: np.ndarray, y_test: np.ndarray) -> dict[str, float]:
    private = result.privacy is not None

    def predictive(noise_aware: bool) -> tuple[np.ndarray, float]:
        out = result.predict(X_test, noise_aware=noise_aware) if private else \
            result.predict(X_test)
        mean, var = (np.ravel(np.asarray(a, float)) for a in out)
        return mean, float(np.mean(-0.5 * (np.log(2 * np.pi * var)
                                           + (y_test - mean) ** 2 / var)))

    mean, aware = predictive(True)
    naive = predictive(False)[1]
    out = {"rmse": float(np.sqrt(np.mean((mean - y_test) ** 2))), "log_lik": aware,
           "log_lik_naive": naive, "abs_mean": float(np.median(np.abs(mean))),
           "repaired": int(result.privacy["repaired"]) if private else 0}
    if isinstance(result, fedppl.FSGPResult):  # the plug-in posterior of the same statistics
        plug = np.asarray(fsgp.predict(result.params, result.stats, jnp.asarray(X_test),
                                       result.jitter)[0], float)
        out["rmse_plug_in"] = float(np.sqrt(np.mean((plug - y_test) ** 2)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=SIZES)
    ap.add_argument("--epsilons", type=float, nargs="+", default=EPSILONS)
    ap.add_argument("--methods", nargs="+", default=["FSGP", "FedBNR"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None,
                    help="JSON path (default benchmarks/results/private_gp.json; with --quick, "
                         "/tmp/private_gp_quick.json)")
    args = ap.parse_args()
    if args.quick:
        args.sizes, args.epsilons, args.repeats = [120], [1.0, math.inf], 1
    if args.out is None:
        args.out = ("/tmp/private_gp_quick.json" if args.quick
                    else "benchmarks/results/private_gp.json")
    warnings.simplefilter("ignore")
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    results: dict = {
        "command": " ".join(sys.argv), "date": date.today().isoformat(), "commit": commit,
        "settings": {k: v for k, v in vars(args).items() if k != "quick"},
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(),
                    "device": str(jax.devices()[0]), "jax": jax.__version__},
        "rows": []}
    print("| method | N | epsilon | test RMSE | test log-lik (noise-aware) | test log-lik "
          "(naive) | median abs(mean) | raised to 0 | plug-in RMSE |\n"
          "|---|---|---|---|---|---|---|---|---|")
    for method in args.methods:
        for n in args.sizes:
            for epsilon in args.epsilons:
                t0 = time.perf_counter()
                runs = [scores(*fit(method, n, epsilon, seed)) for seed in range(args.repeats)]
                row = {"method": method, "N": n,
                       "epsilon": "inf" if math.isinf(epsilon) else epsilon,
                       **{k: float(np.median([r[k] for r in runs])) for k in runs[0]},
                       "seconds": time.perf_counter() - t0, "repeats": args.repeats}
                results["rows"].append(row)
                print(f"| {method} | {n} | {row['epsilon']} | {row['rmse']:.3g} | "
                      f"{row['log_lik']:.3g} | {row['log_lik_naive']:.3g} | "
                      f"{row['abs_mean']:.3g} | {row['repaired']:.0f} | "
                      f"{row.get('rmse_plug_in', float('nan')):.3g} |", flush=True)
                Path(args.out).parent.mkdir(parents=True, exist_ok=True)
                Path(args.out).write_text(json.dumps(stamp(results), indent=1))


if __name__ == "__main__":
    main()
