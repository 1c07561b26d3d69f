"""Federated sparse GPs on a UCI regression folder: the federated SGP paper's protocol (Sec. 6.2).

The standard train/test split ``split`` of the folder is standardised with the training statistics,
and the training part is dealt to ``num_clients`` clients at random (homogeneous partition). Each
method of :data:`METHODS` is fitted and scored on the test set in original units (RMSE and average
test log-likelihood of the Monte Carlo predictive), with the rounds it took to converge and its
seconds per round.

Methods: ``dpo``, ``cpo``, ``fedavg-z``, ``fixed`` and ``global`` are :class:`fedppl.FederatedSGP`;
``fsgp`` is :class:`fedppl.FSGP` (FedAvg of the Titsias bound; its ``rounds`` are FedAvg rounds
of ``local_steps`` on every client, then the aggregation of inducing statistics).

Example (with the UCI folders of ``../shared/data/uci``)::

    rows = run("../shared/data/uci/concrete", split=0, num_clients=10,
               methods=["dpo", "global"], num_rounds=100)
    rows["dpo"]["log_lik"], rows["dpo"]["rmse"], rows["dpo"]["rounds_to_convergence"]
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from fedppl import partition
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
            progress_bar: bool = False, keep_result: bool = False) -> dict[str, Any]:
    """Fit one method and score it; returns a flat dict of metrics and the history (and the
    result object under ``"result"`` with ``keep_result``)."""
    from fedppl.infer.fedavg_gp import FSGP, FSGPConfig
    from fedppl.infer.sparse_gps import FederatedSGP, SGPConfig

    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose from {METHODS}")
    key = jax.random.key(seed)
    start = time.perf_counter()
    front = (FSGP(config or FSGPConfig()) if method == "fsgp"
             else FederatedSGP(method, config or SGPConfig()))
    result = front.run(key, prep.clients, num_rounds, progress_bar=progress_bar)
    seconds = time.perf_counter() - start
    X, y = prep.test
    scale = dict(y_mean=float(prep.scaler.y_mean), y_std=float(prep.scaler.y_std))
    if method == "fsgp":
        ll, err = result.log_likelihood(X, y, **scale), result.rmse(X, y, **scale)
    else:
        k = jax.random.key(seed + 1)
        ll, err = (result.log_likelihood(X, y, rng_key=k, **scale),
                   result.rmse(X, y, rng_key=k, **scale))
    history = {k: np.asarray(v).tolist() for k, v in result.history.items()}
    return {"method": method, "log_lik": float(ll), "rmse": float(err),
            "rounds": num_rounds, "rounds_to_convergence": result.rounds_to_convergence(),
            "seconds": seconds, "seconds_per_round": float(np.median(result.history["seconds"])),
            "history": history, "rejected": [list(r) for r in result.rejected],
            **({"result": result} if keep_result else {})}


def run(path: str, split: int = 0, num_clients: int = 10, methods: Sequence[str] = METHODS,
        num_rounds: int = 100, configs: dict[str, Any] | None = None, seed: int = 0,
        max_train: int | None = None, progress_bar: bool = True,
        rounds: dict[str, int] | None = None, keep_going: bool = False
        ) -> dict[str, dict[str, Any]]:
    """Fit and score every method on one split (see module doc); ``configs`` maps a method
    to its :class:`~fedppl.SGPConfig` or :class:`~fedppl.FSGPConfig`, ``rounds`` to a
    number of rounds other than ``num_rounds`` (e.g. fewer optimisation rounds for ``global``).

    With ``keep_going`` a method that raises (a numerical failure, such as a prediction that is
    not finite) is recorded with NaN metrics and its ``error``, and the other methods still
    run; otherwise the error propagates."""
    prep = prepare(path, split, num_clients, seed=seed, max_train=max_train)
    out: dict[str, dict[str, Any]] = {}
    for method in methods:
        n = (rounds or {}).get(method, num_rounds)
        start = time.perf_counter()
        try:
            out[method] = fit_one(method, prep, n, (configs or {}).get(method), seed,
                                  progress_bar)
        except (ValueError, FloatingPointError, np.linalg.LinAlgError) as err:
            if not keep_going:
                raise
            out[method] = {"method": method, "error": f"{type(err).__name__}: {err}",
                           "log_lik": float("nan"), "rmse": float("nan"), "rounds": n,
                           "rounds_to_convergence": None,
                           "seconds": time.perf_counter() - start,
                           "seconds_per_round": float("nan"), "history": {}}
    return out
