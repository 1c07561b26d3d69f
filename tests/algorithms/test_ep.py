"""Federated EP (fedppl.algorithms.ep, fedppl.EP): the algebra against closed forms, the
sampled version within its Monte Carlo error, and bad input."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest

import fedppl
from fedppl.algorithms import ep, pvi
from fedppl.families import gaussian as g
from fedppl.models import linear_regression, logistic_regression
from tests.conftest import exact_linear_posterior


@pytest.fixture(scope="module")
def linear():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(60, 2))
    y = X @ np.array([1.0, -0.5]) + 0.3 + rng.normal(size=60)
    clients = fedppl.partition.homogeneous(X, y, num_clients=3, seed=0)
    # (w, b) with prior N(0, 1), noise 1: the bias is one more column of ones
    mean, cov = exact_linear_posterior(np.c_[X, np.ones(60)], y, noise=1.0)
    return clients, mean, cov


def _guide(model=linear_regression):
    return fedppl.PVIGuide(model, family="fullrank")


# -- (b) the algebra: exact tilted moments give the exact posterior ------------------------------


@pytest.mark.parametrize("damping, alpha, rounds", [(1.0, 1.0, 1), (1.0, 0.5, 1),
                                                    (0.5, 1.0, 50)])
def test_exact_tilted_is_exact(linear, damping, alpha, rounds):
    clients, mean, cov = linear
    res = fedppl.EP(linear_regression, _guide(), damping=damping, alpha=alpha,
                    tilted="exact").run(jax.random.key(0), clients, rounds, progress_bar=False)
    m, c = res.mean_and_cov()
    np.testing.assert_allclose(m, mean, atol=1e-8)
    np.testing.assert_allclose(c, cov, atol=1e-8)
    assert isinstance(res, fedppl.EPResult) and res.rejected == []


@pytest.mark.parametrize("damping, end, atol", [(ep.decaying_damping(0.5, 0.3), 0.3, 1e-8),
                                                ("decaying", 0.2, 1e-3)])
def test_decaying_damping_converges(linear, damping, end, atol):
    """Undamped, a Gaussian site is its likelihood at once: damped, the error shrinks by
    ``1 - rho_r`` a round (0.8^40 ~ 1e-4 for "decaying", which ends at min(1 / K, 0.2))."""
    clients, mean, _ = linear
    res = fedppl.EP(linear_regression, _guide(), damping=damping,
                    tilted="exact").run(jax.random.key(0), clients, 40, progress_bar=False)
    np.testing.assert_allclose(res.mean_and_cov()[0], mean, atol=atol)
    assert res.history["damping"][0] == 0.5
    assert end < res.history["damping"][-1] < end + 1e-3


def test_client_step_is_pvi_step_with_tilted_solver(linear):
    """With alpha = 1, EP's client step is PVI's with the tilted moment match as q_k."""
    clients, _, _ = linear
    guide = _guide().setup(*clients.client(0))
    solver = ep.ExactTilted(linear_regression, guide)
    rng = np.random.default_rng(1)
    site = g.FullGaussian(jnp.asarray(rng.normal(size=3)), jnp.diag(jnp.asarray([0.5, 2., 1.])))
    q = g.product(guide.prior, site)
    data = tuple(a[1] for a in clients.stacked)
    ours, new = ep.client_update(q, pvi.ClientState(site), data, clients.mask[1],
                                 jax.random.key(0), solver, 0.5)
    theirs, new_pvi = pvi.client_update(q, pvi.ClientState(site), data, clients.mask[1],
                                        jax.random.key(0), solver, 0.5)
    for a, b in zip(jax.tree_util.tree_leaves((ours.delta, new)),
                    jax.tree_util.tree_leaves((theirs.delta, new_pvi)), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-12)


# -- (a) NUTS on the conjugate model: within 3 Monte Carlo standard errors -----------------------


def test_nuts_matches_exact_posterior(linear):
    clients, mean, cov = linear
    # undamped, a Gaussian site is the likelihood plus Monte Carlo noise whatever the cavity, and
    # to first order q's mean errs by the sum of the clients' tilted-mean errors: its s.e. is
    # sd * sqrt(sum_k 1 / ESS_k) (ESS_k the client's smallest over coordinates: conservative)
    res = fedppl.EP(linear_regression, _guide(), damping=1.0, num_warmup=150, num_samples=300,
                    num_chains=2).run(jax.random.key(3), clients, 2, progress_bar=False)
    m, c = res.mean_and_cov()
    ess = res.history["ess"][-1]
    se = np.sqrt(np.diag(cov)) * np.sqrt(np.sum(1.0 / ess))
    assert np.all(np.abs(np.asarray(m) - mean) <= 3 * se), (m, mean, se)
    np.testing.assert_allclose(np.sqrt(np.diag(c)), np.sqrt(np.diag(cov)), rtol=0.15)
    assert np.all(res.history["rhat"] < 1.1) and np.all(res.history["converged"] == 1)
    assert np.all(res.history["mc_error"] == pytest.approx(1 / np.sqrt(res.history["ess"])))


# -- (d) logistic regression: q positive definite and close to the exact posterior --------------


def test_logistic_close_to_posterior():
    rng = np.random.default_rng(1)
    X = rng.normal(size=(200, 2))
    y = (rng.uniform(size=200) < 1 / (1 + np.exp(-(X @ np.array([1.5, -1.0]) + 0.3)))) * 1.0
    clients = fedppl.partition.homogeneous(X, y, num_clients=2, seed=0)
    res = fedppl.EP(logistic_regression, _guide(logistic_regression), num_warmup=150,
                    num_samples=300, num_chains=2).run(jax.random.key(0), clients, 4,
                                                       progress_bar=False)
    m, c = (np.asarray(a) for a in res.mean_and_cov())
    assert np.all(np.linalg.eigvalsh(c) > 0)
    # the pooled posterior's moments by self-normalised importance sampling from a wide
    # Student-t around EP's q (50k draws: its own error is far below the tolerance)
    d = 3
    L = np.linalg.cholesky(2.0 * c)
    z = rng.standard_t(5, size=(50_000, d))
    theta = m + z @ L.T
    log_t = -0.5 * (5 + d) * np.log1p(np.sum(z**2, 1) / 5)
    logits = np.c_[X, np.ones(200)] @ theta.T
    log_post = (np.sum(y[:, None] * logits - np.logaddexp(0, logits), 0)
                - 0.5 * np.sum(theta**2, 1))
    w = np.exp(log_post - log_t - np.max(log_post - log_t))
    w /= w.sum()
    ref_mean = w @ theta
    ref_sd = np.sqrt(w @ (theta - ref_mean) ** 2)
    assert np.all(np.abs(m - ref_mean) < 0.2 * ref_sd), (m, ref_mean, ref_sd)
    np.testing.assert_allclose(np.sqrt(np.diag(c)), ref_sd, rtol=0.2)


# -- (c) bad input, refused before any client runs -----------------------------------------------


@pytest.mark.parametrize("kwargs, match", [
    ({"alpha": 0.0}, "alpha"), ({"alpha": 1.5}, "alpha"), ({"damping": 0.0}, "damping"),
    ({"damping": 1.5}, "damping"), ({"damping": lambda r: 2.0 + 0 * r}, "damping"),
    ({"damping": "fast"}, "damping"),
    ({"num_samples": 0}, "num_samples"), ({"num_chains": 1.5}, "num_chains"),
    ({"tilted": "laplace"}, "tilted"), ({"schedule": "async"}, "schedule"),
    ({"max_rhat": 1.0}, "max_rhat")])
def test_bad_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        fedppl.EP(linear_regression, _guide(), **kwargs)


def test_too_few_draws(linear):
    clients, _, _ = linear
    with pytest.raises(ValueError, match="at least 16 draws"):
        fedppl.EP(linear_regression, _guide(), num_samples=5, num_chains=2).init(
            jax.random.key(0), clients)


def test_exact_needs_conjugate_model(linear):
    clients, _, _ = linear
    X, y = (np.asarray(a) for a in clients.client(0))
    bad = fedppl.partition.homogeneous(X, (y > 0) * 1.0, num_clients=2, seed=0)
    with pytest.raises(ValueError, match="tilted='exact'"):
        fedppl.EP(logistic_regression, _guide(logistic_regression), tilted="exact").init(
            jax.random.key(0), bad)


def test_non_gaussian_prior_not_implemented(linear):
    clients, _, _ = linear

    def model(X, y=None):
        w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
        s = numpyro.sample("s", dist.HalfNormal(1.0))
        with numpyro.plate("data", X.shape[0]):
            numpyro.sample("y", dist.Normal(X @ w, s), obs=y)

    with pytest.raises(NotImplementedError, match="Gaussian in the unconstrained space"):
        fedppl.EP(model, _guide(model)).init(jax.random.key(0), clients)


def test_too_few_draws_message():
    with pytest.raises(ValueError, match="num_samples \\* num_chains = 10"):
        ep.check_draws(10, 3)
    ep.check_draws(16, 3)
