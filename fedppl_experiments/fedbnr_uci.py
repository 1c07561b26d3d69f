"""FedBNR on a UCI regression folder, the protocol of the FedBNR paper (Sec. 5.2).

The data are split 8:1:1 into train/test/validation at random, standardised with the training
statistics, and the training part is dealt to clients with :func:`fedppl.partition.paired_chunks`
(sorted by the feature most correlated with the target, two random chunks per client). FedBNR-KD
uses 80 % of the validation set as the server's distillation data and the rest for validation.
Every variant is scored on the test set in original units (RMSE, log-likelihood, ECE, MCE, Brier),
averaged over the models when the models stay per client.

Example (``run`` returns one row of test metrics per variant)::

    rows = run("../shared/data/uci/power-plant", num_clients=10, variants=["avg", "kd"])
    rows["avg"]["rmse"], rows["avg"]["rounds_to_convergence"]
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
import optax

from fedppl import metrics, partition
from fedppl.clients import Clients
from fedppl.datasets import Standardiser, load_uci, train_test_val_split
from fedppl.infer.bayesian_regression import FedBNR, FedBNRResult
from fedppl.models.random_features import URKSpec

__all__ = ["VARIANTS", "Prepared", "prepare", "evaluate", "run"]

# variant name -> (kernel learning, last layer); "avg" is FedBNR, "kd" FedBNR-KD
VARIANTS = {
    "avg": ("avg", "global"),
    "kd": ("kd", "global"),
    "central": ("central", "global"),
    "local+local": ("local", "local"),
    "local+global": ("local", "global"),
    "avg+local": ("avg", "local"),
    "kd+local": ("kd", "local"),
}


class Prepared(NamedTuple):
    clients: Clients
    validation: tuple[np.ndarray, np.ndarray]  # for every kernel but KD
    kd_data: tuple[np.ndarray, np.ndarray]  # 80 % of validation, held by the server
    kd_validation: tuple[np.ndarray, np.ndarray]  # the other 20 %
    test: tuple[np.ndarray, np.ndarray]  # inputs standardised, targets in original units
    scaler: Standardiser


def prepare(path: str, num_clients: int, seed: int = 0) -> Prepared:
    """Load, split 8:1:1, standardise and partition (see module doc)."""
    data = load_uci(path)
    split = train_test_val_split(data.X, data.y, (0.8, 0.1, 0.1), seed=seed)
    sc = Standardiser.fit(data.X[split.train], data.y[split.train])
    X = sc.transform_X(data.X)
    y = sc.transform_y(data.y)
    clients = partition.paired_chunks(X[split.train], y[split.train], num_clients, seed=seed)
    val = np.random.default_rng(seed).permutation(split.val)
    cut = int(0.8 * len(val))
    return Prepared(clients, (X[split.val], y[split.val]), (X[val[:cut]], y[val[:cut]]),
                    (X[val[cut:]], y[val[cut:]]), (X[split.test], data.y[split.test]), sc)


def evaluate(result: FedBNRResult, prep: Prepared, last_layer: str | None = None
             ) -> dict[str, float]:
    """Test metrics in original units, averaged over the result's models (those of
    ``last_layer``, default the method's own)."""
    X, y = prep.test
    means, variances = result.predict(X, last_layer)
    scores = []
    for mean, var in zip(np.asarray(means), np.asarray(variances), strict=False):
        m, v = metrics.unstandardise(mean, var, prep.scaler.y_mean, prep.scaler.y_std)
        cal = metrics.regression_calibration(y, m, v)
        scores.append([metrics.rmse(y, m), metrics.gaussian_log_likelihood(y, m, v), cal.ece,
                       cal.mce, cal.brier])
    names = ["rmse", "log_lik", "ece", "mce", "brier"]
    return dict(zip(names, np.mean(scores, axis=0).tolist(), strict=False))


def run(path: str, num_clients: int, variants: Sequence[str] = ("avg",), seed: int = 0,
        spec: URKSpec | None = None, rounds: int = 100, local_steps: int = 50,
        optimizer: optax.GradientTransformation | None = None, kd_alpha: float = 5.0,
        kd_steps: int = 50, progress_bar: bool = False, keep_history: bool = False
        ) -> dict[str, dict[str, Any]]:
    """Run the requested variants; those sharing a kernel-learning method share one run, and
    each scores its own last layer from it (``optimizer`` default: ``optax.adam(1e-2)``).
    ``keep_history`` adds the run's ``history`` and ``rejected`` to each row."""
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown variants {unknown}; choose from {sorted(VARIANTS)}")
    prep = prepare(path, num_clients, seed)
    spec = spec or URKSpec(input_dim=prep.test[0].shape[1])
    rows: dict[str, dict[str, Any]] = {}
    for kernel in dict.fromkeys(VARIANTS[v][0] for v in variants):
        wanted = [v for v in variants if VARIANTS[v][0] == kernel]
        method = FedBNR(spec, kernel=kernel, last_layer=VARIANTS[wanted[0]][1],
                        optimizer=optimizer or optax.adam(1e-2), local_steps=local_steps,
                        kd_alpha=kd_alpha, kd_steps=kd_steps)
        t0 = time.perf_counter()
        kd = kernel == "kd"
        result = method.run(jax.random.key(seed), prep.clients, rounds, progress_bar=progress_bar,
                            validation=prep.kd_validation if kd else prep.validation,
                            kd_data=prep.kd_data if kd else None)
        seconds = time.perf_counter() - t0
        for v in wanted:
            rows[v] = evaluate(result, prep, VARIANTS[v][1]) | {
                "kernel_seconds": seconds, "rounds": result.num_rounds,
                "rounds_to_convergence": result.rounds_to_convergence,
                "best_round": result.best_round}
            if keep_history:
                rows[v] |= {"history": dict(result.history), "rejected": list(result.rejected)}
    return rows
