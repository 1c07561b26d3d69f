from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedppl.models import kernels


def test_closed_forms_on_known_distances():
    X1, X2 = np.zeros((1, 2)), np.array([[3.0, 4.0]])  # distance 5
    assert float(kernels.se(X1, X2, 5.0, 2.0)[0, 0]) == pytest.approx(2 * np.exp(-0.5))
    assert float(kernels.matern(X1, X2, 0.5, 5.0)[0, 0]) == pytest.approx(np.exp(-1))
    s3, s5 = np.sqrt(3), np.sqrt(5)
    assert float(kernels.matern(X1, X2, 1.5, 5.0)[0, 0]) == pytest.approx((1 + s3) * np.exp(-s3))
    assert float(kernels.matern(X1, X2, 2.5, 5.0)[0, 0]) == pytest.approx(
        (1 + s5 + 5 / 3) * np.exp(-s5))
    ard = kernels.se(X1, X2, np.array([3.0, 4.0]))
    assert float(ard[0, 0]) == pytest.approx(np.exp(-1.0))
    with pytest.raises(ValueError, match="nu"):
        kernels.matern(X1, X2, nu=3.0)


def test_gram_is_the_point_kernel_on_every_pair_and_matches_the_dense_formula():
    rng = np.random.default_rng(0)
    X1, X2 = rng.normal(size=(4, 3)), rng.normal(size=(5, 3))
    ls = np.array([0.5, 1.0, 2.0])
    K = np.asarray(kernels.se(X1, X2, ls, 1.7))
    d2 = (((X1[:, None, :] - X2[None, :, :]) / ls) ** 2).sum(-1)
    np.testing.assert_allclose(K, 1.7 * np.exp(-0.5 * d2), rtol=1e-14)
    assert float(kernels.se_point(X1[2], X2[3], ls, 1.7)) == pytest.approx(K[2, 3], rel=1e-14)
    # the diagonal of a Gram matrix of one set is the variance exactly (no cancellation)
    assert np.all(np.asarray(kernels.se(X1, X1, ls, 1.7)).diagonal() == 1.7)


def test_matern_gradient_is_finite_at_zero_distance():
    x = jnp.array([0.3, -0.2])
    for nu in kernels.MATERN_NU:
        grad = jax.grad(kernels.matern_point)(x, x, nu, 0.7)
        assert np.all(np.isfinite(grad)), nu


def test_se_params_is_the_one_container():
    p = kernels.SEParams.init(2, lengthscale=0.5, variance=2.0, noise=0.1, dtype=jnp.float64)
    assert p.log_lengthscale.shape == (2,) and p.log_lengthscale.dtype == jnp.float64
    np.testing.assert_allclose(p.lengthscale, [0.5, 0.5])
    assert float(p.variance) == pytest.approx(2.0) and float(p.noise) == pytest.approx(0.1)
    assert float(p.noise_var) == pytest.approx(0.01)
    X = np.array([[0.0, 0.0], [0.5, 0.0]])
    np.testing.assert_allclose(p.kernel(X, X), kernels.se(X, X, 0.5, 2.0))
    # a pytree: jit and averaging work leaf by leaf
    avg = jax.tree_util.tree_map(lambda a, b: (a + b) / 2, p, p._replace(log_variance=0.0 * p[1]))
    assert float(avg.log_variance) == pytest.approx(np.log(2.0) / 2)
