"""Federated sparse GPs on a UCI regression folder: the protocol of the federated SGP paper (Sec. 6.2).

The standard train/test split ``split`` of the folder is standardised with the training statistics,
and the training part is dealt to ``num_clients`` clients at random (homogeneous partition). Each
method of :data:`METHODS` is fitted and scored on the test set in original units (RMSE and average
test log-likelihood of the Monte Carlo predictive), with the rounds it took to converge and its
seconds per round.

Methods: ``dpo``, ``cpo``, ``fedavg-z``, ``fixed`` and ``global`` are :func:`fedppl.sgp.fit_sgp`;
``fsgp`` is :func:`fedppl.fsgp.fit_fsgp` (FedAvg of the Titsias bound; its ``rounds`` are FedAvg
rounds of ``local_steps`` on every client).

Example::

    >>> rows = run("../shared/data/uci/concrete", split=0, num_clients=10, methods=["dpo", "global"],
    ...            num_rounds=100)
    >>> rows["dpo"]["log_lik"], rows["dpo"]["rmse"]
"""

from __future__ import annotations

import time
from typing import Any, Callable, NamedTuple, Sequence

import jax
import numpy as np

from fedppl import metrics, partition
from fedppl.clients import Clients
from fedppl.datasets import Standardiser, load_uci

__all__ = ["METHODS", "Prepared", "prepare", "fit_one", "run"]

METHODS = ("dpo", "cpo", "fedavg-z", "fixed", "global", "fsgp")


class Prepared(NamedTuple):
    clients: Clients
    test: tuple[np.ndarray, np.ndarray]  # inputs standardised, targets in original units
    scaler: Standardiser


def prepare(path: str, split: int, num_clients: int, seed: int = 0,
            max_train: int | None = None) -> Prepared:
    """Load split ``split``, standardise on its training part, deal it to clients at random.

    ``max_train`` keeps a random subset of that many training rows (for quick runs; ``None``: all).
    """
    data = load_uci(path, split)
    train, test = data.train, data.test
    if max_train is not None and len(train) > max_train:
        train = np.random.default_rng(seed).choice(train, max_train, replace=False)
    sc = Standardiser.fit(data.X[train], data.y[train])
    X, y = sc.transform_X(data.X), sc.transform_y(data.y)
    clients = partition.homogeneous(X[train], y[train], num_clients, seed=seed)
    return Prepared(clients, (X[test], data.y[test]), sc)


def fit_one(method: str, prep: Prepared, num_rounds: int, config: Any = None, seed: int = 0,
            callback: Callable[[int, dict], None] | None = None) -> dict[str, Any]:
    """Fit one method and score it; returns a flat dict of metrics and the history."""
    key = jax.random.key(seed)
    start = time.perf_counter()
    if method == "fsgp":
        from fedppl.infer.fedavg_gp import FSGPConfig, fit_fsgp

        result = fit_fsgp(prep.clients, num_rounds, config or FSGPConfig(), key=key,
                          callback=callback)
        monitored = "bound"
    elif method in METHODS:
        from fedppl.infer.sparse_gps import SGPConfig, fit_sgp

        result = fit_sgp(method, prep.clients, num_rounds, config or SGPConfig(), key=key,
                         callback=callback)
        monitored = "free_energy"
    else:
        raise ValueError(f"unknown method {method!r}; choose from {METHODS}")
    seconds = time.perf_counter() - start
    X, y = prep.test
    scale = dict(y_mean=float(prep.scaler.y_mean), y_std=float(prep.scaler.y_std))
    if method == "fsgp":
        ll, err = result.log_likelihood(X, y, **scale), result.rmse(X, y, **scale)
    else:
        k = jax.random.key(seed + 1)
        ll, err = result.log_likelihood(X, y, key=k, **scale), result.rmse(X, y, key=k, **scale)
    history = {k: np.asarray(v).tolist() for k, v in result.history.items()}
    return {"method": method, "log_lik": float(ll), "rmse": float(err),
            "rounds": num_rounds, "rounds_to_convergence": _converged(history.get(monitored)),
            "seconds": seconds, "seconds_per_round": _per_round(history, seconds, num_rounds),
            "history": history}


def _per_round(history: dict, seconds: float, num_rounds: int) -> float:
    """Median seconds per round from the history, else the wall time divided by the rounds."""
    times = history.get("seconds")
    return float(np.median(times)) if times else seconds / max(num_rounds, 1)


def _converged(values: Sequence[float] | None, rel_tol: float = 0.01) -> int | None:
    """First round after which the monitored objective stays within ``rel_tol`` of its final
    value (relative to the range it covered); ``None`` without a history."""
    if not values:
        return None
    v = np.asarray(values, dtype=float)
    if not np.all(np.isfinite(v)):
        return None
    return metrics.rounds_to_convergence(v, rel_tol * max(np.ptp(v), 1e-12))


def run(path: str, split: int = 0, num_clients: int = 10, methods: Sequence[str] = METHODS,
        num_rounds: int = 100, configs: dict[str, Any] | None = None, seed: int = 0,
        max_train: int | None = None, progress_bar: bool = True,
        rounds: dict[str, int] | None = None) -> dict[str, dict[str, Any]]:
    """Fit and score every method on one split (see module doc); ``configs`` maps a method
    to its :class:`~fedppl.sgp.SGPConfig` or :class:`~fedppl.fsgp.FSGPConfig`, ``rounds`` to a
    number of rounds other than ``num_rounds`` (e.g. fewer optimisation rounds for ``global``)."""
    prep = prepare(path, split, num_clients, seed=seed, max_train=max_train)
    rows = {}
    for method in methods:
        n = (rounds or {}).get(method, num_rounds)
        bar = _bar(progress_bar, n, method)
        rows[method] = fit_one(method, prep, n, (configs or {}).get(method), seed,
                               callback=(lambda i, info: bar.update(1)) if bar else None)
        if bar:
            bar.close()
    return rows


def _bar(enabled: bool, total: int, name: str):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=name, leave=False)
