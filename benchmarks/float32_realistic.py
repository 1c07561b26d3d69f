"""float32 against float64 at a realistic size: Bayesian logistic regression on the breast-cancer
data (D = 31 global parameters, full-rank guide), clients skewed by one feature.

For each setting (K clients, schedule, damping) PVI runs in float64 and in float32 (x64 off,
``jax.enable_x64(False)``); the table gives, over the 31 coordinates, the worst
``|mean32 - mean64| / sd64`` and ``|sd32 / sd64 - 1|``, each dtype's distance from its own
GlobalVI (PVI's fixed point), and each dtype's ``result.check`` k-hat (S = 1000 draws).

    python benchmarks/float32_realistic.py --out benchmarks/results/float32_realistic.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time
import warnings

import jax
import numpy as np
from _provenance import stamp

import fedppl
from fedppl.guides import PVIGuide
from fedppl.models.glm import logistic_regression
from fedppl_experiments.demo import load_breast_cancer

BENCHMARK = {
    "summary": ("float32 against float64 at a realistic size: Bayesian logistic regression on "
                "breast cancer, PVI and its check, the two dtypes' answers and seconds"),
    "data": None,
    "quick": ["--quick"],
    "full": [["--out", "benchmarks/results/float32_realistic.json"]],
    "cost": "quick ~1 min (K = 10, synchronous); full ~8 min",
}

SETTINGS = [(10, "synchronous", 0.5, 30), (10, "sequential", 1.0, 10),
            (100, "synchronous", 0.1, 60), (100, "sequential", 1.0, 10)]


def moments(res):
    mean, cov = res.mean_and_cov()
    return np.asarray(mean, float), np.sqrt(np.diag(np.asarray(cov, float)))


def fit(K, schedule, damping, rounds):
    X, y, _, _ = load_breast_cancer(0)
    X, y = np.asarray(X, np.float32 if not jax.config.jax_enable_x64 else float), np.asarray(y)
    clients = fedppl.partition.by_feature(X, y.astype(X.dtype), K)
    t = time.perf_counter()
    res = fedppl.PVI(logistic_regression, PVIGuide(logistic_regression, family="fullrank"),
                     schedule, damping).run(jax.random.key(0), clients, rounds,
                                            progress_bar=False)
    seconds = time.perf_counter() - t
    ref = fedppl.GlobalVI(logistic_regression, PVIGuide(logistic_regression, family="fullrank")
                          ).run(jax.random.key(1), clients, progress_bar=False)
    check = res.check(jax.random.key(2), clients, num_draws=1000)
    return moments(res), moments(ref), float(check.khat), seconds


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="")
    ap.add_argument("--quick", action="store_true", help="the first setting only (K = 10)")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    rows = []
    for K, schedule, damping, rounds in SETTINGS[:1] if args.quick else SETTINGS:
        with jax.enable_x64(True):
            (m64, s64), (g64, gs64), k64, t64 = fit(K, schedule, damping, rounds)
        with jax.enable_x64(False):
            (m32, s32), (g32, gs32), k32, t32 = fit(K, schedule, damping, rounds)
        rows.append({"K": K, "schedule": schedule, "damping": damping, "rounds": rounds,
                     "mean_err_32_vs_64": float(np.max(np.abs(m32 - m64) / s64)),
                     "sd_err_32_vs_64": float(np.max(np.abs(s32 / s64 - 1))),
                     "pvi64_vs_global64": float(np.max(np.abs(m64 - g64) / gs64)),
                     "pvi32_vs_global32": float(np.max(np.abs(m32 - g32) / gs32)),
                     "khat64": k64, "khat32": k32, "seconds64": t64, "seconds32": t32})
        print(" | ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                         for k, v in rows[-1].items()), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(stamp({"what": __doc__.splitlines()[0], "machine": platform.platform(),
                             "processor": platform.processor(),
                             "cpus": __import__("os").cpu_count(), "rows": rows}), f, indent=1)


if __name__ == "__main__":
    main()
