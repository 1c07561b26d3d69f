"""PVI end to end in float32 with x64 on: ``PVIGuide(model, dtype=jnp.float32)`` with float32
data gives a float32 ``q``, factors, moments, draws and history, on the conjugate path and the
natural-gradient one (server line search included), and the conjugate answer is the exact
posterior to ``100 eps cond(Lambda)``. See ``test_no_upcast.py`` for the pieces and
``conftest.py`` for the modes."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fedppl
from fedppl.guides import PVIGuide
from tests.conftest import linear_model, logistic_model
from tests.float32.conftest import assert_dtype, cond, rtol


@pytest.fixture(autouse=True)
def x64_on():
    assert jax.config.read("jax_enable_x64"), "these checks need x64 on (tests/conftest.py sets it)"


def test_pvi_keeps_float32_end_to_end(data32):
    X, y_lin, y_bin = data32
    clients = fedppl.partition.homogeneous(X, y_lin, 3, seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        res = fedppl.PVI(linear_model, PVIGuide(linear_model, family="fullrank",
                                                dtype=jnp.float32),
                         "synchronous", elbo_samples=0).run(jax.random.key(0), clients, 2,
                                                            progress_bar=False)
    mean, cov = res.mean_and_cov()
    assert_dtype((res.q, res.factors, mean, cov, res.sample(jax.random.key(1), 4)),
                 what="conjugate PVI")
    assert res.history["free_energy"].dtype == np.float32
    X64, y64 = X.astype(np.float64), y_lin.astype(np.float64)
    prec = np.eye(3) + X64.T @ X64 / 0.25
    want = np.linalg.solve(prec, X64.T @ y64 / 0.25)
    np.testing.assert_allclose(mean, want, rtol=rtol(cond=cond(prec)))
    clients = fedppl.partition.homogeneous(X, y_bin, 3, seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        res = fedppl.PVI(logistic_model, PVIGuide(logistic_model, family="meanfield",
                                                  dtype=jnp.float32),
                         "synchronous", num_particles=8, elbo_samples=0).run(
            jax.random.key(0), clients, 2, progress_bar=False)
    assert_dtype((res.q, res.factors, res.mean_and_cov()), what="natural-gradient PVI")
    assert res.history["free_energy"].dtype == np.float32
