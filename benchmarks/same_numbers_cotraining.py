"""Same seeds, same numbers: private GP co-training before and after the restructuring.

Runs a few small problems (two parties in every combination, one uncertainty mode each; three
parties; two DP settings) with the code at ``--before`` (an older checkout: its
``fedppl.cotraining.run(parties, y_test, settings, rounds, seed)``) and with this checkout
(``fedppl.CoTraining(...).run(jax.random.key(seed), clients, rounds, pool=..., test=...)``),
each in its own process, and prints the largest differences of what the parties end with:
fitted hyperparameters, queried pool points, every released mean and reported covariance row,
test predictions and RMSE before and after, and the DP epsilon.

Without DP nothing is random and the two must agree to round-off. With DP the old code drew
every party's noise from one NumPy generator shared by all parties, in protocol order; the new
code draws each party's releases from its own key (a deployment cannot share a noise stream
between parties, and a querier that knew the responder's stream could subtract the noise). No
choice of key reproduces the shared stream, so for DP the old code is also run with its
``respond`` fed the new per-release keys ("old, new noise"): that must agree to round-off,
showing that only the noise source changed.

    python benchmarks/same_numbers_cotraining.py --before /tmp/before
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "same_numbers_cotraining.json"
ROUNDS, FIT_STEPS, SEED = 4, 120, 3
CASES = {  # name: (combination, uncertainty, dp?, parties)
    "noisy-full": ("noisy", "full", None, 2),
    "hybrid-marginal": ("hybrid", "marginal", None, 2),
    "blocky-none": ("blocky", "none", None, 2),
    "noisy-full-3-parties": ("noisy", "full", None, 3),
    "noisy-full-dp-rkhs": ("noisy", "full", "rkhs", 2),
    "hybrid-marginal-dp-smith": ("hybrid", "marginal", "smith", 2),
}


def problem(parties: int) -> dict:
    """Two-view Gaussian data (r = 0.9), masked labelled halves; a third party (if any) sees
    view 1 unmasked."""
    rng = np.random.default_rng(11)

    def draw(n):
        y = rng.normal(size=n)
        views = [(0.9 * y + np.sqrt(1 - 0.81) * rng.normal(size=n))[:, None] for _ in range(2)]
        return views, y

    out = {"X": [], "y": []}
    for v in range(parties):
        views, y = draw(18)
        if v < 2:
            sign = np.where((1 - 2 * v) * views[v][:, 0] < 0, -1.0, 1.0)
            views, y = [x * sign[:, None] for x in views], y * sign
        out["X"].append(views[v % 2])
        out["y"].append(y)
    pool, _ = draw(40)
    test, y_test = draw(60)
    out.update(pool=[pool[v % 2] for v in range(parties)],
               test=[test[v % 2] for v in range(parties)], y_test=y_test)
    return out


def _dp(sensitivity):
    return None if sensitivity is None else dict(epsilon=1.0, delta=0.01,
                                                  sensitivity=sensitivity)


def old_run(mode: str) -> dict:
    import jax

    from fedppl.algorithms import cotraining as ct
    from fedppl.cotraining import PartyData, run

    if mode == "old-new-noise":  # the old code with the new per-release keys
        base = jax.random.split(jax.random.key(SEED))[0]
        original = ct.respond

        def respond(state, query, settings, rng):
            r = len(state.answered.get(query.sender, []))
            key = jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(base, r),
                                                        state.party), query.sender)
            return original(state, query, settings, key)

        ct.respond = respond
    out = {}
    for name, (comb, unc, sens, K) in CASES.items():
        if mode == "old-new-noise" and sens is None:
            continue
        d = problem(K)
        parties = [PartyData(d["X"][v], d["y"][v], d["pool"][v], d["test"][v]) for v in range(K)]
        dp = None if sens is None else ct.DPSettings(**_dp(sens))
        res = run(parties, d["y_test"], ct.Settings(comb, unc, dp), rounds=ROUNDS, seed=SEED,
                  fit_steps=FIT_STEPS)
        pred = [ct.predict(s, d["test"][v], ct.Settings(comb, unc, dp))
                for v, s in enumerate(res.states)]
        out[name] = _summary(res.messages, [s.params for s in res.states], pred,
                             res.rmse_before, res.rmse_after, res.epsilon, K)
    return out


def new_run(mode: str) -> dict:
    import jax
    import optax

    import fedppl
    from fedppl.algorithms import cotraining as ct

    out = {}
    for name, (comb, unc, sens, K) in CASES.items():
        d = problem(K)
        clients = fedppl.Clients.from_list(list(zip(d["X"], d["y"], strict=True)))
        dp = None if sens is None else ct.DPSettings(**_dp(sens))
        res = fedppl.CoTraining(comb, unc, dp, optimizer=optax.adam(0.05),
                                fit_steps=FIT_STEPS).run(
            jax.random.key(SEED), clients, ROUNDS, pool=d["pool"], test=d["test"],
            y_test=d["y_test"], progress_bar=False)
        pred = [res.predict(v, d["test"][v]) for v in range(K)]
        out[name] = _summary(res.messages, [p.params for p in res.parties], pred,
                             res.rmse_before, res.rmse_after, res.epsilon, K)
    return out


def _summary(messages, params, pred, before, after, eps, K) -> dict:
    """Arrays to compare; responses by (querier, responder) in protocol order."""
    qs = [m for m in messages if type(m).__name__ == "Query"]
    rs = [m for m in messages if type(m).__name__ == "Response"]  # both logs: protocol order
    cov = [np.asarray(m.cov_row) for m in rs if m.cov_row is not None]
    return {"queried": np.array([[q.pool_index for q in qs if q.sender == v] for v in range(K)],
                                float),
            "released_mean": np.array([m.mean for m in rs]),
            "dp_noise_std": np.array([m.dp_noise_std for m in rs]),
            "cov_rows": np.concatenate(cov) if cov else np.zeros(0),
            "hyperparameters": np.concatenate([np.concatenate([np.ravel(np.asarray(x))
                                                               for x in p]) for p in params]),
            "test_mean": np.concatenate([np.asarray(m) for m, _ in pred]),
            "test_var": np.concatenate([np.asarray(v) for _, v in pred]),
            "rmse_before": np.asarray(before, float), "rmse_after": np.asarray(after, float),
            "epsilon": np.array([np.nan if e is None else e for e in eps], float)}


def child(mode: str, path: str) -> None:
    import jax

    jax.config.update("jax_enable_x64", True)
    out = new_run(mode) if mode == "new" else old_run(mode)
    with open(path, "wb") as f:
        pickle.dump(out, f)


def run_with(pythonpath: str, mode: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.pkl")
        env = dict(os.environ, OPENBLAS_NUM_THREADS="1", PYTHONPATH=pythonpath)
        code = (f"import sys, warnings; warnings.simplefilter('ignore'); "
                f"sys.path.insert(0, {str(HERE)!r}); import same_numbers_cotraining as m; "
                f"m.child({mode!r}, {out!r})")
        subprocess.run([sys.executable, "-c", code], env=env, check=True, cwd=tmp)
        with open(out, "rb") as f:
            return pickle.load(f)


def compare(a: dict, b: dict) -> dict:
    rows = {}
    for name in a:
        diffs = {}
        for key, x in a[name].items():
            y = b[name][key]
            if x.shape != y.shape:
                diffs[key] = {"abs": "shape", "rel": "shape"}
                continue
            d = np.abs(x - y)
            d = np.where(np.isnan(x) & np.isnan(y), 0.0, d)
            diffs[key] = {"abs": float(np.max(d, initial=0.0)),
                          "rel": float(np.max(d / (np.abs(x) + 1e-300), initial=0.0))}
        rows[name] = diffs
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", default="/tmp/before", help="an older checkout of the repo")
    args = p.parse_args()
    old, new = run_with(args.before, "old"), run_with(str(HERE.parent), "new")
    replay = run_with(args.before, "old-new-noise")
    table = {"old vs new": compare(old, new), "old with new noise vs new": compare(replay, new)}
    print("| comparison | case | max abs diff | max rel diff | largest in |")
    print("|---|---|---:|---:|---|")
    summary = {}
    for what, rows in table.items():
        for name, diffs in rows.items():
            worst = max(diffs, key=lambda k: (diffs[k]["abs"] if isinstance(diffs[k]["abs"],
                                                                             float) else 1e300))
            ab = max(v["abs"] if isinstance(v["abs"], float) else np.inf for v in diffs.values())
            rel = max(v["rel"] if isinstance(v["rel"], float) else np.inf for v in diffs.values())
            summary.setdefault(what, {})[name] = {"max_abs": ab, "max_rel": rel, "worst": worst}
            print(f"| {what} | {name} | {ab:.2e} | {rel:.2e} | {worst} |")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"what": "co-training before vs after, same seeds",
                                   "machine": platform.platform(), "before": args.before,
                                   "rounds": ROUNDS, "fit_steps": FIT_STEPS, "seed": SEED,
                                   "summary": summary, "detail": table}, indent=1))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
