"""Federated averaging (McMahan et al. 2017) of any parameter pytree, as pure functions.

Clients start from the server's parameters, take ``steps`` optimiser steps on their own loss and
send their parameters back; the server averages those it accepts (finite ones from clients that
replied), uniformly or weighted by the clients' data counts. Used for FedBNR's kernel learning and
the FedAvg baselines of the sparse GP papers.

Example (three clients fit one mean)::

    >>> import jax, jax.numpy as jnp, optax
    >>> data = (jnp.array([[1.0, 2.0], [3.0, 0.0], [5.0, 6.0]]),)
    >>> masks = jnp.array([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0]])
    >>> loss_fn = lambda p, d, m, key: jnp.sum(m * (d[0] - p) ** 2) / jnp.sum(m)
    >>> state = init(jnp.asarray(0.0))
    >>> keys = jax.random.split(jax.random.key(0), 3)
    >>> new, losses = jax.vmap(local_train, (None, None, 0, 0, None, None, 0))(
    ...     state.params, loss_fn, data, masks, optax.sgd(0.2), 50, keys)
    >>> state, accepted = server_update(state, new, weights=masks.sum(1))
    >>> round(float(state.params), 4), accepted.tolist()     # (1.5 * 2 + 3 + 5.5 * 2) / 5
    (3.4, [True, True, True])
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import Array

from fedppl.optimise import minimise

__all__ = ["FedAvgState", "init", "local_train", "server_update", "all_finite"]

LossFn = Callable[[Any, tuple, Array, Array], Array]  # (params, data, mask, key) -> scalar


class FedAvgState(NamedTuple):
    params: Any
    round: Array


def init(params: Any) -> FedAvgState:
    return FedAvgState(params, jnp.asarray(0))


def local_train(params: Any, loss_fn: LossFn, data: tuple, mask: Array,
                optimizer: optax.GradientTransformation, steps: int, rng_key: Array
                ) -> tuple[Any, Array]:
    """``steps`` optimiser updates of ``loss_fn`` from ``params`` (under ``lax.scan``); returns
    the new parameters and the loss at each step."""

    new, losses, _ = minimise(lambda p, key: loss_fn(p, data, mask, key), params, optimizer,
                              steps, rng_key)
    return new, losses


def all_finite(tree: Any) -> Array:
    """Per client (leading axis): whether every leaf of the pytree is finite."""
    leaves = jax.tree_util.tree_leaves(tree)
    oks = [jnp.all(jnp.isfinite(x.reshape(x.shape[0], -1)), axis=1) for x in leaves]
    return jnp.all(jnp.stack(oks), axis=0)


def server_update(state: FedAvgState, client_params: Any, weights: Array | None = None,
                  received: Array | None = None) -> tuple[FedAvgState, Array]:
    """Average the accepted client parameters (stacked on axis 0).

    ``weights`` default to uniform (the FedBNR paper's mean); pass data counts for McMahan's
    weighting. Non-finite parameters are rejected; with nothing accepted the state is unchanged.
    Returns the new state and which clients were accepted.
    """
    ok = all_finite(client_params)
    if received is not None:
        ok = ok & received
    w = jnp.ones(ok.shape) if weights is None else jnp.asarray(weights, dtype=float)
    w = jnp.where(ok, w, 0.0)
    total = jnp.sum(w)

    def average(old, new):
        clean = jnp.where(ok.reshape(ok.shape + (1,) * (new.ndim - 1)), new, 0.0)
        mean = jnp.tensordot(w, clean, axes=1) / jnp.where(total > 0, total, 1.0)
        return jnp.where(total > 0, mean, old)

    params = jax.tree_util.tree_map(average, state.params, client_params)
    return FedAvgState(params, state.round + 1), ok
