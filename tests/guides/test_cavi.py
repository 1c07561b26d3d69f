"""Polya-Gamma CAVI: the Jaakkola-Jordan bound, monotone ELBO, stationarity and model checks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest

from fedppl.families import gaussian as g
from fedppl.guides import PVIGuide, cavi
from fedppl.handlers import client
from fedppl.sites import SiteLayout
from tests.conftest import linear_model, logistic_model


def _jj_elbo(X, y, mean, cov, prior_var):
    """ELBO with the Jaakkola-Jordan bound at its optimal xi, in numpy (w then b, as the layout)."""
    A = np.hstack([X, np.ones((len(y), 1))])
    m = A @ mean
    v = np.einsum("nd,de,ne->n", A, cov, A)
    xi = np.sqrt(m**2 + v)
    lam = np.tanh(xi / 2) / (4 * xi)
    s = 2 * y - 1
    ell = np.sum(-np.log1p(np.exp(-xi)) + (s * m - xi) / 2 - lam * (m**2 + v - xi**2))
    P = np.diag(1 / prior_var)
    kl = 0.5 * (np.trace(P @ cov) + mean @ P @ mean - len(mean)
                + np.sum(np.log(prior_var)) - np.linalg.slogdet(cov)[1])
    return ell - kl


@pytest.fixture(scope="module")
def fitted():
    rng = np.random.default_rng(1)
    X = rng.normal(size=(400, 3))
    true = np.array([1.5, -1.0, 0.5, 0.3])
    y = (rng.uniform(size=400) < 1 / (1 + np.exp(-(X @ true[:3] + true[3])))).astype(float)
    guide = PVIGuide(logistic_model, family="fullrank").setup(X, y)
    lik = cavi.logit_terms(logistic_model, guide.layout, X, y)
    result = jax.jit(cavi.fit, static_argnums=2)(guide.prior, lik, 100)
    return X, y, true, guide, lik, result


def test_logit_map_is_read_from_the_model(fitted):
    X, y, _, _, lik, _ = fitted
    np.testing.assert_allclose(lik.J, np.hstack([X, np.ones((len(y), 1))]), atol=1e-14)
    np.testing.assert_allclose(lik.offset, 0.0, atol=1e-14)
    np.testing.assert_allclose(lik.kappa, y - 0.5)


def test_elbo_at_optimal_omega_is_jaakkola_jordan(fitted):
    X, y, _, guide, lik, _ = fitted
    rng = np.random.default_rng(3)
    mean = rng.normal(size=4)
    B = rng.normal(size=(4, 4)) * 0.3
    cov = B @ B.T + 0.05 * np.eye(4)
    q = g.FullGaussian.from_moments(jnp.asarray(mean), jnp.asarray(cov))
    value = cavi.elbo(q, guide.prior, lik)
    expected = _jj_elbo(X, y, mean, cov, np.array([1.0, 1.0, 1.0, 4.0]))
    np.testing.assert_allclose(value, expected, rtol=1e-12, atol=1e-10)
    # any other c is worse
    c = cavi.optimal_c(lik, q)
    assert cavi.elbo(q, guide.prior, lik, 1.3 * c) < value


@pytest.mark.parametrize("family", ["fullrank", "meanfield"])
def test_elbo_never_decreases(family):
    rng = np.random.default_rng(5)
    X = rng.normal(size=(80, 6)) * 2.0
    y = rng.integers(0, 2, 80).astype(float)
    guide = PVIGuide(logistic_model, family=family).setup(X, y)
    lik = cavi.logit_terms(logistic_model, guide.layout, X, y)
    result = jax.jit(cavi.fit, static_argnums=2)(guide.prior, lik, 50)
    trace = np.asarray(result.elbo)
    first = float(cavi.elbo(guide.prior, guide.prior, lik))
    assert np.all(np.diff(np.concatenate([[first], trace])) >= -1e-10)
    assert trace[-1] - first > 1.0  # it does move
    assert isinstance(result.q, g.FullGaussian if family == "fullrank" else g.DiagGaussian)


def test_fixed_point_is_a_stationary_point_of_the_jj_elbo(fitted):
    """The closed-form updates maximise the bound: its gradient in (mean, Cholesky) vanishes."""
    _, _, _, guide, lik, result = fitted
    q = result.q
    mean, cov = g.to_moments(q)
    L = jnp.linalg.cholesky(cov)

    def bound(mean, L):
        return cavi.elbo(g.FullGaussian.from_moments(mean, L @ L.T), guide.prior, lik)

    gm, gL = jax.grad(bound, argnums=(0, 1))(mean, L)
    assert np.max(np.abs(gm)) < 1e-7 and np.max(np.abs(jnp.tril(gL))) < 1e-7
    gm0, _ = jax.grad(bound, argnums=(0, 1))(mean + 0.05, L)
    assert np.max(np.abs(gm0)) > 1e-2


def test_padded_rows_change_nothing(fitted):
    X, y, _, guide, _, _ = fitted
    mask = jnp.arange(len(y)) < 300

    @jax.jit
    def run(X, y, mask):
        lik = cavi.logit_terms(client(logistic_model, mask=mask), guide.layout, X, y)
        return cavi.fit(guide.prior, lik, 30)

    a = run(X, y, mask)
    b = run(X[:300], y[:300], jnp.ones(300, bool))
    np.testing.assert_allclose(a.q.prec, b.q.prec, rtol=1e-12)
    np.testing.assert_allclose(a.elbo, b.elbo, rtol=1e-12)


def test_front_end_predicts_and_rejects_other_models(fitted, linear_data):
    X, y, true, _, _, reference = fitted
    result = cavi.CAVI(logistic_model, num_iters=100).run(X, y)
    np.testing.assert_allclose(result.q.prec, reference.q.prec, rtol=1e-12)
    mean, _ = g.to_moments(result.q)
    acc = np.mean(((X @ mean[:3] + mean[3]) > 0) == (y > 0.5))
    bayes = np.mean(((X @ true[:3] + true[3]) > 0) == (y > 0.5))
    assert acc > bayes - 0.02
    with pytest.raises(ValueError, match="'y' is Normal, not a Bernoulli"):
        cavi.CAVI(linear_model).run(*linear_data)


def test_check_says_why(fitted):
    X, y = fitted[:2]

    def squared(X, y=None):
        w = numpyro.sample("w", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
        with numpyro.plate("data", X.shape[0]):
            numpyro.sample("y", dist.Bernoulli(logits=(X @ w) ** 2), obs=y)

    def positive(X, y=None):
        s = numpyro.sample("s", dist.LogNormal(0, 1))
        with numpyro.plate("data", X.shape[0]):
            numpyro.sample("y", dist.Bernoulli(logits=s * X[:, 0]), obs=y)

    assert cavi.check(logistic_model, SiteLayout.from_model(logistic_model, X, y), X, y) is None
    assert "not affine" in cavi.check(squared, SiteLayout.from_model(squared, X, y), X, y)
    assert "constrained" in cavi.check(positive, SiteLayout.from_model(positive, X, y), X, y)
    with pytest.raises(ValueError, match="site 'y' has labels"):
        cavi.check(logistic_model, SiteLayout.from_model(logistic_model, X, y), X, 2 * y - 1)
