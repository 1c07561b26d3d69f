from __future__ import annotations

import numpy as np
import pytest

from fedppl_experiments.sgp_synthetic import CENTRES, TRUE_HYPER, five_partitions, inducing_drift


def test_five_clusters_one_per_client():
    data = five_partitions(per_client=30, seed=1)
    assert data.clients.num_clients == 5
    for (Xk, yk), c in zip(data.clients.data, CENTRES, strict=True):
        assert Xk.shape == (30, 1) and yk.shape == (30,)
        assert np.all(np.abs(Xk[:, 0] - c) <= 0.25 + 1e-12)
    # the noise is the true noise: residuals against the noiseless draw are not available for the
    # training rows, but the targets vary on the scale of the kernel variance
    assert 0.3 < np.std(data.y) < 3.0
    assert data.X_test.min() < CENTRES[0] and data.X_test.max() > CENTRES[-1]


def test_same_seed_same_data_other_seed_other_data():
    a, b, c = five_partitions(seed=0), five_partitions(seed=0), five_partitions(seed=1)
    np.testing.assert_array_equal(a.y, b.y)
    assert not np.allclose(a.y, c.y)


def test_inducing_drift_distances():
    X = np.array([[0.0], [1.0]])
    Z = np.array([[0.0], [0.5], [3.0]])
    d = inducing_drift(Z, X)
    assert d["mean"] == pytest.approx((0.0 + 0.5 + 2.0) / 3)
    assert d["max"] == pytest.approx(2.0)
    assert d["far"] == pytest.approx(np.mean(np.array([0.0, 0.5, 2.0]) > TRUE_HYPER["lengthscale"]))
