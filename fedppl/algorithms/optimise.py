"""The one local-optimisation loop: ``steps`` updates of any optax optimiser under ``lax.scan``.

Every method that trains parameters by gradient steps (a client's local steps, a server's
distillation, a hyperparameter fit) calls :func:`minimise`; none writes its own step loop.

Example::

    >>> import jax.numpy as jnp, optax
    >>> params, losses = minimise(lambda p, key: jnp.sum((p - 3.0) ** 2), jnp.zeros(2),
    ...                           optax.sgd(0.1), steps=100)
    >>> [round(float(v), 3) for v in params], losses.shape
    ([3.0, 3.0], (100,))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import Array

__all__ = ["minimise"]


def minimise(loss: Callable[[Any, Any], Array], params: Any,
             optimizer: optax.GradientTransformation, steps: int | None = None,
             rng_key: Array | None = None, *, keys: Array | None = None,
             opt_state: Any = None) -> tuple[Any, Array]:
    """Minimise ``loss(params, key)`` from ``params``; returns the parameters and the loss
    before each step.

    The keys are ``jax.random.split(rng_key, steps)``, or ``keys`` as given (one per step), or
    step indices when neither is given (a deterministic loss ignores them). ``opt_state``
    continues an earlier optimiser state.
    """
    if keys is None:
        if steps is None:
            raise ValueError("give steps or keys")
        keys = jnp.arange(steps) if rng_key is None else jax.random.split(rng_key, steps)

    def step(carry, key):
        p, state = carry
        value, grads = jax.value_and_grad(loss)(p, key)
        updates, state = optimizer.update(grads, state, p)
        return (optax.apply_updates(p, updates), state), value

    state = optimizer.init(params) if opt_state is None else opt_state
    (params, _), values = jax.lax.scan(step, (params, state), keys)
    return params, values

