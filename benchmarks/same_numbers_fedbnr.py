"""Same seeds, same numbers: FedBNR before and after a restructuring of the package.

Runs FedBNR's kernels (avg, kd, local, central), each scored with both last layers where the
variant has them, on a small UCI-like problem, and the UCI protocol end to end
(:mod:`fedppl_experiments.fedbnr_uci`: loader, split, standardiser, partition, every variant),
with the code at ``--before`` (an older checkout) and with this checkout, each in its own
process; prints the largest differences of the predictions, the learnt kernels and the
validation history, and writes them to ``benchmarks/results/same_numbers_fedbnr.json``.

    python benchmarks/same_numbers_fedbnr.py --before /tmp/before
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
RESULTS = HERE / "results" / "same_numbers_fedbnr.json"
# case -> kernel, the last layers scored (the first one validated), settings beside the defaults
CASES = {"avg": ("avg", ("global", "local"), {}), "kd": ("kd", ("global", "local"), {}),
         "local": ("local", ("local", "global"), {}), "central": ("central", ("global",), {}),
         "avg, stopping early": ("avg", ("global",), dict(eval_every=1, patience=1, lr=0.1))}
ROUNDS, EVAL_EVERY, PATIENCE = 8, 2, 2


def problem():
    """A small UCI-like regression problem: 3 inputs, a smooth target, 4 skewed clients."""
    rng = np.random.default_rng(0)
    X = rng.normal(size=(240, 3))
    y = np.sin(2 * X[:, 0]) + 0.5 * X[:, 1] + 0.1 * rng.normal(size=240)
    Xv = rng.normal(size=(40, 3))
    yv = np.sin(2 * Xv[:, 0]) + 0.5 * Xv[:, 1]
    Xk = rng.normal(size=(30, 3))
    yk = np.sin(2 * Xk[:, 0]) + 0.5 * Xk[:, 1]
    return X, y, (Xv, yv), (Xk, yk), rng.normal(size=(25, 3))


def write_folder(folder: Path) -> None:
    rng = np.random.default_rng(1)
    X = rng.normal(size=(200, 3))
    y = 10 + 4 * np.sin(X[:, 0]) + X[:, 1] + 0.2 * rng.normal(size=200)
    np.savetxt(folder / "data.txt", np.column_stack([X, y]))
    (folder / "index_features.txt").write_text("0\n1\n2\n")
    (folder / "index_target.txt").write_text("3\n")


def kernel_arrays(params) -> list[np.ndarray]:
    """The learnt kernels as plain arrays in one order for both layouts (old: ``x @ W`` layer
    tuples; new: ``equinox.nn.Linear`` with ``weight`` of shape (out, in))."""
    out = []
    for net in (params.kernel.feature, params.kernel.shift):
        layers = getattr(net, "layers", net) or ()
        for layer in layers:
            if isinstance(layer, tuple):
                out += [np.asarray(layer[0]), np.asarray(layer[1])]
            else:
                out += [np.swapaxes(np.asarray(layer.weight), -1, -2), np.asarray(layer.bias)]
    return out + [np.asarray(a) for a in (params.kernel.log_lengthscale, params.log_noise,
                                          params.log_prior_scale)]


def cases(folder: str) -> dict:
    import jax
    import optax

    import fedppl
    from fedppl.models.random_features import URKSpec

    try:
        from fedppl.infer.bayesian_regression import FedBNR
        from fedppl_experiments import fedbnr_uci
    except ImportError:  # the layout before the restructuring
        from fedppl.experiments import fedbnr_uci
        from fedppl.fedbnr import FedBNR

    X, y, val, kd, X_test = problem()
    clients = fedppl.partition.paired_chunks(X, y, num_clients=4, seed=0)
    spec = URKSpec(3, feature_widths=(6, 3), shift_widths=(4,), num_samples=10)
    old = hasattr(FedBNR, "learn_kernel")
    out = {}
    for case, (kernel, layers, change) in CASES.items():
        settings = dict(local_steps=5, kd_steps=5, eval_every=EVAL_EVERY, patience=PATIENCE,
                        lr=1e-2) | change
        settings["optimizer"] = optax.adam(settings.pop("lr"))
        key = jax.random.key(3)
        kd_data = kd if kernel == "kd" else None
        if old:
            method = FedBNR(spec, kernel=kernel, last_layer=layers[0], rounds=ROUNDS, **settings)
            params, omega, hist = method.learn_kernel(key, clients, val, kd)
            fits = {last: method.last_layer_fit(params, omega, clients, last) for last in layers}
            preds = {last: fit.predict(X_test) for last, fit in fits.items()}
            kernels, rounds = fits[layers[0]].params, hist["round"][-1]
            val_rmse = dict(zip(hist["round"], hist["val_rmse"], strict=False))
        else:
            method = FedBNR(spec, kernel=kernel, last_layer=layers[0], **settings)
            res = method.run(key, clients, ROUNDS, progress_bar=False, validation=val,
                             kd_data=kd_data)
            preds = {last: res.predict(X_test, last) for last in layers}
            kernels, rounds = res.models()[0], res.num_rounds
            h = res.history
            val_rmse = {int(r): float(v) for r, v, e in zip(h["round"], h["val_rmse"],
                                                             h["evaluated"], strict=False) if e}
        for last, (mean, var) in preds.items():
            out[f"{case}: {kernel}+{last}"] = {"mean": np.asarray(mean), "var": np.asarray(var),
                                       "kernel": kernel_arrays(kernels), "rounds": rounds,
                                       "val_rmse": val_rmse}
    small = URKSpec(3, feature_widths=(6, 3), shift_widths=(), num_samples=10)
    rows = fedbnr_uci.run(folder, 4, list(fedbnr_uci.VARIANTS), spec=small, rounds=4,
                          local_steps=5, kd_steps=5)
    for v, row in rows.items():
        out[f"uci {v}"] = {k: row[k] for k in ("rmse", "log_lik", "ece", "mce", "brier",
                                               "rounds")}
    return out


def child(path: str, folder: str) -> None:
    import jax

    jax.config.update("jax_enable_x64", True)
    with open(path, "wb") as f:
        pickle.dump(cases(folder), f)


def run_with(pythonpath: str, folder: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.pkl")
        env = dict(os.environ, OPENBLAS_NUM_THREADS="1", PYTHONPATH=pythonpath)
        code = (f"import sys; sys.path.insert(0, {str(HERE)!r}); import same_numbers_fedbnr as m; "
                f"m.child({out!r}, {folder!r})")
        subprocess.run([sys.executable, "-c", code], env=env, check=True, cwd=tmp)
        with open(out, "rb") as f:
            return pickle.load(f)


def _diff(a, b) -> tuple[float, float]:
    a, b = np.asarray(a, float), np.asarray(b, float)
    d = np.abs(a - b)
    return float(d.max()), float((d / (np.abs(a) + 1e-300)).max())


def compare(before: dict, after: dict) -> dict:
    rows = {}
    for name, b in before.items():
        a = after[name]
        if name.startswith("uci"):
            diffs = {k: _diff(b[k], a[k]) for k in b}
            rows[name] = {"max_abs": max(d[0] for d in diffs.values()),
                          "max_rel": max(d[1] for d in diffs.values()),
                          "same_rounds": b["rounds"] == a["rounds"]}
            continue
        pred = [_diff(b[k], a[k]) for k in ("mean", "var")]
        # a leaf of size < 1e-6 is round-off alone: the bias of f's output layer shifts every
        # input alike, which the stationary random features cannot see (its gradient is 0 up to
        # round-off, and Adam scales that noise to ~1e-9): reported apart
        live = [np.abs(x).max() > 1e-6 for x in b["kernel"]]
        kern = [_diff(x, y) for x, y, ok in zip(b["kernel"], a["kernel"], live, strict=False) if ok]
        null = [_diff(x, y)[0] for x, y, ok in zip(b["kernel"], a["kernel"], live, strict=True)
                if not ok]
        same_eval = list(b["val_rmse"]) == list(a["val_rmse"])
        hist = [_diff(b["val_rmse"][r], a["val_rmse"][r]) for r in b["val_rmse"]] if same_eval \
            else [(np.inf, np.inf)]
        rows[name] = {"predictions_abs": max(d[0] for d in pred),
                      "predictions_rel": max(d[1] for d in pred),
                      "kernel_abs": max(d[0] for d in kern), "kernel_rel": max(d[1] for d in kern),
                      "round_off_leaves_abs": max(null, default=0.0),
                      "val_rmse_abs": max(d[0] for d in hist),
                      "rounds": [b["rounds"], a["rounds"]],
                      "evaluated_rounds": [list(b["val_rmse"]), list(a["val_rmse"])]}
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", default="/tmp/before", help="an older checkout of the repo")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        write_folder(Path(folder))
        before = run_with(args.before, folder)
        after = run_with(str(HERE.parent), folder)
    rows = compare(before, after)
    print("| case | predictions: max abs / rel | kernel: max abs / rel | round-off leaves abs "
          "| val RMSE max abs | rounds (before, after) |")
    print("|---|---:|---:|---:|---:|---|")
    for name, r in rows.items():
        if name.startswith("uci"):
            print(f"| {name} | test metrics {r['max_abs']:.1e} / {r['max_rel']:.1e} | | | "
                  f"| same: {r['same_rounds']} |")
        else:
            print(f"| {name} | {r['predictions_abs']:.1e} / {r['predictions_rel']:.1e} | "
                  f"{r['kernel_abs']:.1e} / {r['kernel_rel']:.1e} | "
                  f"{r['round_off_leaves_abs']:.1e} | {r['val_rmse_abs']:.1e} | "
                  f"{r['rounds'][0]}, {r['rounds'][1]} |")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"what": "FedBNR before vs after, same seeds (float64)",
                                   "machine": platform.platform(), "before": args.before,
                                   "cases": rows}, indent=1))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
