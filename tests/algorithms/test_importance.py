"""The importance-sampling pieces against closed forms: proposal densities, the local log
marginal likelihood, PSIS edge cases, leave-one-client-out."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import fedppl
from fedppl.algorithms import importance as imp
from tests.conftest import random_intercepts, random_intercepts_logit


def exact_marginal(gid, y, mu, tau, n_groups):
    """``log p(y | mu, tau)``: per group a Gaussian with covariance ``I + tau^2 11'``."""
    total = 0.0
    for j in range(n_groups):
        yj = y[gid == j]
        if len(yj):
            n = len(yj)
            total += stats.multivariate_normal(mu * np.ones(n), np.eye(n) + tau**2
                                               * np.ones((n, n))).logpdf(yj)
    return total


@pytest.mark.parametrize("df", [np.inf, 5.0])
def test_proposal_density_matches_scipy(df):
    rng = np.random.default_rng(0)
    D = 4
    A = rng.normal(size=(D, D))
    cov = A @ A.T + D * np.eye(D)
    p = imp.Proposal(jnp.asarray(rng.normal(size=D)), jnp.linalg.cholesky(cov), df)
    x = imp.sample(jax.random.key(0), p, 20000)
    ref = (stats.multivariate_normal(np.asarray(p.mean), cov) if np.isinf(df)
           else stats.multivariate_t(np.asarray(p.mean), cov, df=df))
    np.testing.assert_allclose(imp.log_prob(p, x[:50]), ref.logpdf(np.asarray(x[:50])),
                               rtol=1e-10)
    # the draws have the distribution's covariance (scale * df / (df - 2) for a t)
    want = cov if np.isinf(df) else cov * df / (df - 2)
    np.testing.assert_allclose(np.cov(np.asarray(x).T), want, rtol=0.1,
                               atol=0.05 * np.max(np.diag(want)))


def test_mixture_density_weights_by_counts():
    a = imp.Proposal(jnp.zeros(1), jnp.eye(1), np.inf)
    b = imp.Proposal(jnp.ones(1) * 3, jnp.eye(1) * 2, 4.0)
    x = jnp.linspace(-3, 6, 7)[:, None]
    want = np.log(0.25 * np.exp(imp.log_prob(a, x)) + 0.75 * np.exp(imp.log_prob(b, x)))
    np.testing.assert_allclose(imp.mixture_log_prob([a, b], [100, 300], x), want, rtol=1e-12)


def test_laplace_marginal_exact_for_the_conjugate_random_intercepts():
    """The per-client log marginal likelihood at fixed global values equals the closed form
    (the integrand is Gaussian in the local sites: Laplace is exact, every weight equal)."""
    rng = np.random.default_rng(0)
    n_groups = 3
    gid = np.repeat(np.arange(n_groups), 5)
    y = 0.5 + rng.normal(size=n_groups)[gid] + rng.normal(size=len(gid))
    guide = fedppl.PVIGuide(random_intercepts, ("mu", "tau"), family="fullrank").setup(
        gid, y, n_groups=n_groups)
    fn = jax.jit(imp.client_log_lik(partial(random_intercepts, n_groups=n_groups), guide, 8, 10,
                                    16))
    thetas = jnp.array([[0.3, np.log(0.8)], [-1.0, np.log(2.0)], [1.0, -2.0]])
    got = fn(thetas, None, (jnp.asarray(gid), jnp.asarray(y)), jnp.ones(len(gid), bool),
             jax.random.key(0))
    want = [exact_marginal(gid, y, float(m), float(np.exp(t)), n_groups) for m, t in thetas]
    np.testing.assert_allclose(got.log_lik, want, rtol=1e-10)
    np.testing.assert_allclose(got.variance, 0.0, atol=1e-12)  # every weight equal


def test_laplace_marginal_within_its_error_for_a_logistic_random_intercept():
    """Not Gaussian: against quadrature. Fifty estimates at one value of the global sites
    (independent local draws) average to the exact value within four of their standard errors
    (the log's bias, about half its variance, is far smaller), one estimate's sd is small, and
    the variance each estimate states is the spread they show."""
    rng = np.random.default_rng(1)
    gid = np.repeat(np.arange(2), 15)
    y = (rng.uniform(size=30) < 0.6).astype(float)
    guide = fedppl.PVIGuide(random_intercepts_logit, ("mu", "tau"), family="fullrank").setup(
        gid, y, n_groups=2)
    fn = jax.jit(imp.client_log_lik(partial(random_intercepts_logit, n_groups=2), guide, 32, 10,
                                    16))
    theta = jnp.tile(jnp.array([[0.2, np.log(1.5)]]), (50, 1))
    out = fn(theta, None, (jnp.asarray(gid), jnp.asarray(y)), jnp.ones(30, bool),
             jax.random.key(0))
    got = np.asarray(out.log_lik)
    # the variance each estimate states matches the spread of the estimates
    assert 0.5 < float(np.mean(out.variance)) / got.var() < 2.0
    z = np.linspace(-8, 8, 4001)
    want = 0.0
    for j in range(2):
        yj = y[gid == j][:, None]
        logit = 0.2 + 1.5 * z[None, :]
        ll = np.sum(yj * logit - np.logaddexp(0, logit), 0) + stats.norm.logpdf(z)
        want += np.log(np.trapezoid(np.exp(ll - ll.max()), z)) + ll.max()
    assert got.std() < 0.05
    assert abs(got.mean() - want) < 4 * got.std() / np.sqrt(len(got)), (got.mean(), want)


def test_psis_equal_weights_and_zero_likelihood():
    lw, khat = imp.psis(np.full(200, -3.0))
    assert khat == -np.inf and np.allclose(np.exp(lw), 1 / 200)
    lr = np.random.default_rng(0).normal(size=300)
    lr[:5] = -np.inf  # draws the data rule out keep zero weight
    lw, khat = imp.psis(lr)
    assert np.all(np.exp(lw[:5]) == 0) and np.isclose(np.exp(lw).sum(), 1)
    assert khat < 0.5


def test_leave_one_out_matches_exact_predictive():
    """Draws from the exact posterior of a conjugate model: each client's leave-one-client-out
    predictive density matches the closed form ``p(y_k | y_-k)`` (a Gaussian)."""
    rng = np.random.default_rng(2)
    K, n, D, noise = 5, 20, 2, 0.5
    X = rng.normal(size=(K, n, D))
    y = X @ np.array([1.0, -0.5]) + noise * rng.normal(size=(K, n))

    def posterior(keep):
        prec = np.eye(D) + sum(X[k].T @ X[k] for k in keep) / noise**2
        cov = np.linalg.inv(prec)
        return cov @ sum(X[k].T @ y[k] for k in keep) / noise**2, cov

    mean, cov = posterior(range(K))
    draws = rng.multivariate_normal(mean, cov, size=8000)
    log_lik = np.stack([stats.norm(draws @ X[k].T, noise).logpdf(y[k]).sum(1) for k in range(K)])
    ratios = np.zeros(len(draws))  # the draws come from the target: equal weights
    elpd, khat = imp.leave_one_out(ratios, log_lik)
    for k in range(K):
        m, c = posterior([j for j in range(K) if j != k])
        want = stats.multivariate_normal(X[k] @ m, X[k] @ c @ X[k].T + noise**2 * np.eye(n)
                                         ).logpdf(y[k])
        assert abs(elpd[k] - want) < 0.05, (k, elpd[k], want)
    assert np.all(khat < 0.7)


def test_tempered_fit_keeps_enough_draws():
    """A proposal far too narrow: the fit moves towards the target but keeps ``min_ess``
    effective draws behind it (no collapse onto the few heaviest)."""
    p = imp.Proposal(jnp.zeros(3), 0.2 * jnp.eye(3), np.inf)
    x = imp.sample(jax.random.key(0), p, 2000)
    ratios = np.asarray(-0.5 * jnp.sum(x**2, -1) - imp.log_prob(p, x))
    new = imp.tempered_fit(np.asarray(x), ratios, p, min_ess=300, df=7.0)
    sd = np.asarray(jnp.diag(new.scale_tril))
    assert np.all(sd > 0.22) and np.all(sd < 1.0)
    assert float(new.df) == 7.0


def _client_f(model, gid, y, n_groups):
    """A client's ``f(theta, z) = log p(y, z | theta)`` at its global and local coordinates."""
    from fedppl.algorithms.natural_gradient import log_lik_fn

    guide = fedppl.PVIGuide(model, ("mu", "tau"), family="fullrank").setup(
        gid, y, n_groups=n_groups)
    data = (jnp.asarray(gid), jnp.asarray(y))
    ll = log_lik_fn(partial(model, n_groups=n_groups), guide, data, jnp.ones(len(gid), bool))
    return lambda t, z: ll(jnp.concatenate([t, z]), 0)


def test_laplace_gradient_exact_for_the_conjugate_random_intercepts():
    """The gradient of the local sites' Laplace marginal in the global ones (what the sampler's
    gradient moves use) equals the closed form's where the integrand is Gaussian in the local
    sites (by central differences of the exact marginal likelihood)."""
    rng = np.random.default_rng(0)
    gid = np.repeat(np.arange(3), 5)
    y = 0.5 + rng.normal(size=3)[gid] + rng.normal(size=len(gid))
    f = _client_f(random_intercepts, gid, y, 3)
    grad = jax.jit(lambda t: imp.laplace_gradient(
        f, t, imp.laplace_fit(lambda z: f(t, z), jnp.zeros(3), 10)[0]))
    for theta in ([0.3, np.log(0.8)], [-1.0, np.log(2.0)]):
        t = jnp.asarray(theta)
        got = grad(t)

        def exact(m, lt):
            return exact_marginal(gid, y, m, float(np.exp(lt)), 3)

        h = 1e-5
        want = [(exact(t[0] + h, t[1]) - exact(t[0] - h, t[1])) / (2 * h),
                (exact(t[0], t[1] + h) - exact(t[0], t[1] - h)) / (2 * h)]
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_laplace_gradient_near_quadrature_for_a_logistic_random_intercept():
    """Not Gaussian: within a few percent of the quadrature's gradient (the Laplace
    approximation's error), closer than Fisher's identity over 64 local draws typically is
    (the spread of 50 such estimates), and without the log-determinant's terms it would not be."""
    rng = np.random.default_rng(1)
    gid = np.repeat(np.arange(2), 15)
    y = (rng.uniform(size=30) < 0.6).astype(float)
    f = _client_f(random_intercepts_logit, gid, y, 2)
    t = jnp.array([0.2, np.log(1.5)])

    @jax.jit
    def laplace_and_fisher(t):
        mode, chol = imp.laplace_fit(lambda z: f(t, z), jnp.zeros(2), 10)
        fisher = jax.vmap(lambda k: jax.grad(lambda s: imp.laplace_estimate(
            lambda u: f(s, u), mode, chol, k, 64)[0])(t))(jax.random.split(jax.random.key(0), 50))
        return imp.laplace_gradient(f, t, mode), fisher, jax.grad(f)(t, mode)

    got, fisher, envelope = (np.asarray(a) for a in laplace_and_fisher(t))
    z = np.linspace(-8, 8, 4001)

    def exact(m, lt):
        total = 0.0
        for j in range(2):
            logit = m + np.exp(lt) * z[None, :]
            yj = y[gid == j][:, None]
            ll = np.sum(yj * logit - np.logaddexp(0, logit), 0) + stats.norm.logpdf(z)
            total += np.log(np.trapezoid(np.exp(ll - ll.max()), z)) + ll.max()
        return total

    h = 1e-5
    want = np.array([(exact(t[0] + h, t[1]) - exact(t[0] - h, t[1])) / (2 * h),
                     (exact(t[0], t[1] + h) - exact(t[0], t[1] - h)) / (2 * h)])
    err = np.abs(got - want)
    assert np.all(err <= 0.05 * np.abs(want) + 0.02), (got, want)
    assert np.all(err <= fisher.std(0)), (err, fisher.std(0))
    # df/dtheta at the mode alone (without the log-determinant's terms) is far off
    assert np.max(np.abs(envelope - want)) > 3 * np.max(err), (envelope, got, want)
