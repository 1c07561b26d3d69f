"""The HVM guide: factor statistics against brute-force natural parameters; alpha tempering."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import pytest

from fedppl.algorithms import sgp_pvi
from fedppl.families import gaussian as g
from fedppl.families.gaussian import DiagGaussian
from fedppl.guides import sgp_guide as sg
from fedppl.handlers.tempered import tempered
from fedppl.models import sparse_gp as sgp
from fedppl.models.kernels import SEParams, se

HYP = SEParams(jnp.log(jnp.array([0.9])), jnp.log(1.4), jnp.log(0.2))


def _brute(Z, factors):
    """q(u) by explicit products of the factors' natural parameters in u (App. C, Eq. 24-25)."""
    K = np.asarray(sgp.kzz(Z, HYP))
    Ki = np.linalg.inv(K)
    prec, nat1 = Ki.copy(), np.zeros(len(Z))
    for kind, V, m, S in factors:
        if kind == "dpo":
            Kvz = np.asarray(se(V, Z, HYP.lengthscale, HYP.variance))
            H = Kvz @ Ki                                   # t(u) = N(H u; m, S)
            prec += H.T @ np.linalg.solve(S, H)
            nat1 += H.T @ np.linalg.solve(S, m)
        else:
            prec += np.linalg.inv(S)
            nat1 += np.linalg.solve(S, m)
    cov = np.linalg.inv(prec)
    return cov @ nat1, cov


def _pseudo_stack(rng, M_ks, m_max, full):
    parts, masks, dense = [], [], []
    for Mk in M_ks:
        V = np.concatenate([rng.normal(size=(Mk, 1)), np.zeros((m_max - Mk, 1))])
        m = np.concatenate([rng.normal(size=Mk), np.zeros(m_max - Mk)])
        if full:
            raw = 0.3 * rng.normal(size=sg.tril_size(m_max))
            Ls = np.asarray(sg.lower_cholesky(raw))[:Mk, :Mk]
            S = Ls @ Ls.T
        else:
            raw = rng.normal(size=m_max) * 0.3 - 1.0
            S = np.diag(np.exp(raw[:Mk]))
        parts.append(sg.Pseudo(V, m, raw))
        masks.append(np.arange(m_max) < Mk)
        dense.append(("dpo", V[:Mk], m[:Mk], S))
    stack = jax.tree_util.tree_map(lambda *a: jnp.asarray(np.stack(a)), *parts)
    return stack, jnp.asarray(np.stack(masks)), dense


@pytest.mark.parametrize("full", [False, True])
def test_dpo_stats_and_cavity_match_brute_force(full):
    rng = np.random.default_rng(0)
    Z = rng.normal(size=(5, 1))
    stack, mask, dense = _pseudo_stack(rng, [3, 7, 4], 7, full)
    L = jnp.linalg.cholesky(sgp.kzz(Z, HYP))
    cov = "full" if full else "diag"
    for weights, used in (([1.0, 1.0, 1.0], dense), ([1.0, 0.0, 1.0], [dense[0], dense[2]])):
        A, c = sg.summed_stats("dpo", cov, stack, mask, jnp.array(weights), Z, HYP, L)
        mean, covu = sgp.moments(sgp.posterior(L, A, c))
        bm, bc = _brute(Z, used)
        np.testing.assert_allclose(mean, bm, rtol=1e-8, atol=1e-10)
        np.testing.assert_allclose(covu, bc, rtol=1e-8, atol=1e-10)


def test_noise_relative_dpo_is_the_diagonal_factor_times_the_noise_and_opt_at_the_data():
    """``covariance="noise"``: S_k = noise^2 diag(exp(s_raw)), checked against the brute-force
    product; with V = X, m = y and s_raw = 0 it is Titsias' optimal factor ("opt") at every
    noise level."""
    rng = np.random.default_rng(2)
    Z = rng.normal(size=(5, 1))
    stack, mask, dense = _pseudo_stack(rng, [3, 7, 4], 7, False)
    L = jnp.linalg.cholesky(sgp.kzz(Z, HYP))
    noise2 = float(jnp.exp(2 * HYP.log_noise))
    A, c = sg.summed_stats("dpo", "noise", stack, mask, jnp.ones(3), Z, HYP, L)
    mean, covu = sgp.moments(sgp.posterior(L, A, c))
    bm, bc = _brute(Z, [(k, V, m, noise2 * S) for k, V, m, S in dense])
    np.testing.assert_allclose(mean, bm, rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(covu, bc, rtol=1e-8, atol=1e-10)
    at_data = stack._replace(s_raw=jnp.zeros_like(stack.s_raw))
    for hyper in (HYP, HYP._replace(log_noise=jnp.log(0.01))):
        L = jnp.linalg.cholesky(sgp.kzz(Z, hyper))
        got = sg.summed_stats("dpo", "noise", at_data, mask, jnp.ones(3), Z, hyper, L)
        opt = sg.summed_stats("opt", "diag", at_data, mask, jnp.ones(3), Z, hyper, L)
        for a, b in zip(got, opt, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-12)


def test_cpo_stats_match_brute_force():
    rng = np.random.default_rng(1)
    Z = rng.normal(size=(4, 1))
    raws = [0.4 * rng.normal(size=sg.tril_size(4)) for _ in range(2)]
    ms = [rng.normal(size=4) for _ in range(2)]
    stack = sg.Pseudo(jnp.zeros((2, 0, 1)), jnp.asarray(np.stack(ms)), jnp.asarray(np.stack(raws)))
    L = jnp.linalg.cholesky(sgp.kzz(Z, HYP))
    A, c = sg.summed_stats("cpo", "diag", stack, jnp.ones((2, 4), bool), jnp.ones(2), Z, HYP, L)
    dense = []
    for raw, m in zip(raws, ms, strict=True):
        R = np.asarray(sg.lower_cholesky(raw))
        dense.append(("cpo", None, m, np.linalg.inv(R @ R.T)))
    mean, cov = sgp.moments(sgp.posterior(L, A, c))
    bm, bc = _brute(Z, dense)
    np.testing.assert_allclose(mean, bm, rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(cov, bc, rtol=1e-8, atol=1e-10)


def test_lower_cholesky_is_numpyros_bijection_and_initial_factors_are_weak():
    raw = np.arange(1.0, 7.0) / 10  # 3 x 3: strictly lower entries first, then the log diagonal
    R = np.asarray(sg.lower_cholesky(raw))
    np.testing.assert_allclose(R, [[np.exp(0.4), 0, 0], [0.1, np.exp(0.5), 0],
                                   [0.2, 0.3, np.exp(0.6)]], rtol=1e-15)
    cpo = sg.init_cpo(3, 2, precision=1e-2)
    P = np.asarray(sg._cpo_prec(cpo.s_raw))
    np.testing.assert_allclose(P, 1e-2 * np.eye(3), rtol=1e-14)
    dpo, mask = sg.init_dpo(np.random.default_rng(0), np.ones((4, 1)), 2, 3, "full", False)
    np.testing.assert_array_equal(sg.lower_cholesky(dpo.s_raw), np.eye(3))  # S = I
    assert mask.tolist() == [True, True, False]


def test_guide_samples_z_directly_so_tempered_scales_it():
    lq = sg.LocalQ(jnp.zeros(3), jnp.zeros(3), jnp.ones((4, 1)), jnp.zeros((4, 1)))
    guide = tempered(partial(sg.hvm_guide, lq, True, True), alpha=0.1, sites=["Z"])
    tr = numpyro.handlers.trace(numpyro.handlers.seed(guide, 0)).get_trace()
    assert tr["Z"]["scale"] == 0.1 and tr["log_beta"]["scale"] is None


def _spec_state(alpha):
    rng = np.random.default_rng(3)
    X = rng.normal(size=(2, 6, 1))
    spec = sgp_pvi.Spec(alpha=alpha, num_samples=3, input_dim=1)
    state = sgp_pvi.init(spec, jax.random.PRNGKey(0), X, np.ones((2, 6), bool), np.array([6, 6]),
                         4, np.array([3, 3]))
    # move client 0's factors so that q(Z) differs from the cavity
    t_z = DiagGaussian(state.t_z.nat1.at[0].add(5.0), state.t_z.prec.at[0].add(20.0))
    return spec, state._replace(t_z=t_z), (jnp.asarray(X[0]), jnp.asarray(X[0, :, 0]),
                                          jnp.ones(6, bool))


def test_alpha_scales_exactly_the_z_kl():
    fes = {}
    for alpha in (0.1, 1.0, 0.0):
        spec, state, data = _spec_state(alpha)
        lq = sg.local_q_from(sgp_pvi.q_beta(state), sgp_pvi.q_z(state))
        params = (lq, jax.tree_util.tree_map(lambda a: a[0], state.pseudo), state.z_point)
        fe = jax.jit(partial(sgp_pvi.local_free_energy, spec, state, 0, data,
                             key=jax.random.PRNGKey(7)))
        fes[alpha] = float(fe(params))
    q = sgp_pvi.q_z(state)
    cav = sgp_pvi.cavity(state.z_prior, state.t_z, 0)
    kl_z = float(jnp.sum(g.kl(q, cav)))
    assert kl_z > 1.0
    np.testing.assert_allclose(fes[0.1] - fes[1.0], 0.9 * kl_z, rtol=1e-9)
    np.testing.assert_allclose(fes[0.0] - fes[1.0], kl_z, rtol=1e-9)
