"""The embedded runtime: every client in one process, on the padded, stacked client axis.

A round is one compiled function:

* ``synchronous``: all clients step from the same ``q`` under one ``jax.vmap``, then one server
  update combines their deltas;
* ``sequential``: ``lax.scan`` over the clients in order, the server updating after each;
* ``loop``: the synchronous round with a Python loop over clients (one compiled client step called
  K times): the baseline that ``benchmarks/pvi_rounds.py`` compares ``vmap`` against.

Example::

    >>> round_fn = make_round(solver, damping=0.5, schedule="synchronous")
    >>> state, factors, msgs, steps = round_fn(state, factors, data, masks, key, active)
"""

from __future__ import annotations

import warnings
from functools import lru_cache, partial
from typing import Callable

import jax
import jaxlib
import numpy as np
from jax import Array

from fedppl.algorithms import pvi
from fedppl.families import gaussian as g

__all__ = ["make_round", "SCHEDULES"]

SCHEDULES = ("sequential", "synchronous", "loop")

RoundFn = Callable[
    [pvi.ServerState, g.Gaussian, tuple, Array, Array],
    tuple[pvi.ServerState, g.Gaussian, pvi.ClientMessage, Array],
]


def make_round(solver: pvi.LocalSolver, damping: float, schedule: str,
               score: Callable | None = None) -> RoundFn:
    """A function ``(state, factors, data, masks, key, active) -> (state, factors, messages,
    steps)``; ``active`` (K booleans) marks the clients taking part in the round.

    ``score(q, data, masks)`` (the global ELBO), if given, makes the server's step of a
    synchronous round a line search on it (:func:`fedppl.algorithms.pvi.server_update`); the
    sequential schedule applies each client's update at once and does not use it.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    check_cpu_lapack()
    step = partial(pvi.client_update, solver=solver, damping=damping)

    if schedule == "synchronous":

        @jax.jit
        def round_fn(state, factors, data, masks, key, active):
            keys = jax.random.split(key, masks.shape[0])
            msgs, _ = jax.vmap(step, in_axes=(None, 0, 0, 0, 0))(state.q, factors, data, masks, keys)
            elbo = None if score is None else partial(score, data=data, masks=masks)
            state, steps = pvi.server_update(state, msgs, active, elbo)
            return state, pvi.acknowledge(factors, msgs, steps), msgs, steps

        return round_fn

    if schedule == "sequential":

        @jax.jit
        def round_fn(state, factors, data, masks, key, active):
            keys = jax.random.split(key, masks.shape[0])

            def one(state, inputs):
                factor, data_k, mask_k, key_k, active_k = inputs
                msg, _ = step(state.q, factor, data_k, mask_k, key_k)
                batch = jax.tree_util.tree_map(lambda x: x[None], msg)
                q_only = pvi.ServerState(state.q, state.round)
                new_state, s = pvi.server_update(q_only, batch, active_k[None])
                factor = pvi.acknowledge(
                    jax.tree_util.tree_map(lambda x: x[None], factor), batch, s
                )
                factor = jax.tree_util.tree_map(lambda x: x[0], factor)
                return pvi.ServerState(new_state.q, state.round), (factor, msg, s[0])

            state, (factors, msgs, steps) = jax.lax.scan(
                one, state, (factors, data, masks, keys, active))
            return pvi.ServerState(state.q, state.round + 1), factors, msgs, steps

        return round_fn

    client_jit = jax.jit(step)
    server_jit = jax.jit(lambda state, msgs, active, data, masks: pvi.server_update(
        state, msgs, active, None if score is None else partial(score, data=data, masks=masks)))
    ack_jit = jax.jit(pvi.acknowledge)

    def round_fn(state, factors, data, masks, key, active):
        # each client holds its own arrays (host copies), as it would on its own machine
        factors_h, data_h, masks_h = jax.device_get((factors, data, masks))
        replies = {}
        for k, key_k in enumerate(jax.random.split(key, masks.shape[0])):
            if active[k]:
                inputs = _index((factors_h, data_h, masks_h), k)
                replies[k] = jax.device_get(client_jit(state.q, *inputs, key_k)[0])
        blank = jax.tree_util.tree_map(np.zeros_like, next(iter(replies.values())))
        msgs = [replies.get(k, blank) for k in range(masks.shape[0])]
        msgs = jax.tree_util.tree_map(lambda *xs: np.stack(xs), *msgs)
        state, steps = server_jit(state, msgs, active, data, masks)
        return state, ack_jit(factors, msgs, steps), msgs, steps

    return round_fn


@lru_cache(maxsize=1)
def check_cpu_lapack() -> bool:
    """Warn once if this is a CPU jaxlib whose batched LAPACK calls can deadlock (0.10.x).

    jaxlib 0.10 hands every batched CPU factorisation and triangular solve (what ``vmap`` over
    clients makes of them) to a thread-pool batch map; PVI rounds on a 2-core machine hung there
    with every thread waiting. jaxlib 0.9.2 runs them on the calling thread: ``make test`` and
    ``make demo`` install it (``constraints.txt``). Returns whether it warned.
    """
    version = tuple(int(p) for p in jaxlib.__version__.split(".")[:2] if p.isdigit())
    if jax.default_backend() != "cpu" or version[:2] != (0, 10):
        return False
    warnings.warn(f"jaxlib {jaxlib.__version__} on CPU: batched LAPACK calls under vmap can "
                  "deadlock (seen in synchronous rounds with many clients); install "
                  "jax==0.9.2 jaxlib==0.9.2 (see constraints.txt)", RuntimeWarning, stacklevel=3)
    return True


def _index(tree, k: int):
    return jax.tree_util.tree_map(lambda x: x[k], tree)
