"""Time per synchronous PVI round against the number of clients K, at equal total data.

Bayesian logistic regression (``D`` features, ``N_total`` points split homogeneously across ``K``
clients, so each holds ``N_total / K``) runs a few synchronous PVI rounds under two schedules of
the embedded runtime:

* ``vmap`` (``schedule="synchronous"``): one ``jax.vmap`` over the client axis, one compiled round;
* ``loop`` (``schedule="loop"``): the same jitted client step called K times from Python, then one
  server update.

The round time is the median of the rounds after the first; the first round includes jit
compilation, and its excess over that median is reported as the compile time. Both schedules draw
the same keys, so they must reach the same ``q``: the largest difference is recorded as a check
that they did the same work.

``--local-sites`` times instead the default natural-gradient solver's synchronous round on a
random-intercept logistic model (one group, so one local intercept, per client) against the same
model without the intercept (no local sites), both one compiled ``vmap`` over clients.

Run::

    python benchmarks/pvi_rounds.py                 # K = 1, 10, 100, 1000; N_total = 10,000
    python benchmarks/pvi_rounds.py --local-sites   # K = 10, 100, 1000 with and without
    python benchmarks/pvi_rounds.py --quick         # smoke run, about 20 s
    python benchmarks/pvi_rounds.py --clients 1 10 --total 2000 --local-steps 20 --rounds 4

Prints a markdown table and writes JSON (settings, machine, per-K medians) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import optax
from _provenance import stamp

import fedppl
from fedppl.guides import PVIGuide

BENCHMARK = {
    "summary": ("seconds per synchronous PVI round against K at equal total data: one compiled "
                "vmap against a Python loop over clients, with and without local sites"),
    "data": None,
    "quick": ["--quick"],
    "full": [[], ["--local-sites", "--out", "benchmarks/results/pvi_rounds_local.json"]],
    "cost": "quick ~30 s; full ~3 min",
}

jax.config.update("jax_enable_x64", True)

SCHEDULES = {"vmap": "synchronous", "loop": "loop"}
QUICK = {"clients": [1, 10, 100], "total": 1000, "local_steps": 5, "rounds": 3}


def model(X, y=None):
    """Bayesian logistic regression with a standard normal prior on the weights."""
    w = numpyro.sample("w", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)


def intercept_model(X, y=None, *, n_groups=1):
    """Logistic regression plus one random intercept per group (a local site), HalfNormal scale."""
    mu = numpyro.sample("mu", dist.Normal(0, 1))
    tau = numpyro.sample("tau", dist.HalfNormal(1))
    w = numpyro.sample("w", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("groups", n_groups):
        a = numpyro.sample("a", dist.Normal(mu, tau))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w + a[0]), obs=y)


def time_local(K: int, local: bool, X, y, rounds: int) -> dict:
    """Synchronous natural-gradient rounds (one vmap) with or without the local intercepts."""
    clients = fedppl.partition.homogeneous(X, y, num_clients=K, seed=0)
    if local:
        guide = PVIGuide(intercept_model, global_sites=["mu", "tau", "w"], family="fullrank")
        pvi = fedppl.PVI(intercept_model, guide, "synchronous", damping=1.0 / K, elbo_samples=0,
                         local_steps=20)
    else:
        guide = PVIGuide(model, family="fullrank")
        pvi = fedppl.PVI(model, guide, "synchronous", damping=1.0 / K, elbo_samples=0,
                         local_steps=20)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        res = pvi.run(jax.random.key(0), clients, rounds, progress_bar=False)
    seconds = res.history["seconds"]
    median = float(np.median(seconds[1:]))
    return {"K": K, "local_sites": local, "round_s": median,
            "compile_s": float(seconds[0]) - median, "rounds": rounds,
            "local_iterations_median": float(np.nanmedian(res.history["local_iterations"])),
            "peak_rss_mib": peak_rss_mib()}


def run_local(args: argparse.Namespace) -> list[dict]:
    X, y = make_data(args.total, args.dim)
    rows = []
    for K in args.clients:
        for local in (False, True):
            rows.append(time_local(K, local, X, y, args.rounds))
            r = rows[-1]
            print(f"K={K} local={local}: {r['round_s']:.4g} s/round, compile {r['compile_s']:.3g}"
                  f" s", flush=True)
    return rows


def make_data(total: int, dim: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``total`` points with standard normal features and labels from a random true weight."""
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(total, dim))
    logits = X @ rng.normal(size=dim)
    return X, (rng.random(total) < 1.0 / (1.0 + np.exp(-logits))).astype(np.float64)


def time_schedule(schedule: str, clients: fedppl.Clients, args: argparse.Namespace,
                  rounds: int) -> dict:
    """Run ``rounds`` rounds: the later rounds' median, the first round's excess over it, and how
    many RuntimeWarnings (shrunk or rejected updates, repaired cavities) PVI raised."""
    guide = PVIGuide(model, family="meanfield")
    guide.setup(*clients.client(0))
    # synchronous PVI needs damping ~1/K to stay stable with many clients
    damping = 1.0 / clients.num_clients
    pvi = fedppl.PVI(model, guide, schedule=schedule, damping=damping, solver="optax",
                     optimizer=optax.adam(1e-2),
                     local_steps=args.local_steps, num_particles=1, elbo_samples=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RuntimeWarning)
        result = pvi.run(jax.random.key(0), clients, num_rounds=rounds, progress_bar=False)
    seconds = result.history["seconds"]
    median = float(np.median(seconds[1:]))
    return {
        "first_round_s": float(seconds[0]),
        "compile_s": float(seconds[0]) - median,
        "round_s": median,
        "round_s_all": seconds.tolist(),
        "rounds": rounds,
        "pvi_warnings": len(caught),
        "rejected_updates": len(result.rejected),
        "q": result.q,
    }


def rounds_within(budget_s: float, previous: dict | None, scale: float, rounds: int) -> int:
    """Cap the rounds so that their predicted time (the previous K's round time, scaled linearly
    in K) fits the budget; at least two rounds so one is timed after compilation."""
    if previous is None:
        return rounds
    predicted = previous["round_s"] * scale
    return max(2, min(rounds, 1 + int(budget_s // max(predicted, 1e-9))))


def max_abs_diff(a, b) -> float:
    return max(float(jnp.max(jnp.abs(x - y))) for x, y in
               zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True))


def peak_rss_mib() -> float:
    """Peak resident memory of this process so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_benchmark(args: argparse.Namespace) -> list[dict]:
    """One row per K with both schedules timed."""
    X, y = make_data(args.total, args.dim)
    rows: list[dict] = []
    previous: dict[str, dict | None] = {name: None for name in SCHEDULES}
    prev_k = None
    for K in args.clients:
        clients = fedppl.partition.homogeneous(X, y, num_clients=K, seed=0)
        row = {"K": K, "points_per_client": clients.max_size}
        scale = K / prev_k if prev_k else 1.0
        for name, schedule in SCHEDULES.items():
            rounds = rounds_within(args.max_seconds, previous[name], scale, args.rounds)
            row[name] = previous[name] = time_schedule(schedule, clients, args, rounds)
        row["ratio_loop_over_vmap"] = row["loop"]["round_s"] / row["vmap"]["round_s"]
        row["max_abs_diff_q"] = max_abs_diff(row["vmap"].pop("q"), row["loop"].pop("q"))
        row["peak_rss_mib"] = peak_rss_mib()
        rows.append(row)
        prev_k = K
        print(f"K={K}: vmap {row['vmap']['round_s']:.4g} s, loop {row['loop']['round_s']:.4g} s",
              flush=True)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| K | points/client | vmap s/round | loop s/round | loop/vmap | vmap compile s "
             "| loop compile s |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['K']} | {r['points_per_client']} | {r['vmap']['round_s']:.4g} "
                     f"| {r['loop']['round_s']:.4g} | {r['ratio_loop_over_vmap']:.3g} "
                     f"| {r['vmap']['compile_s']:.3g} | {r['loop']['compile_s']:.3g} |")
    return "\n".join(lines)


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).parent, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.stdout.strip()


def machine() -> dict:
    return {
        "processor": platform.processor(),
        "uname": platform.uname()._asdict(),
        "cpu_count": os.cpu_count(),
        "devices": str(jax.devices()),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "numpyro": numpyro.__version__,
        "optax": optax.__version__,
        "fedppl": fedppl.__version__,
        "git_commit": git_commit(),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--clients", type=int, nargs="+", default=[1, 10, 100, 1000],
                   help="numbers of clients K")
    p.add_argument("--total", type=int, default=10_000, help="total data points N_total")
    p.add_argument("--local-steps", type=int, default=50, help="optimiser steps per client update")
    p.add_argument("--rounds", type=int, default=11,
                   help="rounds per run; the first (compilation) is not in the median")
    p.add_argument("--dim", type=int, default=10, help="features D")
    p.add_argument("--max-seconds", type=float, default=120.0,
                   help="per run: fewer rounds (at least 2) when the predicted time exceeds this")
    p.add_argument("--out", type=Path,
                   default=Path(__file__).parent / "results" / "pvi_rounds.json")
    p.add_argument("--quick", action="store_true",
                   help=f"smoke run: {QUICK} (overrides those flags)")
    p.add_argument("--local-sites", action="store_true",
                   help="time the random-intercept model with and without local sites instead "
                        "(default K = 10, 100, 1000; writes pvi_rounds_local.json)")
    args = p.parse_args(argv)
    if args.local_sites:
        if args.clients == [1, 10, 100, 1000]:
            args.clients = [10, 100, 1000]
        if args.out.name == "pvi_rounds.json":
            args.out = args.out.with_name("pvi_rounds_local.json")
        if args.rounds == 11:
            args.rounds = 4
    if args.quick:
        vars(args).update(QUICK)
    if args.rounds < 2:
        p.error("--rounds must be at least 2 (the first round is compilation)")
    if max(args.clients) > args.total:
        p.error(f"--total {args.total} is smaller than the largest K {max(args.clients)}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.local_sites:
        return main_local(args)
    load_before = os.getloadavg()
    start = time.perf_counter()
    rows = run_benchmark(args)
    wall = time.perf_counter() - start
    print()
    print(table(rows))
    print(f"\ntotal wall time {wall:.1f} s; load average before {load_before[0]:.2f}, "
          f"after {os.getloadavg()[0]:.2f} (other processes inflate the timings)")
    report = {
        "measured": "wall seconds per synchronous PVI round vs number of clients K at equal total "
                    "data: jax.vmap over clients (schedule='synchronous') against a Python loop "
                    "over one jitted client step (schedule='loop'); median over rounds after the "
                    "first; compile_s is the first round (which includes jit compilation) minus "
                    "that median",
        "model": "Bayesian logistic regression, Normal(0, 1) prior on D weights, "
                 "meanfield PVIGuide",
        "settings": {"clients": args.clients, "total": args.total, "dim": args.dim,
                     "local_steps": args.local_steps, "rounds": args.rounds,
                     "max_seconds": args.max_seconds, "quick": args.quick, "damping": "1/K",
                     "optimizer": "adam(1e-2)", "num_particles": 1, "elbo_samples": 0,
                     "dtype": "float64 (jax_enable_x64)"},
    }
    write_report(args.out, report, wall, load_before, rows)


def write_report(out: Path, report: dict, wall: float, load_before, rows: list[dict]) -> None:
    """Add the machine, wall time, load and rows to ``report`` and write it as JSON."""
    report.update({"machine": machine(), "total_wall_s": wall,
                   "load_average_1_5_15min": {"before": load_before, "after": os.getloadavg()},
                   "results": rows})
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(stamp(report), indent=2) + "\n")
    print(f"wrote {out}")


def main_local(args: argparse.Namespace) -> None:
    load_before = os.getloadavg()
    start = time.perf_counter()
    rows = run_local(args)
    wall = time.perf_counter() - start
    lines = ["| K | local sites | s/round | compile s | local iterations (median) |",
             "|---:|---|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['K']} | {'yes' if r['local_sites'] else 'no'} | {r['round_s']:.4g} "
                     f"| {r['compile_s']:.3g} | {r['local_iterations_median']:.0f} |")
    print("\n" + "\n".join(lines))
    report = {
        "measured": "wall seconds per synchronous PVI round (one jax.vmap over clients, the "
                    "default natural-gradient local step, at most 20 iterations) on a "
                    "random-intercept logistic model with one local intercept per client, "
                    "against the same model without it; median over rounds after the first",
        "model": "logistic regression (D weights, mu, tau ~ HalfNormal) + a ~ Normal(mu, tau) "
                 "per client; fullrank PVIGuide, local='joint'",
        "settings": {"clients": args.clients, "total": args.total, "dim": args.dim,
                     "rounds": args.rounds, "damping": "1/K", "elbo_samples": 0,
                     "dtype": "float64 (jax_enable_x64)"},
    }
    write_report(args.out, report, wall, load_before, rows)


if __name__ == "__main__":
    main()
