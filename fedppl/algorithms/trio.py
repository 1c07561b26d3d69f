"""What every federated algorithm is: a trio of pure functions that a runtime drives.

A method builds a :class:`Trio` once (from its model and settings); the runtime
(:func:`fedppl.runtime.make_round`, or a deployment's) calls it on NamedTuple states and
explicit message pytrees:

* ``client_update(server, client, data, mask, rng_key, index) -> (message, proposed)``: one
  client's work from the server's broadcast ``server`` and its own state ``client``; ``message``
  is the only thing that leaves the client, ``proposed`` its new state if the server accepts;
* ``server_update(server, messages, index, received, rng_key, evaluate) -> (server, replies)``:
  the server folds the messages (stacked on axis 0, from clients ``index``, ``received`` marking
  the ones that arrived) into its state and answers each client with a ``reply`` (what it
  accepted);
* ``acknowledge(client, message, reply, proposed) -> client``: the client applies the reply
  (default: keep ``proposed``).

Optional parts:

* ``evaluate``: ``client_evaluate(candidate, client, data, mask) -> scalar`` lets the server
  score candidate states on every client's data (a line search: one more exchange of scalars);
  the runtime passes ``server_update`` a function ``evaluate(candidate) -> (K,)``, or ``None``;
* ``begin_round(server, rng_key) -> server``: the server's own work before the clients'
  (a factor it holds itself);
* ``broadcast(server) -> what the clients are sent``: the part of the server's state that leaves
  the server (default: all of it). ``client_update`` receives it in place of ``server``; the
  rest (a sampler's running sums, its tuning) never leaves the server, and a round's
  ``bytes_down`` counts only what is sent.

Example (one synchronous round, as :func:`fedppl.runtime.make_round` runs it)::

    >>> import jax, jax.numpy as jnp
    >>> trio = Trio(lambda s, c, d, m, k, i: (jnp.sum(d * m) - s, c),
    ...             lambda s, msgs, idx, ok, k, ev: (s + jnp.mean(msgs), ok))
    >>> data, masks = jnp.ones((3, 4)), jnp.ones((3, 4))
    >>> msgs, _ = jax.vmap(trio.client_update, (None, 0, 0, 0, 0, 0))(
    ...     0.0, jnp.zeros(3), data, masks, jax.random.split(jax.random.key(0), 3), jnp.arange(3))
    >>> float(trio.server_update(0.0, msgs, jnp.arange(3), jnp.ones(3, bool), None, None)[0])
    4.0
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

__all__ = ["Trio", "keep_proposed", "sent"]


def keep_proposed(client: Any, message: Any, reply: Any, proposed: Any) -> Any:
    """The default acknowledgement: the client keeps the state it proposed."""
    return proposed


class Trio(NamedTuple):
    """A federated algorithm's pure functions (see the module docstring for their signatures).

    ``jit``: whether the runtime may compile them (False for host-side, NumPy protocols).
    """

    client_update: Callable
    server_update: Callable
    acknowledge: Callable = keep_proposed
    client_evaluate: Callable | None = None
    begin_round: Callable | None = None
    jit: bool = True
    broadcast: Callable | None = None


def sent(trio: Trio, server: Any) -> Any:
    """What ``trio``'s server sends its clients from state ``server`` (``trio.broadcast``'s
    part, or the whole state)."""
    return server if trio.broadcast is None else trio.broadcast(server)
