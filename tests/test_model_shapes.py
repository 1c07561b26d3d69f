"""The model shapes NumPyro users write, federated unchanged.

Several data arrays and static keyword arguments, ``numpyro.deterministic``, ``numpyro.factor`` in
no plate (a prior term, counted once), nested plates, a MultivariateNormal prior, plate
subsampling, posterior predictive; and the clear errors for what cannot be federated.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest

import fedppl
from fedppl.guides import PVIGuide
from tests.reference import unconstrained_moments, worst_gap

LAM, NOISE = 3.0, 0.5


def penalised(X1, X2, y=None, *, scale=1.0):
    """Two input arrays, a static keyword, a ridge factor in no plate, a deterministic site."""
    w1 = numpyro.sample("w1", dist.Normal(0.0, 1.0).expand([X1.shape[1]]).to_event(1))
    w2 = numpyro.sample("w2", dist.Normal(0.0, 1.0).expand([X2.shape[1]]).to_event(1))
    numpyro.factor("ridge", -0.5 * LAM * (jnp.sum(w1**2) + jnp.sum(w2**2)))
    mean = numpyro.deterministic("mean", scale * (X1 @ w1 + X2 @ w2))
    with numpyro.plate("data", X1.shape[0]):
        numpyro.sample("y", dist.Normal(mean, NOISE), obs=y)


def test_factor_outside_plates_is_counted_once_exactly():
    """A ridge factor is a Gaussian prior term: the posterior is closed-form; counted once per
    client it would have prior precision 1 + K * LAM."""
    rng = np.random.default_rng(0)
    X1, X2 = rng.normal(size=(200, 2)), rng.normal(size=(200, 3))
    y = X1 @ np.array([1.0, -1.0]) + X2 @ np.array([0.5, 0.0, 2.0]) + NOISE * rng.normal(size=200)
    clients = fedppl.Clients.from_list([(X1[i::4], X2[i::4], y[i::4]) for i in range(4)])
    for schedule in ("sequential", "synchronous"):
        res = fedppl.PVI(penalised, PVIGuide(penalised, family="fullrank"), schedule).run(
            jax.random.key(0), clients, 10, progress_bar=False, tol=1e-14, scale=2.0)
        X = 2.0 * np.hstack([X1, X2])
        prec = (1.0 + LAM) * np.eye(5) + X.T @ X / NOISE**2
        cov = np.linalg.inv(prec)
        m, c = res.mean_and_cov()
        np.testing.assert_allclose(m, cov @ X.T @ y / NOISE**2, atol=1e-6)
        np.testing.assert_allclose(c, cov, atol=1e-6)
    pred = res.predictive(jax.random.key(1), X1[:5], X2[:5], num_samples=2000, scale=2.0)
    assert pred["y"].shape == (2000, 5) and pred["mean"].shape == (2000, 5)
    np.testing.assert_allclose(pred["mean"].mean(0), X[:5] @ (cov @ X.T @ y / NOISE**2),
                               atol=0.05)


def multi_output(X, Y=None):
    """Nested plates: outputs inside the data plate, a MultivariateNormal prior on each column."""
    cov = jnp.array([[1.0, 0.6], [0.6, 1.0]])
    W = numpyro.sample("W", dist.MultivariateNormal(jnp.zeros(2), cov).expand([X.shape[1]])
                       .to_event(1))
    with numpyro.plate("data", X.shape[0], dim=-2), numpyro.plate("outputs", 2, dim=-1):
        numpyro.sample("Y", dist.Normal(X @ W, NOISE), obs=Y)


def test_nested_plates_and_multivariate_prior():
    rng = np.random.default_rng(1)
    X = rng.normal(size=(150, 3))
    Y = X @ rng.normal(size=(3, 2)) + NOISE * rng.normal(size=(150, 2))
    clients = fedppl.Clients.from_list([(X[:40], Y[:40]), (X[40:], Y[40:])])
    full = fedppl.PVI(multi_output, PVIGuide(multi_output, family="fullrank")).run(
        jax.random.key(0), clients, 3, progress_bar=False)
    assert full.prior_factor is None  # a correlated Gaussian prior is exact under full rank
    # the exact posterior: vec(W) with the prior's correlation between the two outputs
    prior_prec = np.kron(np.eye(3), np.linalg.inv([[1.0, 0.6], [0.6, 1.0]]))
    A = np.kron(X, np.eye(2))  # row (n, j) picks W[:, j]
    prec = prior_prec + A.T @ A / NOISE**2
    cov = np.linalg.inv(prec)
    np.testing.assert_allclose(full.mean_and_cov()[0], cov @ A.T @ Y.reshape(-1) / NOISE**2,
                               atol=1e-6)
    # mean-field cannot hold the prior's correlation: it is corrected through the prior factor
    mf = fedppl.PVI(multi_output, PVIGuide(multi_output, family="meanfield")).run(
        jax.random.key(0), clients, 20, progress_bar=False, tol=1e-12)
    assert mf.prior_factor is not None
    ref = fedppl.GlobalVI(multi_output, PVIGuide(multi_output, family="meanfield")).run(
        jax.random.key(0), clients)
    assert max(worst_gap(unconstrained_moments(mf), unconstrained_moments(ref))) < 1e-4


def subsampled(X, y=None, *, batch=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    s = numpyro.sample("s", dist.HalfNormal(1.0))
    with numpyro.plate("data", X.shape[0], subsample_size=batch) as idx:
        numpyro.sample("y", dist.Normal(X[idx] @ w, s), obs=y[idx])


def test_subsampled_data_plate_is_a_minibatched_local_step():
    """Each of the solver's draws sees its own minibatch, consecutive slices of one permutation
    (so the draws together cover each client's rows evenly): the answer stays within Monte
    Carlo tolerance of the full-data one; padded rows of unequal clients stay masked."""
    rng = np.random.default_rng(2)
    X = rng.normal(size=(600, 3))
    y = X @ np.array([1.0, -0.5, 0.2]) + 0.8 * rng.normal(size=600)
    clients = fedppl.Clients.from_list([(X[:250], y[:250]), (X[250:], y[250:])])
    full = fedppl.PVI(subsampled, PVIGuide(subsampled, family="fullrank")).run(
        jax.random.key(0), clients, 10, progress_bar=False, tol=1e-12)
    mini = fedppl.PVI(subsampled, PVIGuide(subsampled, family="fullrank")).run(
        jax.random.key(0), clients, 10, progress_bar=False, tol=1e-12, batch=100)
    mean_gap, sd_gap = worst_gap(unconstrained_moments(mini), unconstrained_moments(full))
    assert mean_gap < 0.1 and sd_gap < 0.05, (mean_gap, sd_gap)
    # with a batch as large as the data the minibatch is the whole (permuted) client
    same = fedppl.PVI(subsampled, PVIGuide(subsampled, family="fullrank")).run(
        jax.random.key(0), clients, 10, progress_bar=False, tol=1e-12, batch=350)
    assert max(worst_gap(unconstrained_moments(same), unconstrained_moments(full))) < 1e-6


def test_discrete_and_unbijectable_sites_are_named():
    X, y = np.zeros((10, 1)), np.zeros(10)
    clients = fedppl.Clients.from_list([(X, y)])

    def discrete(X, y=None):
        k = numpyro.sample("k", dist.Poisson(3.0))
        with numpyro.plate("data", X.shape[0]):
            numpyro.sample("y", dist.Normal(k, 1.0), obs=y)

    with pytest.raises(ValueError, match=r"latent site 'k' is discrete.*[Mm]arginalise"):
        fedppl.PVI(discrete, PVIGuide(discrete)).run(jax.random.key(0), clients, 1,
                                                     progress_bar=False)

    def on_sphere(X, y=None):
        u = numpyro.sample("u", dist.ProjectedNormal(jnp.ones(3)))
        with numpyro.plate("data", X.shape[0]):
            numpyro.sample("y", dist.Normal(u[0], 1.0), obs=y)

    with pytest.raises(ValueError, match=r"latent site 'u' has support .*no biject_to"):
        fedppl.PVI(on_sphere, PVIGuide(on_sphere)).run(jax.random.key(0), clients, 1,
                                                       progress_bar=False)
