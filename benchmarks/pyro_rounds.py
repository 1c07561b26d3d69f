"""Seconds per synchronous PVI round: the NumPyro core against the Pyro port.

Bayesian logistic regression on scikit-learn's bundled breast-cancer data (569 points, the 30
features standardised, plus a bias column: D = 31, ``w ~ N(0, I)``), split homogeneously across
K = 10 and K = 100 clients; a full-rank q; the stochastic local step both cores share: 100
full-batch Adam steps (learning rate 1e-2) per client per round, 10 Monte Carlo draws per step,
the KL to the cavity in closed form; damping 0.1; synchronous schedule. Both run the core's round
(one ``jax.vmap`` over clients, compiled, optax's Adam); the port's local step evaluates the Pyro
model's log density and gradient by torch, called from the compiled round
(:mod:`fedppl.pyro.bridge`: one callback per evaluation for every client and draw, mapped by
``torch.func.vmap``). The round time is the median over the rounds after the first (the first
compiles).

Then the robustness runs: the same set-up at damping 0.5 and 1.0 for 20 rounds, reporting
whether anything crashed, whether the final q is finite and positive definite, and how many
updates the server refused or shrank (a previous public PyTorch PVI failed with a Cholesky
error at round 2 for damping >= 0.5 here). And, at K = 10, the port's Python loop over clients
(``schedule="loop"``) against its vectorised round.

Run::

    python benchmarks/pyro_rounds.py            # about 10 minutes on 2 CPU cores
    python benchmarks/pyro_rounds.py --quick    # smoke run: K = 10 only, few rounds

Prints markdown tables and writes JSON to ``--out`` (default
``benchmarks/results/pyro_rounds.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time
import traceback
import warnings
from pathlib import Path

import jax
import numpy as np
import numpyro
import numpyro.distributions as nd
import optax
import pyro
import pyro.distributions as pd
import pyro.optim
import torch
from _provenance import stamp

import fedppl
import fedppl.pyro as fp
from fedppl.families import gaussian as jg
from fedppl.pyro.families import gaussian as tg

BENCHMARK = {
    "summary": ("the Pyro port against the NumPyro core: seconds per synchronous PVI round at K = "
                "10 and 100, and robustness over longer runs"),
    "data": None,
    "quick": ["--quick"],
    "full": [[]],
    "cost": "quick ~1 min; full ~10 min",
}

jax.config.update("jax_enable_x64", True)

LR, STEPS, PARTICLES = 1e-2, 100, 10


def data() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_breast_cancer

    X, y = load_breast_cancer(return_X_y=True)
    X = (X - X.mean(0)) / X.std(0)
    return np.c_[X, np.ones(len(y))], y.astype(float)


def model_np(X, y=None):
    w = numpyro.sample("w", nd.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", nd.Bernoulli(logits=X @ w), obs=y)


def model_py(X, y=None):
    w = pyro.sample("w", pd.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("y", pd.Bernoulli(logits=X @ w), obs=y)


def run(ppl: str, clients: fedppl.Clients, damping: float, rounds: int,
        schedule: str = "synchronous") -> dict:
    """One run; its round times, refusals and final state's health."""
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RuntimeWarning)
        try:
            if ppl == "numpyro":
                pvi = fedppl.PVI(model_np, fedppl.PVIGuide(model_np, family="fullrank"), schedule,
                                 damping, solver="optax", optimizer=optax.adam(LR),
                                 local_steps=STEPS, num_particles=PARTICLES, elbo_samples=0)
                res = pvi.run(jax.random.key(0), clients, rounds, progress_bar=False)
                q = jg.FullGaussian(*(np.asarray(x) for x in res.q))
                finite = bool(np.all(np.isfinite(q.nat1)) and np.all(np.isfinite(q.prec)))
                pd_ok = bool(np.all(np.linalg.eigvalsh(q.prec) > 0)) if finite else False
            else:
                pvi = fp.PVI(model_py, fp.PVIGuide(model_py, family="fullrank",
                                                  dtype=torch.float64), schedule, damping,
                             solver="optim",
                             optimizer=pyro.optim.Adam({"lr": LR}),
                             local_steps=STEPS, num_particles=PARTICLES, elbo_samples=0)
                res = pvi.run(torch.Generator().manual_seed(0), clients, rounds,
                              progress_bar=False)
                finite = bool(tg.is_finite(res.q))
                pd_ok = bool(tg.is_pd(res.q))
        except Exception as err:  # a crash is a result here
            return {"ppl": ppl, "K": clients.num_clients, "damping": damping, "rounds": rounds,
                    "schedule": schedule, "crashed": True, "error": repr(err),
                    "traceback": traceback.format_exc()[-2000:],
                    "wall_s": time.perf_counter() - t0}
    seconds = np.asarray(res.history["seconds"], float)
    steps = np.asarray(res.history["step"], float)
    return {"ppl": ppl, "K": clients.num_clients, "damping": damping, "rounds": rounds,
            "schedule": schedule, "crashed": False,
            "round_s": float(np.median(seconds[1:])) if rounds > 1 else float(seconds[0]),
            "first_round_s": float(seconds[0]), "round_s_all": seconds.tolist(),
            "final_q_finite": finite, "final_q_positive_definite": pd_ok,
            "refused_updates": len(res.rejected),
            "shrunk_updates": int(np.sum((steps > 0) & (steps < 1))),
            "runtime_warnings": len(caught),
            "kl_change_last": float(res.history["kl_change"][-1]),
            "wall_s": time.perf_counter() - t0}


def git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def machine() -> dict:
    return {"processor": platform.processor(), "cpu_count": os.cpu_count(),
            "python": platform.python_version(), "jax": jax.__version__,
            "numpyro": numpyro.__version__, "torch": torch.__version__,
            "pyro": pyro.__version__, "torch_threads": torch.get_num_threads(),
            "jax_devices": str(jax.devices()), "git_commit": git_commit()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--clients", type=int, nargs="+", default=[10, 100])
    p.add_argument("--rounds", type=int, default=6, help="timed runs' rounds (first excluded)")
    p.add_argument("--robust-rounds", type=int, default=20)
    p.add_argument("--loop-rounds", type=int, default=3,
                   help="rounds of the port's Python loop over clients at the smallest K")
    p.add_argument("--torch-threads", type=int, default=1,
                   help="torch's intra-op threads (1: fastest on this shared 2-core machine)")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", type=Path,
                   default=Path(__file__).parent / "results" / "pyro_rounds.json")
    args = p.parse_args(argv)
    if args.quick:
        args.clients, args.rounds, args.robust_rounds, args.loop_rounds = [10], 3, 3, 2
    torch.set_num_threads(args.torch_threads)
    X, y = data()
    load_before, start = os.getloadavg(), time.perf_counter()
    timing, robust, loop = [], [], []
    for K in args.clients:
        clients = fedppl.partition.homogeneous(X, y, num_clients=K, seed=0)
        for ppl in ("numpyro", "pyro"):
            timing.append(run(ppl, clients, 0.1, args.rounds))
            r = timing[-1]
            print(f"K={K} {ppl}: {r.get('round_s', float('nan')):.4g} s/round "
                  f"(crashed: {r['crashed']})", flush=True)
        for damping in (0.5, 1.0):
            for ppl in ("numpyro", "pyro"):
                robust.append(run(ppl, clients, damping, args.robust_rounds))
                r = robust[-1]
                print(f"K={K} damping {damping} {ppl}: crashed {r['crashed']}, finite "
                      f"{r.get('final_q_finite')}, pd {r.get('final_q_positive_definite')}, "
                      f"refused {r.get('refused_updates')}, shrunk {r.get('shrunk_updates')}",
                      flush=True)
    K = min(args.clients)
    clients = fedppl.partition.homogeneous(X, y, num_clients=K, seed=0)
    loop.append(run("pyro", clients, 0.1, args.loop_rounds, schedule="loop"))
    print(f"K={K} pyro loop: {loop[-1].get('round_s', float('nan')):.4g} s/round", flush=True)
    wall = time.perf_counter() - start

    lines = ["| K | NumPyro core s/round | Pyro port s/round | port / core |",
             "|---:|---:|---:|---:|"]
    for K in args.clients:
        a, b = (next(r for r in timing if r["K"] == K and r["ppl"] == ppl)
                for ppl in ("numpyro", "pyro"))
        lines.append(f"| {K} | {a.get('round_s', float('nan')):.4g} | "
                     f"{b.get('round_s', float('nan')):.4g} | "
                     f"{b.get('round_s', np.nan) / a.get('round_s', np.nan):.3g} |")
    lines += ["", "| K | damping | PPL | crashed | final q finite and PD | refused | shrunk |",
              "|---:|---:|---|---|---|---:|---:|"]
    for r in robust:
        ok = r.get("final_q_finite") and r.get("final_q_positive_definite")
        lines.append(f"| {r['K']} | {r['damping']} | {r['ppl']} | {r['crashed']} | "
                     f"{ok} | {r.get('refused_updates', '')} | {r.get('shrunk_updates', '')} |")
    print("\n" + "\n".join(lines))
    print(f"\ntotal wall time {wall:.1f} s; load average before {load_before[0]:.2f}, after "
          f"{os.getloadavg()[0]:.2f} (other processes inflate the timings)")
    report = {
        "measured": "wall seconds per synchronous PVI round, NumPyro core (solver='optax', "
                    "jax.vmap over clients, jitted) vs the Pyro port (solver='optim': the "
                    "core's round, the log density from torch by callback); median over rounds "
                    "after the first; "
                    "robustness runs at damping 0.5 and 1.0; the port's loop schedule at the "
                    "smallest K",
        "model": "Bayesian logistic regression, breast cancer (569 points, 30 standardised "
                 "features + bias, D = 31), w ~ N(0, I), full-rank PVIGuide",
        "settings": {"clients": args.clients, "rounds": args.rounds,
                     "robust_rounds": args.robust_rounds, "local_steps": STEPS,
                     "num_particles": PARTICLES, "optimizer": f"adam({LR})",
                     "damping_timed": 0.1, "dtype": "float64", "quick": args.quick,
                     "torch_threads": args.torch_threads},
        "machine": machine(), "total_wall_s": wall,
        "load_average_1_5_15min": {"before": load_before, "after": os.getloadavg()},
        "timing": timing, "robustness": robust, "loop": loop, "table": "\n".join(lines)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(stamp(report), indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
