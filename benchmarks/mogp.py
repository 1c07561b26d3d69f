"""pFed-Mul vs pFed-St vs Gaussian-VI: synthetic study (Sec. 5.1.1) and digits few-shot study.

Tables (mean +- standard error over seeds): synthetic -- RMSE and mean posterior variance of the
latent regression/classification functions against the truth, rounds until the exact ELBO per
observation settles within 1e-3 (">R" = not settled), seconds per round; digits (10/20/50 shots
with 20/15/10 clients) -- accuracy, MSE, ECE, seconds per round, rounds to the accuracy plateau
(:func:`rounds_to_plateau`) and the accuracy curve. Defaults are reduced to fit ~15 min on 2 CPU
cores (paper: 20 synthetic / 70 real rounds).

Run::

    python benchmarks/mogp.py                         # defaults below
    python benchmarks/mogp.py --seeds 3 --rounds 20 --digits-rounds 40
    python benchmarks/mogp.py --study digits --seeds 3 --digits-rounds 30 \
        --out benchmarks/results/mogp_digits.json     # the digits study alone
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

BENCHMARK = {
    "summary": ("pFed-Mul, pFed-St and Gaussian VI on multi-task GPs: the synthetic study (Sec. "
                "5.1.1) and the digits few-shot study"),
    "data": None,
    "quick": ["--seeds", "1", "--rounds", "3", "--digits-rounds", "3", "--shots", "10"],
    "full": [[],
             ["--study", "digits", "--seeds", "3", "--digits-rounds", "30", "--out",
              "benchmarks/results/mogp_digits.json"]],
    "cost": "quick ~2 min; full ~25 min + ~40 min (digits)",
}

METHODS = ("pfed-mul", "pfed-st", "gaussian-vi")


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--rounds", type=int, default=15, help="synthetic rounds")
    p.add_argument("--digits-rounds", type=int, default=20)
    p.add_argument("--shots", type=int, nargs="+", default=[10, 20, 50])
    p.add_argument("--study", choices=("both", "synthetic", "digits"), default="both")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "mogp.json"))
    return p.parse_args()


def _cell(vals) -> str:
    vals = np.asarray(vals, float)
    sem = vals.std(ddof=1) / np.sqrt(len(vals)) if len(vals) > 1 else float("nan")
    return f"{vals.mean():.3f} ± {sem:.3f}"


def _rounds_cell(vals, rounds) -> str:
    return ", ".join(str(v) if v is not None else f">{rounds}" for v in vals)


def rounds_to_plateau(curve, tol: float = 0.01, tail: int = 5) -> int:
    """The first round (from 1) whose accuracy is within ``tol`` of the plateau, the mean of the
    last ``tail`` rounds."""
    c = np.asarray(curve, float)
    level = c[-min(tail, len(c)):].mean()
    return int(np.argmax(c >= level - tol)) + 1


def main() -> None:
    args = parse()
    jax.config.update("jax_enable_x64", True)
    from fedppl_experiments import mogp_digits, mogp_synthetic

    t0 = time.perf_counter()
    syn = {m: [] for m in METHODS}
    for seed in range(args.seeds if args.study != "digits" else 0):
        for m in METHODS:
            r = mogp_synthetic.run(m, seed=seed, rounds=args.rounds)
            syn[m].append({k: v for k, v in r.items() if k not in ("post", "grid", "f_true")})
            print(f"synthetic seed={seed} {m}: cls RMSE {r['cls_rmse']:.3f}", flush=True)
    shots = args.shots if args.study != "synthetic" else []
    dig = {s: {m: [] for m in METHODS} for s in shots}
    for s in shots:
        for seed in range(args.seeds):
            for m in METHODS:
                r = mogp_digits.run(m, shots=s, rounds=args.digits_rounds, seed=seed)
                r["rounds_to_plateau"] = rounds_to_plateau(r["acc_curve"])
                dig[s][m].append(r)
                print(f"digits {s}-shot seed={seed} {m}: acc {r['accuracy']:.3f}, plateau at "
                      f"round {r['rounds_to_plateau']}", flush=True)
    lines = _synthetic_lines(syn, args.rounds) if args.study != "digits" else []
    lines += _digits_lines(dig, shots) if shots else []
    print("\n" + "\n".join(lines))
    out = {"measured": "pFed-Mul / pFed-St / Gaussian-VI on the synthetic LMC study and the "
                       "digits few-shot study", "settings": vars(args),
           "machine": {"platform": platform.platform(), "processor": platform.processor(),
                       "cpus": os.cpu_count(), "jax": jax.__version__,
                       "device": str(jax.devices()[0])},
           "total_seconds": time.perf_counter() - t0, "synthetic": syn,
           "digits": {str(s): v for s, v in dig.items()}, "tables": "\n".join(lines)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(stamp(out), indent=1, default=float))
    print(f"\nwrote {args.out} ({out['total_seconds']:.0f} s)")


def _synthetic_lines(syn: dict, rounds: int) -> list[str]:
    lines = ["### synthetic (5 clients)", "",
             "| method | cls RMSE | cls var | reg RMSE | reg var | rounds to converge (per seed)"
             " | s/round |", "|---|---:|---:|---:|---:|---:|---:|"]
    for m in METHODS:
        rs = syn[m]
        lines.append(f"| {m} | " + " | ".join(_cell([r[k] for r in rs]) for k in (
            "cls_rmse", "cls_var", "reg_rmse", "reg_var")) + f" | "
            f"{_rounds_cell([r['rounds_to_convergence'] for r in rs], rounds)} | "
            f"{_cell([r['seconds_per_round'] for r in rs])} |")
    return [*lines, ""]


def _digits_lines(dig: dict, shots: list[int]) -> list[str]:
    lines: list[str] = []
    for metric in ("accuracy", "mse", "ece", "seconds_per_round"):
        lines += [f"### digits: {metric}", "",
                  "| method | " + " | ".join(f"{s}-shot" for s in shots) + " |",
                  "|---|" + "---:|" * len(shots)]
        for m in METHODS:
            lines.append(f"| {m} | " + " | ".join(_cell([r[metric] for r in dig[s][m]])
                                                   for s in shots) + " |")
        lines.append("")
    lines += ["### digits: rounds to the accuracy plateau (per seed; within 0.01 of the mean of "
              "the last 5 rounds)", "",
              "| method | " + " | ".join(f"{s}-shot" for s in shots) + " |",
              "|---|" + "---:|" * len(shots)]
    for m in METHODS:
        lines.append(f"| {m} | " + " | ".join(
            ", ".join(str(rounds_to_plateau(r["acc_curve"])) for r in dig[s][m])
            for s in shots) + " |")
    lines += ["", "### digits: mean test accuracy by round (first seed, 10 marks)", ""]
    for s in shots:
        for m in METHODS:
            c = dig[s][m][0]["acc_curve"]
            idx = np.unique(np.linspace(0, len(c) - 1, 10).astype(int))
            lines.append(f"- {s}-shot {m}: " + " ".join(f"{c[i]:.2f}" for i in idx))
    return lines


if __name__ == "__main__":
    main()
