"""FedBNR on a small regression problem (every kernel variant, its last layers, early
stopping) and the UCI-layout experiment on a synthetic folder: :func:`numbers` gives the test
predictions, the learnt kernels, the rounds and the validation history of each."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

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
    """The learnt kernels as plain arrays, each layer as ``(weight (in, out), bias)`` (the layout
    the stored numbers were first compared in; ``equinox.nn.Linear`` keeps ``(out, in)``)."""
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
    from fedppl.infer.bayesian_regression import FedBNR
    from fedppl.models.random_features import URKSpec
    from fedppl_experiments import fedbnr_uci

    X, y, val, kd, X_test = problem()
    clients = fedppl.partition.paired_chunks(X, y, num_clients=4, seed=0)
    spec = URKSpec(3, feature_widths=(6, 3), shift_widths=(4,), num_samples=10)
    out = {}
    for case, (kernel, layers, change) in CASES.items():
        settings = dict(local_steps=5, kd_steps=5, eval_every=EVAL_EVERY, patience=PATIENCE,
                        lr=1e-2) | change
        settings["optimizer"] = optax.adam(settings.pop("lr"))
        key = jax.random.key(3)
        kd_data = kd if kernel == "kd" else None
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


def numbers() -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        write_folder(Path(tmp))
        return cases(tmp)
