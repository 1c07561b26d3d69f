from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist

from fedppl.algorithms import conjugate
from fedppl.handlers import client
from fedppl.sites import SiteLayout
from tests.conftest import linear_model, logistic_model


def test_linear_gaussian_model_is_detected_and_exact(linear_data):
    X, y = linear_data
    layout = SiteLayout.from_model(linear_model, X, y)
    mask = jnp.arange(len(y)) < 100  # last 20 rows are padding
    m = client(linear_model, mask=mask)
    assert conjugate.check(m, layout, X, y) is None
    lik = conjugate.likelihood_factor(conjugate.likelihood_terms(m, layout, X, y))
    np.testing.assert_allclose(lik.prec, X[:100].T @ X[:100] / 0.25, rtol=1e-12)
    np.testing.assert_allclose(lik.nat1, X[:100].T @ y[:100] / 0.25, rtol=1e-12)


def test_non_conjugate_models_say_why(linear_data):
    X, y = linear_data
    layout = SiteLayout.from_model(logistic_model, X, (y > 0).astype(float))
    assert "Bernoulli" in conjugate.check(logistic_model, layout, X, (y > 0).astype(float))

    def quadratic(X, y=None):
        w = numpyro.sample("w", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
        with numpyro.plate("data", X.shape[0]):
            numpyro.sample("y", dist.Normal((X @ w) ** 2, 1.0), obs=y)

    lay = SiteLayout.from_model(quadratic, X, y)
    assert "not affine" in conjugate.check(quadratic, lay, X, y)

    def hetero(X, y=None):
        w = numpyro.sample("w", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
        with numpyro.plate("data", X.shape[0]):
            numpyro.sample("y", dist.Normal(X @ w, jnp.exp(w[0])), obs=y)

    assert "scale" in conjugate.check(hetero, SiteLayout.from_model(hetero, X, y), X, y)

    def positive(X, y=None):
        s = numpyro.sample("s", dist.LogNormal(0, 1))
        with numpyro.plate("data", X.shape[0]):
            numpyro.sample("y", dist.Normal(0.0, s), obs=y)

    assert "constrained" in conjugate.check(positive, SiteLayout.from_model(positive, X, y), X, y)


def test_expected_log_lik_matches_monte_carlo(linear_data):
    X, y = linear_data
    layout = SiteLayout.from_model(linear_model, X, y)
    lik = conjugate.likelihood_terms(linear_model, layout, X, y)
    mean, cov = np.array([1.0, -2.0, 0.5]), 0.01 * np.eye(3)
    rng = np.random.default_rng(0)
    ws = rng.multivariate_normal(mean, cov, size=4000)
    mc = dist.Normal(ws @ X.T, 0.5).log_prob(y).sum(-1)
    got = conjugate.expected_log_lik(lik, mean, cov)
    assert abs(float(got) - mc.mean()) < 4 * mc.std() / np.sqrt(len(mc))
