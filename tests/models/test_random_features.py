from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numpyro import handlers

from fedppl.models import kernels
from fedppl.models import random_features as rf


@pytest.fixture
def X():
    return jax.random.normal(jax.random.key(0), (6, 3))


@pytest.mark.parametrize("spectral,closed", [
    ("se", lambda A, B: kernels.se(A, B, 0.7)),
    ("matern12", lambda A, B: kernels.matern(A, B, 0.5, 0.7)),
    ("matern32", lambda A, B: kernels.matern(A, B, 1.5, 0.7)),
    ("matern52", lambda A, B: kernels.matern(A, B, 2.5, 0.7)),
])
def test_random_fourier_features_converge_to_the_kernel(X, spectral, closed):
    spec = rf.URKSpec(3, feature_widths=(), shift_widths=(), num_samples=100_000,
                      spectral=spectral)
    params = rf.init_urk(jax.random.key(1), spec, lengthscale=0.7)
    Phi = rf.urk_features(params, rf.base_draws(jax.random.key(2), spec), X)
    np.testing.assert_allclose(Phi @ Phi.T, closed(X, X), atol=0.015)
    assert spec.num_features == Phi.shape[1] == 200_000


def test_finite_m_estimate_is_unbiased(X):
    """Averaged over independent draws, the m = 3 estimate matches k: dividing by m - 1 (the
    paper's Eq. 17) would be biased by a factor 3/2 and fail this test."""
    spec = rf.URKSpec(3, feature_widths=(), shift_widths=(), num_samples=3)
    params = rf.init_urk(jax.random.key(1), spec, lengthscale=1.5)

    def estimate(key):
        Phi = rf.urk_features(params, rf.base_draws(key, spec), X)
        return Phi @ Phi.T

    ests = jax.vmap(estimate)(jax.random.split(jax.random.key(3), 20_000))
    err = np.abs(np.asarray(ests.mean(0)) - kernels.se(X, X, 1.5))
    se = np.asarray(ests.std(0)) / np.sqrt(ests.shape[0])
    assert np.all(err <= 5 * se + 1e-12)


def test_neural_urk_is_a_valid_kernel_and_starts_as_rff_on_f(X):
    spec = rf.URKSpec(3, feature_widths=(8, 4), shift_widths=(5,), num_samples=30)
    params = rf.init_urk(jax.random.key(0), spec)
    omega = rf.base_draws(jax.random.key(1), spec)
    Phi = rf.urk_features(params, omega, X)
    assert Phi.shape == (6, 60)
    assert np.all(np.linalg.eigvalsh(np.asarray(Phi @ Phi.T)) > -1e-10)
    np.testing.assert_allclose(np.diag(Phi @ Phi.T), 1.0, rtol=1e-12)  # |z|^2 = cos^2 + sin^2
    # the shifter's MLP starts at zero: features equal plain RFF on f(x)
    fx = params.feature(X)
    np.testing.assert_allclose(Phi, rf.rff_features(omega, fx), rtol=1e-12)


def test_urk_weights_are_numpyro_params(X):
    spec = rf.URKSpec(3, feature_widths=(4,), num_samples=5)
    init = rf.init_urk(jax.random.key(0), spec)
    omega = rf.base_draws(jax.random.key(1), spec)
    tr = handlers.trace(handlers.seed(rf.urk_regression, 0)).get_trace(X, omega=omega, init=init)
    names = [n for n, s in tr.items() if s["type"] == "param"]
    assert "urk/feature/layers/0/weight" in names and "noise" in names
    assert "prior_scale" in names and "urk/shift/layers/1/bias" in names
    zero = {n: jnp.zeros_like(tr[n]["value"]) for n in names if n.startswith("urk/feature")}
    sub = handlers.trace(handlers.seed(handlers.substitute(rf.urk_regression, data=zero), 0)
                         ).get_trace(X, omega=omega, init=init)
    assert float(jnp.abs(sub["urk/feature/layers/0/weight"]["value"]).max()) == 0.0


@pytest.mark.parametrize("spec,match", [
    (rf.URKSpec(2, spectral="cauchy"), "spectral must be one of"),
    (rf.URKSpec(0), "input_dim must be a positive integer"),
    (rf.URKSpec(2.5), "input_dim must be a positive integer"),
    (rf.URKSpec(2, feature_widths=(8, 0)), "feature_widths must be a tuple of positive"),
    (rf.URKSpec(2, shift_widths=[4]), "shift_widths must be a tuple of positive"),
    (rf.URKSpec(2, num_samples=-3), "num_samples must be a positive integer"),
])
def test_malformed_specs_are_refused(spec, match):
    with pytest.raises(ValueError, match=match):
        rf.base_draws(jax.random.key(0), spec)
    with pytest.raises(ValueError, match=match):
        rf.init_urk(jax.random.key(0), spec)


def test_identity_feature_map_and_no_shifter():
    spec = rf.URKSpec(3, feature_widths=(), shift_widths=(), num_samples=4)
    params = rf.init_urk(jax.random.key(0), spec)
    assert params.shift is None and params.feature.layers == ()
    X = jnp.arange(6.0).reshape(2, 3)
    omega = rf.base_draws(jax.random.key(1), spec)
    np.testing.assert_array_equal(rf.urk_features(params, omega, X), rf.rff_features(omega, X))
