"""Bayesian logistic regression on the breast-cancer data (scikit-learn's copy, standardised),
split across ``num-clients`` nodes; node ``k`` (``--node-config partition-id=k``) loads only its
own rows."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from sklearn.datasets import load_breast_cancer
from sklearn.preprocessing import StandardScaler

import fedppl
from fedppl.models import logistic_regression
from fedppl.runtime.flower import Task


def _partition(k: int, num_clients: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    X, y = load_breast_cancer(return_X_y=True)
    X = StandardScaler().fit_transform(X)
    clients = fedppl.partition.homogeneous(X, y.astype(float), num_clients=num_clients,
                                           seed=seed)
    return clients.client(k)


def task(run_config: dict[str, Any]) -> Task:
    jax.config.update("jax_enable_x64", True)
    K, seed = int(run_config["num-clients"]), int(run_config["seed"])
    pvi = fedppl.PVI(logistic_regression, fedppl.PVIGuide(logistic_regression),
                     schedule=str(run_config["schedule"]))
    return Task(pvi, lambda k: _partition(k, K, seed), K, int(run_config["num-rounds"]),
                seed=seed)
