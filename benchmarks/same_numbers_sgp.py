"""Same numbers before and after the restructuring: the federated sparse GPs and FSGP.

Runs the old code (``fit_sgp`` / ``fit_fsgp`` of an old checkout, ``--before``) and the new fronts
(:class:`fedppl.FederatedSGP`, :class:`fedppl.FSGP`) on the same small problems and seeds, each
in its own process, and prints the largest absolute and relative differences of the final state,
the history and the test predictions. Covered: dpo (diagonal and full S_k), cpo, fedavg-z, fixed
(both schedules each), global (Gaussian and Bernoulli) and FSGP (both inducing-point inits).

Known, deliberate differences:

* the old FSGP history began with a round-0 row (the initial bound): the new one starts at round
  1, so the old rows 1.. are compared, and its rounds to convergence (``rounds_to_convergence``,
  1 % of the curve's range) no longer counts that row;
* the old SGP ``local_free_energy`` was one number per round (the one client's, or the sum over
  clients); the new one is a row of K (NaN for clients outside the round): the row's sum is
  compared;
* DPO-full and CPO factors keep the unconstrained vector of numpyro's ``lower_cholesky``
  bijection where the old code kept a matrix: the old matrix's lower triangle is compared.

Run::

    python benchmarks/same_numbers_sgp.py                 # old code at /tmp/before
    python benchmarks/same_numbers_sgp.py --before PATH   # another old checkout
    # a checkout that already has the fronts (a later restructuring): the same front both sides
    python benchmarks/same_numbers_sgp.py --before PATH --before-api front --out OUT.json
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "same_numbers_sgp.json"

# (name, method, settings); every case runs ROUNDS rounds
SGP_CASES = [
    ("dpo sequential", "dpo", {}),
    ("dpo synchronous", "dpo", {"schedule": "synchronous", "damping": 0.5}),
    ("dpo full S_k sequential", "dpo", {"covariance": "full", "num_samples": 2}),
    ("cpo sequential", "cpo", {}),
    ("cpo synchronous", "cpo", {"schedule": "synchronous", "damping": 0.5}),
    ("fedavg-z sequential", "fedavg-z", {}),
    ("fedavg-z synchronous", "fedavg-z", {"schedule": "synchronous"}),
    ("fixed sequential", "fixed", {}),
    ("fixed synchronous", "fixed", {"schedule": "synchronous", "damping": 0.5}),
    ("global gaussian", "global", {}),
    ("global bernoulli", "global", {"likelihood": "bernoulli"}),
]
FSGP_CASES = [("fsgp client-data", {}), ("fsgp random-normal", {"init_inducing": "random-normal"})]
BASE = {"num_inducing": 5, "local_steps": 15, "inner_steps": 10, "max_pseudo": 10}
ROUNDS, SEED = 4, 3


def data(bernoulli: bool = False):
    rng = np.random.default_rng(0)
    X = rng.uniform(-2, 2, (36, 2))
    f = np.sin(2 * X[:, 0]) + 0.5 * X[:, 1]
    y = (f > 0).astype(float) if bernoulli else f + 0.1 * rng.normal(size=36)
    return X, y, np.linspace(-2, 2, 14).reshape(7, 2)


def clients(X, y):
    from fedppl.partition import from_indices

    return from_indices(X, y, [np.arange(0, 10), np.arange(10, 24), np.arange(24, 36)])


# -- each side (run in its own process) ---------------------------------------------------------


def run_old() -> dict:
    import jax

    from fedppl.fsgp import FSGPConfig, fit_fsgp
    from fedppl.sgp import SGPConfig, fit_sgp

    out = {}
    for name, method, extra in SGP_CASES:
        X, y, Xt = data(extra.get("likelihood") == "bernoulli")
        cfg = SGPConfig(**BASE, **extra)
        res = fit_sgp(method, clients(X, y), ROUNDS, cfg, key=jax.random.key(SEED))
        out[name] = _sgp_numbers(res, Xt, _old_state, res.history,
                                 np.asarray(res.history["local_free_energy"]))
    for name, extra in FSGP_CASES:
        X, y, Xt = data()
        res = fit_fsgp(clients(X, y), ROUNDS, FSGPConfig(num_inducing=5, local_steps=15, **extra),
                       key=jax.random.key(SEED))
        p = res.params
        bound = np.asarray(res.history["bound"])
        out[name] = _fsgp_numbers((p.log_lengthscale, p.log_variance, p.log_noise, p.inducing),
                                  res, Xt, bound[1:], _old_r2c(bound))
    return out


def run_new() -> dict:
    import jax
    import optax

    from fedppl.infer.fedavg_gp import FSGP
    from fedppl.infer.sparse_gps import FederatedSGP

    out = {}
    for name, method, extra in SGP_CASES:
        X, y, Xt = data(extra.get("likelihood") == "bernoulli")
        front = FederatedSGP(method, **BASE, **extra, optimizer=optax.adam(1e-2))
        res = front.run(jax.random.key(SEED), clients(X, y), ROUNDS, progress_bar=False)
        local = np.nansum(res.history["local_free_energy"], axis=1)
        out[name] = _sgp_numbers(res, Xt, _new_state, res.history, local)
    for name, extra in FSGP_CASES:
        X, y, Xt = data()
        res = FSGP(num_inducing=5, local_steps=15, **extra).run(
            jax.random.key(SEED), clients(X, y), ROUNDS, progress_bar=False)
        h = res.params.hyper
        out[name] = _fsgp_numbers((h.log_lengthscale, h.log_variance, h.log_noise,
                                   res.params.inducing), res, Xt,
                                  np.asarray(res.history["bound"]), res.rounds_to_convergence())
    return out


def _sgp_numbers(res, Xt, state_fn, history, local) -> dict:
    mean, var = res.predict(Xt)
    numbers = {**state_fn(res.state), "predict mean": mean, "predict var": var,
               "free_energy": history["free_energy"], "local_free_energy": local}
    if res.spec.likelihood == "gaussian":
        numbers["log_likelihood"] = res.log_likelihood(Xt, np.sin(2 * Xt[:, 0]))
    return {k: np.asarray(v, dtype=float) for k, v in numbers.items()}


def _old_state(s) -> dict:
    s_raw = np.asarray(s.pseudo.s_raw)
    if s_raw.ndim == 3:  # the old full / CPO parameterisation: a matrix, read as numpyro's vector
        n = s_raw.shape[-1]
        lower = np.stack([m[np.tril_indices(n, -1)] for m in s_raw])
        s_raw = np.concatenate([lower, np.stack([np.diagonal(m) for m in s_raw])], axis=1)
    return _state(s, s_raw)


def _new_state(s) -> dict:
    return _state(s, np.asarray(s.pseudo.s_raw))


def _state(s, s_raw) -> dict:
    return {"t_beta": np.concatenate([s.t_beta.nat1, s.t_beta.prec], -1),
            "t_z": np.concatenate([s.t_z.nat1, s.t_z.prec], -1), "z_point": s.z_point,
            "pseudo V": s.pseudo.V, "pseudo m": s.pseudo.m, "pseudo s_raw": s_raw}


def _fsgp_numbers(params, res, Xt, bound, r2c) -> dict:
    mean, var = res.predict(Xt)
    names = ("log_lengthscale", "log_variance", "log_noise", "inducing")
    out = {n: np.asarray(p, dtype=float) for n, p in zip(names, params, strict=True)}
    out.update({"predict mean": np.asarray(mean), "predict var": np.asarray(var),
                "bound (rounds 1..)": bound, "stats scatter": np.asarray(res.stats.scatter),
                "stats proj": np.asarray(res.stats.proj),
                "rounds_to_convergence": np.asarray(float(r2c))})
    return out


def _old_r2c(bound: np.ndarray) -> int:
    """What the old sgp_uci reported for FSGP: 1 % of the range, over the history with its
    round-0 row counted as the first round."""
    from fedppl import metrics

    return metrics.rounds_to_convergence(bound, 0.01 * max(np.ptp(bound), 1e-12))


# -- comparing -----------------------------------------------------------------------------------


def side(which: str, path: str) -> None:
    import jax

    jax.config.update("jax_enable_x64", True)
    numbers = run_old() if which == "old" else run_new()
    with open(path, "wb") as f:
        pickle.dump(numbers, f)


def spawn(which: str, pythonpath: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, f"{which}.pkl")
        env = {**os.environ, "PYTHONPATH": pythonpath, "OPENBLAS_NUM_THREADS": "1"}
        subprocess.run([sys.executable, __file__, "--side", which, "--dump", path], check=True,
                       env=env, cwd=tmp)
        with open(path, "rb") as f:
            return pickle.load(f)


def compare(old: dict, new: dict) -> dict:
    rows = {}
    for case in old:
        rows[case] = {}
        for key, a in old[case].items():
            b = new[case][key]
            if a.shape != b.shape:
                rows[case][key] = {"shape_old": list(a.shape), "shape_new": list(b.shape)}
                continue
            diff = np.abs(a - b)
            scale = np.maximum(np.abs(a), 1e-300)
            rows[case][key] = {"max_abs": float(diff.max(initial=0.0)),
                               "max_rel": float((diff / scale).max(initial=0.0)),
                               "old": a.tolist() if a.size == 1 else None,
                               "new": b.tolist() if b.size == 1 else None}
    return rows


def report(rows: dict) -> str:
    lines = ["| case | max abs diff | max rel diff | worst quantity |", "|---|---:|---:|---|"]
    for case, table in rows.items():
        shown = {k: v for k, v in table.items() if "max_abs" in v and k != "rounds_to_convergence"}
        worst = max(shown, key=lambda k: shown[k]["max_rel"])
        lines.append(f"| {case} | {max(v['max_abs'] for v in shown.values()):.2e} | "
                     f"{shown[worst]['max_rel']:.2e} | {worst} |")
        r2c = table.get("rounds_to_convergence")
        if r2c:
            lines.append(f"| {case}: rounds to convergence | old {r2c['old']:.0f} (round-0 row "
                         f"counted) | new {r2c['new']:.0f} | history starts at round 1 |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", default="/tmp/before", help="an old checkout (fedppl/sgp.py)")
    p.add_argument("--before-api", choices=["fit", "front"], default="fit",
                   help="the old checkout's API: fit_sgp/fit_fsgp, or the same fronts as now")
    p.add_argument("--out", default=str(OUT))
    p.add_argument("--side", choices=["old", "new"], help=argparse.SUPPRESS)
    p.add_argument("--dump", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.side:
        return side(args.side, args.dump)
    old = spawn("old" if args.before_api == "fit" else "new", args.before)
    new = spawn("new", str(ROOT))
    rows = compare(old, new)
    text = report(rows)
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"before": args.before, "rounds": ROUNDS, "seed": SEED,
                                          "settings": BASE, "table": text, "cases": rows},
                                         indent=1))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
