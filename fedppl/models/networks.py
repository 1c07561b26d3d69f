"""The one neural network of fedppl: a tanh multilayer perceptron built from equinox layers.

:class:`MLP` is an ``equinox.Module`` holding a tuple of ``equinox.nn.Linear`` layers; its
activation is a static field, so the module's pytree leaves are exactly its weights and biases.
That is what the federated code needs: ``optax`` optimises it, FedAvg averages it leaf by leaf,
``jax.vmap`` maps over a stack of networks (one per client) and ``numpyro.param`` can register
every leaf (see :func:`fedppl.models.random_features.urk_param`). ``equinox.nn.MLP`` itself is not
used because it has one hidden width for all layers and keeps its activations as pytree leaves
(functions), which ``jax.tree_util.tree_map`` over the parameters cannot average.

The weights start as the package always initialised its networks: Glorot-normal weights
``N(0, 2 / (fan_in + fan_out))``, drawn from ``jax.random.split(key, layers)`` one layer each, zero
biases; ``final_scale`` multiplies the last layer's weights (``0`` makes a network that starts at
a constant zero output). A network with one width and no layers is the identity.

Moving a ``(weight, bias)``-tuple network onto it: ``MLP(sizes, key=key)`` draws exactly the
weights ``mlp_init(key, sizes)`` drew (each ``W`` transposed to ``layer.weight``), ``net(X)``
computes ``mlp_apply(net, X)`` (same numbers), and an empty network ``()`` becomes
``MLP((input_dim,), key=key)``, the identity.

Example::

    >>> import jax, jax.numpy as jnp
    >>> net = MLP((3, 16, 2), key=jax.random.key(0))    # 3 inputs, one hidden layer of 16
    >>> net(jnp.ones(3)).shape                          # one point ...
    (2,)
    >>> net(jnp.ones((5, 3))).shape                     # ... or any leading batch axes
    (5, 2)
    >>> [w.shape for w in jax.tree_util.tree_leaves(net)]   # eqx.nn.Linear: weight (out, in)
    [(16, 3), (16,), (2, 16), (2,)]
    >>> MLP((3,), key=jax.random.key(0))(jnp.ones(3)).tolist()   # no layers: the identity
    [1.0, 1.0, 1.0]
    >>> zero = MLP((3, 4, 2), key=jax.random.key(0), final_scale=0.0)
    >>> float(jnp.abs(zero(jnp.ones(3))).max())
    0.0
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

__all__ = ["MLP", "glorot_normal"]


def glorot_normal(key: Array, fan_in: int, fan_out: int, scale: float = 1.0) -> Array:
    """A ``(fan_out, fan_in)`` weight matrix (``eqx.nn.Linear``'s layout) with entries
    ``N(0, 2 / (fan_in + fan_out))`` times ``scale``; drawn as ``(fan_in, fan_out)`` and
    transposed, so the numbers are those of the ``x @ W`` networks the package had before."""
    std = jnp.sqrt(2.0 / (fan_in + fan_out)) * scale
    return (std * jax.random.normal(key, (fan_in, fan_out))).T


def _check_widths(widths: Sequence[int]) -> tuple[int, ...]:
    widths = tuple(widths)
    if not widths or not all(isinstance(w, (int, np.integer)) and not isinstance(w, bool)
                             and w >= 1 for w in widths):
        raise ValueError(f"widths must be positive integers (input first), got {widths!r}")
    return tuple(int(w) for w in widths)


class MLP(eqx.Module):
    """``widths[0] -> ... -> widths[-1]``: tanh (or ``activation``) between layers, a linear
    output; ``widths = (d,)`` is the identity. Call it on ``(..., widths[0])`` arrays."""

    layers: tuple[eqx.nn.Linear, ...]
    activation: Callable[[Array], Array] = eqx.field(static=True)

    def __init__(self, widths: Sequence[int], *, key: Array,
                 activation: Callable[[Array], Array] = jnp.tanh, final_scale: float = 1.0):
        widths = _check_widths(widths)
        keys = jax.random.split(key, max(len(widths) - 1, 1))
        layers = []
        for i, (a, b) in enumerate(itertools.pairwise(widths)):
            last = i == len(widths) - 2
            weight = glorot_normal(keys[i], a, b, final_scale if last else 1.0)
            layer = eqx.nn.Linear(a, b, key=keys[i])  # equinox's own draw is replaced:
            layers.append(eqx.tree_at(lambda l: (l.weight, l.bias), layer,
                                      (weight, jnp.zeros(b, weight.dtype))))
        self.layers = tuple(layers)
        self.activation = activation

    @property
    def widths(self) -> tuple[int, ...]:
        """Input width first (an identity network has one width, unknown here: ``()``)."""
        if not self.layers:
            return ()
        return (self.layers[0].in_features, *(l.out_features for l in self.layers))

    def __call__(self, x: Array) -> Array:
        if jnp.ndim(x) > 1:
            return jax.vmap(self)(x)
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = self.activation(x)
        return x
