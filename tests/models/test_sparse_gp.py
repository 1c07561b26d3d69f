"""Closed-form checks of the sparse GP linear algebra (float64)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import pytest

from fedppl.models import gp
from fedppl.models import sparse_gp as sgp
from fedppl.models.kernels import SEParams, se


def _setup(seed=0, M=6, N=15):
    rng = np.random.default_rng(seed)
    Z, X = rng.normal(size=(M, 2)), rng.normal(size=(N, 2))
    hyper = SEParams(jnp.log(jnp.array([0.8, 1.3])), jnp.log(1.7), jnp.log(0.3))
    return rng, Z, X, hyper


def test_posterior_equals_natural_parameter_product():
    rng, Z, X, hyper = _setup()
    K = np.asarray(sgp.kzz(Z, hyper))
    Ki = np.linalg.inv(K)
    Kxz = np.asarray(se(X, Z, hyper.lengthscale, hyper.variance))
    S = rng.uniform(0.1, 1.0, len(X))
    m = rng.normal(size=len(X))
    B, b = Kxz.T @ (Kxz / S[:, None]), Kxz.T @ (m / S)
    # brute force: the factor in u has precision K^-1 B K^-1 and natural mean K^-1 b
    prec = Ki + Ki @ B @ Ki
    cov = np.linalg.inv(prec)
    mean = cov @ (Ki @ b)
    got_mean, got_cov = sgp.moments(sgp.posterior_from_B(jnp.asarray(K), B, b))
    np.testing.assert_allclose(got_mean, mean, rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(got_cov, cov, rtol=1e-8, atol=1e-10)
    # the M-space form K (K + B)^-1 K / K (K + B)^-1 b
    np.testing.assert_allclose(got_cov, K @ np.linalg.solve(K + B, K), rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(got_mean, K @ np.linalg.solve(K + B, b), rtol=1e-8, atol=1e-10)


def test_predict_f_and_kl_match_dense_formulas():
    rng, Z, X, hyper = _setup(1)
    K = np.asarray(sgp.kzz(Z, hyper))
    Kxz = np.asarray(se(X, Z, hyper.lengthscale, hyper.variance))
    B1 = Kxz[:8].T @ Kxz[:8] / 0.2
    B2 = Kxz[8:].T @ Kxz[8:] / 0.5
    b1, b2 = Kxz[:8].T @ rng.normal(size=8), Kxz[8:].T @ rng.normal(size=7)
    q = sgp.posterior_from_B(jnp.asarray(K), B1 + B2, b1 + b2)
    p = sgp.posterior_from_B(jnp.asarray(K), B2, b2)
    mq, Sq = (np.asarray(a) for a in sgp.moments(q))
    mp, Sp = (np.asarray(a) for a in sgp.moments(p))
    A = Kxz @ np.linalg.inv(K)
    mean, var = sgp.predict_f(q, jnp.asarray(Kxz), jnp.full(len(X), hyper.variance))
    np.testing.assert_allclose(mean, A @ mq, rtol=1e-8)
    dense_var = hyper.variance - np.sum(A * Kxz, 1) + np.sum((A @ Sq) * A, 1)
    np.testing.assert_allclose(var, dense_var, rtol=1e-7)
    Spi = np.linalg.inv(Sp)
    kl = 0.5 * (np.trace(Spi @ Sq) + (mq - mp) @ Spi @ (mq - mp) - len(mq)
                + np.linalg.slogdet(Sp)[1] - np.linalg.slogdet(Sq)[1])
    np.testing.assert_allclose(sgp.kl_whitened(q, p), kl, rtol=1e-7)
    assert float(sgp.kl_whitened(q, q)) == pytest.approx(0.0, abs=1e-9)


def test_collapsed_bound_matches_dense_formula():
    rng, Z, X, hyper = _setup(2)
    y = rng.normal(size=len(X))
    Kxz = np.asarray(se(X, Z, hyper.lengthscale, hyper.variance))
    for relative in (True, False):
        Q = Kxz @ np.linalg.solve(np.asarray(sgp.kzz(Z, hyper, relative=relative)), Kxz.T)
        C = Q + hyper.noise**2 * np.eye(len(X))
        logn = -0.5 * (len(X) * np.log(2 * np.pi) + np.linalg.slogdet(C)[1]
                       + y @ np.linalg.solve(C, y))
        ref = logn - (len(X) * hyper.variance - np.trace(Q)) / (2 * hyper.noise**2)
        got = sgp.collapsed_bound(X, y, Z, hyper, relative=relative)
        np.testing.assert_allclose(got, ref, rtol=1e-9)


def test_collapsed_bound_is_the_exact_marginal_at_z_equal_x_and_below_it_otherwise():
    rng = np.random.default_rng(0)
    X = rng.uniform(-3, 3, (15, 1))
    y = np.sin(X[:, 0]) + 0.2 * rng.normal(size=15)
    hyper = SEParams(jnp.zeros(1), jnp.log(1.5), jnp.log(0.3))
    exact = -float(gp.neg_log_marginal(hyper, X, y))
    full = float(sgp.collapsed_bound(X, y, X, hyper, jitter=1e-10, relative=False))
    assert abs(full - exact) < 1e-6
    sub = float(sgp.collapsed_bound(X, y, X[::3], hyper, jitter=1e-10, relative=False))
    assert sub < exact - 1e-3  # a strict gap: 5 points cannot represent the function


def test_collapsed_bound_ignores_masked_rows_even_nan_ones():
    rng, Z, X, hyper = _setup(3)
    y = rng.normal(size=len(X))
    alone = float(sgp.collapsed_bound(X[:9], y[:9], Z, hyper))
    mask = np.arange(len(X)) < 9
    for fill in (np.nan, 1e3):
        Xp, yp = X.copy(), y.copy()
        Xp[9:], yp[9:] = fill, fill
        padded = sgp.collapsed_bound(Xp, yp, Z, hyper, mask)
        np.testing.assert_allclose(padded, alone, rtol=1e-10)
        grad = jax.grad(sgp.collapsed_bound, argnums=3)(Xp, yp, Z, hyper, mask)
        assert all(np.isfinite(g).all() for g in grad)


def test_expected_log_lik():
    y = jnp.array([0.3, -1.0, 1.0, 0.0])
    mean, var = jnp.array([0.1, -0.5, 2.0, -1.0]), jnp.array([0.2, 1.0, 0.5, 2.0])
    got = sgp.expected_log_lik("gaussian", y, mean, var, jnp.asarray(0.5))
    ref = np.sum(-0.5 * np.log(2 * np.pi * 0.25) - ((y - mean) ** 2 + var) / 0.5)
    np.testing.assert_allclose(got, ref, rtol=1e-12)
    lab = jnp.array([1.0, 0.0, 1.0, 0.0])
    f = np.linspace(-30, 30, 200001)
    dense = 0.0
    for yi, mi, vi in zip(lab, mean, var, strict=True):
        w = np.exp(-0.5 * (f - mi) ** 2 / vi) / np.sqrt(2 * np.pi * vi)
        dense += np.trapezoid(w * (yi * f - np.logaddexp(0, f)), f)
    np.testing.assert_allclose(sgp.expected_log_lik("bernoulli", lab, mean, var, 1.0), dense,
                               rtol=1e-6)
    masked = sgp.expected_log_lik("gaussian", y, mean, var, jnp.asarray(0.5),
                                  jnp.array([True, True, False, False]))
    assert float(masked) < 0 and float(masked) != float(got)
    with pytest.raises(ValueError, match="likelihood"):
        sgp.expected_log_lik("poisson", y, mean, var, 1.0)


def test_local_model_sites():
    tr = numpyro.handlers.trace(numpyro.handlers.seed(sgp.local_model, 0)).get_trace(
        lambda lb, Z: jnp.sum(Z) + jnp.sum(lb), (jnp.zeros(3), jnp.ones(3)),
        (jnp.zeros((4, 2)), jnp.ones((4, 2))))
    assert set(tr) == {"log_beta", "Z", "u_term"}
    tr = numpyro.handlers.trace(sgp.local_model).get_trace(
        lambda lb, Z: jnp.sum(Z), None, None, jnp.zeros(3), jnp.ones((4, 2)))
    assert set(tr) == {"u_term"} and float(tr["u_term"]["fn"].log_factor) == 8.0
