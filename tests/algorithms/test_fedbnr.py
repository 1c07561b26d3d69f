from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fedppl
from fedppl.algorithms import exact
from fedppl.algorithms import fedbnr as alg
from fedppl.models.random_features import URKSpec, base_draws, init_urk
from fedppl.runtime import make_round

SPEC = URKSpec(2, feature_widths=(4, 2), shift_widths=(3,), num_samples=6)


@pytest.fixture(scope="module")
def setting():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(90, 2))
    y = np.sin(X[:, 0]) + 0.1 * rng.normal(size=90)
    clients = fedppl.partition.homogeneous(X, y, num_clients=3, seed=0)
    params = alg.init_params(init_urk(jax.random.key(1), SPEC))
    return clients, params, base_draws(jax.random.key(2), SPEC)


def _round(kernel, clients, params, omega, **kw):
    settings = alg.Settings(kernel, optax.adam(1e-2), local_steps=3, eval_every=1, patience=2,
                            kd_steps=3)
    K = clients.num_clients
    server = alg.init_server(params, omega, 1 if settings.shared else K, num_clients=K, **kw)
    return (alg.make_trio(settings), make_round(alg.make_trio(settings), "synchronous"),
            server, alg.init_clients(params, K))


def test_statistics_have_fixed_sizes_and_no_raw_data(setting):
    """What a client sends at an evaluation: S = Phi^T Phi, b = Phi^T y and a count per kernel,
    sized by the features whatever its number of points."""
    clients, params, omega = setting
    trio, _, server, cstates = _round("avg", clients, params, omega)
    D = SPEC.num_features
    for k in range(clients.num_clients):
        data = tuple(a[k] for a in clients.stacked)
        mine = jax.tree_util.tree_map(lambda x, k=k: x[k], cstates)
        msg = trio.client_evaluate((server.kernels, omega), mine, data, clients.mask[k])
        assert type(msg) is exact.Stats and msg._fields == ("scatter", "proj", "count")
        assert msg.scatter.shape == (1, D, D) and msg.proj.shape == (1, D)
        X_k, y_k = clients.client(k)
        sent = np.concatenate([np.ravel(np.asarray(m)) for m in msg])
        assert not np.isin(sent, X_k).any() and not np.isin(sent, y_k).any()
        assert float(msg.count[0]) == len(y_k)


def test_a_round_from_the_runtime_and_the_final_state(setting):
    clients, params, omega = setting
    _trio, round_fn, server, cstates = _round("avg", clients, params, omega, final_round=2)
    keys = jax.random.split(jax.random.key(0), clients.num_clients)
    active = jnp.ones(clients.num_clients, bool)
    data, masks = clients.stacked, clients.mask
    server, cstates, msgs, ok = round_fn(server, cstates, data, masks, keys, active, None)
    assert isinstance(msgs, alg.KernelMessage) and bool(ok.all()) and int(server.round) == 1
    assert bool(server.evaluated) and not bool(server.done)  # no validation: always "better"
    np.testing.assert_allclose(msgs.log_ml, [-alg.neg_log_ml(
        params, tuple(a[k] for a in data), masks[k], omega=omega) * clients.sizes[k]
        for k in range(3)], rtol=1e-10)
    # the global last layer is the exact posterior from the summed statistics
    stats = [exact.client_stats(*_features(server.kernels, omega, clients.client(k)))
             for k in range(3)]
    kern = jax.tree_util.tree_map(lambda x: x[0], server.kernels)
    want = exact.posterior(exact.aggregate(stats), kern.noise, kern.prior_scale)
    np.testing.assert_allclose(server.last_layer.global_.prec[0], want.prec, rtol=1e-12)
    server, cstates, _, _ = round_fn(server, cstates, data, masks, keys, active, None)
    assert bool(server.done) and int(server.best_round) == 2
    again, _, msgs, ok = round_fn(server, cstates, data, masks, keys, active, None)
    assert not bool(ok.any()) and np.all(np.isnan(msgs.log_ml)) and int(again.round) == 2
    np.testing.assert_array_equal(again.last_layer.local.nat1, server.last_layer.local.nat1)


def _features(kernels, omega, data):
    from fedppl.models.random_features import urk_features

    X, y = data
    kern = jax.tree_util.tree_map(lambda x: x[0], kernels)
    return urk_features(kern.kernel, omega, jnp.asarray(X)), jnp.asarray(y)


def test_non_finite_kernels_are_refused_and_scored_as_no_improvement(setting):
    clients, params, omega = setting
    trio, _, server, cstates = _round("avg", clients, params, omega)
    msgs = alg.KernelMessage(jax.tree_util.tree_map(
        lambda x: jnp.stack([x, x * jnp.nan, x]), params), jnp.zeros(3))
    evaluate = lambda cand: jax.vmap(trio.client_evaluate, (None, 0, 0, 0))(  # noqa: E731
        cand, cstates, clients.stacked, clients.mask)
    new, ok = trio.server_update(server, msgs, jnp.arange(3), jnp.ones(3, bool), None, evaluate)
    assert ok.tolist() == [True, False, True]
    assert np.all(np.isfinite(np.asarray(new.kernels.log_noise)))


def test_local_kernels_and_kd(setting):
    clients, params, omega = setting
    _, round_fn, server, cstates = _round("local", clients, params, omega)
    keys = jax.random.split(jax.random.key(0), 3)
    server, cstates, _, _ = round_fn(server, cstates, clients.stacked, clients.mask, keys,
                                     jnp.ones(3, bool), None)
    assert server.last_layer.global_.nat1.shape == (3, 12)  # one per client's kernel
    np.testing.assert_array_equal(server.kernels.log_noise, cstates.params.log_noise)
    X_kd, y_kd = (jnp.asarray(a[:20]) for a in clients.client(0))
    stacked = jax.tree_util.tree_map(lambda x: x[:2], cstates.params)
    start = jax.tree_util.tree_map(lambda x: x[0], stacked)
    target = stacked.kernel
    before = alg.kd_loss(start, target, omega, X_kd, y_kd, 5.0)
    after = alg.kd_server_update(start, stacked, omega, X_kd, y_kd, 5.0, optax.adam(1e-2), 20)
    assert alg.kd_loss(after, target, omega, X_kd, y_kd, 5.0) < before


def test_the_sequential_schedule_is_refused(setting):
    clients, params, omega = setting
    trio, _, server, cstates = _round("avg", clients, params, omega)
    with pytest.raises(ValueError, match="synchronously"):
        make_round(trio, "sequential")(server, cstates, clients.stacked, clients.mask,
                                       jax.random.split(jax.random.key(0), 3),
                                       jnp.ones(3, bool), jax.random.key(1))
