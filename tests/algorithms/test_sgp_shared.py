"""The sparse GPs' linear rounds: CPO's cavity as the total less the client's own factor, and
DPO's shared draws (``Spec.shared_draws``), against the direct sum over the other clients."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from numpyro.distributions import Normal
from numpyro.distributions.kl import kl_divergence

import fedppl
from fedppl import trees
from fedppl.algorithms import sgp_pvi
from fedppl.guides import sgp_guide as sg
from fedppl.models import sparse_gp as sgp

K, N, M = 4, 12, 5


def _state(spec: sgp_pvi.Spec, seed: int = 0):
    """K clients' factors moved away from their initial values (random pseudo-observations,
    factors over beta and Z), so that every client's factor differs from the others'."""
    rng = np.random.default_rng(seed)
    X = rng.uniform(-2, 2, (K, N, 1))
    y = np.sin(2 * X[..., 0]) + 0.2 * rng.normal(size=(K, N))
    state = sgp_pvi.init(spec, jax.random.key(seed), X, np.ones((K, N), bool), np.full(K, N), M,
                         np.full(K, 8), pseudo_from_data=False)
    pseudo = jax.tree_util.tree_map(lambda a: a + 0.3 * rng.normal(size=a.shape), state.pseudo)
    t_beta = state.t_beta._replace(nat1=jnp.asarray(0.2 * rng.normal(size=state.t_beta.nat1.shape)))
    return state._replace(pseudo=pseudo, t_beta=t_beta), (X, y)


@pytest.mark.parametrize("factor", ["cpo", "dpo"])
def test_cavity_statistics_are_the_sum_over_the_other_clients(factor):
    spec = sgp_pvi.Spec(factor=factor, input_dim=1)
    state, _ = _state(spec)
    Z = jnp.asarray(np.random.default_rng(1).normal(size=(M, 1)))
    hyper = sgp.split_hyper(jnp.log(jnp.array([0.8, 1.3, 0.2])), 1)
    L = jnp.linalg.cholesky(sgp.kzz(Z, hyper, spec.jitter))

    @jax.jit
    def both(k):
        w = jnp.ones(K).at[k].set(0.0)
        return (sgp_pvi._cavity_stats(spec, state, k, Z, hyper, L),
                sg.summed_stats(factor, "diag", state.pseudo, state.pseudo_mask, w, Z, hyper, L))

    (A, c), (A0, c0) = jax.vmap(both)(jnp.arange(K))
    np.testing.assert_allclose(A, A0, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(c, c0, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("z_mode", ["hvm", "fixed"])
def test_shared_draw_estimate_starts_at_the_exact_local_free_energy(z_mode):
    """At the start of a local step (the client's q is q), the estimate at shared draw s is the
    direct one at the same (beta, Z): the client's u-term with the others' factors summed
    there, less the analytic KLs; its gradient in the client's pseudo-observations too."""
    spec = sgp_pvi.Spec(factor="dpo", z_mode=z_mode, input_dim=1, shared_draws=3)
    state, (X, y) = _state(spec)
    state = sgp_pvi.begin_round(spec, state, jax.random.key(7))
    lq = sg.local_q_from(sgp_pvi.q_beta(state), sgp_pvi.q_z(state))

    def shared(own, k, data, key):
        return sgp_pvi._shared_estimate(spec, state, k, data, lq, own, state.z_point, key)

    def direct(own, k, data, key):
        s = jax.random.randint(key, (), 0, 3)
        lb, Z = state.shared.log_beta[s], state.shared.Z[s]
        value = sgp_pvi._u_term(spec, state, k, own, data, lb, Z)
        loc, scale = sgp_pvi._loc_scale(state.beta_prior, state.t_beta, k)
        value -= jnp.sum(kl_divergence(Normal(lq.beta_loc, jnp.exp(lq.beta_logsd)),
                                       Normal(loc, scale)))
        if z_mode == "hvm":
            loc, scale = sgp_pvi._loc_scale(state.z_prior, state.t_z, k)
            value -= spec.alpha * jnp.sum(kl_divergence(
                Normal(lq.z_loc, jnp.exp(lq.z_logsd)), Normal(loc, scale)))
        return value

    @jax.jit
    def values_and_grads(k, key):
        data = (jnp.asarray(X)[k], jnp.asarray(y)[k], jnp.ones(N, bool))
        own = trees.index(state.pseudo, k)
        return [jax.value_and_grad(f)(own, k, data, key) for f in (shared, direct)]

    for k in (0, 3):
        (v, gv), (v0, gv0) = values_and_grads(k, jax.random.key(k))
        np.testing.assert_allclose(v, v0, rtol=1e-10)
        for a, b in zip(jax.tree_util.tree_leaves(gv), jax.tree_util.tree_leaves(gv0),
                        strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-8, atol=1e-10)


def test_begin_round_draws_from_q_and_sums_every_factor():
    spec = sgp_pvi.Spec(factor="dpo", input_dim=1, shared_draws=2)
    state, _ = _state(spec)
    new = sgp_pvi.begin_round(spec, state, jax.random.key(3))
    lb, Z = sgp_pvi.sample_q(spec, state, jax.random.key(3), 2)
    np.testing.assert_array_equal(new.shared.Z, Z)

    @jax.jit
    def each(lb, Z):  # every client's own statistics at one draw, added up
        hyper = sgp.split_hyper(lb, 1)
        L = jnp.linalg.cholesky(sgp.kzz(Z, hyper, spec.jitter))
        return jax.vmap(lambda k: sgp_pvi._own_stats(spec, state, k,
                                                     trees.index(state.pseudo, k), Z, hyper,
                                                     L))(jnp.arange(K))

    for s in range(2):
        A, c = each(lb[s], Z[s])
        np.testing.assert_allclose(new.shared.A[s], A.sum(0), rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(new.shared.c[s], c.sum(0), rtol=1e-10, atol=1e-12)


def test_shared_draws_run_and_are_refused_where_they_do_not_apply():
    rng = np.random.default_rng(0)
    X = rng.uniform(-3, 3, (80, 1))
    clients = fedppl.partition.homogeneous(X, np.sin(X[:, 0]), num_clients=4, seed=0)
    front = fedppl.FederatedSGP("dpo", num_inducing=4, local_steps=3, schedule="synchronous",
                                damping=0.5, shared_draws=4, optimizer=optax.adam(1e-2))
    result = front.run(jax.random.key(0), clients, 3, progress_bar=False)
    assert result.rejected == [] and np.all(np.isfinite(result.history["free_energy"]))
    with pytest.raises(ValueError, match="shared_draws applies to"):
        fedppl.FederatedSGP("cpo", shared_draws=4)
    with pytest.raises(ValueError, match="shared_draws"):
        fedppl.FederatedSGP("dpo", shared_draws=-1)
