"""Secure aggregation inside synchronous PVI: what the norm bound costs, what a negated update
does, and what SecAgg+ costs on the wire.

Task: Bayesian logistic regression on scikit-learn's breast-cancer data (30 standardised features
plus a bias, D = 31, full-rank q, weights ~ N(0, I)), split homogeneously across K clients,
synchronous PVI with damping 0.5, no line search, ``--rounds`` rounds. Each run is held against
GlobalVI with the same solver settings (PVI's fixed point): the worst error of q's mean in
posterior sds and of its marginal sds (relative), after the last round, and the first round
at which both are below 0.05.

* ``plain``: the embedded runtime, deltas in the clear;
* ``secure``: :class:`fedppl.runtime.secure.SecureAggregation` (the protocol simulated: clients
  judge and clip their deltas, two-limb encoding, masks, the server's checks of the total) with
  ``scale = 1e3`` and ``max_norm`` a multiple of the median norm of the clients' first deltas
  (``inf``: the scale, which no delta here reaches);
* ``negated``: the secure run with 5% of the messages negated at the clients (``Faults``), the
  largest mean difference from the clean secure run, in sds.

``--traffic``: the bytes and messages of one SecAgg+ exchange of a PVI summand (the full-rank
delta over D = 31 and its flags: 996 entries) on Flower's Simulation Engine at K nodes, against
the plain round's K deltas (what PVI's history counts).

    python benchmarks/secure_pvi.py                    # K = 10 (3 seeds) and 100; ~15 min
    python benchmarks/secure_pvi.py --quick            # K = 10, one seed, 8 rounds
    python benchmarks/secure_pvi.py --traffic          # SecAgg+ bytes at K = 10 and 50
    python benchmarks/secure_pvi.py --clients 10 --bounds 0.25 0.1 0.05 \
        --out benchmarks/results/secure_pvi_tight.json  # where the bound starts to cost

Prints a markdown table; writes JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import time
import warnings
from pathlib import Path

import jax
import numpy as np
from _provenance import stamp
from pvi_accuracy import breast_cancer, logistic

import fedppl
from fedppl.algorithms import secure_pvi
from fedppl.runtime.faults import Faults
from fedppl.runtime.secure import SecureAggregation, SecureSum

BENCHMARK = {
    "summary": ("secure synchronous PVI on breast cancer (D = 31): accuracy against the norm "
                "bound at K = 10 and 100, a negated update's effect, SecAgg+'s bytes per round "
                "at K = 10 and 50"),
    "data": None,
    "quick": ["--quick"],
    "full": [[], ["--traffic"],
             ["--clients", "10", "--bounds", "0.25", "0.1", "0.05", "--out",
              "benchmarks/results/secure_pvi_tight.json"]],
    "cost": "quick ~2 min; full ~15 min plus ~5 min for --traffic",
}

jax.config.update("jax_enable_x64", True)

SCALE, DAMPING, TOL = 1e3, 0.5, 0.05
BOUNDS = [math.inf, 2.0, 1.0, 0.5]  # max_norm as multiples of the median first-delta norm


def method() -> fedppl.PVI:
    return fedppl.PVI(logistic, fedppl.PVIGuide(logistic, family="fullrank"), "synchronous",
                      DAMPING, line_search=False, elbo_samples=0)


def moments(q) -> tuple[np.ndarray, np.ndarray]:
    from fedppl.families import gaussian as g

    mean, cov = g.to_moments(g.to_full(q))
    return np.asarray(mean), np.sqrt(np.diag(np.asarray(cov)))


def errors(q, ref) -> tuple[float, float]:
    (m, sd), (m0, sd0) = moments(q), ref
    return float(np.max(np.abs(m - m0) / sd0)), float(np.max(np.abs(sd / sd0 - 1)))


def run(clients, rounds: int, seed: int, ref, runtime=None) -> dict:
    """Round by round, the errors against ``ref`` after each."""
    pvi = method()
    state = pvi.init(jax.random.key(seed), clients, runtime=runtime)
    curve, t0 = [], time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(rounds):
            state, _ = pvi.update(state)
            curve.append(errors(state.server.q, ref))
    reached = [r + 1 for r, (m, s) in enumerate(curve) if m < TOL and s < TOL]
    return {"mean_err": curve[-1][0], "sd_err": curve[-1][1],
            "rounds_to_tol": reached[0] if reached else None,
            "refused": len(state.log.method.rounds.rejected), "q": state.server.q,
            "seconds": time.perf_counter() - t0}


def first_norm(clients, seed: int) -> float:
    """The median norm of the clients' first deltas (plain PVI's first round)."""
    pvi = method()
    state, _ = pvi.update(pvi.init(jax.random.key(seed), clients))
    return float(np.median(np.asarray(jax.vmap(secure_pvi.norm)(state.log.last_messages.delta))))


def accuracy(K: int, seeds: int, rounds: int, bounds: list[float]) -> list[dict]:
    X, y = breast_cancer()
    rows: list[dict] = []
    per_seed: list[list[dict]] = []
    for seed in range(seeds):
        clients = fedppl.partition.homogeneous(X, y, num_clients=K, seed=seed)
        ref_q = fedppl.GlobalVI(logistic, fedppl.PVIGuide(logistic, family="fullrank")).run(
            jax.random.key(seed), clients, progress_bar=False).q
        ref = moments(ref_q)
        norm0 = first_norm(clients, seed)
        out = [{"runtime": "plain", "bound": None, **run(clients, rounds, seed, ref)}]
        clean = None
        for b in bounds:
            max_norm = SCALE if math.isinf(b) else b * norm0
            sim = SecureAggregation(SecureSum(SCALE, max_norm=max_norm))
            r = run(clients, rounds, seed, ref, sim.runtime)
            out.append({"runtime": "secure", "bound": b, "max_norm": max_norm, **r})
            clean = r if math.isinf(b) else clean
        if K <= 10 and clean is not None:  # a negated update: 5% of the messages, at clients
            sim = SecureAggregation(SecureSum(SCALE), Faults(corrupt=0.05, kinds=("negated",),
                                                             seed=seed))
            r = run(clients, rounds, seed, ref, sim.runtime)
            shift = errors(r["q"], moments(clean["q"]))[0]
            out.append({"runtime": "secure, 5% negated", "bound": math.inf,
                        "negated": len(sim.faults.events) if sim.faults else 0,
                        "shift_vs_clean": shift, **r})
        for row in out:
            row.update(K=K, seed=seed, first_norm=norm0)
        per_seed.append(out)
    for i in range(len(per_seed[0])):  # medians over the seeds
        group = [s[i] for s in per_seed]
        row = {k: v for k, v in group[0].items() if k != "q"}
        for key in ("mean_err", "sd_err", "seconds", "first_norm", "shift_vs_clean",
                    "max_norm", "refused"):
            if key in row:
                row[key] = float(np.median([g[key] for g in group]))
        reached = [g["rounds_to_tol"] for g in group]
        row["rounds_to_tol"] = (None if any(r is None for r in reached)
                                else float(np.median(reached)))
        row["repeats"] = len(group)
        rows.append(row)
    return rows


def traffic(K: int) -> dict:
    """One SecAgg+ exchange of a 996-entry summand over K simulated nodes: bytes and messages
    (measured by the ServerApp's grid), against K plain float64 deltas."""
    from fedppl.runtime import secagg

    size = 31 + 31 * 31 + 4
    got: dict = {}
    exchange = secagg.secure_exchange

    def watched(*args, **kwargs):
        summed = exchange(*args, **kwargs)
        got["traffic"] = summed.traffic.tolist()
        return summed

    secagg.secure_exchange = watched  # the ServerApp runs in this process
    try:
        stats = {k: np.full(size, 0.5) for k in range(K)}
        like = jax.ShapeDtypeStruct((size,), np.float64)
        t0 = time.perf_counter()
        secagg.secure_sum(secagg.SumTask(stats.__getitem__, like, K, scale=SCALE))
        seconds = time.perf_counter() - t0
    finally:
        secagg.secure_exchange = exchange
    up, down, bytes_up, bytes_down = got["traffic"]
    plain = K * (31 + 31 * 31) * 8
    return {"K": K, "entries": size, "messages_up": up, "messages_down": down,
            "bytes_up": bytes_up, "bytes_down": bytes_down, "plain_bytes_up": plain,
            "ratio_up": bytes_up / plain, "seconds": seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, nargs="+", default=[10, 100])
    ap.add_argument("--seeds", type=int, default=3, help="partitions and keys at K <= 10")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--bounds", type=float, nargs="+", default=BOUNDS,
                    help="max_norm as multiples of the median first-delta norm (inf: scale)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--traffic", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.quick:
        args.clients, args.seeds, args.rounds = [10], 1, 8
    out = args.out or ("/tmp/secure_pvi_quick.json" if args.quick else
                       "benchmarks/results/secure_pvi_traffic.json" if args.traffic else
                       "benchmarks/results/secure_pvi.json")
    report: dict = {"settings": {k: v for k, v in vars(args).items() if k != "out"},
                    "scale": SCALE, "damping": DAMPING, "tol": TOL, "rows": []}
    if args.traffic:
        print("| K | entries | SecAgg+ messages up | bytes up | bytes down | plain bytes up |"
              " ratio |\n|---|---|---|---|---|---|---|")
        for K in (10, 50):
            row = traffic(K)
            report["rows"].append(row)
            print(f"| {K} | {row['entries']} | {row['messages_up']} | {row['bytes_up']} | "
                  f"{row['bytes_down']} | {row['plain_bytes_up']} | {row['ratio_up']:.1f} |",
                  flush=True)
            Path(out).write_text(json.dumps(stamp(report), indent=1))
        return
    print("| K | runtime | max_norm / median first norm | mean err (sd) | sd err | rounds to "
          "0.05 | refused | negated shift (sd) | s |\n|---|---|---|---|---|---|---|---|---|")
    for K in args.clients:
        for row in accuracy(K, args.seeds if K <= 10 else 1, args.rounds, args.bounds):
            report["rows"].append(row)
            b = "-" if row["bound"] is None else ("scale" if math.isinf(row["bound"])
                                                  else f"{row['bound']:g}")
            print(f"| {K} | {row['runtime']} | {b} | {row['mean_err']:.3g} | "
                  f"{row['sd_err']:.3g} | {row['rounds_to_tol']} | {row['refused']:.0f} | "
                  f"{row.get('shift_vs_clean', float('nan')):.3g} | {row['seconds']:.0f} |",
                  flush=True)
            Path(out).parent.mkdir(parents=True, exist_ok=True)
            Path(out).write_text(json.dumps(stamp(report), indent=1, default=str))


if __name__ == "__main__":
    main()
