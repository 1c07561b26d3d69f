from __future__ import annotations

import jax
import numpy as np
import pytest

import fedppl
from fedppl.guides import PVIGuide
from tests.conftest import linear_model

az = pytest.importorskip("arviz", reason="the arviz extra is not installed")


def test_export_has_posterior_and_client_dimension(linear_data):
    X, y = linear_data
    clients = fedppl.partition.homogeneous(X, y, 4)
    result = fedppl.PVI(linear_model, PVIGuide(linear_model, family="fullrank")).run(
        jax.random.key(0), clients, 2, progress_bar=False)
    idata = result.to_arviz(jax.random.key(1), num_samples=500)
    assert idata.posterior["w"].shape == (1, 500, 3)
    assert idata.constant_data["factor_prec"].dims == ("client", "theta", "theta_")
    assert list(idata.constant_data["client"].values) == list(clients.names)
    summary = az.summary(idata, var_names=["w"], kind="stats")
    mean, _ = result.mean_and_cov()
    np.testing.assert_allclose(summary["mean"].to_numpy(), mean, atol=0.02)
