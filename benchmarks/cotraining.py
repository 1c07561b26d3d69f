"""Private GP co-training (thesis Ch. 4): the factorial study behind Tables 4.3-4.15.

Runs every configuration of combination (Blocky, Noisy, Hybrid) x uncertainty integration
(none, marginal, full) x masking x conditional independence x r x n_obs x DP x seed on the
simulated two-view design, and the CCPP two-view design, 25 rounds each; then prints the
thesis's stratified tables (mean ± sd of the test RMSE, averaged over the two parties) and
writes all runs to JSON. The thesis's full grid is 8,640 simulated runs; the defaults are a
reduced grid that fits a CPU budget, and every flag takes the full lists.

Run::

    python benchmarks/cotraining.py                                   # reduced grid
    python benchmarks/cotraining.py --seeds 10 --r 0.5 0.75 0.9 0.99 --n-obs 25 50 200  # full
    python benchmarks/cotraining.py --quick                           # smoke run
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
from _provenance import stamp

from fedppl_experiments import cotraining_study as study

BENCHMARK = {
    "summary": ("private GP co-training (thesis Ch. 4): RMSE and privacy of every combination and "
                "uncertainty mode over correlation, labelled size and DP, synthetic and CCPP"),
    "data": ["../shared/data/uci/power-plant"],
    "quick": ["--quick"],
    "full": [[]],
    "cost": "quick ~1 min; full ~30 min",
}

CCPP = Path(__file__).resolve().parents[2] / "shared" / "data" / "uci" / "power-plant"
TABLES = [
    ("4.3 by combination (no DP)", ["dp"], {"dp": False}),
    ("4.4 masking x r (no DP)", ["masked", "r"], {"dp": False}),
    ("4.5 conditional independence (no DP)", ["cond_indep"], {"dp": False}),
    ("4.6 masking x conditional independence (no DP)", ["masked", "cond_indep"], {"dp": False}),
    ("4.7 uncertainty integration x n_obs (no DP)", ["uncertainty", "n_obs"], {"dp": False}),
    ("4.8 by combination, with DP", ["dp"], {"dp": True}),
    ("4.9-4.12 masking x uncertainty, with DP", ["masked", "uncertainty"], {"dp": True}),
]


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--r", type=float, nargs="+", default=[0.5, 0.9])
    p.add_argument("--n-obs", type=int, nargs="+", default=[25, 200])
    p.add_argument("--rounds", type=int, default=25)
    p.add_argument("--ccpp", default=str(CCPP), help="power-plant folder ('' to skip CCPP)")
    p.add_argument("--ccpp-n-obs", type=int, nargs="+", default=[25, 50, 100, 200])
    p.add_argument("--quick", action="store_true", help="a tiny grid, to check the script")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "cotraining.json"))
    return p.parse_args()


def main() -> None:
    args = parse()
    jax.config.update("jax_enable_x64", True)
    if args.quick:
        args.seeds, args.r, args.n_obs, args.rounds, args.ccpp_n_obs = 1, [0.9], [25], 3, [25]
    t0 = time.perf_counter()
    configs = study.grid(rs=args.r, n_obs=args.n_obs, seeds=range(args.seeds))
    if args.ccpp and Path(args.ccpp).is_dir():
        configs += study.grid(cond_indep=[True], rs=[0.0], n_obs=args.ccpp_n_obs,
                              seeds=range(args.seeds), dataset=args.ccpp)
    elif args.ccpp:
        print(f"CCPP skipped: {args.ccpp} not found")
    rows = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for i, cfg in enumerate(configs):
            rows.append(study.run_one(cfg, rounds=args.rounds))
            if (i + 1) % 50 == 0 or i + 1 == len(configs):
                print(f"{i + 1}/{len(configs)} runs, {time.perf_counter() - t0:.0f} s", flush=True)
    sim = [r for r in rows if r["dataset"] == "simulated"]
    ccpp = [r for r in rows if r["dataset"] != "simulated"]
    text = []
    for title, by, where in TABLES:
        sub = [r for r in sim if all(r[k] == v for k, v in where.items())]
        text.append(f"### Table {title}\n\n" + study.stratified_table(sub, by))
    for v in (0, 1) if ccpp else ():
        by = ["masked", "dp", "n_obs"]
        text.append(f"### Tables 4.13-4.15 (CCPP), view {v + 1} before co-training\n\n"
                    + study.stratified_table(ccpp, by, value=f"rmse_before_{v}",
                                             columns="dataset"))
        text.append(f"### Tables 4.13-4.15 (CCPP), view {v + 1} after co-training\n\n"
                    + study.stratified_table(ccpp, by, value=f"rmse_after_{v}"))
    body = "\n\n".join(text)
    print("\n" + body)
    out = {"measured": "test RMSE (standardised units) of each party after co-training, "
                       "and before (rmse_before)", "settings": vars(args),
           "dp": study.DEFAULT_DP._asdict(), "wall_seconds": time.perf_counter() - t0,
           "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                       "jax": jax.__version__},
           "runs": rows, "tables_markdown": body}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(stamp(out), indent=1, default=float))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
