"""Federated sparse GPs on the eight UCI sets of the federated SGP paper, plus round timings.

Part 1 (accuracy): every method of :mod:`fedppl.experiments.sgp_uci` (DPO, CPO, FedAvg-Z, fixed Z,
FSGP, global VI) on each dataset, K = 10 homogeneous clients, M = 100, M_k = min(0.8 N_k, 500),
alpha = 0.1, Adam 1e-2; mean +- standard error of the test log-likelihood and RMSE (original
units) over splits, rounds to convergence and seconds per round.

Part 2 (speed): seconds per synchronous round (all clients at once, ``vmap`` over clients) for
K = 10 and K = 1000 clients of synthetic 1-D data, median of repeats.

Run::

    python benchmarks/sgp_uci.py                                   # all datasets, defaults
    python benchmarks/sgp_uci.py --datasets concrete energy --splits 2 --rounds 100
    python benchmarks/sgp_uci.py --datasets yacht --splits 1 --rounds 10 --local-steps 20  # smoke

Prints markdown tables and writes JSON (settings, machine, per-split rows) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import jax
import numpy as np

from fedppl.experiments import sgp_uci

UCI = Path(__file__).resolve().parents[2] / "shared" / "data" / "uci"
DATASETS = ["bostonHousing", "concrete", "energy", "kin8nm", "naval-propulsion-plant",
            "power-plant", "protein-tertiary-structure", "wine-quality-red", "yacht"]
PAPER = ["bostonHousing", "concrete", "energy", "kin8nm", "naval-propulsion-plant",
         "power-plant", "wine-quality-red", "yacht"]  # the eight of the paper's figure


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--uci", default=str(UCI), help="folder holding the UCI dataset folders")
    p.add_argument("--datasets", nargs="+", default=PAPER)
    p.add_argument("--methods", nargs="+", default=list(sgp_uci.METHODS))
    p.add_argument("--splits", type=int, default=2, help="first n standard splits")
    p.add_argument("--rounds", type=int, default=100)
    p.add_argument("--local-steps", type=int, default=200)
    p.add_argument("--max-train", type=int, default=None,
                   help="subsample training rows of large sets (default: all)")
    p.add_argument("--timing-clients", type=int, nargs="*", default=[10, 1000])
    p.add_argument("--timing-repeats", type=int, default=5)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "sgp_uci.json"))
    return p.parse_args()


def configs(args: argparse.Namespace) -> dict:
    from fedppl.fsgp import FSGPConfig
    from fedppl.sgp import SGPConfig

    return {m: FSGPConfig(local_steps=args.local_steps) if m == "fsgp"
            else SGPConfig(local_steps=args.local_steps) for m in args.methods}


def _cell(vals: list[float], digits: int = 3) -> str:
    v = np.asarray(vals, dtype=float)
    sem = v.std(ddof=1) / np.sqrt(len(v)) if len(v) > 1 else float("nan")
    return f"{v.mean():.{digits}f} ± {sem:.{digits}f}"


def table(results: dict, methods: list[str], metric: str) -> str:
    lines = ["| dataset | " + " | ".join(methods) + " |", "|---|" + "---:|" * len(methods)]
    for name, runs in results.items():
        cells = [_cell([r[m][metric] for r in runs]) for m in methods]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def rounds_table(results: dict, methods: list[str]) -> str:
    lines = ["| dataset | " + " | ".join(methods) + " |", "|---|" + "---:|" * len(methods)]
    for name, runs in results.items():
        cells = []
        for m in methods:
            r2c = [r[m]["rounds_to_convergence"] for r in runs]
            spr = np.median([r[m]["seconds_per_round"] for r in runs])
            med = np.median([x for x in r2c if x is not None]) if any(
                x is not None for x in r2c) else float("nan")
            cells.append(f"{med:.0f} ({spr:.2f} s)")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def timing(clients: list[int], repeats: int, local_steps: int) -> dict[int, float]:
    """Median seconds per synchronous DPO round on 1-D data, 20 points per client."""
    from fedppl import partition
    from fedppl.sgp import SGPConfig, fit_sgp

    out = {}
    for k in clients:
        rng = np.random.default_rng(0)
        X = rng.normal(size=(20 * k, 1))
        y = np.sin(2 * X[:, 0]) + 0.1 * rng.normal(size=len(X))
        cfg = SGPConfig(num_inducing=20, schedule="synchronous", local_steps=local_steps,
                        damping=1.0 / max(k, 1) ** 0.5)
        res = fit_sgp("dpo", partition.homogeneous(X, y, k), repeats + 1, cfg,
                      key=jax.random.key(0))
        out[k] = float(np.median(np.asarray(res.history["seconds"])[1:]))  # drop compile round
        print(f"K={k}: {out[k]:.4f} s per synchronous round", flush=True)
    return out


def main() -> None:
    args = parse()
    jax.config.update("jax_enable_x64", True)
    t0 = time.perf_counter()
    results: dict[str, list] = {}
    for name in args.datasets:
        folder = Path(args.uci) / name
        if not folder.is_dir():
            print(f"skipping {name}: {folder} not found (pass --uci PATH)")
            continue
        results[name] = []
        for split in range(args.splits):
            rows = sgp_uci.run(str(folder), split, 10, args.methods, args.rounds, configs(args),
                               seed=split, max_train=args.max_train, progress_bar=False)
            for r in rows.values():
                r.pop("history", None)
            results[name].append(rows)
            print(f"{name} split {split}: " + ", ".join(
                f"{m} {r['log_lik']:.3f}" for m, r in rows.items()), flush=True)
    speeds = timing(args.timing_clients, args.timing_repeats, args.local_steps)
    text = "\n\n".join([
        "### test log-likelihood (original units)\n\n" + table(results, args.methods, "log_lik"),
        "### test RMSE (original units)\n\n" + table(results, args.methods, "rmse"),
        "### rounds to convergence (seconds per round)\n\n" + rounds_table(results, args.methods),
        "### seconds per synchronous DPO round (vmap over clients)\n\n| clients | s / round |\n"
        "|---:|---:|\n" + "\n".join(f"| {k} | {v:.4f} |" for k, v in speeds.items())])
    print("\n" + text)
    out = {"measured": "federated sparse GP methods on UCI sets (K=10 homogeneous), test metrics "
                       "in original units; synchronous round timings",
           "settings": vars(args), "wall_seconds": time.perf_counter() - t0,
           "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                       "devices": str(jax.devices()), "jax": jax.__version__},
           "results": results, "timing": speeds, "tables_markdown": text}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
