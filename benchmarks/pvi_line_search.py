"""When does synchronous PVI need its line search, and what does a deployment pay for it?

The server of a synchronous PVI round may score candidate steps along the clients' combined
update on their data (``line_search``): free on the embedded runtime, one more exchange with
every node a round on a deployment (Flower). This runs synchronous PVI (damping 1, the
natural-gradient or closed-form local step) on the embedded runtime, which runs the same
algorithm as a deployment, in three ways:

* ``every round``: ``line_search=True`` (the embedded default): two exchanges a round deployed;
* ``adaptive``: the deployment default (``line_search=None`` on a runtime whose server holds no
  data): a round is scored only when its full step would leave q not positive definite or move
  q further than the last round's update did; the others take one exchange;
* ``off``: ``line_search=False``: one exchange a round, only the acceptance rule (non-finite,
  not positive definite, implausibly large messages) guards the step;

(and, on the mean-field case, ``off`` with damping 0.2: the one-exchange alternative), on

* ``blr``: Bayesian linear regression (closed form; full rank), 1000 points, 5 correlated
  features, K = 10: the exact posterior is known;
* ``logistic``: logistic regression on breast cancer (30 standardised features and a bias,
  D = 31, w ~ N(0, I)), full rank, K = 10 and K = 100 (homogeneous split);
* ``logistic-meanfield``: the same with a mean-field guide, K = 10: strongly correlated
  features, where synchronous undamped steps over-count each other;
* ``student-t``: heavy-tailed regression (Student-t with 1 degree of freedom, scale 0.05, a
  tenth of the targets shifted as outliers, w ~ N(0, 10^2 I), 3 features two of them nearly
  collinear), 400 points on K = 200 clients of 2 points each, full rank.

Each run stops once a round moves q by ``KL(q_new || q_old) <= 1e-8`` (``tol``) or after the
case's cap of rounds. Per case and way, over ``--seeds`` seeds (partition and key): rounds to
that point (each seed; None: not reached), and medians of ``KL(q || q*)`` at the end, q* the
fixed point (the exact posterior for ``blr``; else ``GlobalVI`` with the same guide family and
fixed draws, which is PVI's fixed point), ``KL(q || q_every_round)``, updates the server
refused, rounds in which a step below 1 was taken, exchanges per round as a deployment makes
them (the history's ``exchanges``), and seconds (including compilation; the table shows the
fastest seed's).

Run::

    python benchmarks/pvi_line_search.py            # every case, 2 seeds (~8 min on 2 cores)
    python benchmarks/pvi_line_search.py --quick    # blr, logistic K = 10, the mean-field case

Prints a markdown table and writes JSON (settings, machine, rows) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time
import warnings
from pathlib import Path
from typing import Any

import jax
import numpy as np
import numpyro
import numpyro.distributions as dist
from _provenance import stamp

import fedppl
from fedppl.families import gaussian as g
from fedppl.guides import PVIGuide
from fedppl.infer.base import Runtime, embedded_round

BENCHMARK = {
    "summary": ("when synchronous PVI needs its line search, and the exchanges a deployment pays "
                "for it (BLR, logistic K = 10 and 100, mean-field)"),
    "data": None,
    "quick": ["--quick"],
    "full": [[]],
    "cost": "quick ~3 min; full ~8 min",
}

jax.config.update("jax_enable_x64", True)

TOL = 1e-8
NOISE = 0.5  # the regression's known noise sd
# a runtime whose server holds no data (as Flower's), run in this process
DEPLOYED = Runtime(embedded_round, data_at_server=False)
# label, line_search, deployed runtime?, damping
WAYS = (("every round", True, False, 1.0), ("adaptive", None, True, 1.0),
        ("off", False, False, 1.0))
DAMPED = ("off, damping 0.2", False, False, 0.2)


def blr(X, y=None):
    w = numpyro.sample("w", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Normal(X @ w, NOISE), obs=y)


def logistic(X, y=None):
    w = numpyro.sample("w", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)


def student(X, y=None):
    w = numpyro.sample("w", dist.Normal(0, 10).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.StudentT(1.0, X @ w, 0.05), obs=y)


def breast_cancer() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_breast_cancer
    from sklearn.preprocessing import StandardScaler

    X, y = load_breast_cancer(return_X_y=True)
    X = StandardScaler().fit_transform(X)
    return np.hstack([X, np.ones((len(X), 1))]), y.astype(float)


def blr_data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    X = rng.normal(size=(1000, 5))
    X[:, 1] = X[:, 0] + 0.1 * X[:, 1]
    return X, X @ rng.normal(size=5) + NOISE * rng.normal(size=1000)


def student_data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    X = rng.normal(size=(400, 3))
    X[:, 1] = X[:, 0] + 0.05 * X[:, 1]
    y = X @ rng.normal(size=3) + 0.05 * rng.standard_cauchy(400)
    y[::10] += 20 * rng.normal(size=40)
    return X, y


def exact_blr(X: np.ndarray, y: np.ndarray) -> g.FullGaussian:
    return g.FullGaussian(X.T @ y / NOISE**2, np.eye(X.shape[1]) + X.T @ X / NOISE**2)


# name: (model, family, data, K, cap of rounds)
CASES: dict[str, tuple[Any, str, Any, int, int]] = {
    "blr": (blr, "fullrank", blr_data, 10, 10),
    "logistic K=10": (logistic, "fullrank", breast_cancer, 10, 25),
    "logistic K=100": (logistic, "fullrank", breast_cancer, 100, 20),
    "logistic-meanfield K=10": (logistic, "meanfield", breast_cancer, 10, 25),
    "student-t K=200": (student, "fullrank", student_data, 200, 20),
}
QUICK = ("blr", "logistic K=10", "logistic-meanfield K=10")


def run_way(case: str, way: tuple, seed: int) -> tuple[fedppl.PVIResult, float]:
    model, family, data, K, cap = CASES[case]
    _, line_search, deployed, damping = way
    X, y = data()
    clients = fedppl.partition.homogeneous(X, y, num_clients=K, seed=seed)
    pvi = fedppl.PVI(model, PVIGuide(model, family=family), "synchronous", damping,
                     line_search=line_search, elbo_samples=0)
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the round log's warnings (shrunk steps, collapse)
        result = pvi.run(jax.random.key(seed), clients, cap, tol=TOL, progress_bar=False,
                         runtime=DEPLOYED if deployed else None)
    return result, time.perf_counter() - t0


def fixed_point(case: str, seed: int) -> g.Gaussian:
    """The fixed point synchronous PVI should reach: the exact posterior, or GlobalVI's q."""
    model, family, data, K, _ = CASES[case]
    X, y = data()
    if model is blr:
        return exact_blr(X, y)
    clients = fedppl.partition.homogeneous(X, y, num_clients=K, seed=seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pooled = fedppl.GlobalVI(model, PVIGuide(model, family=family), elbo_samples=0).run(
            jax.random.key(seed), clients, progress_bar=False)
    return pooled.q


def measure(case: str, seeds: int) -> list[dict]:
    ways = WAYS + ((DAMPED,) if "meanfield" in case else ())
    runs: dict[str, list[dict]] = {way[0]: [] for way in ways}
    for seed in range(seeds):
        results = {way[0]: run_way(case, way, seed) for way in ways}
        every, target = results["every round"][0], fixed_point(case, seed)
        for label, (res, seconds) in results.items():
            kl = np.asarray(res.history["kl_change"])
            step = np.asarray(res.history["step"], float)
            row = {"rounds": res.num_rounds,
                   "rounds_to_tol": int(res.num_rounds) if kl[-1] <= TOL else None,
                   "kl_to_fixed_point": float(g.kl(res.q, target)),
                   "kl_to_every_round": float(g.kl(res.q, every.q)),
                   "last_kl_change": float(kl[-1]),
                   "max_kl_change_after_round_2": float(np.max(kl[2:], initial=0.0)),
                   "refused": len(res.rejected),
                   "shrunk_rounds": int(np.sum(np.nanmin(step, axis=1) < 1.0)),
                   "exchanges": int(np.sum(res.history["exchanges"])),
                   "seconds": seconds}
            runs[label].append(row)
    out = []
    for label, rows in runs.items():
        summary: dict[str, Any] = {"case": case, "way": label, "seeds": seeds,
                                   "family": CASES[case][1], "K": CASES[case][3],
                                   "cap": CASES[case][4]}
        for key in rows[0]:
            values = [r[key] for r in rows]
            if key == "rounds_to_tol":  # each seed's (None: not within the cap)
                summary[key] = values
            else:
                summary[key] = float(np.median(values))
        summary["fastest_seconds"] = float(min(r["seconds"] for r in rows))
        summary["exchanges_per_round"] = summary["exchanges"] / summary["rounds"]
        summary["per_seed"] = rows
        out.append(summary)
    return out


def table(rows: list[dict]) -> str:
    head = ("| case | way | rounds to KL change <= 1e-8 (each seed) | KL to fixed point | "
            "KL to every-round q | refused | rounds shrunk | exchanges / round | s |")
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        to_tol = ", ".join(f">{r['cap']}" if v is None else str(v) for v in r["rounds_to_tol"])
        lines.append(f"| {r['case']} | {r['way']} | {to_tol} | {r['kl_to_fixed_point']:.2g} | "
                     f"{r['kl_to_every_round']:.2g} | {r['refused']:g} | "
                     f"{r['shrunk_rounds']:g} | {r['exchanges_per_round']:.2f} | "
                     f"{r['fastest_seconds']:.0f} |")
    return "\n".join(lines)


def machine() -> dict:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = None
    return {"platform": platform.platform(), "processor": platform.processor(),
            "cpus": os.cpu_count(), "jax": jax.__version__, "backend": jax.default_backend(),
            "commit": commit}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    ap.add_argument("--cases", nargs="+", choices=list(CASES), default=None)
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/pvi_line_search.json")
    args = ap.parse_args()
    cases = args.cases or (QUICK if args.quick else tuple(CASES))
    rows: list[dict] = []
    for case in cases:
        t0 = time.perf_counter()
        rows += measure(case, args.seeds)
        print(f"{case}: {time.perf_counter() - t0:.0f} s", flush=True)
    print(table(rows))
    report = {"what": "synchronous PVI with the line search every round, adaptive (the "
                      "deployment default) and off: rounds to a fixed point, distance to the "
                      "every-round run, refusals, exchanges a deployment makes per round "
                      "(medians over seeds)",
              "settings": {**vars(args), "cases": list(cases), "tol": TOL,
                           "damping": 1.0, "schedule": "synchronous"},
              "machine": machine(), "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(stamp(report), indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
