"""pFed-Mul's trio: CAVI monotonicity, messages, server guards, personalisation, sampling."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedppl.algorithms import pfedmul as pm
from fedppl.models import mogp

SPEC = mogp.MOGPSpec(("regression", "classification"), 2)


def _tasks(seed, n=(20, 20)):
    rng = np.random.default_rng(seed)
    Xs = [rng.uniform(0, 10, (k, 1)) if k else None for k in n]
    ys = [np.sin(Xs[0][:, 0]) + 0.2 * rng.normal(size=n[0]) if n[0] else None,
          (rng.uniform(size=n[1]) < 1 / (1 + np.exp(-2 * np.sin(Xs[1][:, 0])))).astype(float)
          if n[1] else None]
    return Xs, ys


HYPER = mogp.init_hyper(SPEC, 1, phi0=[1.0, 0.5], phi1=[0.5, 2.0],
                        W=jnp.array([[0.8, 0.3], [0.6, -0.4]]), noise=0.1)


def test_cavi_elbo_never_decreases_with_mixed_tasks():
    data = mogp.client_data(*_tasks(0), SPEC)
    Z = mogp.sample_inducing(jax.random.PRNGKey(0), data, 12)
    _, _, trace = pm.local_cavi(SPEC, HYPER, Z, data, mogp.prior_qu(SPEC, HYPER, Z), 8, True)
    trace = np.asarray(trace)
    assert trace[-1] > trace[0] + 1.0
    assert np.all(np.diff(trace) >= -1e-10 * max(1.0, abs(trace[-1])))


def _federation(config, sizes):
    clients = mogp.multitask_clients([_tasks(i, n) for i, n in enumerate(sizes)], SPEC)
    data, masks = clients.stacked, clients.mask
    Z = jnp.stack([data[0][k, :8] for k in range(len(sizes))])
    states = pm.init_clients(config, HYPER, Z, clients.max_size)
    trio = pm.make_trio(config)
    step = jax.jit(jax.vmap(trio.client_update, (None, 0, 0, 0, 0, 0)))
    server = pm.init_server(config, HYPER)
    keys = jax.random.split(jax.random.PRNGKey(0), len(sizes))
    msgs, proposed = step(server, states, data, masks, keys, jnp.arange(len(sizes)))
    return trio, server, states, msgs, proposed, masks


@pytest.fixture(scope="module")
def kernel_variant():
    # one task only on clients 1 and 2; padding rows on every client but the largest
    config = pm.Config(SPEC, variant="kernel", local_steps=1)
    return config, _federation(config, [(20, 20), (20, 0), (0, 20)])


def test_round_messages_and_personalisation(kernel_variant):
    _, (trio, server, _, msgs, new, masks) = kernel_variant
    assert np.all(np.isfinite(np.asarray(msgs.elbo)))
    assert np.asarray(msgs.num_obs).tolist() == np.asarray(masks.sum(1)).tolist()
    assert np.all(np.asarray(msgs.grad.W) == 0) and np.all(np.asarray(msgs.noise_sum) == 0)
    assert np.all(np.any(np.asarray(msgs.grad.log_phi1) != 0, axis=1))
    one = jax.tree_util.tree_map(lambda x: x[0], msgs)
    assert max(np.size(x) for x in jax.tree_util.tree_leaves(one)) <= 4  # no data, no Z
    # local groups (W, noise) become personal; the client with no regression keeps its noise
    W = np.asarray(new.hyper.W)
    assert not np.allclose(W[0], W[1])
    noise = np.asarray(new.hyper.log_noise)[:, 0]
    assert np.isclose(noise[2], HYPER.log_noise[0]) and not np.isclose(noise[1],
                                                                         HYPER.log_noise[0])
    # server: one Adam step on the kernel only, uphill
    s2, ok = trio.server_update(server, msgs, jnp.arange(3), jnp.ones(3, bool), None, None)
    assert np.all(np.asarray(ok))
    assert np.allclose(s2.hyper.W, server.hyper.W)
    step = np.asarray(s2.hyper.log_phi1 - server.hyper.log_phi1)
    assert np.all(np.sign(step) == np.sign(np.mean(np.asarray(msgs.grad.log_phi1), 0)))


def test_padding_rows_change_nothing(kernel_variant):
    """A client's message is the same whether or not its rows are padded (vmap needs it)."""
    _, (trio, server, states, msgs, _, masks) = kernel_variant
    n = int(masks[1].sum())
    clients = mogp.multitask_clients([_tasks(1, (20, 0))], SPEC)
    st = jax.tree_util.tree_map(lambda x: x[1], states)
    st = st._replace(c=st.c[:n])
    msg, _ = trio.client_update(server, st, tuple(a[0] for a in clients.stacked),
                                clients.mask[0], jax.random.split(jax.random.PRNGKey(0), 3)[1], 1)
    np.testing.assert_allclose(float(msg.elbo), float(msgs.elbo[1]), rtol=1e-10)
    np.testing.assert_allclose(np.asarray(msg.grad.log_phi1), np.asarray(msgs.grad.log_phi1[1]),
                               rtol=1e-8, atol=1e-12)


def test_server_rejects_non_finite_messages(kernel_variant):
    _, (trio, server, states, msgs, proposed, _) = kernel_variant
    bad = msgs._replace(grad=msgs.grad._replace(
        log_phi0=msgs.grad.log_phi0.at[0, 0].set(jnp.nan)))
    s2, ok = trio.server_update(server, bad, jnp.arange(3), jnp.ones(3, bool), None, None)
    assert np.asarray(ok).tolist() == [False, True, True]
    assert np.all(np.isfinite(np.asarray(s2.hyper.log_phi0)))
    clients = jax.vmap(trio.acknowledge)(states, bad, ok, proposed)
    assert np.array_equal(clients.hyper.W[0], states.hyper.W[0])  # refused: keeps its state
    assert np.array_equal(clients.hyper.W[1], proposed.hyper.W[1])
    # nothing accepted: the server's state is unchanged
    s3, ok = trio.server_update(server, bad, jnp.arange(3), jnp.array([True, False, False]),
                                None, None)
    assert not np.any(np.asarray(ok))
    for a, b in zip(jax.tree_util.tree_leaves(s3), jax.tree_util.tree_leaves(server), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_global_noise_is_pooled_in_closed_form():
    config = pm.Config(SPEC, variant="all")
    trio, server, _, msgs, _, _ = _federation(config, [(20, 20), (15, 20)])
    s2, _ = trio.server_update(server, msgs, jnp.arange(2), jnp.ones(2, bool), None, None)
    pooled = np.sum(np.asarray(msgs.noise_sum)[:, 0]) / np.sum(np.asarray(msgs.noise_count)[:, 0])
    assert np.isclose(float(jnp.exp(s2.hyper.log_noise[0])), pooled)
    assert float(s2.hyper.log_noise[1]) == float(HYPER.log_noise[1])  # no regression data


def test_client_sampling_and_keys():
    chosen = pm.sample_clients(jax.random.PRNGKey(0), 10, 0.3)
    assert len(chosen) == 3 and chosen == sorted(chosen)
    keys, active = pm.round_keys(jax.random.PRNGKey(1), 4, 10, 0.3)
    assert active.sum() == 3 and keys.shape[0] == 10
    # the clients taking part get split(kc, m) in order, as the reference code gave them
    k = jax.random.split(jax.random.PRNGKey(1), 7)[4]
    ks, kc = jax.random.split(k)
    assert np.flatnonzero(active).tolist() == pm.sample_clients(ks, 10, 0.3)
    assert np.array_equal(keys[active], jax.random.split(kc, 3))
    assert len({tuple(np.asarray(x)) for x in keys}) == 10


def test_monte_carlo_draws_do_not_depend_on_padding():
    key = jax.random.PRNGKey(3)
    padded = pm._row_normals(key, 4, jnp.arange(9) < 6)
    np.testing.assert_array_equal(padded[:, :6], jax.random.normal(key, (4, 6)))
    assert np.all(np.isfinite(np.asarray(padded)))


def test_bad_variant_is_rejected():
    with pytest.raises(ValueError, match="unknown variant"):
        pm.make_trio(pm.Config(SPEC, variant="everything"))
