from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from numpyro.infer import SVI, Trace_ELBO

from fedppl.models import gp
from fedppl.models.cotraining import cotraining_gp, cotraining_kernel


def spd(rng, n):
    a = rng.normal(size=(n, n))
    return a @ a.T + n * np.eye(n)


def direct(blocks, n):
    P = np.zeros((n, n))
    for idx, C in blocks:
        P[np.ix_(idx, idx)] += np.linalg.inv(C)
    return np.linalg.inv(P)


def test_equals_inverse_of_summed_precisions():
    rng = np.random.default_rng(0)
    n = 9
    covering = [(np.arange(n), spd(rng, n)), (np.array([2, 5, 7]), spd(rng, 3)),
                (np.array([0, 1]), spd(rng, 2))]
    np.testing.assert_allclose(cotraining_kernel(covering, n), direct(covering, n), rtol=1e-10)
    # no view sees every point: the general path
    partial = [(np.arange(0, 6), spd(rng, 6)), (np.arange(3, 9), spd(rng, 6))]
    np.testing.assert_allclose(cotraining_kernel(partial, n), direct(partial, n), rtol=1e-10)
    # a permuted full view is handled
    perm = rng.permutation(n)
    C = spd(rng, n)
    blocks = [(perm, C), (np.array([4]), np.eye(1))]
    np.testing.assert_allclose(cotraining_kernel(blocks, n), direct(blocks, n), rtol=1e-10)


def test_one_view_is_that_views_gp():
    rng = np.random.default_rng(1)
    X = rng.normal(size=(7, 2))
    p = gp.init_params(2, 0.7, 1.3, 0.2)
    C = gp.kernel(p, X, X) + p.noise_var * jnp.eye(7)
    np.testing.assert_allclose(cotraining_kernel([(np.arange(7), C)], 7), C, rtol=1e-12)


def test_errors():
    with pytest.raises(ValueError, match="seen by no view"):
        cotraining_kernel([(np.array([0, 1]), np.eye(2))], 3)
    with pytest.raises(ValueError, match="covers 2 points"):
        cotraining_kernel([(np.array([0, 1]), np.eye(3))], 2)


def test_numpyro_model_fits_hyperparameters_by_type_two_ml():
    rng = np.random.default_rng(2)
    x = rng.uniform(-2, 2, (30, 1))
    views = [x, x + 0.05 * rng.normal(size=(30, 1))]
    obs = np.arange(20)
    y = np.sin(2 * x[obs, 0]) + 0.1 * rng.normal(size=20)
    svi = SVI(cotraining_gp, lambda *a, **k: None, optax.adam(0.05), Trace_ELBO())
    res = svi.run(jax.random.key(0), 300, views, obs, y, progress_bar=False)
    assert res.losses[-1] < res.losses[0] - 5
    assert set(res.params) >= {"lengthscale_0", "noise_1"}
