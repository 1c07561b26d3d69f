"""Structured variational GPs against SVIGP on the thesis's comparisons (Chs. 2-3).

Tasks (standard UCI splits, 90 % train / 10 % test as in the thesis, inputs and target
standardised on the training part; the score is the test RMSE in standardised units):

* ``ccpp-tvgp`` / ``ccpp-svigp`` (power-plant): TVGP with m0 = 5, q0 = 3, b = 10 (kernel
  variance 1 and noise variance 0.1 fixed, lengthscales learned; Adagrad 0.1, 50,000 steps)
  against SVIGP with M = 200 learned inducing inputs, b = 100, every hyperparameter learned
  (Adam 0.01, 25,000 steps). Thesis Tables 2.4 and 2.5: 0.25 and 0.269.
* ``boston-rnvgp`` / ``boston-svigp`` (bostonHousing): RNVGP with M = 455 (every training input,
  fixed), b = 100, d = 5 probes, eps_L = 1e-3, eps = 1e-6, roulette beta = 0.1 (Adagrad 0.1)
  against SVIGP with M = 455, b = 100 (Adam 0.01); 5,000 steps each by default. Thesis Tables
  3.9 and 3.13: 0.327 and 0.299.
* ``sumkron-R`` (bostonHousing), R = 1..5 Kronecker terms, m0 = 3 per dimension (M = 3^13),
  b = 100, Sigma started at 100 I (q(u) near the prior: with 1.6 million inducing points a
  start at I costs a KL of 10^6 nats that takes many steps to shed), Adagrad 0.1, 5,000 steps.
  Thesis Table 2.1: test 0.888, 1.000, 1.177, 1.366, 1.558 (train 0.672, 0.679, 0.690, 0.705,
  0.723).

Run::

    python benchmarks/structured_vgp.py                                  # every task, 3 splits
    python benchmarks/structured_vgp.py --tasks ccpp-tvgp ccpp-svigp --splits 5 --out a.json
    python benchmarks/structured_vgp.py --merge a.json b.json            # one table and JSON
    python benchmarks/structured_vgp.py --tasks sumkron-1 --splits 1 --steps sumkron-1=200  # smoke

Prints a markdown table (mean ± standard error over splits) and writes JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
import platform
import time
from pathlib import Path

import jax
import numpy as np
from _provenance import stamp

from fedppl_experiments import svgp

BENCHMARK = {
    "summary": ("structured variational GPs (TVGP, RNVGP, sums of Kronecker terms) against SVIGP "
                "on the thesis's comparisons (CCPP, concrete, Boston)"),
    "data": ["../shared/data/uci"],
    "quick": ["--tasks", "sumkron-1", "--splits", "1", "--steps", "sumkron-1=200"],
    "full": [[]],
    "cost": "quick ~1 min; full several hours",
}

UCI = Path(__file__).resolve().parents[2] / "shared" / "data" / "uci"
S = svgp.Settings
TASKS = {
    "ccpp-tvgp": ("power-plant", "tvgp", S(m0=5, q0=3, batch_size=10, steps=50_000,
                                          optimizer="adagrad", learning_rate=0.1)),
    "ccpp-svigp": ("power-plant", "svigp", S(num_inducing=200, batch_size=100, steps=25_000,
                                            optimizer="adam", learning_rate=0.01)),
    "concrete-tvgp": ("concrete", "tvgp", S(m0=5, q0=3, batch_size=10, steps=50_000,
                                            optimizer="adagrad", learning_rate=0.1)),
    "concrete-svigp": ("concrete", "svigp", S(num_inducing=200, batch_size=100, steps=25_000,
                                              optimizer="adam", learning_rate=0.01)),
    "boston-rnvgp": ("bostonHousing", "rnvgp", S(num_inducing=455, batch_size=100, probes=5,
                                                tol_first=1e-3, tol=1e-6, roulette=0.1,
                                                steps=5000, optimizer="adagrad",
                                                learning_rate=0.1)),
    "boston-svigp": ("bostonHousing", "svigp", S(num_inducing=455, batch_size=100, steps=5000,
                                                optimizer="adam", learning_rate=0.01)),
    **{f"sumkron-{r}": ("bostonHousing", "sumkron", S(m0=3, terms=r, batch_size=100,
                                                      steps=5000, optimizer="adagrad",
                                                      learning_rate=0.1, sigma=100.0))
       for r in range(1, 6)},
}
THESIS = {"ccpp-tvgp": 0.25, "ccpp-svigp": 0.269, "boston-rnvgp": 0.327, "boston-svigp": 0.299,
          **{f"sumkron-{r}": v for r, v in enumerate([0.8878, 1.0002, 1.1766, 1.3663, 1.5578], 1)}}
THESIS_TRAIN = {f"sumkron-{r}": v
                for r, v in enumerate([0.6722, 0.6790, 0.6897, 0.7050, 0.7232], 1)}


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--uci", default=str(UCI), help="folder holding the UCI dataset folders")
    p.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    p.add_argument("--splits", type=int, default=3, help="first n standard splits (3)")
    p.add_argument("--steps", nargs="*", default=[], metavar="TASK=N",
                   help="other step counts per task")
    p.add_argument("--jobs", type=int, default=1, help="(task, split) runs in parallel")
    p.add_argument("--merge", nargs="*", default=[], metavar="JSON",
                   help="only combine earlier result files into one table and --out")
    p.add_argument("--out", default=str(Path(__file__).parent / "results"
                                        / "structured_vgp.json"))
    return p.parse_args()


def _setup() -> None:
    jax.config.update("jax_enable_x64", True)
    jax.config.update("jax_cpu_enable_async_dispatch", False)  # see benchmarks/sgp_uci.py


def one(task: str, folder: str, split: int, steps: int | None) -> dict:
    """One task on one split (seed = split); the loss curve is kept, thinned to 100 points."""
    _setup()
    _, method, settings = TASKS[task]
    settings = settings._replace(seed=split, **({"steps": steps} if steps else {}))
    row = svgp.run(folder, split, method, settings)
    print(f"{task} split {split}: test RMSE {row['rmse']:.4f}, train {row['train_rmse']:.4f}, "
          f"{row['seconds']:.0f} s ({row['seconds_per_step'] * 1e3:.2f} ms/step)", flush=True)
    return row


def _cell(vals: list[float], digits: int = 3) -> str:
    v = np.asarray(vals, dtype=float)
    if len(v) == 1:
        return f"{v[0]:.{digits}f}"
    return f"{v.mean():.{digits}f} ± {v.std(ddof=1) / np.sqrt(len(v)):.{digits}f}"


def _thesis(task: str) -> str:
    return f"{THESIS[task]:.3f}" if task in THESIS else "-"     # the thesis has no concrete


def table(results: dict[str, list[dict]]) -> str:
    lines = ["| task | method | M | steps | splits | test RMSE (thesis) | test RMSE (here) "
             "| train RMSE (thesis) | train RMSE (here) | test log-lik | ms / step |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for task, rows in results.items():
        r0 = rows[0]
        train = f"{THESIS_TRAIN[task]:.3f}" if task in THESIS_TRAIN else "-"
        cells = [task, r0["method"], f"{r0['num_inducing']:,}", f"{r0['settings']['steps']:,}",
                 str(len(rows)), _thesis(task), _cell([r["rmse"] for r in rows]), train,
                 _cell([r["train_rmse"] for r in rows]), _cell([r["log_lik"] for r in rows]),
                 f"{np.median([r['seconds_per_step'] for r in rows]) * 1e3:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write(out: str, results: dict, meta: dict) -> None:
    text = table(results)
    print("\n" + text)
    payload = {"measured": "structured variational GPs (TVGP, RNVGP, sum of Kronecker terms) "
                           "and SVIGP on UCI splits; test RMSE in standardised units, mean ± "
                           "standard error over splits (seed = split)",
               **meta, "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                                   "devices": str(jax.devices()), "jax": jax.__version__,
                                   "gpu": "none lent to this task"},
               "thesis_test_rmse": THESIS, "thesis_train_rmse": THESIS_TRAIN,
               "results": results, "table_markdown": text}
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(stamp(payload), indent=1))
    print(f"\nwrote {out}")


def main() -> None:
    args = parse()
    _setup()
    if args.merge:
        results, parts = {}, []
        for path in args.merge:
            d = json.loads(Path(path).read_text())
            results.update(d["results"])
            parts += d.get("merged_from") or [{"file": path, "settings": d.get("settings"),
                                               "wall_seconds": d.get("wall_seconds")}]
        return write(args.out, {t: results[t] for t in TASKS if t in results},
                     {"merged_from": parts})
    steps = {k: int(v) for k, v in (item.split("=") for item in args.steps)}
    t0 = time.perf_counter()
    jobs = []
    for task in args.tasks:
        folder = Path(args.uci) / TASKS[task][0]
        if not folder.is_dir():
            print(f"skipping {task}: {folder} not found (pass --uci PATH)")
            continue
        jobs += [(task, str(folder), split, steps.get(task)) for split in range(args.splits)]
    if args.jobs > 1:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(args.jobs, mp_context=mp.get_context("spawn")) as pool:
            done = [(j[0], pool.submit(one, *j)) for j in jobs]
            rows = [(task, f.result()) for task, f in done]
    else:
        rows = [(j[0], one(*j)) for j in jobs]
    results: dict[str, list[dict]] = {}
    for task, row in rows:
        results.setdefault(task, []).append(row)
    write(args.out, results, {"settings": vars(args), "wall_seconds": time.perf_counter() - t0})


if __name__ == "__main__":
    main()
