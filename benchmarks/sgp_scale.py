"""Seconds per synchronous round and compiled memory of the federated sparse GPs against K.

Every client holds ``--points`` points of a 1-D sine regression (so N grows with K); every
method runs its synchronous round (one ``vmap`` over the client axis) with M inducing points and
``--local-steps`` local steps (FedAvg-Z: as many joint steps with its Z after them). Per method
and K it reports:

* ``seconds``: the median over ``--repeats`` rounds after the first (the first compiles);
* ``compile``: the first round's excess over that median;
* ``temp_mib``: the temporary memory XLA allocates for the compiled round
  (``compiled.memory_analysis()``), which is what runs out on a GPU when it grows as K^2.

The ratios K_max / K_min of both come last (linear growth is K_max / K_min; quadratic its
square). FSGP rounds go through the same front. Run::

    python benchmarks/sgp_scale.py                       # K = 50, 200 (the issue's CPU check)
    python benchmarks/sgp_scale.py --clients 10 100 1000 --points 100 --inducing 100  # a GPU

Prints a markdown table and writes JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
import warnings
from pathlib import Path

import jax
import numpy as np
from _provenance import stamp

import fedppl

BENCHMARK = {
    "summary": ("seconds per synchronous round and compiled memory of the federated sparse GPs "
                "against K (K = 50, 200 on CPU)"),
    "data": None,
    "quick": ["--clients", "10", "--repeats", "1", "--methods", "dpo", "fixed", "fsgp"],
    "full": [[]],
    "cost": "quick ~1 min (dpo, fixed, fsgp); full ~5 min",
}

jax.config.update("jax_enable_x64", True)

METHODS = ("dpo", "cpo", "fedavg-z", "fixed", "global", "fsgp", "dpo-shared", "fedavg-z-shared",
           "fixed-shared")
SHARED_DRAWS = 16  # the "-shared" rows: the linear rounds (FederatedSGP's shared_draws)


def build(method: str, inducing: int, local_steps: int):
    if method == "fsgp":
        return fedppl.FSGP(num_inducing=inducing, local_steps=local_steps)
    shared = method.endswith("-shared")
    return fedppl.FederatedSGP(method.removesuffix("-shared"), num_inducing=inducing,
                               local_steps=local_steps, inner_steps=local_steps,
                               schedule="synchronous", shared_draws=SHARED_DRAWS * shared)


def measure(method: str, K: int, points: int, inducing: int, local_steps: int,
            repeats: int) -> dict:
    rng = np.random.default_rng(0)
    X = rng.uniform(-3, 3, (points * K, 1))
    y = np.sin(X[:, 0]) + 0.1 * rng.normal(size=points * K)
    clients = fedppl.partition.homogeneous(X, y, num_clients=K, seed=0)
    front = build(method, inducing, local_steps)
    state = front.init(jax.random.key(0), clients)
    temp = front.lower_round(state).compile().memory_analysis().temp_size_in_bytes
    times = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # rejected updates are not timed here
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            state, _ = front.update(state)
            times.append(time.perf_counter() - t0)
    seconds = float(np.median(times[1:]))
    return {"method": method, "clients": K, "seconds": seconds,
            "compile": times[0] - seconds, "temp_mib": temp / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[50, 200])
    parser.add_argument("--points", type=int, default=50)
    parser.add_argument("--inducing", type=int, default=10)
    parser.add_argument("--local-steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).parent / "results" / "sgp_scale.json")
    a = parser.parse_args()
    rows = []
    for method in a.methods:
        for K in a.clients:
            row = measure(method, K, a.points, a.inducing, a.local_steps, a.repeats)
            rows.append(row)
            print(f"{method:9s} K={K:6d}  {row['seconds']:.4f} s/round  compile "
                  f"{row['compile']:.1f} s  temp {row['temp_mib']:.1f} MiB", flush=True)
    lo, hi = min(a.clients), max(a.clients)
    print(f"\n| method | s/round K={lo} | s/round K={hi} | ratio | temp MiB K={lo} | "
          f"temp MiB K={hi} | ratio |\n|---|---:|---:|---:|---:|---:|---:|")
    ratios = {}
    for method in a.methods:
        r = {row["clients"]: row for row in rows if row["method"] == method}
        ratios[method] = {"seconds": r[hi]["seconds"] / r[lo]["seconds"],
                          "temp": r[hi]["temp_mib"] / r[lo]["temp_mib"]}
        print(f"| {method} | {r[lo]['seconds']:.4f} | {r[hi]['seconds']:.4f} | "
              f"{ratios[method]['seconds']:.1f} | {r[lo]['temp_mib']:.1f} | "
              f"{r[hi]['temp_mib']:.1f} | {ratios[method]['temp']:.1f} |")
    out = {"what": "seconds per synchronous round and compiled temp memory against K",
           "settings": {"points_per_client": a.points, "inducing": a.inducing,
                        "local_steps": a.local_steps, "repeats": a.repeats,
                        "dtype": "float64"},
           "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                       "device": str(jax.devices()[0]), "jax": jax.__version__},
           "rows": rows, "ratios": ratios}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(stamp(out), indent=2))
    print(f"\nwrote {a.out}")


if __name__ == "__main__":
    main()
