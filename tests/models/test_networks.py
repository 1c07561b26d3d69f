from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedppl.algorithms import fedavg
from fedppl.models.networks import MLP


def _old_scheme(key, widths, last_scale=1.0):
    """The ``x @ W`` networks fedppl had before equinox (random_features and mogp), verbatim."""
    layers = []
    keys = jax.random.split(key, max(len(widths) - 1, 1))
    for i, (a, b) in enumerate(itertools.pairwise(widths)):
        scale = jnp.sqrt(2.0 / (a + b)) * (last_scale if i == len(widths) - 2 else 1.0)
        layers.append((scale * jax.random.normal(keys[i], (a, b)), jnp.zeros(b)))
    return layers


def _old_apply(layers, x):
    for i, (W, b) in enumerate(layers):
        x = x @ W + b
        if i < len(layers) - 1:
            x = jnp.tanh(x)
    return x


@pytest.mark.parametrize("widths", [(3, 8, 8, 2), (4, 5), (2, 16, 3)])
def test_same_weights_and_outputs_as_the_old_networks(widths):
    key, X = jax.random.key(3), jax.random.normal(jax.random.key(4), (7, widths[0]))
    net, old = MLP(widths, key=key), _old_scheme(key, widths)
    for layer, (W, b) in zip(net.layers, old, strict=False):
        np.testing.assert_array_equal(layer.weight, W.T)
        np.testing.assert_array_equal(layer.bias, b)
    np.testing.assert_array_equal(net(X), _old_apply(old, X))
    np.testing.assert_array_equal(jax.vmap(net)(X), net(X))


def test_leaves_are_arrays_so_optax_fedavg_and_vmap_work():
    nets = [MLP((2, 4, 1), key=jax.random.key(k)) for k in range(3)]
    assert all(isinstance(x, jax.Array) for x in jax.tree_util.tree_leaves(nets[0]))
    stacked = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *nets)
    avg, ok = fedavg.server_update(fedavg.init(nets[0]), stacked)
    assert bool(ok.all())
    np.testing.assert_allclose(avg.params.layers[0].weight,
                               np.mean([n.layers[0].weight for n in nets], axis=0))
    x = jnp.ones(2)
    np.testing.assert_allclose(jax.vmap(lambda n: n(x))(stacked)[:, 0],
                               [float(n(x)[0]) for n in nets], rtol=1e-12)
    opt = optax.adam(1e-2)
    grads = jax.grad(lambda n: jnp.sum(n(x) ** 2))(nets[0])
    updates, _ = opt.update(grads, opt.init(nets[0]), nets[0])
    assert optax.apply_updates(nets[0], updates).layers[1].weight.shape == (1, 4)


def test_identity_and_zero_output():
    x = jnp.arange(6.0).reshape(2, 3)
    np.testing.assert_array_equal(MLP((3,), key=jax.random.key(0))(x), x)
    zero = MLP((3, 5, 2), key=jax.random.key(0), final_scale=0.0)
    assert float(jnp.abs(zero(x)).max()) == 0.0
    relu = MLP((3, 5, 2), key=jax.random.key(0), activation=jax.nn.relu)
    assert relu(x).shape == (2, 2) and MLP((3, 5, 2), key=jax.random.key(0)).widths == (3, 5, 2)


@pytest.mark.parametrize("widths", [(), (3, 0), (3, 2.5), (True, 2), [3, -1]])
def test_bad_widths(widths):
    with pytest.raises(ValueError, match="widths must be positive integers"):
        MLP(widths, key=jax.random.key(0))
