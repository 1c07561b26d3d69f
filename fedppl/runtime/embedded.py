"""The embedded runtime: every client in one process, on the padded, stacked client axis.

It drives any :class:`~fedppl.algorithms.trio.Trio`. A round is one compiled function:

* ``synchronous``: all clients step from the same server state under one ``jax.vmap``, then one
  server update combines their messages;
* ``sequential``: ``lax.scan`` over the clients in order, the server updating after each (a
  client outside the round is skipped by ``lax.cond``);
* ``loop``: the synchronous round with a Python loop over clients (one compiled client step called
  K times, each client on its own host copy of its arrays): the baseline that
  ``benchmarks/pvi_rounds.py`` compares ``vmap`` against, and the runtime for host-side trios.

Example (a toy trio: each client sends the sum of its data, the server adds them up)::

    >>> import jax, jax.numpy as jnp
    >>> from fedppl.algorithms.trio import Trio
    >>> trio = Trio(lambda s, c, d, m, k, i: (jnp.sum(d * m), c + 1),
    ...             lambda s, msgs, idx, ok, k, ev: (s + jnp.sum(jnp.where(ok, msgs, 0)), ok))
    >>> round_fn = make_round(trio, schedule="sequential")
    >>> data, masks = jnp.ones((3, 4)), jnp.ones((3, 4), bool)
    >>> server, clients, messages, replies = round_fn(
    ...     0.0, jnp.zeros(3), data, masks, jax.random.split(jax.random.key(0), 3),
    ...     jnp.array([True, False, True]), jax.random.key(1))
    >>> float(server), clients.tolist()
    (8.0, [1.0, 0.0, 1.0])
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from functools import lru_cache
from typing import Any

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
from jax import Array

from fedppl import trees
from fedppl.algorithms.trio import Trio

__all__ = ["make_round", "SCHEDULES"]

SCHEDULES = ("sequential", "synchronous", "loop")

RoundFn = Callable[[Any, Any, tuple, Array, Array, Array, Array], tuple[Any, Any, Any, Any]]


def make_round(trio: Trio, schedule: str) -> RoundFn:
    """A function ``(server, clients, data, masks, keys, active, server_key) -> (server,
    clients, messages, replies)``.

    ``clients``, ``data``, ``masks`` and ``keys`` are stacked on the client axis (K); ``active``
    (K booleans) marks the clients taking part; ``server_key`` is the server's own randomness.
    ``messages`` and ``replies`` come back stacked on the client axis (zeros for a client that
    sat the round out).
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if trio.jit:
        check_cpu_lapack()
    if schedule == "synchronous":
        return jax.jit(_synchronous(trio)) if trio.jit else _synchronous(trio)
    if schedule == "sequential":
        return jax.jit(_sequential(trio)) if trio.jit else _sequential(trio)
    return _loop(trio)


def _begin(trio: Trio, server, server_key):
    return server if trio.begin_round is None else trio.begin_round(server, server_key)


def _evaluator(trio: Trio, clients, data, masks):
    if trio.client_evaluate is None:
        return None
    return lambda candidate: jax.vmap(trio.client_evaluate, (None, 0, 0, 0))(candidate, clients,
                                                                              data, masks)


def _synchronous(trio: Trio):
    def round_fn(server, clients, data, masks, keys, active, server_key):
        server = _begin(trio, server, server_key)
        index = jnp.arange(masks.shape[0])
        msgs, proposed = jax.vmap(trio.client_update, (None, 0, 0, 0, 0, 0))(
            server, clients, data, masks, keys, index)
        server, replies = trio.server_update(server, msgs, index, active, server_key,
                                             _evaluator(trio, proposed, data, masks))
        clients = jax.vmap(trio.acknowledge)(clients, msgs, replies, proposed)
        return server, clients, msgs, replies

    return round_fn


def _sequential(trio: Trio):
    def round_fn(server, clients, data, masks, keys, active, server_key):
        server = _begin(trio, server, server_key)
        first = _first_client(clients, data, masks, keys)

        def update(server, inputs):
            cstate, data_k, mask_k, key_k, k = inputs
            msg, proposed = trio.client_update(server, cstate, data_k, mask_k, key_k, k)
            server, reply = trio.server_update(server, trees.one(msg), k[None], jnp.ones(1, bool),
                                               jax.random.fold_in(server_key, k), None)
            reply = trees.first(reply)
            return server, (trio.acknowledge(cstate, msg, reply, proposed), msg, reply)

        blank = jax.tree_util.tree_map(
            lambda s: jnp.zeros(s.shape, s.dtype),
            jax.eval_shape(lambda: update(server, first)[1][1:]))

        def one(server, inputs):
            *rest, active_k = inputs
            return jax.lax.cond(active_k, update, lambda sv, inp: (sv, (inp[0], *blank)),
                                server, tuple(rest))

        index = jnp.arange(masks.shape[0])
        server, (clients, msgs, replies) = jax.lax.scan(
            one, server, (clients, data, masks, keys, index, active))
        return server, clients, msgs, replies

    return round_fn


def _first_client(clients, data, masks, keys):
    return (trees.index(clients, 0), trees.index(data, 0), masks[0], keys[0], jnp.asarray(0))


def _loop(trio: Trio):
    def server_step(server, msgs, index, active, server_key, proposed, data, masks):
        return trio.server_update(server, msgs, index, active, server_key,
                                  _evaluator(trio, proposed, data, masks))

    client_fn, server_fn = trio.client_update, server_step
    ack_fn = _host_vmap(trio.acknowledge)
    if trio.jit:
        client_fn, server_fn = jax.jit(client_fn), jax.jit(server_fn)
        ack_fn = jax.jit(jax.vmap(trio.acknowledge))

    def round_fn(server, clients, data, masks, keys, active, server_key):
        server = _begin(trio, server, server_key)
        # each client holds its own arrays (host copies), as it would on its own machine
        clients_h, data_h, masks_h = jax.device_get((clients, data, masks))
        K = np.shape(masks)[0]
        replies = {k: jax.device_get(client_fn(server,
                                               *trees.index((clients_h, data_h, masks_h), k),
                                               keys[k], k))
                   for k in range(K) if active[k]}
        if not replies:
            raise ValueError("no client takes part in this round")
        blank = jax.tree_util.tree_map(np.zeros_like, next(iter(replies.values())))
        out = [replies.get(k, blank) for k in range(K)]
        msgs, proposed = trees.stack(out, xp=np)
        server, reps = server_fn(server, msgs, np.arange(K), active, server_key, proposed, data,
                                 masks)
        return server, ack_fn(clients, msgs, reps, proposed), msgs, reps

    return round_fn


def _host_vmap(fn):
    def mapped(*args):
        K = len(jax.tree_util.tree_leaves(args[1])[0])
        outs = [fn(*trees.index(args, k)) for k in range(K)]
        return trees.stack(outs, xp=np)

    return mapped




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

