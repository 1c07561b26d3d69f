"""The (alpha, diagonal Sigma) guide of Eq. 2.8: its bound (Eq. 2.12) against dense computation,
and its optimum where theory places it (float64)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from scipy.stats import multivariate_normal

from fedppl.guides.svgp import DiagGuide, optimal_alpha
from fedppl.models import sparse_gp, svgp
from fedppl.models.kernels import SEParams
from tests.svgp_reference import elbo_fn, exact_lml, hensman_bound, predictive, titsias_bound

LOG_HYPER = {"log_lengthscale": jnp.log(jnp.array([0.7, 1.2])), "log_variance": jnp.log(1.3),
             "log_noise": jnp.log(0.2)}


def test_diag_bound_and_prediction_equal_dense():
    rng = np.random.default_rng(0)
    X = rng.uniform(-2, 2, (14, 2))
    y = np.cos(X[:, 0]) + 0.1 * rng.normal(size=14)
    Z = rng.uniform(-2, 2, (6, 2))
    model = svgp.SparseGPRegression(svgp.Points(Z))             # Z a learned param here
    guide = DiagGuide(model)
    alpha, sigma = rng.normal(size=6), rng.uniform(0.05, 2.0, 6)
    params = {**LOG_HYPER, "Z": jnp.asarray(Z), "q_alpha": jnp.asarray(alpha),
              "q_sigma": jnp.asarray(sigma)}
    F = float(elbo_fn(model, guide)(params, X, y))
    hyper = SEParams(*LOG_HYPER.values())
    K = np.asarray(sparse_gp.kzz(jnp.asarray(Z), hyper))
    Kfu, kff, s2 = np.asarray(hyper.kernel(X, Z)), np.full(14, 1.3), 0.04
    m, S = K @ alpha, K - K @ np.linalg.solve(K + np.diag(sigma), K)
    ref = hensman_bound(y, m, S, K, Kfu, kff, s2)
    assert abs(F - ref) < 1e-8 * abs(ref)
    exact = exact_lml(y, np.asarray(hyper.kernel(X, X)), s2)
    assert F < titsias_bound(y, K, Kfu, kff, s2) < exact
    mean, var = jax.jit(lambda p: svgp.predict(model, guide, p, X))(params)
    ref_mean, ref_var = predictive(m, S, K, Kfu, kff)
    np.testing.assert_allclose(mean, ref_mean, rtol=1e-8)
    np.testing.assert_allclose(var, ref_var, rtol=1e-8, atol=1e-12)


def test_diag_optimum_with_inducing_points_at_the_data_is_exact():
    """With Z = X (no jitter) the optimal Sigma is s2 I, inside the family, and the bound there is
    Titsias' bound, which for Z = X is the exact log marginal likelihood."""
    X = np.linspace(-3, 3, 6)[:, None] * np.array([[1.0, -0.5]])
    y = np.sin(X[:, 0])
    model = svgp.SparseGPRegression(svgp.Points(X, learn=False), jitter=0.0)
    hyper = SEParams(*LOG_HYPER.values())
    K = np.asarray(hyper.kernel(X, X))
    s2 = 0.04
    alpha = np.linalg.solve(K + s2 * np.eye(6), y)
    prior = svgp.PointsPrior(jnp.asarray(X), hyper, 0.0)
    np.testing.assert_allclose(optimal_alpha(prior, jnp.asarray(X), jnp.asarray(y),
                                             jnp.full(6, s2), hyper.noise), alpha, rtol=1e-8)
    params = {**LOG_HYPER, "q_alpha": jnp.asarray(alpha), "q_sigma": jnp.full(6, s2)}
    F = elbo_fn(model, DiagGuide(model))
    exact = multivariate_normal(np.zeros(6), K + s2 * np.eye(6)).logpdf(y)
    assert abs(float(F(params, X, y)) - exact) < 1e-8 * abs(exact)
    grads = jax.grad(lambda q: F({**params, **q}, X, y))(
        {"q_alpha": params["q_alpha"], "q_sigma": params["q_sigma"]})
    assert float(jnp.max(jnp.abs(grads["q_alpha"]))) < 1e-6
    assert float(jnp.max(jnp.abs(grads["q_sigma"] * s2))) < 1e-6   # d/dlog sigma
    off = {**params, "q_sigma": jnp.full(6, 3 * s2)}
    assert float(F(off, X, y)) < exact
