"""What ``shared_draws`` costs in accuracy: the exact synchronous DPO / fixed-Z round against the
linear one (``SGPConfig(shared_draws=S)``), same seeds, same clients, same number of rounds.

Two problems:

* ``synthetic``: y = sin(x) + 0.1 noise on x ~ U(-3, 3), K = 10 clients of 50 points, M = 10,
  20 local steps, damping 0.3, 200 synchronous rounds, pseudo-inputs from the prior; the test
  set is 500 fresh points;
* UCI folders (``--uci NAME ...``): the standard split(s), standardised on the training part and
  dealt to K = 10 clients (``fedppl_experiments.sgp_uci.prepare``), M = ``--inducing``, 20 local
  steps, damping 0.3, ``--rounds`` synchronous rounds; test log-likelihood in original units.

Each row reports the exact free energy of the final q (``history["free_energy"]``, the same
bound for both rounds) and the average test log-likelihood. Run::

    python benchmarks/sgp_shared_accuracy.py                       # synthetic only
    python benchmarks/sgp_shared_accuracy.py --uci yacht concrete --splits 2

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
    "summary": ("the accuracy cost of shared_draws: the exact synchronous DPO / fixed-Z round "
                "against the shared-draws one, synthetic data (UCI sets optional)"),
    "data": None,
    "quick": ["--methods", "dpo"],
    "full": [[]],
    "cost": "quick ~1 min; full ~3 min",
}

jax.config.update("jax_enable_x64", True)

UCI = Path(__file__).resolve().parents[2] / "shared" / "data" / "uci"


def synthetic():
    rng = np.random.default_rng(0)
    X = rng.uniform(-3, 3, (500, 1))
    y = np.sin(X[:, 0]) + 0.1 * rng.normal(size=500)
    Xt = rng.uniform(-3, 3, (500, 1))
    yt = np.sin(Xt[:, 0]) + 0.1 * rng.normal(size=500)
    return fedppl.partition.homogeneous(X, y, num_clients=10, seed=0), (Xt, yt), {}


def uci(folder: Path, split: int):
    from fedppl_experiments.sgp_uci import prepare

    prep = prepare(str(folder), split, 10)
    scale = dict(y_mean=float(prep.scaler.y_mean), y_std=float(prep.scaler.y_std))
    return prep.clients, prep.test, scale


def one(problem: str, method: str, shared: int, clients, test, scale, inducing: int,
        rounds: int) -> dict:
    front = fedppl.FederatedSGP(method, num_inducing=inducing, local_steps=20,
                                schedule="synchronous", damping=0.3, shared_draws=shared,
                                pseudo_init="prior")
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        res = front.run(jax.random.key(0), clients, rounds, progress_bar=False)
    seconds = time.perf_counter() - t0
    fe = np.asarray(res.history["free_energy"])
    ll = float(res.log_likelihood(*test, rng_key=jax.random.key(1), **scale))
    row = {"problem": problem, "method": method, "shared_draws": shared, "rounds": rounds,
           "free_energy": float(fe[-1]), "test_log_lik": ll, "seconds": seconds,
           "rejected": len(res.rejected)}
    print(f"{problem} {method} S={shared}: free energy {row['free_energy']:.2f}, "
          f"test log-lik {ll:.4f}, {seconds:.0f} s", flush=True)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--uci", nargs="*", default=[], help="UCI dataset folder names")
    p.add_argument("--uci-root", type=Path, default=UCI)
    p.add_argument("--splits", type=int, default=1)
    p.add_argument("--rounds", type=int, default=100, help="rounds on the UCI sets (100)")
    p.add_argument("--inducing", type=int, default=50, help="M on the UCI sets (50)")
    p.add_argument("--shared", type=int, default=16, help="S, the shared draws (16)")
    p.add_argument("--methods", nargs="+", default=["dpo", "fixed"])
    p.add_argument("--out", type=Path,
                   default=Path(__file__).parent / "results" / "sgp_shared_accuracy.json")
    args = p.parse_args()
    problems = [("synthetic", synthetic, 10, 200)]
    for name in args.uci:
        folder = args.uci_root / name
        if not folder.is_dir():
            print(f"skipping {name}: {folder} not found (pass --uci-root)")
            continue
        problems += [(f"{name} split {s}", lambda f=folder, s=s: uci(f, s), args.inducing,
                      args.rounds) for s in range(args.splits)]
    rows = []
    for problem, load, inducing, rounds in problems:
        clients, test, scale = load()
        for method in args.methods:
            for shared in (0, args.shared):
                rows.append(one(problem, method, shared, clients, test, scale, inducing,
                                rounds))
    lines = ["| problem | method | free energy, exact | free energy, shared | test log-lik, "
             "exact | test log-lik, shared | s, exact | s, shared |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for i in range(0, len(rows), 2):
        a, b = rows[i], rows[i + 1]
        lines.append(f"| {a['problem']} | {a['method']} | {a['free_energy']:.2f} | "
                     f"{b['free_energy']:.2f} | {a['test_log_lik']:.4f} | "
                     f"{b['test_log_lik']:.4f} | {a['seconds']:.0f} | {b['seconds']:.0f} |")
    text = "\n".join(lines)
    print("\n" + text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(stamp({
        "what": "exact synchronous round vs shared_draws (linear in K), same seeds and rounds",
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "device": str(jax.devices()[0]), "jax": jax.__version__},
        "rows": rows, "table_markdown": text}), indent=1))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
