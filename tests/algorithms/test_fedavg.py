from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedppl.algorithms import fedavg


def test_weighted_average_rejects_non_finite_clients():
    state = fedavg.init({"a": jnp.zeros(2), "b": jnp.asarray(0.0)})
    client = {"a": jnp.array([[1.0, 1.0], [3.0, 3.0], [jnp.nan, 0.0]]),
              "b": jnp.array([1.0, 2.0, 3.0])}
    new, ok = fedavg.server_update(state, client, weights=jnp.array([1.0, 3.0, 5.0]))
    np.testing.assert_array_equal(ok, [True, True, False])
    np.testing.assert_allclose(new.params["a"], [2.5, 2.5])
    np.testing.assert_allclose(new.params["b"], 1.75)
    uniform, _ = fedavg.server_update(state, client)
    np.testing.assert_allclose(uniform.params["a"], [2.0, 2.0])
    nobody, _ = fedavg.server_update(state, client, received=jnp.array([False, False, True]))
    np.testing.assert_allclose(nobody.params["a"], [0.0, 0.0])


def test_local_training_descends_a_quadratic():
    def loss(p, data, mask, key):
        return jnp.sum(mask * (data[0] - p) ** 2)

    p, losses = fedavg.local_train(jnp.asarray(0.0), loss, (jnp.array([1.0, 3.0, 100.0]),),
                                   jnp.array([1.0, 1.0, 0.0]), optax.sgd(0.1), 100,
                                   jax.random.key(0))
    assert abs(float(p) - 2.0) < 1e-6
    assert losses[-1] < losses[0]
