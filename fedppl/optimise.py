"""The one local-optimisation loop: ``steps`` updates of any optax optimiser under ``lax.scan``.

Every method that trains parameters by gradient steps (a client's local steps, a server's
distillation, a hyperparameter fit) calls :func:`minimise`; none writes its own step loop.

Example::

    >>> import jax.numpy as jnp, optax
    >>> params, losses, opt_state = minimise(lambda p, key: jnp.sum((p - 3.0) ** 2),
    ...                                      jnp.zeros(2), optax.adam(0.1), steps=200)
    >>> [round(float(v), 2) for v in params], losses.shape
    ([3.0, 3.0], (200,))

Optimisers that keep state across calls (a client's Adam moments from one round to the next)
continue from the state handed back::

    >>> more = minimise(lambda p, key: jnp.sum((p - 3.0) ** 2), params, optax.adam(0.1),
    ...                 steps=10, opt_state=opt_state)
    >>> int(more.opt_state[0].count)
    210
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import Array

__all__ = ["Minimised", "minimise"]


class Minimised(NamedTuple):
    """What :func:`minimise` hands back."""

    params: Any  # the parameters after the last step
    losses: Array  # the loss before each step, shape (steps,)
    opt_state: Any  # the optimiser's state after the last step (pass it back to continue)


def minimise(loss: Callable[[Any, Any], Array], params: Any,
             optimizer: optax.GradientTransformation, steps: int | None = None,
             rng_key: Array | None = None, *, keys: Array | None = None,
             opt_state: Any = None,
             value_and_grad: Callable[[Any, Any], tuple[Array, Any]] | None = None,
             line_search: bool = False) -> Minimised:
    """Minimise ``loss(params, key)`` from ``params``; returns the parameters, the loss
    before each step and the final optimiser state.

    The keys are ``jax.random.split(rng_key, steps)``, or ``keys`` as given (one per step), or
    step indices when neither is given (a deterministic loss ignores them). ``opt_state``
    continues an earlier optimiser state. ``line_search`` hands the optimiser the value, the
    gradient and the loss itself at each step, as optax's line-searching optimisers
    (``optax.lbfgs``) need.
    """
    if keys is None:
        if steps is None:
            raise ValueError("give steps or keys")
        keys = jnp.arange(steps) if rng_key is None else jax.random.split(rng_key, steps)

    direction = jax.value_and_grad(loss) if value_and_grad is None else value_and_grad

    def step(carry, key):
        p, state = carry
        value, grads = direction(p, key)
        if line_search:
            updates, state = optimizer.update(
                grads, state, p, value=value, grad=grads, value_fn=lambda x: loss(x, key))
        else:
            updates, state = optimizer.update(grads, state, p)
        return (optax.apply_updates(p, updates), state), value

    state = optimizer.init(params) if opt_state is None else opt_state
    (params, state), values = jax.lax.scan(step, (params, state), keys)
    return Minimised(params, values, state)

