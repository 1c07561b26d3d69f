"""The embedded runtime: every client in one process, on the padded, stacked client axis; and
the one implementation of each schedule that every runtime's round is made of.

It drives any :class:`~fedppl.algorithms.trio.Trio`. A round's schedule says in which order the
clients and the server work:

* ``synchronous``: all clients step from the same server state, then one server update combines
  their messages;
* ``sequential``: the clients in order, the server updating after each (a client outside the
  round is skipped);
* ``loop``: the synchronous schedule on the :data:`LOOP` client map (below).

How the round reaches its clients is a :class:`ClientMap`, an argument of :func:`make_round`:

* :data:`VMAP` (the default): the clients' steps under one ``jax.vmap``; the sequential round a
  ``lax.scan`` over the clients with a ``lax.cond`` for those outside the round; the whole round
  one compiled function;
* :data:`LOOP`: a Python loop over clients (one compiled client step called K times, each client
  on its own host copy of its arrays), the server's steps compiled on their own: the baseline
  that ``benchmarks/pvi_rounds.py`` compares ``vmap`` against, and the runtime for host-side
  trios (``Trio(jit=False)``);
* a remote map (:func:`host_map` of a deployment's exchanges): :mod:`fedppl.runtime.flower`
  sends each step to the nodes over Flower. A client that does not answer takes no part in the
  server's update (its ``received`` is False).

Example (a toy trio: each client sends the sum of its data, the server adds them up)::

    >>> import jax, jax.numpy as jnp
    >>> from fedppl.algorithms.trio import Trio, sent
    >>> trio = Trio(lambda s, c, d, m, k, i: (jnp.sum(d * m), c + 1),
    ...             lambda s, msgs, idx, ok, k, ev: (s + jnp.sum(jnp.where(ok, msgs, 0)), ok))
    >>> round_fn = make_round(trio, schedule="sequential")
    >>> data, masks = jnp.ones((3, 4)), jnp.ones((3, 4), bool)
    >>> inputs = (data, masks, jax.random.split(jax.random.key(0), 3),
    ...           jnp.array([True, False, True]), jax.random.key(1))
    >>> server, clients, messages, replies = round_fn(0.0, jnp.zeros(3), *inputs)
    >>> float(server), clients.tolist()
    (8.0, [1.0, 0.0, 1.0])

The same round with client 2 reached by a call that never answers (a node that is down): it
takes no part, as if it had sat the round out::

    >>> def update(trio, server, clients, data, masks, keys, index, active):
    ...     msgs, proposed, _ = VMAP.update(trio, server, clients, data, masks, keys, index,
    ...                                     active)
    ...     return msgs, proposed, jnp.array([True, True, False])
    >>> def step(trio, server, client, data, mask, key, k):
    ...     msg, proposed, _ = VMAP.step(trio, server, client, data, mask, key, k)
    ...     return msg, proposed, int(k) != 2
    >>> down = host_map(update, step, VMAP.evaluator)
    >>> for schedule in ("sequential", "synchronous"):
    ...     server, *_ = make_round(trio, schedule, down)(0.0, jnp.zeros(3), *inputs)
    ...     print(schedule, float(server))
    sequential 4.0
    synchronous 4.0
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from functools import lru_cache
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
from jax import Array

from fedppl import trees
from fedppl.algorithms.trio import Trio, sent

__all__ = ["make_round", "Runtime", "SCHEDULES", "ClientMap", "VMAP", "LOOP", "host_map",
           "host_scan", "host_cond", "recording"]

SCHEDULES = ("sequential", "synchronous", "loop")

RoundFn = Callable[[Any, Any, tuple, Array, Array, Array, Array], tuple[Any, Any, Any, Any]]


class ClientMap(NamedTuple):
    """How a round reaches its clients (what a schedule leaves open).

    * ``update(trio, server, clients, data, masks, keys, index, active) -> (messages,
      proposed, received)``: the synchronous step, every client taking part (``active``) running
      ``trio.client_update`` from ``server``; ``messages`` and ``proposed`` stacked on the client
      axis (blanks where no message came), ``proposed`` the states the round acknowledges
      (a remote map, whose proposed states stay on the nodes, gives the server's record
      ``clients``);
    * ``step(trio, server, client, data, mask, key, k) -> (message, proposed, received)``: one
      client's step (the sequential schedule);
    * ``evaluator(trio, proposed, data, masks) -> evaluate``: the server's ``evaluate(candidate)
      -> (K,)`` on the clients' data (``None`` if the trio has no ``client_evaluate``);
    * ``scan``, ``cond``: ``lax.scan`` and ``lax.cond``, or their Python forms for a map that
      works on the host (:func:`host_scan`, :func:`host_cond`);
    * ``compiled``: whether the round is one compiled program (else the server's steps are
      compiled each on its own, and the map runs in Python between them).

    ``received``: which clients answered (booleans; ``None``: every client asked did). A client
    that did not answer takes no part in the server's update: its message is not received (as
    a dropout of :class:`fedppl.runtime.faults.Faults`), so the server's reply to it says so; on
    the sequential schedule it still had its turn (a client outside the round has none).
    """

    update: Callable
    step: Callable
    evaluator: Callable
    scan: Callable = jax.lax.scan
    cond: Callable = jax.lax.cond
    compiled: bool = True


class Runtime(NamedTuple):
    """Who runs a plan's rounds: ``make_round(trio, schedule) -> round function`` (of
    :func:`fedppl.runtime.make_round`'s signature), and whether the server holds the clients'
    data (False on a deployment, whose server set up on stand-ins: history columns that need
    the data, such as a global ELBO or a bound, are then left out, and a set-up that reads data
    values is refused). ``init`` and ``run`` take one as ``runtime=`` (None: the embedded
    runtime, ``fedppl.infer.base.EMBEDDED``; a
    bare ``runtime(trio, schedule)`` callable, such as :class:`fedppl.runtime.faults.Faults`,
    counts as one whose server holds the data). ``summed``: whether the server receives each
    round's messages only as their sum (secure aggregation, :mod:`fedppl.runtime.secure`): the
    messages a plan's record is given are then equal shares of the total, and a record that
    reads each client's message (the check's) reads their sum instead."""

    make_round: Callable[[Trio, str], Callable]
    data_at_server: bool = True
    summed: bool = False


def make_round(trio: Trio, schedule: str, client_map: ClientMap | None = None) -> RoundFn:
    """A function ``(server, clients, data, masks, keys, active, server_key) -> (server,
    clients, messages, replies)``: one round of ``trio`` on ``schedule``, its clients reached by
    ``client_map`` (None: :data:`VMAP`; ``schedule="loop"`` is the synchronous schedule on
    :data:`LOOP`).

    ``clients``, ``data``, ``masks`` and ``keys`` are stacked on the client axis (K); ``active``
    (K booleans) marks the clients taking part; ``server_key`` is the server's own randomness.
    ``messages`` and ``replies`` come back stacked on the client axis (zeros for a client that
    sat the round out).
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if schedule == "loop":
        if client_map is not None:
            raise ValueError("schedule='loop' is the synchronous schedule on the LOOP client "
                             "map: give schedule='synchronous' with a client_map")
        schedule, client_map = "synchronous", LOOP
    client_map = VMAP if client_map is None else client_map
    if trio.jit:
        check_cpu_lapack()
    round_fn = (_synchronous if schedule == "synchronous" else _sequential)(trio, client_map)
    return jax.jit(round_fn) if trio.jit and client_map.compiled else round_fn


# -- the schedules, each written once ----------------------------------------------------------


def recording(last: dict) -> Callable[[Trio, str], RoundFn]:
    """A ``runtime`` for a method's ``run`` that rounds as :func:`make_round` does and keeps the
    server state after each in ``last["server"]``: what another runtime's last state (a Flower
    server's ``state.npz``) is compared with.

    >>> import jax, fedppl
    >>> from fedppl.models import linear_regression
    >>> X = jax.random.normal(jax.random.key(0), (40, 2)); y = X @ jax.numpy.ones(2)
    >>> clients = fedppl.partition.homogeneous(X, y, num_clients=2, seed=0)
    >>> last = {}
    >>> pvi = fedppl.PVI(linear_regression, fedppl.PVIGuide(linear_regression))
    >>> _ = pvi.run(jax.random.key(0), clients, 2, runtime=recording(last), progress_bar=False)
    >>> "server" in last
    True
    """

    def runtime(trio: Trio, schedule: str) -> RoundFn:
        round_fn = make_round(trio, schedule)

        def recorded(*args: Any) -> Any:
            out = round_fn(*args)
            last["server"] = out[0]
            return out

        return recorded

    return runtime


def _synchronous(trio: Trio, clients: ClientMap) -> RoundFn:
    compile_, vmap = _compilers(trio, clients)

    @compile_
    def serve(server, msgs, index, received, server_key, proposed, data, masks):
        return trio.server_update(server, msgs, index, received, server_key,
                                  clients.evaluator(trio, proposed, data, masks))

    acknowledge = compile_(vmap(trio.acknowledge))

    def round_fn(server, cstates, data, masks, keys, active, server_key):
        server = _begin(trio, server, server_key)
        index = jnp.arange(masks.shape[0])
        msgs, proposed, received = clients.update(trio, sent(trio, server), cstates, data,
                                                  masks, keys, index, active)
        server, replies = serve(server, msgs, index, _taking_part(active, received), server_key,
                                proposed, data, masks)
        return server, acknowledge(cstates, msgs, replies, proposed), msgs, replies

    return round_fn


def _sequential(trio: Trio, clients: ClientMap) -> RoundFn:
    compile_, _ = _compilers(trio, clients)

    @compile_
    def serve(server, msg, k, received, server_key):
        server, reply = trio.server_update(server, trees.one(msg), k[None],
                                           _received_batch(received),
                                           jax.random.fold_in(server_key, k), None)
        return server, trees.first(reply)

    acknowledge = compile_(trio.acknowledge)

    def round_fn(server, cstates, data, masks, keys, active, server_key):
        server = _begin(trio, server, server_key)
        first = _first_client(cstates, data, masks, keys)

        def with_step(step: Callable) -> Callable:
            """One client's part of the round, its step taken by ``step``."""

            def update(server, inputs):
                cstate, data_k, mask_k, key_k, k = inputs
                msg, proposed, received = step(trio, sent(trio, server), cstate, data_k, mask_k,
                                               key_k, k)
                server, reply = serve(server, msg, k, received, server_key)
                return server, (acknowledge(cstate, msg, reply, proposed), msg, reply)

            return update

        # what a client outside the round sends and is sent: zeros (their shapes found with
        # the client's step taken here, so that a remote map is not asked for them)
        blank = trees.zeros(jax.eval_shape(lambda: with_step(_direct_step)(server, first)[1][1:]))
        update = with_step(clients.step)

        def one(server, inputs):
            *rest, active_k = inputs
            return clients.cond(active_k, update, lambda sv, inp: (sv, (inp[0], *blank)),
                                server, tuple(rest))

        index = jnp.arange(masks.shape[0])
        server, (cstates, msgs, replies) = clients.scan(
            one, server, (cstates, data, masks, keys, index, active))
        return server, cstates, msgs, replies

    return round_fn


def _begin(trio: Trio, server, server_key):
    return server if trio.begin_round is None else trio.begin_round(server, server_key)


def _first_client(clients, data, masks, keys):
    return (trees.index(clients, 0), trees.index(data, 0), masks[0], keys[0], jnp.asarray(0))


def _taking_part(active, received):
    """The clients in the server's update: those taking part that answered."""
    return active if received is None else active & received


def _received_batch(received):
    """One client's ``received`` as the server's batch of one."""
    return jnp.ones(1, bool) if received is None else jnp.reshape(received, (1,))


def _compilers(trio: Trio, clients: ClientMap) -> tuple[Callable, Callable]:
    """How a round's server-side pieces are compiled and mapped over the clients: inlined in
    the round's own compiled program (a compiled map), compiled each on its own (a host map),
    or run as they are (a host map and a host-side trio)."""
    if clients.compiled:
        return (lambda f: f), jax.vmap
    if trio.jit:
        return jax.jit, jax.vmap
    return (lambda f: f), _host_vmap


def _host_vmap(fn):
    """``jax.vmap(fn)`` for a host-side function: a Python loop over the leading axis."""

    def mapped(*args):
        K = len(jax.tree_util.tree_leaves(args[1])[0])
        outs = [fn(*trees.index(args, k)) for k in range(K)]
        return trees.stack(outs, xp=np)

    return mapped


# -- the client maps ---------------------------------------------------------------------------


def host_scan(f: Callable, carry: Any, xs: Any) -> tuple[Any, Any]:
    """``lax.scan`` as a Python loop (for a map that works on the host)."""
    ys = []
    for k in range(len(jax.tree_util.tree_leaves(xs)[0])):
        carry, y = f(carry, trees.index(xs, k))
        ys.append(y)
    return carry, trees.stack(ys)


def host_cond(pred: Any, true_fun: Callable, false_fun: Callable, *operands: Any) -> Any:
    """``lax.cond`` as a Python ``if`` (``pred`` a concrete value)."""
    return true_fun(*operands) if bool(pred) else false_fun(*operands)


def host_map(update: Callable, step: Callable, evaluator: Callable) -> ClientMap:
    """A :class:`ClientMap` that works on the host: Python drives the round, between the
    server's compiled steps, so ``update`` and ``step`` may reach clients anywhere."""
    return ClientMap(update, step, evaluator, host_scan, host_cond, compiled=False)


def _vmap_update(trio: Trio, server, clients, data, masks, keys, index, active):
    msgs, proposed = jax.vmap(trio.client_update, (None, 0, 0, 0, 0, 0))(
        server, clients, data, masks, keys, index)
    return msgs, proposed, None


def _direct_step(trio: Trio, server, client, data, mask, key, k):
    msg, proposed = trio.client_update(server, client, data, mask, key, k)
    return msg, proposed, None


def _vmap_evaluator(trio: Trio, proposed, data, masks):
    if trio.client_evaluate is None:
        return None
    return lambda candidate: jax.vmap(trio.client_evaluate, (None, 0, 0, 0))(candidate, proposed,
                                                                              data, masks)


@lru_cache(maxsize=32)
def _local(trio: Trio) -> Callable:
    """A client's step as it runs on the client's own machine (compiled, unless the trio is
    host-side), made once per trio: the loop calls it once per client and round."""
    return jax.jit(trio.client_update) if trio.jit else trio.client_update


def _loop_update(trio: Trio, server, clients, data, masks, keys, index, active):
    # each client holds its own arrays (host copies), as it would on its own machine
    step = _local(trio)
    clients_h, data_h, masks_h = jax.device_get((clients, data, masks))
    K = np.shape(masks)[0]
    out = {k: jax.device_get(step(server, *trees.index((clients_h, data_h, masks_h), k),
                                  keys[k], k))
           for k in range(K) if active[k]}
    if not out:
        raise ValueError("no client takes part in this round")
    blank = jax.tree_util.tree_map(np.zeros_like, next(iter(out.values())))
    msgs, proposed = trees.stack([out.get(k, blank) for k in range(K)], xp=np)
    return msgs, proposed, None


def _loop_step(trio: Trio, server, client, data, mask, key, k):
    msg, proposed = jax.device_get(_local(trio)(server, *jax.device_get((client, data, mask)),
                                                key, k))
    return msg, proposed, None


VMAP = ClientMap(_vmap_update, _direct_step, _vmap_evaluator)
"""Every client under one ``jax.vmap`` (a sequential round: ``lax.scan``), the round compiled
whole."""

LOOP = host_map(_loop_update, _loop_step, _vmap_evaluator)
"""A Python loop over the clients, each on host copies of its arrays, its step compiled once
and called K times; the server's steps compiled on their own."""


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
