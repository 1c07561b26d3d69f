"""RNVGP's randomised estimators: unbiased CG and unbiased gradients of the Eq. 3.15 bound."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedppl.guides.rnvgp import RandomisedConfig, RNVGPGuide, kl_part, unbiased_cg
from fedppl.guides.svgp import DiagGuide
from fedppl.models import svgp


def spd(n, seed=0):
    rng = np.random.default_rng(seed)
    B = rng.normal(size=(n, n))
    return jnp.asarray(B @ B.T / n + 0.3 * np.eye(n))


def test_unbiased_cg_mean_is_the_solution():
    A, b = spd(8), jnp.linspace(-1.0, 1.0, 8)
    cfg = RandomisedConfig(tol_first=0.5, tol=1e-12, roulette=0.4)
    xs, its = jax.jit(jax.vmap(lambda k: unbiased_cg(A, b, k, cfg)))(
        jax.random.split(jax.random.key(0), 4000))
    xs, its = np.asarray(xs), np.asarray(its)
    assert its.min() < its.max()                     # the roulette stops at different steps
    se = xs.std(0) / np.sqrt(len(xs))
    assert np.all(se > 0)
    assert np.all(np.abs(xs.mean(0) - np.linalg.solve(A, b)) < 4 * se)
    x_plain, _ = unbiased_cg(A, b, jax.random.key(1), RandomisedConfig(tol_first=1e-12,
                                                                        tol=1e-12))
    np.testing.assert_allclose(x_plain, np.linalg.solve(A, b), rtol=1e-9)


def problem():
    rng = np.random.default_rng(3)
    X = rng.uniform(-2, 2, (10, 2))
    y = np.sin(X[:, 0]) + 0.1 * rng.normal(size=10)
    Z = X[:6] + 0.1
    params = {"log_lengthscale": jnp.log(jnp.array([0.9, 1.4])), "log_variance": jnp.log(1.2),
              "log_noise": jnp.log(0.3), "Z": jnp.asarray(Z),
              "q_mu": jnp.asarray(rng.normal(size=6)), "q_sigma": jnp.asarray(
                  rng.uniform(0.1, 1.0, 6))}
    return X, y, svgp.SparseGPRegression(svgp.Points(Z)), params


def test_gradient_estimate_is_unbiased_per_coordinate():
    """Mean of the RNVGP gradient over many probe draws against the exact gradient of Eq. 2.12
    (the same family through DiagGuide), every coordinate: hyperparameters, inducing inputs,
    mu and Sigma."""
    X, y, model, params = problem()
    cfg = RandomisedConfig(probes=2, tol_first=0.3, tol=1e-11, roulette=0.3)
    elbo = svgp.InducingELBO().elbo
    rn = RNVGPGuide(model, cfg)
    grads = jax.jit(jax.vmap(lambda k: jax.grad(lambda p: elbo(k, p, model, rn, X, y))(params)))(
        jax.random.split(jax.random.key(0), 3000))
    dparams = {("q_alpha" if k == "q_mu" else k): v for k, v in params.items()}
    exact = jax.jit(jax.grad(lambda p: elbo(jax.random.key(0), p, model, DiagGuide(model), X, y))
                    )(dparams)
    for name, g in grads.items():
        g = np.asarray(g).reshape(len(g), -1)
        ref = np.asarray(exact["q_alpha" if name == "q_mu" else name]).ravel()
        se = g.std(0) / np.sqrt(len(g))
        err = np.abs(g.mean(0) - ref)
        assert np.all(err <= 4 * se + 1e-9 * (1 + np.abs(ref))), (name, err, se)
    assert np.asarray(grads["q_sigma"]).std(0).min() > 0     # the estimates are random


def test_kl_part_exact_value_option():
    K, sigma = spd(5, seed=1), jnp.linspace(0.2, 1.0, 5)
    A = K + jnp.diag(sigma)
    ref = 0.5 * (jnp.linalg.slogdet(A)[1] - jnp.trace(jnp.linalg.solve(A, K)))
    exact = kl_part(K, sigma, jax.random.key(0), RandomisedConfig(exact_value=True))
    assert abs(float(exact - ref)) < 1e-10


def test_bad_config_is_named():
    for bad, match in [(dict(probes=0), "probes"), (dict(tol=1e-2, tol_first=1e-3), "tol"),
                       (dict(roulette=-1.0), "roulette"), (dict(probe="uniform"), "probe")]:
        with pytest.raises(ValueError, match=match):
            RandomisedConfig(**bad).check()


def test_a_step_factorises_nothing():
    """The compiled gradient has no Cholesky and no triangular solve: only products and CG."""
    X, y, model, params = problem()
    elbo = svgp.InducingELBO().elbo
    grad = jax.jit(jax.grad(lambda p, k: elbo(k, p, model, RNVGPGuide(model), X, y)))
    hlo = grad.lower(params, jax.random.key(0)).compile().as_text().lower()
    assert "while" in hlo
    assert "cholesky" not in hlo and "triangular" not in hlo
    exact = jax.jit(jax.grad(lambda p: elbo(jax.random.key(0), p, model, DiagGuide(model), X, y)))
    dparams = {("q_alpha" if k == "q_mu" else k): v for k, v in params.items()}
    assert "cholesky" in exact.lower(dparams).compile().as_text().lower()
