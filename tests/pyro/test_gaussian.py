"""The torch natural-parameter algebra against the NumPyro core's, at the same inputs, in float64
(to 1e-12) and float32 (to float32's precision), batched."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from fedppl.families import gaussian as jg
from fedppl.families import polya_gamma as jpg
from fedppl.pyro.families import gaussian as tg
from fedppl.pyro.families import polya_gamma as tpg


def spd(rng, d):
    a = rng.normal(size=(d, d))
    return a @ a.T + d * np.eye(d)


def pair(rng, full=True, batch=()):
    mean = rng.normal(size=(*batch, 4))
    if full:
        cov = np.stack([spd(rng, 4) for _ in range(int(np.prod(batch)))]).reshape(*batch, 4, 4)
        return (jg.FullGaussian.from_moments(jnp.asarray(mean), jnp.asarray(cov)),
                tg.FullGaussian.from_moments(torch.as_tensor(mean), torch.as_tensor(cov)))
    var = rng.uniform(0.5, 2.0, size=(*batch, 4))
    return (jg.DiagGaussian.from_moments(jnp.asarray(mean), jnp.asarray(var)),
            tg.DiagGaussian.from_moments(torch.as_tensor(mean), torch.as_tensor(var)))


def same(a, b, tol=1e-12):
    np.testing.assert_allclose(b.numpy() if isinstance(b, torch.Tensor) else b, np.asarray(a),
                               rtol=tol, atol=tol)


@pytest.mark.parametrize("full", [True, False], ids=["full", "diag"])
def test_algebra_equals_the_numpyro_cores(full):
    rng = np.random.default_rng(0)
    (ja, ta), (jb, tb) = pair(rng, full, (3,)), pair(rng, full, (3,))
    for j, t in [(jg.product(ja, jb), tg.product(ta, tb)),
                 (jg.quotient(ja, jb), tg.quotient(ta, tb)),
                 (jg.damp(ja, jb, 0.3), tg.damp(ta, tb, 0.3))]:
        same(j.nat1, t.nat1)
        same(j.prec, t.prec)
    for j, t in zip(jg.to_moments(ja), tg.to_moments(ta), strict=True):
        same(j, t)
    same(jg.kl(ja, jb), tg.kl(ta, tb))
    same(jg.kl(ja, ja), tg.kl(ta, ta), 0.0)  # exactly zero
    x = rng.normal(size=(3, 4))
    same(jg.log_prob(ja, jnp.asarray(x)), tg.log_prob(ta, torch.as_tensor(x)))
    mean, sc = tg.mean_and_scale_tril(ta)
    same(jg.kl_from_moments(*jg.mean_and_scale_tril(ja), jb, jg.to_moments(jb)[0]),
         tg.kl_from_moments(mean, sc, tb, tg.to_moments(tb)[0]))
    assert tg.num_bytes(tg.index(ta, 0)) == jg.num_bytes(jg.FullGaussian(*(x[0] for x in ja))
                                                        if full else
                                                        jg.DiagGaussian(*(x[0] for x in ja)))


def test_indefinite_precisions_are_flagged_and_repaired_like_the_numpyro_cores():
    rng = np.random.default_rng(1)
    (ja, ta), (jb, tb) = pair(rng), pair(rng)
    jq, tq = jg.quotient(ja, jg.scale(jb, 3.0)), tg.quotient(ta, tg.scale(tb, 3.0))
    assert not bool(jg.is_pd(jq)) and not bool(tg.is_pd(tq))
    assert bool(torch.isnan(tg.to_moments(tq)[0]).all())  # NaN, as JAX's Cholesky, no error
    (jr, jc), (tr, tc) = jg.repair(jq), tg.repair(tq)
    assert bool(jc) and bool(tc) and bool(tg.is_pd(tr))
    same(jr.prec, tr.prec, 1e-10)
    same(jr.nat1, tr.nat1, 1e-10)
    bad = tg.FullGaussian(tq.nat1 * np.nan, tq.prec)
    assert not bool(tg.is_finite(bad)) and not bool(tg.is_pd(tg.FullGaussian(bad.nat1,
                                                                          bad.prec * np.nan)))


def test_joint_and_split_over_local_coordinates_equal_the_numpyro_cores():
    rng = np.random.default_rng(2)
    ja, ta = pair(rng)
    jm, jc = jg.split(ja, 3)
    tm, tc = tg.split(ta, 3)
    for j, t in zip((*jm, *jc), (*tm, *tc), strict=True):
        same(j, t)
    same(jg.join(jm, jc, False).prec, tg.join(tm, tc, False).prec)
    same(jg.conditional_entropy(jc), tg.conditional_entropy(tc))


def test_float32_keeps_float32_and_agrees_with_float64():
    rng = np.random.default_rng(3)
    (_, a64), (_, b64) = pair(rng), pair(rng)
    a32, b32 = (tg.FullGaussian(*(x.float() for x in g)) for g in (a64, b64))
    out = tg.damp(a32, tg.product(a32, b32), 0.5)
    assert out.nat1.dtype == out.prec.dtype == torch.float32
    kl32, kl64 = tg.kl(a32, b32), tg.kl(a64, b64)
    assert kl32.dtype == torch.float32
    assert float(kl32) == pytest.approx(float(kl64), rel=1e-4)
    assert float(tg.kl(a32, a32)) == 0.0


def test_polya_gamma_moments_equal_the_numpyro_cores():
    c = np.array([0.0, 1e-5, 0.005, 0.5, 3.0, 40.0])
    same(jpg.mean(1.0, jnp.asarray(c)), tpg.mean(1.0, torch.as_tensor(c)), 1e-14)
    same(jpg.kl_to_prior(1.0, jnp.asarray(c)), tpg.kl_to_prior(1.0, torch.as_tensor(c)), 1e-14)
