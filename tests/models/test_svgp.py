"""The sparse GP model over inducing values: priors, the likelihood site, SVIGP at its optimum,
minibatching, and bad input (float64)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.stats import multivariate_normal

from fedppl.families import kronecker as kr
from fedppl.guides.svgp import SVIGPGuide
from fedppl.models import sparse_gp, svgp
from fedppl.models.kernels import SEParams
from tests.svgp_reference import elbo_fn, hensman_bound

HYPER = SEParams(jnp.log(jnp.array([0.8, 1.3])), jnp.log(1.4), jnp.log(0.25))


def test_grid_prior_against_dense():
    rng = np.random.default_rng(0)
    axes = (np.linspace(-1, 1, 3), np.linspace(-2, 1, 4))
    X = rng.uniform(-2, 2, (6, 2))
    u = rng.normal(size=12)

    def pieces(u, X):
        p = svgp.GridPrior(axes, HYPER)
        return p.log_prob(u), p.ktilde(X), p.project(u, X), kr.kron_dense(p.factors), \
            kr.kron_rows(p.cross(X))

    lp, ktilde, proj, K, Kxu = jax.jit(pieces)(u, X)
    K, Kxu = np.asarray(K), np.asarray(Kxu)
    zgrid = np.array([[a, b] for a in axes[0] for b in axes[1]])   # row-major grid order
    jitter = svgp.JITTER * np.sqrt(1.4) ** 2                      # per factor, multiplied
    np.testing.assert_allclose(Kxu, np.asarray(HYPER.kernel(X, zgrid)), rtol=1e-12)
    np.testing.assert_allclose(K, np.asarray(HYPER.kernel(zgrid, zgrid)), atol=3 * jitter)
    assert abs(float(lp) - multivariate_normal(np.zeros(12), K).logpdf(u)) < 1e-8
    np.testing.assert_allclose(ktilde, 1.4 - np.sum(Kxu * np.linalg.solve(K, Kxu.T).T, 1),
                               rtol=1e-7, atol=1e-12)
    np.testing.assert_allclose(proj, Kxu @ np.linalg.solve(K, u), rtol=1e-8)


def test_likelihood_site_is_titsias_conditional_bound():
    rng = np.random.default_rng(1)
    Z, X = rng.normal(size=(5, 2)), rng.normal(size=(4, 2))
    y, u = rng.normal(size=4), rng.normal(size=5)
    prior = svgp.PointsPrior(jnp.asarray(Z), HYPER)
    lp = svgp.InducingLikelihood(jnp.asarray(u), prior, jnp.asarray(X), HYPER.noise).log_prob(y)
    K, Kxu = np.asarray(prior.K), np.asarray(HYPER.kernel(X, Z))
    mean = Kxu @ np.linalg.solve(K, u)
    ktilde = 1.4 - np.sum(Kxu * np.linalg.solve(K, Kxu.T).T, 1)
    s2 = 0.25**2
    ref = -0.5 * np.log(2 * np.pi * s2) - 0.5 * (y - mean) ** 2 / s2 - ktilde / (2 * s2)
    np.testing.assert_allclose(lp, ref, rtol=1e-10)
    undrawn = svgp.InducingLikelihood(svgp.Undrawn("u"), prior, jnp.asarray(X), HYPER.noise)
    with pytest.raises(ValueError, match="was not drawn"):
        undrawn.log_prob(y)


def data(n=12, seed=2):
    rng = np.random.default_rng(seed)
    X = rng.uniform(-2, 2, (n, 2))
    return X, np.sin(X[:, 0]) * X[:, 1] + 0.1 * rng.normal(size=n)


def hyper_params():
    return {"log_lengthscale": HYPER.log_lengthscale, "log_variance": HYPER.log_variance,
            "log_noise": HYPER.log_noise}


def test_svigp_at_its_optimum_is_the_titsias_bound():
    X, y = data()
    Z = X[::3]
    model = svgp.SparseGPRegression(svgp.Points(Z, learn=False))
    guide = SVIGPGuide(model, whiten=False)
    K = np.asarray(sparse_gp.kzz(jnp.asarray(Z), HYPER))
    Kfu = np.asarray(HYPER.kernel(X, Z))
    s2 = float(HYPER.noise_var)
    P = K + Kfu.T @ Kfu / s2                                       # Titsias' optimal q(u)
    m = K @ np.linalg.solve(P, Kfu.T @ y) / s2
    S = K @ np.linalg.solve(P, K)
    params = {**hyper_params(), "q_mean": jnp.asarray(m),
              "q_scale_tril": jnp.asarray(np.linalg.cholesky(S))}
    F = elbo_fn(model, guide)
    titsias = float(sparse_gp.collapsed_bound(jnp.asarray(X), jnp.asarray(y), jnp.asarray(Z),
                                              HYPER))
    assert abs(float(F(params, X, y)) - titsias) < 1e-8 * abs(titsias)
    grad = jax.grad(lambda mean: F({**params, "q_mean": mean}, X, y))(params["q_mean"])
    assert float(jnp.max(jnp.abs(grad))) < 1e-6
    L = np.linalg.cholesky(K)                                     # the same q(u), whitened
    Li = np.linalg.inv(L)
    white = {**hyper_params(), "q_mean": jnp.asarray(Li @ m),
             "q_scale_tril": jnp.asarray(np.linalg.cholesky(Li @ S @ Li.T))}
    whitened = elbo_fn(model, SVIGPGuide(model))(white, X, y)
    assert abs(float(whitened) - titsias) < 1e-8 * abs(titsias)
    # away from the optimum: below, and equal to the dense Eq. 1.34
    off = {**params, "q_mean": params["q_mean"] + 0.3}
    ref = hensman_bound(y, m + 0.3, S, K, Kfu, np.full(len(y), 1.4), s2)
    assert abs(float(F(off, X, y)) - ref) < 1e-8 * abs(ref) and ref < titsias


def test_minibatch_bound_is_unbiased_for_the_full_bound():
    X, y = data(n=10)
    params = {**hyper_params(), "q_mean": jnp.linspace(-1, 1, 4), "q_scale_tril": 0.5 * jnp.eye(4)}
    full = svgp.SparseGPRegression(svgp.Points(X[:4], learn=False))
    batch = svgp.SparseGPRegression(svgp.Points(X[:4], learn=False), batch_size=3)
    elbo = svgp.InducingELBO().elbo
    F = float(elbo(jax.random.key(0), params, full, SVIGPGuide(full), X, y))
    draws = np.asarray(jax.jit(jax.vmap(lambda k: elbo(k, params, batch, SVIGPGuide(batch), X, y)))(
        jax.random.split(jax.random.key(1), 3000)))
    assert draws.std() > 0
    assert abs(draws.mean() - F) < 4 * draws.std() / np.sqrt(len(draws))


def test_bad_model_input_is_named():
    X, y = data()
    with pytest.raises(ValueError, match="learn names"):
        svgp.SparseGPRegression(svgp.Points(X[:3]), learn=("lengthscales",))
    with pytest.raises(ValueError, match="batch_size"):
        svgp.SparseGPRegression(svgp.Points(X[:3]), batch_size=0)
    with pytest.raises(ValueError, match="positive"):
        svgp.SparseGPRegression(svgp.Points(X[:3]), noise=0.0)
    with pytest.raises(ValueError, match="2-D"):
        svgp.SparseGPRegression(svgp.Points(X[:3, 0]))
    with pytest.raises(ValueError, match="2-D"):
        svgp.Grid.over(X[:, 0], 3)
    with pytest.raises(ValueError, match="3 grid sizes for 2 input dimensions"):
        svgp.Grid.over(X, [3, 3, 3])
    model = svgp.SparseGPRegression(svgp.Points(X[:3, :1]))
    with pytest.raises(ValueError, match="inducing inputs have 1 columns, the data 2"):
        model(X, y)
    with pytest.raises(ValueError, match=r"y must have shape \(12,\)"):
        svgp.SparseGPRegression(svgp.Points(X[:3]))(X, y[:5])
