"""Exact aggregation equals centralised Bayesian linear regression on the pooled features."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fedppl
from fedppl.algorithms import exact
from fedppl.families import gaussian as g
from fedppl.guides import PVIGuide
from fedppl.models.random_features import feature_regression

NOISE, SCALE = 0.3, 1.7


@pytest.fixture
def pooled():
    rng = np.random.default_rng(0)
    Phi = rng.normal(size=(200, 12))
    y = Phi @ rng.normal(size=12) * 0.3 + 0.3 * rng.normal(size=200)
    return Phi, y


def centralised(Phi, y):
    A = Phi.T @ Phi / NOISE**2 + np.eye(Phi.shape[1]) / SCALE**2
    cov = np.linalg.inv(A)
    return cov @ Phi.T @ y / NOISE**2, cov


@pytest.mark.parametrize("num_clients", [1, 2, 7, 50])
def test_federated_posterior_equals_centralised(pooled, num_clients):
    Phi, y = pooled
    rng = np.random.default_rng(num_clients)
    cuts = np.sort(rng.choice(np.arange(1, 200), num_clients - 1, replace=False))
    parts = np.split(rng.permutation(200), cuts)
    msgs = [exact.client_stats(jnp.asarray(Phi[p]), jnp.asarray(y[p])) for p in parts]
    post = exact.posterior(exact.aggregate(msgs), NOISE, SCALE)
    mean, cov = g.to_moments(post)
    ref_mean, ref_cov = centralised(Phi, y)
    np.testing.assert_allclose(mean, ref_mean, rtol=1e-8)
    np.testing.assert_allclose(cov, ref_cov, rtol=1e-8, atol=1e-12)
    Phi_test = rng.normal(size=(5, 12))
    m, v = exact.predict(post, jnp.asarray(Phi_test), NOISE)
    np.testing.assert_allclose(m, Phi_test @ ref_mean, rtol=1e-8)
    np.testing.assert_allclose(v, np.einsum("nd,de,ne->n", Phi_test, ref_cov, Phi_test)
                               + NOISE**2, rtol=1e-8)


def test_padded_masked_statistics_are_unchanged(pooled):
    Phi, y = pooled
    padded = np.vstack([Phi[:30], np.ones((10, 12))])
    mask = jnp.arange(40) < 30
    a = exact.client_stats(jnp.asarray(padded), jnp.asarray(np.r_[y[:30], np.ones(10)]), mask)
    b = exact.client_stats(jnp.asarray(Phi[:30]), jnp.asarray(y[:30]))
    for x, z in zip(a, b, strict=False):
        np.testing.assert_allclose(x, z, rtol=1e-12)


def test_equals_conjugate_pvi_on_the_numpyro_model(pooled):
    """The same posterior as one round of conjugate PVI on ``feature_regression``."""
    Phi, y = pooled
    clients = fedppl.partition.homogeneous(Phi, y, 5, seed=0)

    def model(Phi, y=None):
        feature_regression(Phi, y, NOISE, SCALE)

    res = fedppl.PVI(model, PVIGuide(model, family="fullrank"), schedule="synchronous").run(
        jax.random.key(0), clients, 1, progress_bar=False)
    msgs = [exact.client_stats(jnp.asarray(P), jnp.asarray(t)) for P, t in clients.data]
    post = exact.posterior(exact.aggregate(msgs), NOISE, SCALE)
    np.testing.assert_allclose(res.q.prec, post.prec, rtol=1e-10)
    np.testing.assert_allclose(res.q.nat1, post.nat1, rtol=1e-10, atol=1e-12)


def test_log_marginal_likelihood_matches_the_dense_gaussian(pooled):
    from scipy.stats import multivariate_normal

    Phi, y = pooled
    stats = exact.client_stats(jnp.asarray(Phi), jnp.asarray(y))
    got = exact.log_marginal_likelihood(stats, jnp.sum(y**2), NOISE, SCALE)
    cov = SCALE**2 * Phi @ Phi.T + NOISE**2 * np.eye(len(y))
    assert float(got) == pytest.approx(multivariate_normal(np.zeros(len(y)), cov).logpdf(y),
                                       rel=1e-10)


def test_bad_messages_name_the_client(pooled):
    Phi, y = pooled
    good = exact.client_stats(jnp.asarray(Phi[:20]), jnp.asarray(y[:20]))
    small = exact.client_stats(jnp.asarray(Phi[:20, :5]), jnp.asarray(y[:20]))
    with pytest.raises(ValueError, match=r"hospital B sent statistics of shapes .*dimension 12"):
        exact.aggregate([good, small], ["hospital A", "hospital B"])
    nan = good._replace(scatter=good.scatter.at[0, 0].set(jnp.inf))
    with pytest.raises(ValueError, match="client 1 sent non-finite statistics"):
        exact.aggregate([good, nan])
    empty = exact.client_stats(jnp.zeros((0, 12)), jnp.zeros(0))
    with pytest.raises(ValueError, match="no client holds any data"):
        exact.aggregate([empty, empty])
    with pytest.raises(ValueError, match="no client statistics"):
        exact.aggregate([])


def test_add_up_makes_the_hosts_additions_in_order():
    """The server's compiled sum equals :func:`exact.aggregate`'s host sum bit for bit."""
    rng = np.random.default_rng(3)
    msgs = [exact.client_stats(jnp.asarray(rng.normal(size=(n, 5))),
                               jnp.asarray(rng.normal(size=n))) for n in (7, 11, 3, 9)]
    stacked = exact.Stats(*(jnp.stack(parts) for parts in zip(*msgs, strict=False)))
    for got, want in zip(jax.jit(exact.add_up)(stacked), exact.aggregate(msgs), strict=False):
        np.testing.assert_array_equal(got, want)
    assert bool(exact.all_finite(stacked))
    assert not bool(exact.all_finite(stacked._replace(proj=stacked.proj.at[2, 0].set(np.nan))))


def _ill_conditioned(dtype):
    """Random Fourier features of a smooth function with little noise."""
    rng = np.random.default_rng(3)
    X = rng.normal(size=(400, 2))
    proj = X @ rng.normal(size=(2, 25))
    Phi = np.hstack([np.cos(proj), np.sin(proj)]) / 5
    y = np.sin(X[:, 0]) + 0.005 * rng.normal(size=400)
    return jnp.asarray(Phi, dtype), jnp.asarray(y, dtype)


def test_data_log_marginal_likelihood_equals_the_statistics_form(pooled):
    Phi, y = (jnp.asarray(a) for a in pooled)
    mask = jnp.arange(200) < 150
    want = exact.log_marginal_likelihood(exact.client_stats(Phi, y, mask),
                                         jnp.sum(mask * y**2), NOISE, SCALE)
    got = exact.data_log_marginal_likelihood(Phi, y, NOISE, SCALE, mask)
    np.testing.assert_allclose(got, want, rtol=1e-12)


def test_data_log_marginal_likelihood_is_accurate_in_float32():
    """At noise 0.05 the statistics' form is 3 nats off in float32 and its noise gradient 1.5 %
    (cancellation and the jitter floor); the residual form 2e-4 nats and 2e-6."""
    def value_and_grad(dtype):
        Phi, y = _ill_conditioned(dtype)
        f = lambda s: exact.data_log_marginal_likelihood(Phi, y, s, 1.0)  # noqa: E731
        return (float(v) for v in jax.value_and_grad(f)(jnp.asarray(0.05, dtype)))

    v64, g64 = value_and_grad(jnp.float64)
    with jax.enable_x64(False):
        v32, g32 = value_and_grad(jnp.float32)
    assert abs(v32 - v64) < 0.01 and abs(g32 / g64 - 1) < 1e-4, (v32, v64, g32, g64)


def test_solve_removes_the_jitter_floor_bias_in_float32():
    """The fitted values of a last layer whose precision float32 factors only with the floor."""
    def mean(dtype):
        Phi, y = _ill_conditioned(dtype)
        post = exact.posterior(exact.client_stats(Phi, y), 0.005, 1.0)
        return np.asarray(Phi @ exact.solve(post.prec, post.nat1)[0], np.float64)

    want = mean(jnp.float64)
    with jax.enable_x64(False):
        got = mean(jnp.float32)
    _, y = _ill_conditioned(jnp.float64)
    # measured: 0.012 of the residual's RMSE (the floor alone: 0.38)
    assert np.sqrt(np.mean((got - want) ** 2)) < 0.1 * np.sqrt(np.mean((y - want) ** 2))
