from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import numpyro.distributions as dist
import pytest

from fedppl.families import gaussian as g
from fedppl.families import lognormal


def random_spd(rng, d):
    a = rng.normal(size=(d, d))
    return a @ a.T + d * np.eye(d)


@pytest.fixture
def pair():
    rng = np.random.default_rng(0)
    a = g.FullGaussian.from_moments(rng.normal(size=4), random_spd(rng, 4))
    b = g.FullGaussian.from_moments(rng.normal(size=4), random_spd(rng, 4))
    return a, b


def test_moments_round_trip_full_and_diag():
    rng = np.random.default_rng(1)
    mean, cov = rng.normal(size=3), random_spd(rng, 3)
    m, c = g.to_moments(g.FullGaussian.from_moments(mean, cov))
    np.testing.assert_allclose(m, mean, rtol=1e-12)
    np.testing.assert_allclose(c, cov, rtol=1e-12)
    var = np.array([0.5, 2.0, 3.0])
    m, v = g.to_moments(g.DiagGaussian.from_moments(mean, var))
    np.testing.assert_allclose(m, mean)
    np.testing.assert_allclose(v, var)


def test_product_matches_gaussian_conditioning(pair):
    a, b = pair
    ma, ca = g.to_moments(a)
    mb, cb = g.to_moments(b)
    # product of densities N(ma, ca) N(mb, cb) is proportional to N(m, c) with
    c = np.linalg.inv(np.linalg.inv(ca) + np.linalg.inv(cb))
    m = c @ (np.linalg.solve(ca, ma) + np.linalg.solve(cb, mb))
    mp, cp = g.to_moments(g.product(a, b))
    np.testing.assert_allclose(mp, m, rtol=1e-10)
    np.testing.assert_allclose(cp, c, rtol=1e-10)


def test_quotient_inverts_product_and_damping_interpolates(pair):
    a, b = pair
    back = g.quotient(g.product(a, b), b)
    np.testing.assert_allclose(back.prec, a.prec, rtol=1e-12)
    np.testing.assert_allclose(back.nat1, a.nat1, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(g.damp(a, b, 1.0).prec, b.prec)
    np.testing.assert_allclose(g.damp(a, b, 1.0).nat1, b.nat1)
    np.testing.assert_allclose(g.damp(a, b, 0.0).prec, a.prec)
    half = g.damp(a, b, 0.5)
    np.testing.assert_allclose(half.prec, 0.5 * (a.prec + b.prec))


def test_mixing_families_is_an_error(pair):
    a, _ = pair
    d = g.DiagGaussian(jnp.zeros(4), jnp.ones(4))
    with pytest.raises(TypeError, match="DiagGaussian"):
        g.product(a, d)


def test_kl_and_log_prob_match_numpyro(pair):
    a, b = pair
    qa, qb = g.to_distribution(a), g.to_distribution(b)
    np.testing.assert_allclose(g.kl(a, b), dist.kl_divergence(qa, qb), rtol=1e-10)
    x = jnp.linspace(-1, 1, 4)
    np.testing.assert_allclose(g.log_prob(a, x), qa.log_prob(x), rtol=1e-10)
    assert abs(float(g.kl(a, a))) < 1e-10


def test_diag_kl_and_log_prob_match_numpyro():
    a = g.DiagGaussian.from_moments(jnp.array([0.0, 1.0]), jnp.array([1.0, 0.25]))
    b = g.DiagGaussian.from_moments(jnp.array([0.5, -1.0]), jnp.array([2.0, 0.5]))
    np.testing.assert_allclose(
        g.kl(a, b), dist.kl_divergence(g.to_distribution(a), g.to_distribution(b)), rtol=1e-10
    )
    x = jnp.array([0.3, 0.2])
    np.testing.assert_allclose(g.log_prob(a, x), g.to_distribution(a).log_prob(x), rtol=1e-12)


def test_samples_have_the_right_moments(pair):
    a, _ = pair
    xs = g.sample(jax.random.key(0), a, 200_000)
    mean, cov = g.to_moments(a)
    se = np.sqrt(np.diag(cov) / xs.shape[0])
    assert np.all(np.abs(xs.mean(0) - mean) < 5 * se)
    np.testing.assert_allclose(np.cov(xs.T), cov, rtol=0.03, atol=0.03)


def test_repair_clips_an_indefinite_precision_and_leaves_pd_alone(pair):
    a, _ = pair
    fixed, changed = g.repair(a)
    assert not bool(changed)
    np.testing.assert_allclose(fixed.prec, a.prec)
    bad = g.FullGaussian(jnp.array([1.0, 2.0]), jnp.array([[1.0, 0.0], [0.0, -3.0]]))
    assert not bool(g.is_pd(bad))
    fixed, changed = g.repair(bad, min_prec=1e-3)
    assert bool(changed) and bool(g.is_pd(fixed))
    np.testing.assert_allclose(np.linalg.eigvalsh(fixed.prec), [1e-3, 1.0])
    # the well-defined direction keeps its mean (1.0 / 1.0)
    assert g.to_moments(fixed)[0][0] == pytest.approx(1.0)
    dbad = g.DiagGaussian(jnp.array([1.0, 1.0]), jnp.array([2.0, -1.0]))
    dfixed, dchanged = g.repair(dbad, min_prec=0.5)
    assert bool(dchanged) and bool(g.is_pd(dfixed))
    np.testing.assert_allclose(dfixed.prec, [2.0, 0.5])


def test_batched_checks_and_bytes():
    stacked = g.DiagGaussian(jnp.array([[1.0, jnp.nan], [1.0, 2.0]]), jnp.ones((2, 2)))
    np.testing.assert_array_equal(g.is_finite(stacked), [False, True])
    full = g.FullGaussian(jnp.zeros(3), jnp.eye(3))
    assert g.num_bytes(full) == (3 + 6) * 8


def test_project_diag_keeps_mean_and_diagonal_precision(pair):
    a, _ = pair
    d = g.project_diag(a)
    np.testing.assert_allclose(g.to_moments(d)[0], g.to_moments(a)[0], rtol=1e-10)
    np.testing.assert_allclose(d.prec, np.diag(a.prec))


def test_lognormal_factor_round_trip_and_kl():
    f = lognormal.from_params(0.3, 0.5)
    loc, sc = lognormal.to_params(f)
    assert float(loc[0]) == pytest.approx(0.3) and float(sc[0]) == pytest.approx(0.5)
    d = lognormal.to_distribution(f)
    assert float(d.mean[0]) == pytest.approx(np.exp(0.3 + 0.125))
    other = lognormal.from_params(0.0, 1.0)
    np.testing.assert_allclose(
        g.kl(f, other), dist.kl_divergence(dist.Normal(0.3, 0.5), dist.Normal(0.0, 1.0)), rtol=1e-10
    )
