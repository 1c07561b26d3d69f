"""Faults injected into the embedded runtime: clients that drop out and messages that arrive
corrupted, for testing a method's server against them.

:class:`Faults` is a runtime (``method.run(..., runtime=Faults(...))``): it runs the method's
own trio through :func:`fedppl.runtime.make_round`, except that each round, independently for
each client taking part, the client's message is lost with probability ``dropout`` (it computed
its update; the server never hears of it) or else, with probability ``corrupt``, arrives
replaced by one of the ``kinds`` of corruption (every floating-point entry of the message):

* ``"nan"``, ``"inf"``: NaN, +inf;
* ``"huge"``: 1e12, a finite message far beyond what data can carry;
* ``"improper"``: -1e12, a message with which no Gaussian stays proper;
* ``"negated"`` (not among the default ``KINDS``): the message times -1, a plausible-looking
  wrong message that no rule without the client's data can tell from an honest one.

The corruption is in what the server receives: the client keeps what it computed (a hostile
client, or a fault between the two), so a corrupted message the server accepts leaves the server's
state and the client's own apart for good. Which
client had which fault in which round is drawn from ``seed`` alone (the method's own randomness
is untouched, so a clean run with the same seed draws the same keys) and kept in ``events``:
``(round, client index, fault)``.

Example (PVI with a third of the messages lost and a fifth corrupted; every corrupted message
that arrived is refused, and the server's record says why)::

    >>> import numpy as np, jax, fedppl
    >>> from fedppl.models import linear_regression
    >>> from fedppl.runtime.faults import Faults
    >>> rng = np.random.default_rng(0)
    >>> X = rng.normal(size=(200, 3))
    >>> clients = fedppl.partition.homogeneous(X, X @ np.ones(3), num_clients=5, seed=0)
    >>> pvi = fedppl.PVI(linear_regression, fedppl.PVIGuide(linear_regression),
    ...                  schedule="synchronous")
    >>> faults = Faults(dropout=0.3, corrupt=0.2, kinds=("nan", "huge"), seed=1)
    >>> result = pvi.run(jax.random.key(0), clients, num_rounds=20, progress_bar=False,
    ...                  runtime=faults)
    >>> corrupted = {(r, clients.names[k]) for r, k, f in faults.events if f != "dropped"}
    >>> refused = {(r, who) for r, who, why in result.rejected if "no message" not in why}
    >>> corrupted == refused
    True
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fedppl.algorithms.trio import Trio
from fedppl.runtime.embedded import make_round

__all__ = ["Faults", "KINDS", "ALL_KINDS", "DROPPED", "corrupt", "corrupt_where"]

#: The kinds of corrupted message :func:`corrupt` can make.
KINDS = ("nan", "inf", "huge", "improper")
_CORRUPT: dict[str, Callable[[Any], Any]] = {
    "nan": lambda x: jnp.full_like(x, jnp.nan),
    "inf": lambda x: jnp.full_like(x, jnp.inf),
    "huge": lambda x: jnp.full_like(x, 1e12),
    "improper": lambda x: jnp.full_like(x, -1e12),
    "negated": lambda x: -x,
}
#: Every kind :func:`corrupt` knows (:data:`KINDS` and ``"negated"``).
ALL_KINDS = tuple(_CORRUPT)
DROPPED = 1  # a client's fault code: 0 none, 1 dropped, 2 + i the i-th of kinds


def corrupt(message: Any, kind: str) -> Any:
    """``message`` with every floating-point entry corrupted by ``kind`` (one of :data:`KINDS`
    or ``"negated"``); a deployment's fault drills use it too."""
    if kind not in _CORRUPT:
        raise ValueError(f"kind must be one of {tuple(_CORRUPT)}, got {kind!r}")
    return jax.tree_util.tree_map(
        lambda x: _CORRUPT[kind](x) if jnp.issubdtype(jnp.result_type(x), jnp.inexact) else x,
        message)


def corrupt_where(messages: Any, plan: Any, kinds: Sequence[str]) -> Any:
    """Stacked ``messages`` (clients on axis 0) with client ``k``'s corrupted by the fault its
    ``plan[k]`` code names (:meth:`Faults.draw`; a dropout or no fault leaves it as it is)."""
    for i, kind in enumerate(kinds):
        hit = plan == DROPPED + 1 + i
        messages = jax.tree_util.tree_map(
            lambda x, f=_CORRUPT[kind], hit=hit:
            jnp.where(hit.reshape(hit.shape + (1,) * (x.ndim - 1)), f(x), x)
            if jnp.issubdtype(x.dtype, jnp.inexact) else x, messages)
    return messages


@lru_cache(maxsize=16)
def _faulty_round(trio: Trio, schedule: str, kinds: tuple[str, ...]) -> Callable:
    """The compiled round with a fault plan as its last argument (one per trio, schedule and
    kinds, shared by every :class:`Faults` that drives them)."""

    @jax.jit
    def faulty_round(server, clients, data, masks, keys, active, server_key, plan):
        def server_update(server, msgs, index, received, key, evaluate):
            code = plan[index]
            msgs = corrupt_where(msgs, code, kinds)
            return trio.server_update(server, msgs, index, received & (code != DROPPED),
                                      key, evaluate)

        inner = make_round(trio._replace(server_update=server_update), schedule)
        return inner(server, clients, data, masks, keys, active, server_key)

    return faulty_round


class Faults:
    """A runtime that injects dropouts and corrupted messages (see the module docstring)."""

    def __init__(self, dropout: float = 0.0, corrupt: float = 0.0,
                 kinds: Sequence[str] = KINDS, seed: int = 0):
        for name, p in (("dropout", dropout), ("corrupt", corrupt)):
            if not 0.0 <= p <= 1.0:  # also refuses NaN
                raise ValueError(f"{name} must be a probability in [0, 1], got {p}")
        kinds = tuple(kinds)
        if not kinds or any(k not in _CORRUPT for k in kinds):
            raise ValueError(f"kinds must be some of {tuple(_CORRUPT)}, got {kinds}")
        self.dropout, self.corrupt = float(dropout), float(corrupt)
        self.kinds, self.seed = kinds, seed
        self.events: list[tuple[int, int, str]] = []

    def __call__(self, trio: Trio, schedule: str) -> Callable:
        """The round function for ``trio`` (a new run: the fault draws and ``events`` restart)."""
        if not trio.jit or schedule == "loop":
            raise ValueError("Faults drives compiled trios on the synchronous and sequential "
                             f"schedules, not {schedule!r} or a host-side protocol")
        self.restart()
        faulty_round = _faulty_round(trio, schedule, self.kinds)

        def round_fn(server, clients, data, masks, keys, active, server_key):
            return faulty_round(server, clients, data, masks, keys, active, server_key,
                                jnp.asarray(self.draw(active)))

        return round_fn

    def restart(self) -> None:
        """A new run: the fault draws and ``events`` start again from ``seed``."""
        self.events, self._rng, self._round = [], np.random.default_rng(self.seed), 0

    def draw(self, active: Any) -> np.ndarray:
        """The next round's fault plan: a code per client (0: none, :data:`DROPPED`, ``DROPPED
        + 1 + i``: the ``i``-th of ``kinds``) for the clients taking part (``active``), kept in
        ``events``. A runtime that drives the trio its own way (secure aggregation's
        simulation) draws its faults here too."""
        self._round += 1
        taking = np.asarray(active, bool)
        u, which = self._rng.random(taking.shape), self._rng.integers(len(self.kinds),
                                                                      size=taking.shape)
        dropped = taking & (u < self.dropout)
        corrupted = taking & ~dropped & (u < self.dropout + (1 - self.dropout) * self.corrupt)
        plan = np.where(dropped, DROPPED, np.where(corrupted, DROPPED + 1 + which, 0))
        for k in np.nonzero(plan)[0]:
            fault = "dropped" if plan[k] == DROPPED else self.kinds[plan[k] - DROPPED - 1]
            self.events.append((self._round, int(k), fault))
        return plan
