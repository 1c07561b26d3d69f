"""The one front every federated method shares, shaped like numpyro's ``SVI``.

A method is an object built from its model and settings. It turns the clients' data into a
:class:`~fedppl.algorithms.trio.Trio` and its initial states, and the embedded runtime
(:func:`fedppl.runtime.make_round`) runs the rounds:

* ``init(rng_key, clients) -> RunState`` (a NamedTuple: server and client states, the stacked
  data, the key, the round);
* ``update(state) -> (state, info)``: one round; ``info`` is that round's row of the history;
* ``run(rng_key, clients, num_rounds, *, progress_bar=True, tol=None) -> result``.

Every ``run`` shows a progress bar on stderr (``progress_bar=False``: none) with a quantity
the method has (``FederatedMethod.progress``). ``tol`` is a ``run`` argument wherever a method
stops early by it (PVI, GlobalVI, EP: ``KL(q_new || q_old) <= tol``; FederatedSGP, FSGP,
PFedMul: the objective's relative change ``<= tol``); a run that stops before ``num_rounds``
writes one line naming the round and the criterion, and keeps it as ``result.stopped``.

Every result derives from :class:`Result`: ``.history`` maps the same keys wherever they apply
(``round``, ``seconds``, ``messages_up``/``messages_down``, ``bytes_up``/``bytes_down``,
``rejected``, and the method's objective: ``free_energy``, ``elbo`` or ``bound``) to one row per
round, round 1 first; ``.to_arviz()`` and ``.to_json()`` report it.

Example::

    >>> import jax, numpy as np, fedppl
    >>> from fedppl.models import linear_regression
    >>> rng = np.random.default_rng(0)
    >>> X = rng.normal(size=(200, 3))
    >>> y = X @ np.array([1.0, -0.5, 0.2]) + rng.normal(size=200)
    >>> clients = fedppl.partition.homogeneous(X, y, num_clients=4, seed=0)
    >>> pvi = fedppl.PVI(linear_regression, fedppl.PVIGuide(linear_regression))
    >>> state = pvi.init(jax.random.key(1), clients)
    >>> state, info = pvi.update(state)
    >>> info["round"], info["messages_up"]
    (1, 4)
"""

from __future__ import annotations

import json
import math
import operator
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

from fedppl import validation
from fedppl.algorithms.trio import Trio
from fedppl.clients import Clients
from fedppl.infer.round_log import Progress
from fedppl.runtime.embedded import make_round

__all__ = ["RunState", "Result", "FederatedMethod", "COMMON_HISTORY", "num_bytes", "plain"]

COMMON_HISTORY = ("round", "seconds", "messages_up", "messages_down", "bytes_up", "bytes_down",
                  "rejected")


class RunState(NamedTuple):
    """Everything one round needs: the server's and the clients' states (clients stacked on
    axis 0), their padded data and masks, the key for the next round and the rounds done."""

    server: Any
    clients: Any
    data: tuple
    masks: Array
    rng_key: Array
    round: int


def num_bytes(tree: Any) -> int:
    """Bytes in a pytree's arrays (what a message or broadcast costs on the wire)."""
    return int(sum(np.asarray(x).nbytes for x in jax.tree_util.tree_leaves(tree)))


@dataclass(kw_only=True)
class Result:
    """What every method's ``run`` returns: per-round ``history`` (arrays, one row per round),
    the clients' names, ``rejected``: ``(round, client, reason)`` for each refused update, and
    ``stopped``: why the run ended before its ``num_rounds`` (``tol`` met, a method's own
    stopping rule), or None."""

    history: dict[str, np.ndarray]
    client_names: tuple[str, ...] = ()
    rejected: list[tuple[int, str, str]] = field(default_factory=list)
    stopped: str | None = None

    @property
    def num_rounds(self) -> int:
        return len(self.history["round"])

    def to_arviz(self, *args: Any, **kwargs: Any):
        raise NotImplementedError

    def check(self, *args: Any, **kwargs: Any):
        """How far the answer is from the pooled posterior (results with a Gaussian ``q`` over a
        NumPyro model's global sites: PVI, GlobalVI, EP, OneShot)."""
        raise TypeError(f"{type(self).__name__} has no Gaussian q over a NumPyro model's global "
                        "sites to check against the pooled posterior: check and refine apply "
                        "to the results of PVI, GlobalVI, EP and OneShot")

    def refine(self, *args: Any, **kwargs: Any):
        """Importance-corrected pooled posterior (see :meth:`check`)."""
        return self.check(*args, **kwargs)

    def _client_index(self, client: int | str, num_clients: int) -> int:
        """``client`` (a name from ``client_names``, or an index) as an index below
        ``num_clients``."""
        if isinstance(client, str):
            if client not in self.client_names:
                raise KeyError(f"no client named {client!r}; clients are {self.client_names}")
            return self.client_names.index(client)
        try:
            if isinstance(client, bool):
                raise TypeError
            k = operator.index(client)
        except TypeError:
            raise TypeError(f"client must be an index or a name, got {client!r}") from None
        if not 0 <= k < num_clients:
            raise IndexError(f"client {client} out of range for {num_clients} clients")
        return k

    def summary(self) -> dict[str, Any]:
        """Scalars that describe the run (extended by each method)."""
        return {"rounds": self.num_rounds,
                "seconds": float(np.sum(self.history["seconds"])),
                "messages_up": int(np.sum(self.history["messages_up"])),
                "bytes_up": int(np.sum(self.history["bytes_up"])),
                "rejected": len(self.rejected)}

    def to_json(self, path: str | None = None) -> dict[str, Any]:
        """``{"summary": ..., "history": ...}`` with plain types (and written to ``path``)."""
        out = {"method": type(self).__name__.removesuffix("Result") or "Result",
               "summary": plain(self.summary()),
               "history": {k: plain(v) for k, v in self.history.items()},
               "rejected": [list(r) for r in self.rejected]}
        if path is not None:
            with open(path, "w") as f:
                json.dump(out, f, indent=1)
        return out


def plain(value: Any) -> Any:
    """JSON types: mappings to dicts, arrays to (nested) lists, non-finite floats to ``None``,
    other objects to ``str`` (what ``to_json`` and the CLI's ``--json`` write)."""
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, (int, float, np.ndarray, np.generic)) or hasattr(value, "__array__"):
        arr = np.asarray(value)
        if arr.dtype.kind in "fc":
            arr = arr.real.astype(float)
            if arr.ndim:
                return [plain(v) for v in arr]
            return float(arr) if math.isfinite(arr) else None
        if arr.dtype.kind in "biu":
            return arr.tolist()
    return str(value)


class FederatedMethod:
    """Base of every method's front. A subclass provides

    * ``_setup(rng_key, clients, **kwargs) -> (trio, schedule, server, client_states)``;
    * ``_record(before, after, messages, replies, active, rng_key) -> dict`` (its own history
      columns; ``rng_key`` for estimates such as an ELBO);
    * ``_refused(replies, active) -> (K,) booleans`` (updates the server did not accept);
    * ``_result(state, history, rejected) -> Result``;

    and may override ``_round_inputs`` (keys and participants), ``_message_bytes`` and
    ``_broadcast_bytes`` (what a message and the server's broadcast cost on the wire),
    ``progress`` (the history keys its bar shows) and ``tol_objective`` (the history key whose
    relative change ``run(..., tol=)`` stops on; None: the method takes no ``tol``) or
    ``_tol_rule``.
    """

    name = "method"
    schedule = "synchronous"
    # Who runs the rounds: None for the embedded runtime (fedppl.runtime.make_round), else a
    # ``runtime(trio, schedule) -> round function`` of the same signature (a Flower server's).
    runtime: Any = None
    # False where the server holds only stand-ins for the clients' data (a deployment): history
    # columns that need the data (a global ELBO, a bound) are then left out.
    data_at_server = True
    clients_per_round: int | None = None
    refusal = "update not accepted"
    # what the progress bar shows: history keys ("name:max" / "name:mean" reduce a per-client
    # array), those finite in a round (see fedppl.infer.round_log.postfix)
    progress: ClassVar[tuple[str, ...]] = ("elbo", "bound", "free_energy")
    # the scalar history entry whose relative change run(..., tol=) stops on (None: no tol)
    tol_objective: ClassVar[str | None] = None

    # -- what a subclass provides --------------------------------------------------------------

    def _setup(self, rng_key: Array, clients: Clients, **kwargs: Any
               ) -> tuple[Trio, str, Any, Any]:
        raise NotImplementedError

    def _record(self, before: RunState, after: RunState, messages: Any, replies: Any,
                active: np.ndarray, rng_key: Array) -> dict[str, Any]:
        return {}

    def _refused(self, replies: Any, active: np.ndarray) -> np.ndarray:
        return np.zeros(len(active), bool)

    def _result(self, state: RunState, history: dict[str, np.ndarray],
                rejected: list[tuple[int, str, str]]) -> Result:
        raise NotImplementedError

    def _message_bytes(self, messages: Any) -> int:
        """Bytes of one client's message (messages stacked on the client axis)."""
        return num_bytes(jax.tree_util.tree_map(lambda x: x[0], messages))

    def _broadcast_bytes(self, server: Any) -> int:
        """Bytes of what the server sends each client taking part."""
        return num_bytes(server)

    def _round_inputs(self, state: RunState) -> tuple[Array, Array, Array, Array, Array]:
        """``(next_key, client_keys, active, server_key, spare_key)`` for one round."""
        K = state.masks.shape[0]
        rng_key, k_round, k_spare, k_pick = jax.random.split(state.rng_key, 4)
        return (rng_key, jax.random.split(k_round, K), self._participants(k_pick, K),
                jax.random.fold_in(k_round, K), k_spare)

    def _participants(self, key: Array, num_clients: int) -> Array:
        """Booleans marking this round's clients (all, or a random ``clients_per_round``)."""
        m = self.clients_per_round
        if m is None or m >= num_clients:
            return jnp.ones(num_clients, bool)
        chosen = jax.random.permutation(key, num_clients)[:m]
        return jnp.zeros(num_clients, bool).at[chosen].set(True)

    # -- the numpyro SVI shape -----------------------------------------------------------------

    def init(self, rng_key: Array, clients: Clients, **kwargs: Any) -> RunState:
        """Check the clients, build the algorithm and its initial states."""
        if not isinstance(clients, Clients):
            raise TypeError(f"clients must be a fedppl.Clients (see fedppl.partition), got "
                            f"{type(clients).__name__}")
        rng_key = validation.rng_key(rng_key)
        self._check_clients_per_round(clients.num_clients)
        rng_key, k_setup = jax.random.split(rng_key)
        trio, schedule, server, cstates = self._setup(k_setup, clients, **kwargs)
        if self.runtime is not None:  # a deployment's rounds (fedppl.runtime.flower)
            self._round_fn = self.runtime(trio, schedule)
        else:
            cache = self.__dict__.setdefault("_rounds", {})
            if (trio, schedule) not in cache:
                cache[(trio, schedule)] = make_round(trio, schedule)
            self._round_fn = cache[(trio, schedule)]
        self._names = clients.names
        return RunState(server, cstates, clients.stacked, clients.mask, rng_key, 0)

    def _check_clients_per_round(self, num_clients: int) -> None:
        """``clients_per_round`` no larger than the number of clients (known at ``init``)."""
        m = self.clients_per_round
        if m is not None and m > num_clients:
            raise ValueError(f"clients_per_round={m} exceeds the number of clients "
                             f"({num_clients}); give at most {num_clients}, or None for all")

    def update(self, state: RunState) -> tuple[RunState, dict[str, Any]]:
        """One round: every taking part client's update, then the server's."""
        if not hasattr(self, "_round_fn"):
            raise RuntimeError(f"call {type(self).__name__}.init(rng_key, clients) before update")
        rng_key, keys, active, server_key, spare = self._round_inputs(state)
        t0 = time.perf_counter()
        server, cstates, msgs, replies = self._round_fn(state.server, state.clients, state.data,
                                                        state.masks, keys, active, server_key)
        jax.block_until_ready((server, cstates))
        seconds = time.perf_counter() - t0
        new = RunState(server, cstates, state.data, state.masks, rng_key, state.round + 1)
        active = np.asarray(active)
        # what left the clients this round, stacked on the client axis (rows of clients that
        # did not take part were never sent): fedppl.audit reads it
        self.last_messages, self.last_active = msgs, active
        refused = self._refused(replies, active) & active
        n = int(active.sum())
        info = {"round": new.round, "seconds": seconds, "messages_up": n, "messages_down": n,
                "bytes_up": n * self._message_bytes(msgs),
                "bytes_down": n * self._broadcast_bytes(state.server),
                "rejected": int(refused.sum())}
        self._refused_now = [self._names[k] for k in np.nonzero(refused)[0]]
        info.update(self._record(state, new, msgs, replies, active, spare))
        return new, info

    def lower_round(self, state: RunState) -> Any:
        """The next round as XLA sees it (``jax.stages.Lowered``), with the inputs ``update``
        would give it, for inspection: ``.compile().memory_analysis()``, ``.cost_analysis()``."""
        if not hasattr(self, "_round_fn"):
            raise RuntimeError(f"call {type(self).__name__}.init(rng_key, clients) first")
        _, keys, active, server_key, _ = self._round_inputs(state)
        return jax.jit(self._round_fn).lower(state.server, state.clients, state.data,
                                             state.masks, keys, active, server_key)

    def run(self, rng_key: Array, clients: Clients, num_rounds: int, *,
            progress_bar: bool = True, tol: float | None = None, **kwargs: Any) -> Result:
        """``init``, then up to ``num_rounds`` calls of ``update`` (fewer once ``tol`` is met,
        where the method takes one); returns the method's result."""
        num_rounds = check_rounds(num_rounds)
        stop = self._tol_rule(check_tol(tol, self.name, self.tol_objective is not None))
        state = self.init(rng_key, clients, **kwargs)
        return self._loop(state, num_rounds, progress_bar, stop)

    def _tol_rule(self, tol: float | None) -> StopRule | None:
        """``run(..., tol=)``'s rule: the relative change of ``tol_objective`` between two
        rounds at most ``tol`` (a NaN never stops)."""
        key = self.tol_objective
        if tol is None or key is None:
            return None

        def rule(rows: list[dict[str, Any]]) -> str | None:
            if len(rows) < 2:
                return None
            new, old = float(rows[-1][key]), float(rows[-2][key])
            change = abs(new - old) / max(abs(old), 1e-300)
            return (f"relative change of {key} {change:.3g} <= tol {tol:g}" if change <= tol
                    else None)

        return rule

    def _loop(self, state: RunState, num_rounds: int, progress_bar: bool,
              stop: StopRule | None = None) -> Result:
        rows: list[dict[str, Any]] = []
        rejected: list[tuple[int, str, str]] = []
        bar = Progress(f"{self.name} ({self.schedule})", num_rounds, self.progress,
                       progress_bar)
        why = None
        try:
            for _ in range(num_rounds):
                state, info = self.update(state)
                rows.append(info)
                rejected += [(info["round"], who, self.refusal) for who in self._refused_now]
                bar.update(info)
                why = None if stop is None else stop(rows)
                if why:
                    break
        finally:
            early = why if why and len(rows) < num_rounds else None
            bar.close(early)
        history = {k: np.asarray([r[k] for r in rows]) for k in rows[0]}
        result = self._result(state, history, rejected)
        result.stopped = early
        return result


# a run's stopping rule: the history rows so far -> why it stops now (None: go on)
StopRule = Callable[[list[dict[str, Any]]], "str | None"]


def check_rounds(num_rounds: Any, name: str = "num_rounds") -> int:
    """A positive whole number of rounds (a clear error for 0, -2, 2.5 or \"3\")."""
    return validation.positive_int(num_rounds, name)


def check_tol(tol: Any, method: str, supported: bool = True) -> float | None:
    """``run``'s ``tol``: None, or a positive finite number for a method that stops by it."""
    if tol is None:
        return None
    if not supported:
        raise TypeError(f"{method} has no early stopping by tol (it runs the rounds it is "
                        f"given); leave tol out")
    if isinstance(tol, bool) or not isinstance(tol, (int, float, np.integer, np.floating)):
        raise TypeError(f"tol must be a number, got {tol!r}")
    if not tol > 0:  # the Pyro port's words (tests/pyro/test_bad_input.py)
        raise ValueError(f"tol must be positive, got {tol}")
    return float(tol)

