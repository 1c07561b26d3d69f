"""The Gaussian natural-parameter algebra in float32 (see ``conftest.py`` for how float32 is run
and how the tolerances are derived): each result against a float64 reference computed from the
same float32-rounded inputs, within ``100 eps`` times the conditioning of the matrix it comes out
of. (That no function turns float32 inputs into a float64 result is checked with x64 on, in
``test_no_upcast.py``.)"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedppl.families import gaussian as g
from tests.float32.conftest import F32, assert_dtype, cond, eps, f64, rtol

pytestmark = pytest.mark.usefixtures("no_x64")


def spd(rng, d, condition):
    """A random SPD matrix of condition number ``condition`` (eigenvalues log-spaced)."""
    q, _ = np.linalg.qr(rng.normal(size=(d, d)))
    return (q * np.logspace(0, np.log10(condition), d)) @ q.T


def full(rng, d, condition=30.0, scale=1.0):
    prec = jnp.asarray(scale * spd(rng, d, condition), F32)
    mean = jnp.asarray(rng.normal(size=d) * 2.0, F32)
    return g.FullGaussian(prec @ mean, 0.5 * (prec + prec.T))


def close(got, want, tol, what=""):
    """Norm-wise relative error ``|got - want| / |want|`` at most ``tol``."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    err = np.linalg.norm(got - want) / max(np.linalg.norm(want), np.finfo(np.float64).tiny)
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol:.3g}"


@pytest.mark.parametrize("d,condition", [(3, 10.0), (10, 1e3)])
def test_moments_round_trip(d, condition):
    rng = np.random.default_rng(d)
    cov = jnp.asarray(spd(rng, d, condition), F32)
    mean = jnp.asarray(rng.normal(size=d), F32)
    q = g.FullGaussian.from_moments(mean, cov)
    m, c = g.to_moments(q)
    assert_dtype((q, m, c), what="moments")
    k = cond(cov)  # two inversions of a matrix with this condition number
    close(c, cov, rtol(cond=k), "covariance")
    close(m, mean, rtol(cond=k), "mean")
    var = jnp.asarray(rng.uniform(0.5, 2.0, d), F32)
    md, vd = g.to_moments(g.DiagGaussian.from_moments(mean, var))
    close(md, mean, rtol(), "diag mean")
    close(vd, var, rtol(), "diag variance")


def test_product_matches_conditioning():
    rng = np.random.default_rng(0)
    a, b = full(rng, 6, 100.0), full(rng, 6, 100.0)
    m, c = g.to_moments(g.product(a, b))
    a64, b64 = f64(a), f64(b)
    prec = a64.prec + b64.prec
    want_c = np.linalg.inv(prec)
    close(c, want_c, rtol(cond=cond(prec)), "covariance")
    close(m, want_c @ (a64.nat1 + b64.nat1), rtol(cond=cond(prec)), "mean")


def test_quotient_undoes_product_and_damping_interpolates():
    rng = np.random.default_rng(1)
    a, b = full(rng, 5), full(rng, 5, scale=100.0)
    back = g.quotient(g.product(a, b), b)
    # a sum and a difference of numbers of size |a| + |b|: a few eps of that, absolutely
    for x, y, z in zip(back, a, b, strict=True):
        bound = 4 * eps() * (np.abs(np.asarray(y)) + np.abs(np.asarray(z)))
        assert np.all(np.abs(np.asarray(x) - np.asarray(y)) <= bound)
    half = g.damp(a, b, 0.5)
    close(half.prec, 0.5 * (f64(a).prec + f64(b).prec), rtol())
    assert_dtype((back, half, g.damp(a, b, jnp.asarray(0.3, F32))))


@pytest.mark.parametrize("gap", [1e-1, 1e-3, 1e-5])
def test_kl_is_accurate_however_close_q_and_p_are(gap):
    """The textbook ``tr - d + log det`` form of KL leaves an error of ~``d eps`` (~1e-6 in
    float32, of either sign) that swamps a KL of 1e-9; :func:`g.kl` works from the differences
    of the natural parameters and keeps its relative accuracy."""
    rng = np.random.default_rng(2)
    d = 8
    q = full(rng, d, 30.0)
    e = rng.normal(size=(d, d))
    p = g.FullGaussian(q.nat1 + jnp.asarray(gap * rng.normal(size=d), F32),
                       q.prec + jnp.asarray(gap * (e + e.T), F32))
    got = g.kl(q, p)
    assert got.dtype == F32
    q64, p64 = f64(q), f64(p)
    cq, cp = np.linalg.inv(q64.prec), np.linalg.inv(p64.prec)
    diff = cq @ q64.nat1 - cp @ p64.nat1
    _, ldq = np.linalg.slogdet(q64.prec)
    _, ldp = np.linalg.slogdet(p64.prec)
    want = 0.5 * (np.trace(p64.prec @ cq) - d + diff @ p64.prec @ diff + ldq - ldp)
    # relative error of the eigenvalues of L^-1 (Lp - Lq) L^-T, which the KL squares
    assert abs(float(got) - want) <= 2 * rtol(cond=d * cond(q64.prec)) * want, (got, want)
    # the same with diagonal Gaussians
    qd = g.DiagGaussian(jnp.diagonal(q.prec) * 0.3, jnp.diagonal(q.prec))
    pd = g.DiagGaussian(qd.nat1 + jnp.asarray(gap * rng.normal(size=d), F32),
                        qd.prec * (1 + jnp.asarray(gap * rng.uniform(size=d), F32)))
    q64, p64 = f64(qd), f64(pd)
    r = p64.prec / q64.prec
    want = 0.5 * np.sum(r - 1 - np.log(r) + p64.prec * (q64.nat1 / q64.prec
                                                          - p64.nat1 / p64.prec) ** 2)
    assert abs(float(g.kl(qd, pd)) - want) <= 2 * rtol() * want


def test_kl_of_a_gaussian_with_itself_is_exactly_zero():
    rng = np.random.default_rng(3)
    q = full(rng, 10, 1e3)
    assert float(g.kl(q, q)) == 0.0
    d = g.DiagGaussian(jnp.ones(4, F32), jnp.asarray([1.0, 10.0, 1e3, 1e-2], F32))
    assert float(g.kl(d, d)) == 0.0
    # and never negative for nearby Gaussians (the sign of the old error was random)
    near = g.damp(q, full(rng, 10, 1e3), jnp.asarray(1e-6, F32))
    assert float(g.kl(near, q)) >= 0.0 and float(g.kl(q, near)) >= 0.0


def test_log_prob_and_samples():
    rng = np.random.default_rng(4)
    q = full(rng, 5, 100.0)
    x = jnp.asarray(rng.normal(size=(3, 5)), F32)
    q64 = f64(q)
    m = np.linalg.solve(q64.prec, q64.nat1)
    r = np.asarray(x, np.float64) - m
    want = 0.5 * (np.linalg.slogdet(q64.prec)[1] - 5 * np.log(2 * np.pi)
                  - np.einsum("ni,ij,nj->n", r, q64.prec, r))
    got = g.log_prob(q, x)
    assert got.dtype == F32
    # the terms summed are of size |logdet| + maha; their rounding, not the result's size, counts
    size = np.abs(np.linalg.slogdet(q64.prec)[1]) + np.einsum("ni,ij,nj->n", r, q64.prec, r)
    assert np.all(np.abs(np.asarray(got, np.float64) - want) <= rtol(cond=cond(q64.prec)) * size)
    draws = g.sample(jax.random.key(0), q, 8)
    assert draws.dtype == F32 and draws.shape == (8, 5)


def test_repair_floor_follows_the_dtype():
    """Eigenvalues below ``10 D eps`` of the largest are rounding noise: float32 clips them (the
    repaired precision then factorises), float64 keeps a precision of condition number 1e7."""
    rng = np.random.default_rng(5)
    qmat, _ = np.linalg.qr(rng.normal(size=(4, 4)))
    evals = np.array([1e4, 10.0, 1.0, 1e-3])
    prec = (qmat * evals) @ qmat.T
    mean = rng.normal(size=4)
    with jax.enable_x64(True):
        g64 = g.FullGaussian(jnp.asarray(prec @ mean), jnp.asarray(prec))
        fixed64, changed64 = g.repair(g64)
        assert not bool(changed64)
        np.testing.assert_array_equal(fixed64.prec, g64.prec)
    g32 = g.FullGaussian(jnp.asarray(prec @ mean, F32), jnp.asarray(prec, F32))
    fixed, changed = g.repair(g32)
    assert bool(changed) and fixed.prec.dtype == F32
    new = np.linalg.eigvalsh(np.asarray(fixed.prec, np.float64))
    floor = 10 * 4 * eps() * 1e4
    assert new.min() >= 0.9 * floor and bool(g.is_pd(fixed))
    m, c = g.to_moments(fixed)
    assert np.all(np.isfinite(np.asarray(m))) and np.all(np.isfinite(np.asarray(c)))
    # the mean along the kept eigen-directions is where it was
    kept = qmat[:, :3]
    close(kept.T @ np.asarray(m, np.float64), kept.T @ mean, rtol(cond=1e4 / floor))


def test_repair_clips_an_indefinite_precision_and_leaves_a_good_one_alone():
    rng = np.random.default_rng(6)
    q = full(rng, 5, 30.0)
    same, changed = g.repair(q)
    assert not bool(changed)
    np.testing.assert_array_equal(same.prec, q.prec)
    bad = g.FullGaussian(q.nat1, q.prec - 2 * jnp.eye(5, dtype=F32) * jnp.max(q.prec))
    fixed, changed = g.repair(bad)
    assert bool(changed) and bool(g.is_pd(fixed)) and fixed.prec.dtype == F32
    diag = g.DiagGaussian(jnp.asarray([1.0, -1.0], F32), jnp.asarray([2.0, -3.0], F32))
    fixed, changed = g.repair(diag)
    assert bool(changed) and bool(g.is_pd(fixed)) and fixed.prec.dtype == F32


def test_join_and_split_round_trip():
    rng = np.random.default_rng(7)
    q = full(rng, 3, 10.0)
    joint = full(rng, 5, 100.0)
    marginal, conditional = g.split(joint, 3)
    back = g.join(marginal, conditional, diag=False)
    k = cond(f64(joint).prec)
    close(back.prec, joint.prec, rtol(cond=k), "precision")
    close(back.nat1, joint.nat1, rtol(cond=k), "nat1")
    m_joint, c_joint = g.to_moments(joint)
    m_marg, c_marg = g.to_moments(marginal)
    close(m_marg, m_joint[:3], rtol(cond=k), "marginal mean")
    close(c_marg, c_joint[:3, :3], rtol(cond=k), "marginal covariance")
    assert_dtype((marginal, conditional, back, g.embed(q, 2), g.conditional_entropy(conditional)))
