"""Federated sparse GPs on the eight UCI sets of the federated SGP paper, plus round timings.

Part 1 (accuracy): every method of :mod:`fedppl_experiments.sgp_uci` (DPO, CPO, FedAvg-Z, fixed Z,
FSGP, global VI) on each dataset, K = 10 homogeneous clients, M = 100, M_k = min(0.8 N_k, 500),
each method's default settings (DPO: ``DPO_DEFAULTS``, q(Z)'s sds held; the others the paper's
alpha = 0.1), Adam 1e-2; mean +- standard error of the test log-likelihood and RMSE (original
units) over splits, rounds to convergence and seconds per round. ``--merge`` pools runs made
apart, and can rename a method on the way in (the paper's DPO rows as ``dpo-paper``).

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

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # small solves: threads only contend
import platform
import time
from pathlib import Path

import jax
import numpy as np
from _provenance import stamp

from fedppl_experiments import sgp_uci

BENCHMARK = {
    "summary": ("federated sparse GPs (DPO, CPO, FedAvg-Z, fixed, global, FSGP) on eight UCI sets "
                "of the federated SGP paper: test RMSE and log-likelihood, plus round timings"),
    "data": ["../shared/data/uci"],
    "quick": ["--datasets", "yacht", "--splits", "1", "--rounds", "10", "--local-steps", "20",
              "--timing-clients", "10", "--timing-repeats", "1"],
    "full": [[]],
    "cost": "quick ~3 min; full several hours",
}

UCI = Path(__file__).resolve().parents[2] / "shared" / "data" / "uci"
DATASETS = ["bostonHousing", "concrete", "energy", "kin8nm", "naval-propulsion-plant",
            "power-plant", "protein-tertiary-structure", "wine-quality-red", "yacht"]
PAPER = ["bostonHousing", "concrete", "energy", "kin8nm", "naval-propulsion-plant",
         "power-plant", "wine-quality-red", "yacht"]  # the eight of the paper's figure
LARGE = ["kin8nm", "naval-propulsion-plant", "power-plant", "protein-tertiary-structure"]


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--uci", default=str(UCI), help="folder holding the UCI dataset folders")
    p.add_argument("--datasets", nargs="*", default=PAPER)
    p.add_argument("--methods", nargs="+", default=list(sgp_uci.METHODS))
    p.add_argument("--splits", type=int, default=2, help="first n standard splits")
    p.add_argument("--split-ids", type=int, nargs="*", default=None,
                   help="run exactly these standard splits (overrides --splits)")
    p.add_argument("--rounds", type=int, default=100)
    p.add_argument("--local-steps", type=int, default=200)
    p.add_argument("--rounds-for", nargs="*", default=["global=30"], metavar="METHOD=N",
                   help="other round counts per method (global: 30 rounds = 30 x local-steps "
                        "full-batch steps)")
    p.add_argument("--merge", nargs="*", default=[], metavar="JSON[::OLD=NEW,...]",
                   help="only combine earlier result files into one table and --out; a suffix "
                        "::OLD=NEW renames method OLD of that file (e.g. ::dpo=dpo-paper)")
    p.add_argument("--max-train", type=int, default=None,
                   help="subsample training rows of large sets (default: all)")
    p.add_argument("--large", nargs="*", default=LARGE,
                   help="datasets whose training rows are capped at --max-train-large")
    p.add_argument("--max-train-large", type=int, default=None,
                   help="cap on training rows for --large datasets (default: all)")
    p.add_argument("--jobs", type=int, default=1, help="(dataset, split) runs in parallel")
    p.add_argument("--timing-clients", type=int, nargs="*", default=[10, 1000])
    p.add_argument("--timing-repeats", type=int, default=3)
    p.add_argument("--timing-local-steps", type=int, default=10)
    p.add_argument("--timing-inducing", type=int, default=10)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "sgp_uci.json"))
    return p.parse_args()


def configs(args: argparse.Namespace) -> dict:
    from fedppl.infer.fedavg_gp import FSGPConfig
    from fedppl.infer.sparse_gps import SGPConfig

    return {m: FSGPConfig(local_steps=args.local_steps) if m == "fsgp"
            else SGPConfig(local_steps=args.local_steps, inner_steps=args.local_steps)
            for m in args.methods}


def _cell(vals: list[float], digits: int = 3) -> str:
    """Mean ± standard error over splits; a split whose method failed (NaN) is left out and
    counted, e.g. ``-0.9 (2 of 3 splits; 1 failed)``."""
    v = np.asarray(vals, dtype=float)
    ok = v[np.isfinite(v)]
    if len(ok) == 0:
        return "failed"
    text = (f"{ok[0]:.{digits}f}" if len(ok) == 1 else
            f"{ok.mean():.{digits}f} ± {ok.std(ddof=1) / np.sqrt(len(ok)):.{digits}f}")
    failed = len(v) - len(ok)
    return text if not failed else f"{text} ({len(ok)} of {len(v)}; {failed} failed)"


def _fewer(cell: str, have: int, runs: list) -> str:
    """A cell over fewer splits than its row's: the count beside it (``-`` where none)."""
    if have == 0:
        return "-"
    return cell if have == len(runs) else f"{cell} ({have} split{'s' * (have > 1)})"


def table(results: dict, methods: list[str], metric: str) -> str:
    lines = ["| dataset (splits) | " + " | ".join(methods) + " |", "|---|" + "---:|" * len(methods)]
    for name, runs in results.items():
        cells = []
        for m in methods:
            vals = [r[m][metric] for r in runs if m in r]
            cells.append(_fewer(_cell(vals) if vals else "", len(vals), runs))
        lines.append(f"| {name} ({len(runs)}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def gap_table(results: dict, methods: list[str]) -> str:
    """Test log-likelihood of each federated method minus global VI's (nats; mean over splits)."""
    others = [m for m in methods if m != "global"]
    lines = ["| dataset (splits) | " + " | ".join(others) + " |", "|---|" + "---:|" * len(others)]
    for name, runs in results.items():
        if not any("global" in r for r in runs):
            continue
        cells = []
        for m in others:
            vals = [r[m]["log_lik"] - r["global"]["log_lik"] for r in runs
                    if m in r and "global" in r]
            cells.append(_fewer(_cell(vals) if vals else "", len(vals), runs))
        lines.append(f"| {name} ({len(runs)}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def rounds_table(results: dict, methods: list[str]) -> str:
    lines = ["| dataset (splits) | " + " | ".join(methods) + " |", "|---|" + "---:|" * len(methods)]
    for name, runs in results.items():
        cells = []
        for m in methods:
            if not any(m in r for r in runs):
                cells.append("-")
                continue
            r2c = [r[m]["rounds_to_convergence"] for r in runs if m in r]
            spr = np.nanmedian([r[m]["seconds_per_round"] for r in runs if m in r])
            med = np.median([x for x in r2c if x is not None]) if any(
                x is not None for x in r2c) else float("nan")
            cells.append(f"{med:.0f} ({spr:.2f} s)")
        lines.append(f"| {name} ({len(runs)}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def timing(clients: list[int], repeats: int, local_steps: int, inducing: int) -> dict[int, float]:
    """Median seconds per synchronous DPO round on 1-D data, 20 points (16 pseudo-points) per
    client. Each client's step needs every other client's pseudo-points at its own (beta, Z)
    sample, so a round costs O(K * sum_k M_k * M^2) per local step: quadratic in K."""
    from fedppl import partition
    from fedppl.infer.sparse_gps import FederatedSGP, SGPConfig

    out = {}
    for k in clients:
        rng = np.random.default_rng(0)
        X = rng.normal(size=(20 * k, 1))
        y = np.sin(2 * X[:, 0]) + 0.1 * rng.normal(size=len(X))
        cfg = SGPConfig(num_inducing=inducing, schedule="synchronous", local_steps=local_steps,
                        damping=1.0 / max(k, 1) ** 0.5)
        res = FederatedSGP("dpo", cfg).run(jax.random.key(0), partition.homogeneous(X, y, k),
                                           repeats + 1, progress_bar=False)
        out[k] = float(np.median(np.asarray(res.history["seconds"])[1:]))  # drop compile round
        print(f"K={k}: {out[k]:.4f} s per synchronous round", flush=True)
    return out


def _setup() -> None:
    jax.config.update("jax_enable_x64", True)
    # jaxlib 0.10.2 on a busy 2-core machine deadlocked (all threads in futex waits) in several
    # long runs with asynchronous CPU dispatch; synchronous dispatch costs little here.
    jax.config.update("jax_cpu_enable_async_dispatch", False)


def one(folder: str, split: int, args: argparse.Namespace) -> dict:
    """Every method on one (dataset, split); histories dropped to keep the JSON small."""
    _setup()
    cap = args.max_train_large if Path(folder).name in args.large else args.max_train
    rounds = {m: int(n) for m, n in (item.split("=") for item in args.rounds_for)}
    rows = sgp_uci.run(folder, split, 10, args.methods, args.rounds, configs(args), seed=split,
                       max_train=cap, progress_bar=False, rounds=rounds, keep_going=True)
    for r in rows.values():
        r["free_energy_curve"] = r.pop("history", {}).get("free_energy")
        r["split"] = split
    print(f"{Path(folder).name} split {split}: " + ", ".join(
        f"{m} {r['log_lik']:.3f} ({r['seconds']:.0f} s)" for m, r in rows.items()), flush=True)
    for m, r in rows.items():
        if "error" in r:
            print(f"  {m} failed: {r['error']}", flush=True)
    return rows


def main() -> None:
    args = parse()
    _setup()
    if args.merge:
        return merge(args)
    t0 = time.perf_counter()
    tasks = []
    for name in args.datasets:
        folder = Path(args.uci) / name
        if not folder.is_dir():
            print(f"skipping {name}: {folder} not found (pass --uci PATH)")
            continue
        splits = args.split_ids if args.split_ids is not None else range(args.splits)
        tasks += [(name, str(folder), split) for split in splits]
    results: dict[str, list] = {name: [] for name, _, _ in tasks}
    if args.jobs > 1:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(args.jobs, mp_context=mp.get_context("spawn")) as pool:
            futures = [(name, split, pool.submit(one, folder, split, args))
                       for name, folder, split in tasks]
            done = [(name, split, f.result()) for name, split, f in futures]
    else:
        done = [(name, split, one(folder, split, args)) for name, folder, split in tasks]
    for name, _, rows in done:
        results[name].append(rows)
    speeds = timing(args.timing_clients, args.timing_repeats, args.timing_local_steps,
                    args.timing_inducing) if args.timing_clients else {}
    write(args, results, speeds, {"settings": vars(args), "wall_seconds": time.perf_counter() - t0})


def write(args: argparse.Namespace, results: dict, speeds: dict, meta: dict) -> None:
    methods = list(dict.fromkeys(m for runs in results.values() for r in runs for m in r))
    methods = methods or args.methods
    parts = []
    if results:
        parts += ["### test log-likelihood (original units)\n\n"
                  + table(results, methods, "log_lik"),
                  "### test log-likelihood minus global VI's (nats)\n\n"
                  + gap_table(results, methods),
                  "### test RMSE (original units)\n\n" + table(results, methods, "rmse"),
                  "### rounds to convergence (seconds per round)\n\n"
                  + rounds_table(results, methods)]
    if speeds:
        parts.append(f"### seconds per synchronous DPO round (vmap over clients; M = "
                     f"{args.timing_inducing}, {args.timing_local_steps} local steps, 20 points "
                     f"per client)\n\n| clients | s / round |\n|---:|---:|\n"
                     + "\n".join(f"| {k} | {v:.4f} |" for k, v in speeds.items()))
    text = "\n\n".join(parts)
    print("\n" + text)
    out = {"measured": "federated sparse GP methods on UCI sets (K=10 homogeneous), test metrics "
                       "in original units; synchronous round timings",
           **meta, "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                               "devices": str(jax.devices()), "jax": jax.__version__},
           "results": results, "timing": speeds, "tables_markdown": text}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(stamp(out), indent=1))
    print(f"\nwrote {args.out}")


def _renames(item: str) -> tuple[str, dict[str, str]]:
    """``PATH::old=new,old2=new2`` -> ``(PATH, {old: new, ...})``."""
    path, _, spec = item.partition("::")
    pairs = [p.split("=") for p in spec.split(",") if p]
    if any(len(p) != 2 for p in pairs):
        raise SystemExit(f"--merge {item!r}: write renames as PATH::OLD=NEW,OLD2=NEW2")
    return path, dict(pairs)  # type: ignore[arg-type]


def merge(args: argparse.Namespace) -> None:
    """Combine result files of separate runs (sets, splits or methods run side by side, or an
    earlier merge): a dataset's splits from all files are pooled, and a split's methods; a
    (dataset, split, method) seen twice is kept once, from the last file naming it. A method
    can be renamed on the way in (``PATH::old=new``), e.g. to keep an earlier default's rows
    beside the new default's."""
    results: dict[str, dict[int, dict]] = {}
    speeds, parts = {}, []
    for item in args.merge:
        path, rename = _renames(item)
        d = json.loads(Path(path).read_text())
        for name, runs in d["results"].items():
            for i, rows in enumerate(runs):
                # rows written before splits were recorded are the first splits, in order
                split = next(iter(rows.values())).get("split", i)
                named = {rename.get(m, m): {**r, "method": rename.get(m, m), "split": split}
                         for m, r in rows.items()}
                results.setdefault(name, {}).setdefault(split, {}).update(named)
        speeds.update({int(k): v for k, v in d.get("timing", {}).items()})
        parts += d.get("merged_from") or [
            {"file": path, "settings": d["settings"], "wall_seconds": d["wall_seconds"]}]
    pooled = {name: [by_split[s] for s in sorted(by_split)]
              for name, by_split in sorted(results.items())}
    write(args, pooled, speeds, {"merged_from": parts})


if __name__ == "__main__":
    main()
