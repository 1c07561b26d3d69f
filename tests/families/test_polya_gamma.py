"""Polya-Gamma moments, KL and the augmented bound against closed forms and Monte Carlo."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedppl.families import polya_gamma as pg

TERMS = 200


def sample_pg(rng: np.random.Generator, b: float, c: float, size: int) -> np.ndarray:
    """Test-only PG(b, c) sampler from the infinite sum of Gammas (Polson, Scott and Windle).

    ``omega = 1/(2 pi^2) sum_k g_k / ((k - 1/2)^2 + a^2)``, ``a = c / (2 pi)``, ``g_k ~ Gamma(b)``,
    truncated at ``TERMS`` terms; the tail is replaced by its expectation, computed by the midpoint
    rule ``sum_{k > K} 1/((k - 1/2)^2 + a^2) ~ int_K^inf dx / (x^2 + a^2) = arctan(a / K) / a``
    (error ~ 1/(12 K^3); the tail's variance is of order K^-3 and is neglected).
    """
    k = np.arange(1, TERMS + 1)
    a = c / (2 * np.pi)
    gam = rng.gamma(b, 1.0, size=(size, TERMS))
    head = gam @ (1.0 / ((k - 0.5) ** 2 + a**2))
    tail = np.arctan(a / TERMS) / a if a > 0 else 1.0 / TERMS
    return (head + b * tail) / (2 * np.pi**2)


CASES = [(1.0, 0.0), (1.0, 1e-3), (1.0, 2.5), (1.0, 20.0), (2.5, 1.0), (0.7, 6.0)]


@pytest.mark.parametrize("b,c", CASES)
def test_mean_and_kl_match_monte_carlo(b, c):
    rng = np.random.default_rng(int(100 * b + c))
    omega = sample_pg(rng, b, c, 20000)
    se = omega.std(ddof=1) / np.sqrt(omega.size)
    assert abs(omega.mean() - float(pg.mean(b, c))) < 4 * se
    # KL[PG(b, c) || PG(b, 0)] = E_q[log density ratio] = E_q[b log cosh(c/2) - c^2 omega / 2]
    ratio = b * np.log(np.cosh(c / 2)) - 0.5 * c**2 * omega
    kl_se = ratio.std(ddof=1) / np.sqrt(ratio.size)
    assert abs(ratio.mean() - float(pg.kl_to_prior(b, c))) < 4 * kl_se + 1e-12
    assert float(pg.kl_to_prior(b, c)) >= 0.0


@pytest.mark.parametrize("b,c", [(1.0, 1.0), (1.0, 3.0), (2.0, 2.0)])
def test_density_ratio_normaliser(b, c):
    """The tilt used for the KL: ``E_{PG(b,0)}[exp(-c^2 omega / 2)] = cosh(c/2)^-b``."""
    omega = sample_pg(np.random.default_rng(7), b, 0.0, 20000)
    w = np.exp(-0.5 * c**2 * omega)
    se = w.std(ddof=1) / np.sqrt(w.size)
    assert abs(w.mean() - np.cosh(c / 2) ** -b) < 4 * se


def test_mean_is_even_smooth_and_stable():
    c = jnp.array([0.0, 1e-6, 9.99e-5, 1.001e-4, 0.3, 50.0, 1e4])
    m = pg.mean(1.0, c)
    exact = np.where(c > 0, np.tanh(np.asarray(c) / 2) / (2 * np.where(c > 0, c, 1)), 0.25)
    np.testing.assert_allclose(m, exact, rtol=1e-12)
    np.testing.assert_allclose(pg.mean(2.0, -c), 2 * m, rtol=1e-15)
    kl = pg.kl_to_prior(1.0, c)
    assert np.all(np.isfinite(kl)) and np.all(np.asarray(kl) >= 0)
    # d/dc E[omega] is finite at 0 (the series branch)
    assert np.isfinite(jax.grad(lambda x: pg.mean(1.0, x))(0.0))


def _jj(y, m, v):
    """Jaakkola-Jordan bound at xi = sqrt(m^2 + v), labels in {0, 1}, written independently."""
    xi = np.sqrt(m**2 + v)
    lam = np.tanh(xi / 2) / (4 * xi)
    s = 2 * y - 1
    return -np.log1p(np.exp(-xi)) + (s * m - xi) / 2 - lam * (m**2 + v - xi**2)


def test_augmented_bound_is_jj_at_optimum_and_a_lower_bound():
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 50).astype(float)
    m, v = rng.normal(size=50) * 3, rng.uniform(0.01, 4, 50)
    np.testing.assert_allclose(pg.augmented_bound(y, m, v), _jj(y, m, v), rtol=1e-12, atol=1e-12)
    # other c give a smaller bound; the optimum is below E_q[log p(y | f)] (Monte Carlo)
    for scale in (0.5, 2.0):
        c = scale * pg.optimal_c(m, v)
        assert np.all(np.asarray(pg.augmented_bound(y, m, v, c)) < _jj(y, m, v))
    f = m + np.sqrt(v) * rng.normal(size=(20000, 50))
    exact = -np.logaddexp(0, -(2 * y - 1) * f).mean(0)
    assert np.all(_jj(y, m, v) <= exact + 1e-2)
    assert np.mean(exact - _jj(y, m, v)) > 1e-3  # the bound is not tight for v > 0


def test_gaussian_site_is_kappa_and_mean():
    kappa, prec = pg.gaussian_site(jnp.array([0.0, 1.0]), jnp.array([0.0, 2.0]))
    np.testing.assert_allclose(kappa, [-0.5, 0.5])
    np.testing.assert_allclose(prec, [0.25, np.tanh(1.0) / 4], rtol=1e-14)
