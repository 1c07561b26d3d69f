"""The sparse-GP PVI trio: free energy against Titsias' bound, server guards."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fedppl.algorithms import sgp_pvi
from fedppl.families.gaussian import DiagGaussian
from fedppl.guides import sgp_guide as sg
from fedppl.models import sparse_gp as sgp

NOISE = 0.3


def _data(N=24, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.uniform(-2, 2, (N, 1))
    return X, np.sin(2 * X[:, 0]) + NOISE * rng.normal(size=N)


def _state(spec, X, y, M=5, pseudo=None):
    log_beta = np.log([0.7, 1.2, NOISE])
    return sgp_pvi.init(spec, jax.random.PRNGKey(0), X[None], np.ones((1, len(X)), bool),
                        np.array([len(X)]), M, np.array([len(X)]), log_beta_fixed=log_beta,
                        pseudo=pseudo)


def test_global_free_energy_equals_titsias_bound():
    X, y = _data()
    hyper = sgp.split_hyper(jnp.log(jnp.array([0.7, 1.2, NOISE])), 1)
    # collapsed optimum ('opt' factor), point Z, fixed hyper: no Monte Carlo at all
    spec = sgp_pvi.Spec(factor="opt", z_mode="fixed", learn_hyper=False, input_dim=1)
    pseudo = sg.Pseudo(X[None], y[None], np.zeros((1, len(X))))
    state = _state(spec, X, y, pseudo=pseudo)
    fe = sgp_pvi.free_energy(spec, state, X, y, jnp.ones(len(X), bool), jax.random.PRNGKey(0))
    ref = sgp.titsias_elbo(X, y, state.z_point, hyper)
    np.testing.assert_allclose(fe, ref, rtol=1e-9)
    # the same optimum written as a DPO factor (V = X, m = y, S = noise^2), and an HVM q(Z)
    # with a point-mass-like variance: the data + u part is the same bound
    spec = sgp_pvi.Spec(factor="dpo", z_mode="hvm", learn_hyper=False, alpha=0.1, input_dim=1)
    pseudo = sg.Pseudo(X[None], y[None], np.full((1, len(X)), 2 * np.log(NOISE)))
    state = _state(spec, X, y, pseudo=pseudo)
    Z0 = state.z_point
    tiny = DiagGaussian(1e14 * Z0[None], jnp.full((1,) + Z0.shape, 1e14))
    state = state._replace(t_z=tiny)
    fe = sgp_pvi.free_energy(spec, state, X, y, jnp.ones(len(X), bool), jax.random.PRNGKey(1))
    kl_z = sgp_pvi._kl_diag(sgp_pvi._q(state.z_prior, state.t_z), state.z_prior)
    np.testing.assert_allclose(fe + 0.1 * kl_z, sgp.titsias_elbo(X, y, Z0, hyper), rtol=1e-5)
    # below the optimum, the bound is lower
    worse = state._replace(pseudo=pseudo._replace(m=jnp.zeros((1, len(X)))))
    assert float(sgp_pvi.free_energy(spec, worse, X, y, jnp.ones(len(X), bool),
                                     jax.random.PRNGKey(1))) < float(fe) - 1.0


def _two_clients(spec):
    rng = np.random.default_rng(1)
    X = rng.normal(size=(2, 8, 1))
    return sgp_pvi.init(spec, jax.random.PRNGKey(0), X, np.ones((2, 8), bool), np.array([8, 8]),
                        4, np.array([5, 5]))


def _message(state, k):
    return sgp_pvi.Message(jax.tree_util.tree_map(lambda a: a[k], state.t_beta),
                           jax.tree_util.tree_map(lambda a: a[k], state.t_z),
                           jax.tree_util.tree_map(lambda a: a[k], state.pseudo), state.z_point)


def test_server_rejects_nan_update_and_keeps_state():
    spec = sgp_pvi.Spec(input_dim=1)
    state = _two_clients(spec)
    msg = _message(state, 1)
    bad = msg._replace(pseudo=msg.pseudo._replace(m=msg.pseudo.m.at[2].set(jnp.nan)))
    new, ok = sgp_pvi.server_update(spec, state, sgp_pvi.expand(bad), jnp.array([1]))
    assert not bool(ok[0])
    for a, b in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(new)):
        if a.shape == b.shape and a.ndim > 0:
            np.testing.assert_array_equal(a, b)
    # a good message is applied
    good = msg._replace(pseudo=msg.pseudo._replace(m=msg.pseudo.m + 1.0))
    new, ok = sgp_pvi.server_update(spec, state, sgp_pvi.expand(good), jnp.array([1]))
    assert bool(ok[0]) and np.allclose(new.pseudo.m[1], state.pseudo.m[1] + 1.0)


def test_server_keeps_q_proper_under_joint_updates():
    spec = sgp_pvi.Spec(input_dim=1)
    state = _two_clients(spec)
    q_prec = sgp_pvi._q(state.z_prior, state.t_z).prec
    # each client alone may lower q(Z)'s precision to 0.4 of it, both together would not be proper
    msgs = [_message(state, k) for k in range(2)]
    msgs = [m._replace(t_z=DiagGaussian(m.t_z.nat1, m.t_z.prec - 0.6 * q_prec)) for m in msgs]
    stacked = jax.tree_util.tree_map(lambda *a: jnp.stack(a), *msgs)
    new, ok = sgp_pvi.server_update(spec, state, stacked, jnp.array([0, 1]))
    assert ok.tolist() == [True, False]
    assert bool(jnp.all(sgp_pvi._q(new.z_prior, new.t_z).prec > 0))
    # with damping 0.5 both fit
    new, ok = sgp_pvi.server_update(spec._replace(damping=0.5), state, stacked, jnp.array([0, 1]))
    assert ok.tolist() == [True, True]


def test_client_update_increases_local_free_energy_and_only_moves_own_factor():
    spec = sgp_pvi.Spec(input_dim=1, local_steps=60, num_samples=2)
    state = _two_clients(spec)
    rng = np.random.default_rng(2)
    X = jnp.asarray(rng.normal(size=(8, 1)))
    data = (X, jnp.sin(X[:, 0]), jnp.ones(8, bool))
    lq = sg.local_q_from(sgp_pvi._q(state.beta_prior, state.t_beta),
                         sgp_pvi._q(state.z_prior, state.t_z))
    start = (lq, jax.tree_util.tree_map(lambda a: a[0], state.pseudo), state.z_point)
    keys = jax.random.split(jax.random.PRNGKey(5), 16)
    fe = jax.jit(jax.vmap(lambda p, k: sgp_pvi.local_free_energy(spec, state, 0, data, p, k),
                          (None, 0)))
    before = float(jnp.mean(fe(start, keys)))
    msg, _ = jax.jit(sgp_pvi.client_update, static_argnums=0)(spec, state, 0, data,
                                                               jax.random.PRNGKey(3))
    new, ok = sgp_pvi.server_update(spec, state, sgp_pvi.expand(msg), jnp.array([0]))
    assert bool(ok[0])
    np.testing.assert_array_equal(new.pseudo.V[1], state.pseudo.V[1])
    np.testing.assert_array_equal(new.t_z.prec[1], state.t_z.prec[1])
    lq = sg.local_q_from(sgp_pvi._q(new.beta_prior, new.t_beta), sgp_pvi._q(new.z_prior, new.t_z))
    after_p = (lq, msg.pseudo, state.z_point)
    after = float(jnp.mean(fe(after_p, keys)))
    assert after > before + 1.0
