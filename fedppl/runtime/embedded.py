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
import jax.numpy as jnp
import jaxlib
import numpy as np
from jax import Array

from fedppl.algorithms import pvi
from fedppl.families import gaussian as g

__all__ = ["make_round", "SCHEDULES"]

SCHEDULES = ("sequential", "synchronous", "loop")

RoundFn = Callable[
    [pvi.ServerState, pvi.ClientState, tuple, Array, Array, Array],
    tuple[pvi.ServerState, pvi.ClientState, pvi.ClientMessage, Array],
]


def make_round(solver: pvi.LocalSolver, damping: float, schedule: str,
               score: Callable | None = None, prior_solver: pvi.LocalSolver | None = None
               ) -> RoundFn:
    """A function ``(state, clients, data, masks, key, active) -> (state, clients, messages,
    steps)``; ``clients`` are the stacked :class:`~fedppl.algorithms.pvi.ClientState` and
    ``active`` (K booleans) marks the clients taking part in the round.

    ``score(q, data, masks, clients)`` (the clients' expected log-likelihoods and ``KL(q ||
    p~)``), if given, makes the server's step of a synchronous round a line search on the global
    ELBO (:func:`fedppl.algorithms.pvi.server_update`); the sequential schedule applies each
    client's update at once and does not use it. ``prior_solver`` (for a prior that is not
    Gaussian) makes the server refine its prior factor ``t_0`` in every round: first in a
    sequential round, alongside the clients (as one more message) in a synchronous one.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    check_cpu_lapack()
    step = partial(pvi.client_update, solver=solver, damping=damping)

    def elbo_for(data, masks, clients):
        if score is None:
            return None

        def elbo(q):
            ell, kl = score(q, data, masks, clients)
            if prior_solver is not None:
                ell = jnp.concatenate([ell, prior_solver.expected_log_lik(q)[None]])
            return ell, kl

        return elbo

    def server(state, msgs, active, data, masks, proposed, key):
        """Combine the clients' messages (and the prior factor's) into a new state."""
        if prior_solver is None:
            return pvi.server_update(state, msgs, active, elbo_for(data, masks, proposed))
        pmsg, _ = pvi.prior_update(state, prior_solver, damping, key)
        both = jax.tree_util.tree_map(lambda a, b: jnp.concatenate([a, b[None]]), msgs, pmsg)
        state, steps = pvi.server_update(state, both, jnp.append(active, True),
                                         elbo_for(data, masks, proposed))
        return _ack_prior(state, pmsg, steps[-1]), steps[:-1]

    if schedule == "synchronous":

        @jax.jit
        def round_fn(state, clients, data, masks, key, active):
            keys = jax.random.split(key, masks.shape[0])
            msgs, proposed = jax.vmap(step, in_axes=(None, 0, 0, 0, 0))(state.q, clients, data,
                                                                        masks, keys)
            state, steps = server(state, msgs, active, data, masks, proposed,
                                  jax.random.fold_in(key, masks.shape[0]))
            return state, pvi.acknowledge(clients, msgs, steps, proposed), msgs, steps

        return round_fn

    if schedule == "sequential":

        @jax.jit
        def round_fn(state, clients, data, masks, key, active):
            keys = jax.random.split(key, masks.shape[0])
            if prior_solver is not None:
                pmsg, _ = pvi.prior_update(state, prior_solver, damping,
                                           jax.random.fold_in(key, masks.shape[0]))
                new, s = pvi.server_update(state, _one(pmsg), jnp.ones(1, bool))
                state = _ack_prior(state._replace(q=new.q), pmsg, s[0])

            def one(state, inputs):
                cstate, data_k, mask_k, key_k, active_k = inputs
                msg, proposed = step(state.q, cstate, data_k, mask_k, key_k)
                new_state, s = pvi.server_update(state, _one(msg), active_k[None])
                cstate = pvi.acknowledge(_one(cstate), _one(msg), s, _one(proposed))
                return state._replace(q=new_state.q), (_first(cstate), msg, s[0])

            state, (clients, msgs, steps) = jax.lax.scan(
                one, state, (clients, data, masks, keys, active))
            return state._replace(round=state.round + 1), clients, msgs, steps

        return round_fn

    client_jit = jax.jit(step)
    server_jit = jax.jit(server)
    ack_jit = jax.jit(pvi.acknowledge)

    def round_fn(state, clients, data, masks, key, active):
        # each client holds its own arrays (host copies), as it would on its own machine
        clients_h, data_h, masks_h = jax.device_get((clients, data, masks))
        replies = {}
        for k, key_k in enumerate(jax.random.split(key, masks.shape[0])):
            if active[k]:
                inputs = _index((clients_h, data_h, masks_h), k)
                replies[k] = jax.device_get(client_jit(state.q, *inputs, key_k))
        blank = jax.tree_util.tree_map(np.zeros_like, next(iter(replies.values())))
        out = [replies.get(k, blank) for k in range(masks.shape[0])]
        msgs, proposed = jax.tree_util.tree_map(lambda *xs: np.stack(xs), *out)
        state, steps = server_jit(state, msgs, active, data, masks, proposed,
                                  jax.random.fold_in(key, masks.shape[0]))
        return state, ack_jit(clients, msgs, steps, proposed), msgs, steps

    return round_fn


def _ack_prior(state: pvi.ServerState, msg: pvi.ClientMessage, step: Array) -> pvi.ServerState:
    """The server applies its own prior-factor delta with the step it accepted."""
    t0 = pvi.acknowledge(_one(pvi.ClientState(state.prior_factor)), _one(msg), step[None])
    return state._replace(prior_factor=_first(t0).factor)


def _one(tree):
    return jax.tree_util.tree_map(lambda x: x[None], tree)


def _first(tree):
    return jax.tree_util.tree_map(lambda x: x[0], tree)


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
