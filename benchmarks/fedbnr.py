"""FedBNR on CCPP (power-plant) with 10 and 100 clients: all variants and ablations.

Reproduces the layout of Tables 1-2 and A.2-A.3 of the FedBNR paper: for each metric (RMSE,
ECE, MCE, Brier, plus test log-likelihood) a table with one row per method and one column per
number of clients, mean +- standard error over seeds. The protocol (8:1:1 split, paired sorted
chunks, KD data = 80 % of validation) is :mod:`fedppl_experiments.fedbnr_uci`; the schedule is
shorter than the paper's (see ``--rounds``/``--local-steps``) to fit a CPU budget.

Run::

    python benchmarks/fedbnr.py --data ../shared/data/uci/power-plant            # 10 seeds
    python benchmarks/fedbnr.py --seeds 2 --clients 10 --rounds 5 --local-steps 5  # smoke run

Prints markdown tables and writes JSON (settings, machine, per-seed rows) to ``--out``.
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
from _provenance import stamp

from fedppl_experiments import fedbnr_uci

BENCHMARK = {
    "summary": ("FedBNR on CCPP (power plant) with 10 and 100 clients: every kernel variant and "
                "ablation, test RMSE and log-likelihood over 10 seeds"),
    "data": ["../shared/data/uci/power-plant"],
    "quick": ["--seeds", "1", "--clients", "10", "--rounds", "3", "--local-steps", "3"],
    "full": [[]],
    "cost": "quick ~2.5 min; full ~75 min",
}

ROWS = [("Central GP", "central"), ("local+local", "local+local"),
        ("local+global", "local+global"), ("avg+local", "avg+local"), ("kd+local", "kd+local"),
        ("FedBNR", "avg"), ("FedBNR-KD", "kd")]
METRICS = ["rmse", "ece", "mce", "brier", "log_lik"]
DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "uci" / "power-plant"


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=str(DEFAULT_DATA))
    p.add_argument("--clients", type=int, nargs="+", default=[10, 100])
    p.add_argument("--seeds", type=int, default=10)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--local-steps", type=int, default=20)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "fedbnr.json"))
    return p.parse_args()


def table(results: dict, metric: str, clients: list[int]) -> str:
    head = "| method | " + " | ".join(f"{k} clients" for k in clients) + " |"
    lines = [head, "|---|" + "---:|" * len(clients)]
    for label, variant in ROWS:
        cells = []
        for k in clients:
            vals = np.array([r[variant][metric] for r in results[k]])
            sem = vals.std(ddof=1) / np.sqrt(len(vals)) if len(vals) > 1 else float("nan")
            cells.append(f"{vals.mean():.3f} ± {sem:.3f}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    args = parse()
    jax.config.update("jax_enable_x64", True)
    if not Path(args.data).is_dir():
        raise SystemExit(f"data folder not found: {args.data} (pass --data PATH/TO/power-plant)")
    t0 = time.perf_counter()
    results: dict[int, list] = {}
    for k in args.clients:
        results[k] = []
        for seed in range(args.seeds):
            rows = fedbnr_uci.run(args.data, k, [v for _, v in ROWS], seed=seed,
                                  rounds=args.rounds, local_steps=args.local_steps)
            results[k].append(rows)
            print(f"K={k} seed={seed}: FedBNR RMSE {rows['avg']['rmse']:.3f}, "
                  f"KD {rows['kd']['rmse']:.3f}, central {rows['central']['rmse']:.3f}",
                  flush=True)
    text = "\n\n".join(f"### {m}\n\n" + table(results, m, args.clients) for m in METRICS)
    print("\n" + text)
    out = {"measured": "FedBNR variants and ablations on a UCI folder, test metrics in original "
                       "units, mean over per-client models where models stay local",
           "data": args.data, "settings": vars(args), "wall_seconds": time.perf_counter() - t0,
           "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                       "devices": str(jax.devices()), "jax": jax.__version__},
           "results": {str(k): v for k, v in results.items()}, "tables_markdown": text}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(stamp(out), indent=1))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
