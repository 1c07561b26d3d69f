"""Kronecker, Tucker (TVGP) and sum-of-Kronecker guides against dense computation (float64)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numpyro.infer import Trace_ELBO

from fedppl.families import kronecker as kr
from fedppl.guides.kronecker import KroneckerGuide, SumKroneckerGuide, TuckerGuide
from fedppl.guides.svgp import DiagGuide
from fedppl.models import svgp
from fedppl.models.kernels import SEParams
from tests.svgp_reference import elbo_fn, exact_lml, hensman_bound, predictive, titsias_bound

RNG = np.random.default_rng(0)


def problem(sizes, n=15, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.uniform(-1.5, 1.5, (n, len(sizes)))
    y = np.sin(2 * X[:, 0]) + 0.5 * X[:, -1] + 0.1 * rng.normal(size=n)
    model = svgp.SparseGPRegression(svgp.Grid.over(X, sizes), variance=1.7, noise=0.3,
                                    lengthscale=rng.uniform(0.6, 1.4, len(sizes)).tolist())
    return X, y, model


def hyper_params(p, seed=0):
    rng = np.random.default_rng(seed)
    return {"log_lengthscale": jnp.asarray(rng.uniform(-0.5, 0.3, p)),
            "log_variance": jnp.asarray(0.4), "log_noise": jnp.asarray(np.log(0.3))}


def tucker_params(sizes, rank, seed=1):
    rng = np.random.default_rng(seed)
    out = hyper_params(len(sizes), seed)
    out["q_core"] = jnp.asarray(rng.normal(size=(rank,) * len(sizes)))
    for l, m in enumerate(sizes):
        out[f"q_factor_{l}"] = jnp.asarray(rng.normal(size=(m, rank)) / np.sqrt(m))
        out[f"q_sigma_{l}"] = jnp.asarray(rng.uniform(0.05, 3.0, m))
    return out


def dense(model, guide, params, X):
    """``(m, S, K, Kfu, kff, s2)`` of the guide's q(u), formed densely (one compile)."""
    def pieces(params, X):
        q, p = svgp.posterior(model, guide, params, X)
        S = sum(w * kr.kron_dense(Sl) for w, Sl in q._terms())
        return (q.mean, S, kr.kron_dense(p.factors), kr.kron_rows(p.cross(X)),
                jnp.full(X.shape[0], p.hyper.variance), p.hyper.noise_var)

    m, S, K, Kfu, kff, s2 = jax.jit(pieces)(params, jnp.asarray(X))
    return (*(np.asarray(a) for a in (m, S, K, Kfu, kff)), float(s2))


def predictor(model, guide):
    return jax.jit(lambda params, X, noise=False: svgp.predict(model, guide, params, X, noise),
                   static_argnums=2)


def test_tucker_bound_and_prediction_equal_dense():
    sizes, rank = (2, 3, 2), 2
    X, y, model = problem(sizes)
    guide = TuckerGuide(model, rank=rank)
    params = tucker_params(sizes, rank)
    F = float(elbo_fn(model, guide)(params, X, y))
    m, S, K, Kfu, kff, s2 = dense(model, guide, params, X)
    ref = hensman_bound(y, m, S, K, Kfu, kff, s2)
    assert abs(F - ref) < 1e-8 * abs(ref)
    assert F < titsias_bound(y, K, Kfu, kff, s2) < exact_lml(y, svgp_kff(model, params, X), s2)
    Xs = np.random.default_rng(5).uniform(-2, 2, (7, len(sizes)))
    predict = predictor(model, guide)
    mean, var = predict(params, Xs)
    _, _, _, Ksu, ks, _ = dense(model, guide, params, Xs)
    ref_mean, ref_var = predictive(m, S, K, Ksu, ks)
    np.testing.assert_allclose(mean, ref_mean, rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(var, ref_var, rtol=1e-8, atol=1e-10)
    _, ynoise = predict(params, Xs, True)
    np.testing.assert_allclose(ynoise, ref_var + s2, rtol=1e-8)


def svgp_kff(model, params, X):
    hyper = SEParams(params["log_lengthscale"], params["log_variance"], params["log_noise"])
    return np.asarray(hyper.kernel(X, X))


def test_full_core_tucker_equals_kronecker():
    sizes = (3, 3)
    X, y, model = problem(sizes, seed=2)
    a = [RNG.normal(size=m) for m in sizes]
    kron = tucker_params(sizes, 1, seed=3)
    full = dict(kron)
    for l in range(2):
        kron[f"q_factor_{l}"] = jnp.asarray(a[l][:, None])
        full[f"q_factor_{l}"] = jnp.eye(3)
    kron["q_core"] = jnp.ones((1, 1))
    full["q_core"] = jnp.asarray(np.outer(a[0], a[1]))         # W = a_1 ⊗ a_2, U_l = I
    F_kron = elbo_fn(model, KroneckerGuide(model))(kron, X, y)
    F_full = elbo_fn(model, TuckerGuide(model, rank=3))(full, X, y)
    assert abs(float(F_kron - F_full)) < 1e-10 * abs(float(F_kron))
    mk, vk = predictor(model, KroneckerGuide(model))(kron, X)
    mf, vf = predictor(model, TuckerGuide(model, rank=3))(full, X)
    np.testing.assert_allclose(mk, mf, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(vk, vf, rtol=1e-10)


def test_one_dimensional_kronecker_is_eq_2_12():
    """With one input dimension the Kronecker family is the (alpha, Sigma) family on the grid."""
    X, y, model = problem((5,), seed=4)
    grid = np.asarray(model.inducing.axes[0])[:, None]
    diag_model = svgp.SparseGPRegression(svgp.Points(grid, learn=False), variance=1.7, noise=0.3)
    params = tucker_params((5,), 1, seed=5)
    alpha = params["q_core"][0] * params["q_factor_0"][:, 0]
    dparams = {**hyper_params(1, 5), "q_alpha": alpha, "q_sigma": params["q_sigma_0"]}
    F_kron = elbo_fn(model, KroneckerGuide(model))(params, X, y)
    F_diag = elbo_fn(diag_model, DiagGuide(diag_model))(dparams, X, y)
    assert abs(float(F_kron - F_diag)) < 1e-10 * abs(float(F_diag))


def test_sum_of_kronecker_terms():
    sizes = (2, 3)
    X, y, model = problem(sizes, seed=6)
    rng = np.random.default_rng(7)
    R = 3
    params = hyper_params(2, 7)
    for l, m in enumerate(sizes):
        params[f"q_alpha_{l}"] = jnp.asarray(rng.normal(size=(R, m)))
        params[f"q_sigma_{l}"] = jnp.asarray(rng.uniform(0.05, 3.0, (R, m)))
    guide = SumKroneckerGuide(model, terms=R)
    F = float(elbo_fn(model, guide)(params, X, y))
    m, S, K, Kfu, kff, s2 = dense(model, guide, params, X)
    terms = jax.jit(lambda p: [kr.kron_dense(Sl) for _, Sl in svgp.posterior(
        model, guide, p, X)[0]._terms()])(params)
    logdets = [np.linalg.slogdet(np.asarray(Sr))[1] for Sr in terms]
    jensen_gap = 0.5 * (np.linalg.slogdet(S)[1] - np.mean(logdets))
    ref = hensman_bound(y, m, S, K, Kfu, kff, s2)
    assert jensen_gap > 0
    assert abs(F - (ref - jensen_gap)) < 1e-8 * abs(ref)          # exact but for Jensen's gap
    assert F < titsias_bound(y, K, Kfu, kff, s2) < exact_lml(y, svgp_kff(model, params, X), s2)
    # one term: the Kronecker bound
    one = {k: (v[:1] if k.startswith("q_") else v) for k, v in params.items()}
    kron = {k: v for k, v in params.items() if not k.startswith("q_")}
    kron["q_core"] = jnp.ones((1, 1))
    for l in range(2):
        kron[f"q_factor_{l}"] = one[f"q_alpha_{l}"].T
        kron[f"q_sigma_{l}"] = one[f"q_sigma_{l}"][0]
    F_one = elbo_fn(model, SumKroneckerGuide(model, terms=1))(one, X, y)
    F_kron = elbo_fn(model, KroneckerGuide(model))(kron, X, y)
    assert abs(float(F_one - F_kron)) < 1e-10 * abs(float(F_kron))


def test_numpyro_trace_elbo_estimates_the_same_bound():
    """Stock ``Trace_ELBO`` (u drawn from the guide) is an unbiased estimate of the closed form."""
    sizes = (3, 4)
    X, y, model = problem(sizes, n=10, seed=8)
    guide = TuckerGuide(model, rank=2)
    params = tucker_params(sizes, 2, seed=9)
    F = float(elbo_fn(model, guide)(params, X, y))
    loss = Trace_ELBO().loss
    draws = jax.jit(jax.vmap(lambda k: -loss(k, params, model, guide, X, y)))(
        jax.random.split(jax.random.key(1), 2000))
    draws = np.asarray(draws)
    assert abs(draws.mean() - F) < 4 * draws.std() / np.sqrt(len(draws))


def test_no_grid_sized_intermediate():
    """A step of the Tucker bound on a 100^3 = 10^6 point grid forms nothing of size M."""
    sizes = (100, 100, 100)
    rng = np.random.default_rng(0)
    X = rng.uniform(-1, 1, (10, 3))
    model = svgp.SparseGPRegression(svgp.Grid.over(X, 100), batch_size=10)
    guide = TuckerGuide(model, rank=3)
    params = tucker_params(sizes, 3)
    elbo = svgp.InducingELBO().elbo
    jaxpr = jax.make_jaxpr(jax.grad(lambda p: elbo(jax.random.key(0), p, model, guide, X,
                                                   np.zeros(10))))(params)
    sizes_seen = [int(np.prod(v.aval.shape)) for eqn in jaxpr.jaxpr.eqns for v in eqn.outvars
                  if hasattr(v.aval, "shape")]
    assert max(sizes_seen) < 10**5


def test_bad_input_is_named():
    X, y, model = problem((3, 4))
    with pytest.raises(ValueError, match="m0 >= 2"):
        svgp.Grid.over(X, 1)
    with pytest.raises(ValueError, match="m0 >= 2"):
        svgp.SparseGPRegression(svgp.Grid((np.zeros(3), np.zeros(1))))
    with pytest.raises(ValueError, match=r"q0 <= m0"):
        TuckerGuide(model, rank=4)
    with pytest.raises(ValueError, match=r"q0 <= m0"):
        TuckerGuide(model, rank=0)
    with pytest.raises(ValueError, match="terms"):
        SumKroneckerGuide(model, terms=0)
    three = svgp.SparseGPRegression(svgp.Grid.over(np.c_[X, X[:, 0]], 3))
    with pytest.raises(ValueError, match="3 axes but the data have 2 columns"):
        elbo_fn(three, KroneckerGuide(three))(tucker_params((3, 3, 3), 1), X, y)
    with pytest.raises(ValueError, match="need inducing points on a Grid"):
        KroneckerGuide(svgp.SparseGPRegression(svgp.Points(X[:3])))
    with pytest.raises(ValueError, match="needs inducing Points"):
        elbo_fn(model, DiagGuide(model))(hyper_params(2), X, y)
    bad = X.copy()
    bad[3, 1] = np.nan
    with pytest.raises(ValueError, match="X has NaN"):
        model(bad, y)
    with pytest.raises(ValueError, match="y has NaN"):
        model(X, np.where(np.arange(len(y)) == 2, np.inf, y))
