"""Fixtures shared by the algorithm tests."""

from __future__ import annotations

import numpy as np
import pytest

import fedppl
from tests.conftest import exact_linear_posterior


@pytest.fixture(scope="module")
def linear():
    """Bayesian linear regression, 60 rows over 3 clients, and its exact posterior over
    (w, b) (prior N(0, 1), noise 1: the bias is one more column of ones)."""
    rng = np.random.default_rng(0)
    X = rng.normal(size=(60, 2))
    y = X @ np.array([1.0, -0.5]) + 0.3 + rng.normal(size=60)
    clients = fedppl.partition.homogeneous(X, y, num_clients=3, seed=0)
    mean, cov = exact_linear_posterior(np.c_[X, np.ones(60)], y, noise=1.0)
    return clients, mean, cov
