"""The sparse-GP PVI trio: free energy against Titsias' bound, server guards, the runtime."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedppl.algorithms import sgp_pvi
from fedppl.families import gaussian as g
from fedppl.families.gaussian import DiagGaussian
from fedppl.guides import sgp_guide as sg
from fedppl.models import sparse_gp as sgp
from fedppl.runtime import make_round

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
    fe_fn = jax.jit(sgp_pvi.free_energy, static_argnums=(0, 6))
    mask = jnp.ones(len(X), bool)
    # collapsed optimum ('opt' factor), point Z, fixed hyper: no Monte Carlo at all
    spec = sgp_pvi.Spec(factor="opt", z_mode="fixed", learn_hyper=False, input_dim=1)
    pseudo = sg.Pseudo(X[None], y[None], np.zeros((1, len(X))))
    state = _state(spec, X, y, pseudo=pseudo)
    fe = fe_fn(spec, state, X, y, mask, jax.random.PRNGKey(0), 4)
    ref = sgp.collapsed_bound(X, y, state.z_point, hyper)
    np.testing.assert_allclose(fe, ref, rtol=1e-9)
    # the same optimum written as a DPO factor (V = X, m = y, S = noise^2), and an HVM q(Z)
    # with a point-mass-like variance: the data + u part is the same bound
    spec = sgp_pvi.Spec(factor="dpo", z_mode="hvm", learn_hyper=False, alpha=0.1, input_dim=1)
    pseudo = sg.Pseudo(X[None], y[None], np.full((1, len(X)), 2 * np.log(NOISE)))
    state = _state(spec, X, y, pseudo=pseudo)
    Z0 = state.z_point
    tiny = DiagGaussian(1e14 * Z0[None], jnp.full((1, *Z0.shape), 1e14))
    state = state._replace(t_z=tiny)
    fe = fe_fn(spec, state, X, y, mask, jax.random.PRNGKey(1), 4)
    kl_z = jnp.sum(g.kl(sgp_pvi.q_z(state), state.z_prior))
    np.testing.assert_allclose(fe + 0.1 * kl_z, sgp.collapsed_bound(X, y, Z0, hyper), rtol=1e-5)
    # below the optimum, the bound is lower
    worse = state._replace(pseudo=pseudo._replace(m=jnp.zeros((1, len(X)))))
    assert float(fe_fn(spec, worse, X, y, mask, jax.random.PRNGKey(1), 4)) < float(fe) - 1.0


def _two_clients(spec):
    rng = np.random.default_rng(1)
    X = rng.normal(size=(2, 8, 1))
    state = sgp_pvi.init(spec, jax.random.PRNGKey(0), X, np.ones((2, 8), bool), np.array([8, 8]),
                         4, np.array([5, 5]))
    return state, X


def _message(state, k):
    take = lambda t: jax.tree_util.tree_map(lambda a: a[k], t)  # noqa: E731
    return sgp_pvi.Message(take(state.t_beta), take(state.t_z), take(state.pseudo),
                           state.z_point, jnp.asarray(0.0))


def test_server_rejects_nan_or_missing_update_and_keeps_state():
    spec = sgp_pvi.Spec(input_dim=1)
    state, _ = _two_clients(spec)
    server = jax.jit(sgp_pvi.server_update, static_argnums=0)
    msg = _message(state, 1)
    bad = msg._replace(pseudo=msg.pseudo._replace(m=msg.pseudo.m.at[2].set(jnp.nan)))
    good = msg._replace(pseudo=msg.pseudo._replace(m=msg.pseudo.m + 1.0))
    for m, received in ((bad, True), (good, False)):
        new, ok = server(spec, state, sgp_pvi.expand(m), jnp.array([1]), jnp.array([received]))
        assert not bool(ok[0])
        for a, b in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(new),
                        strict=True):
            if a.shape == b.shape and a.ndim > 0:
                np.testing.assert_array_equal(a, b)
    # a good message is applied
    new, ok = server(spec, state, sgp_pvi.expand(good), jnp.array([1]), jnp.array([True]))
    assert bool(ok[0]) and np.allclose(new.pseudo.m[1], state.pseudo.m[1] + 1.0)


def test_server_keeps_q_proper_under_joint_updates():
    spec = sgp_pvi.Spec(input_dim=1)
    state, _ = _two_clients(spec)
    q_prec = sgp_pvi.q_z(state).prec
    # each client alone may lower q(Z)'s precision to 0.4 of it, both together would not be proper
    msgs = [_message(state, k) for k in range(2)]
    msgs = [m._replace(t_z=DiagGaussian(m.t_z.nat1, m.t_z.prec - 0.6 * q_prec)) for m in msgs]
    stacked = jax.tree_util.tree_map(lambda *a: jnp.stack(a), *msgs)
    new, ok = sgp_pvi.server_update(spec, state, stacked, jnp.array([0, 1]))
    assert ok.tolist() == [True, False]
    assert bool(jnp.all(sgp_pvi.q_z(new).prec > 0))
    # with damping 0.5 both fit
    new, ok = sgp_pvi.server_update(spec._replace(damping=0.5), state, stacked, jnp.array([0, 1]))
    assert ok.tolist() == [True, True]


def test_trio_round_moves_only_the_active_clients_factor_and_raises_its_free_energy():
    """A sequential round of the runtime with only client 0 taking part: client 0's local free
    energy rises and no other client's factor moves."""
    spec = sgp_pvi.Spec(input_dim=1, local_steps=60, num_samples=2)
    state, X = _two_clients(spec)
    y = np.sin(X[..., 0])
    data, masks = (jnp.asarray(X), jnp.asarray(y)), jnp.ones((2, 8), bool)
    keys = jnp.stack([jax.random.PRNGKey(3)] * 2)
    round_fn = make_round(sgp_pvi.make_trio(spec, optax.adam(1e-2)), "sequential")
    new, _, msgs, ok = round_fn(state, sgp_pvi.ClientState(), data, masks, keys,
                                jnp.array([True, False]), jax.random.PRNGKey(4))
    assert ok.tolist() == [True, False] and int(new.round) == 1
    np.testing.assert_array_equal(new.pseudo.V[1], state.pseudo.V[1])
    np.testing.assert_array_equal(new.t_z.prec[1], state.t_z.prec[1])
    assert not np.array_equal(new.pseudo.m[0], state.pseudo.m[0])

    k_fe = jax.random.split(jax.random.PRNGKey(5), 16)
    client0 = (data[0][0], data[1][0], masks[0])

    @jax.jit
    def local(s, pseudo):
        lq = sg.local_q_from(sgp_pvi.q_beta(s), sgp_pvi.q_z(s))
        fe = jax.vmap(lambda k: sgp_pvi.local_free_energy(spec, s, 0, client0,
                                                          (lq, pseudo, s.z_point), k))
        return jnp.mean(fe(k_fe))

    before = float(local(state, jax.tree_util.tree_map(lambda a: a[0], state.pseudo)))
    after = float(local(new, jax.tree_util.tree_map(lambda a: a[0], new.pseudo)))
    assert after > before + 1.0
    assert np.isfinite(float(msgs.free_energy[0])) and float(msgs.free_energy[1]) == 0.0


def test_init_gives_q_z_its_own_precision():
    """``z_precision`` sets q(Z)'s total precision apart from q(beta)'s, split over the factors;
    q(Z)'s mean is Z0 either way."""
    spec = sgp_pvi.Spec(input_dim=1)
    rng = np.random.default_rng(1)
    X = rng.normal(size=(2, 8, 1))
    Z0 = np.linspace(-1.0, 1.0, 4)[:, None]
    args = (spec, jax.random.PRNGKey(0), X, np.ones((2, 8), bool), np.array([8, 8]), 4,
            np.array([5, 5]))
    state = sgp_pvi.init(*args, init_precision=100.0, z_init=Z0, z_precision=1e4)
    np.testing.assert_allclose(sgp_pvi.q_z(state).prec, 1e4)
    np.testing.assert_allclose(sgp_pvi.q_beta(state).prec, 100.0)
    np.testing.assert_allclose(g.to_moments(sgp_pvi.q_z(state))[0], Z0, rtol=1e-12)
    default = sgp_pvi.init(*args, init_precision=100.0, z_init=Z0)
    np.testing.assert_allclose(sgp_pvi.q_z(default).prec, 100.0)


def _z_after_one_update(learn_z_sd, dtype):
    spec = sgp_pvi.Spec(input_dim=1, local_steps=30, alpha=0.01, learn_z_sd=learn_z_sd)
    state, X = _two_clients(spec)
    data = (jnp.asarray(X[0], dtype), jnp.sin(jnp.asarray(X[0, :, 0], dtype)),
            jnp.ones(8, bool))
    msg = jax.jit(sgp_pvi.client_update, static_argnums=(0, 1))(
        spec, optax.adam(5e-2), state, 0, data, jax.random.PRNGKey(2))
    new, ok = sgp_pvi.server_update(spec, state, sgp_pvi.expand(msg), jnp.array([0]))
    assert bool(ok[0])
    return state, new


def test_fixed_q_z_sd_moves_its_means_only():
    """``learn_z_sd=False``: a client's update leaves every sd of q(Z) where it was (its factor's
    precision unchanged) and moves q(Z)'s means; the paper's learnt sds move too. Float64 and
    float32."""
    for x64, dtype in ((True, jnp.float64), (False, jnp.float32)):
        with jax.enable_x64(x64):
            for learn in (False, True):
                state, new = _z_after_one_update(learn, dtype)
                assert new.t_z.prec.dtype == dtype
                before, after = sgp_pvi.q_z(state), sgp_pvi.q_z(new)
                moved = np.abs(np.asarray(g.to_moments(after)[0] - g.to_moments(before)[0]))
                assert moved.max() > 1e-3
                change = np.abs(np.asarray(after.prec) / np.asarray(before.prec) - 1.0)
                if learn:
                    assert change.max() > 1e-2
                else:
                    np.testing.assert_allclose(change, 0.0, atol=1e-5 if x64 else 1e-4)
