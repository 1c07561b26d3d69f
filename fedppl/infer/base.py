"""The one front every federated method shares, shaped like numpyro's ``SVI``.

A method is an object built from its model and settings. Its plan builder turns the clients'
data into a :class:`Plan` (a :class:`~fedppl.algorithms.trio.Trio`, its initial states, how a
round's messages become a history row and the final state a result), and one driver runs any
plan on a runtime given as an argument (``runtime=``: None for the embedded runtime,
:func:`fedppl.runtime.make_round`; :class:`fedppl.runtime.faults.Faults`; a Flower server's):

* ``plan(rng_key, clients) -> Plan``: the run before its first round;
* ``init(rng_key, clients, *, runtime=None) -> RunState`` (a NamedTuple: server and client
  states, the stacked data, the key, the round, the plan and the run's log; everything the run
  needs, as numpyro's ``SVIState``: the method object keeps none of it);
* ``update(state) -> (state, info)``: one round; ``info`` is that round's row of the history;
* ``run(rng_key, clients, num_rounds, *, progress_bar=True, tol=None, runtime=None) -> result``.

The embedded runtime makes one round function per (trio, schedule) in a process
(:func:`embedded_round`), and PVI, GlobalVI, EP and OneShot make one trio per (model, guide,
settings): a second method with the same settings reuses the compiled round.

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
from functools import lru_cache
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

from fedppl import trees, validation
from fedppl.algorithms.trio import Trio, sent
from fedppl.clients import Clients
from fedppl.infer.round_log import Progress
from fedppl.runtime.embedded import Runtime, make_round

__all__ = ["RunState", "RunLog", "Plan", "Runtime", "EMBEDDED", "Result", "FederatedMethod",
           "clear_compiled",
           "COMMON_HISTORY", "num_bytes", "plain", "shared", "embedded_round"]

COMMON_HISTORY = ("round", "seconds", "messages_up", "messages_down", "bytes_up", "bytes_down",
                  "rejected")


@lru_cache(maxsize=32)
def embedded_round(trio: Trio, schedule: str) -> Callable:
    """The embedded runtime's round for ``trio`` and ``schedule``, made once per (trio,
    schedule) in a process (and so compiled once): methods with the same settings share their
    trio (see :mod:`fedppl.infer.variational`), hence this round and its compiled code."""
    return make_round(trio, schedule)


EMBEDDED = Runtime(embedded_round)


def shared(make: Callable[..., Any], *args: Any) -> Any:
    """``make(*args)``, made once per ``(make, args)`` in a process where the arguments are
    hashable (a bounded cache), else made afresh. Fronts build their trios (and compiled
    functions such as PVI's ELBO) through it, so that methods with equal settings share them,
    and with them the compiled rounds (:func:`embedded_round`)."""
    try:
        hash(args)
    except TypeError:
        return make(*args)
    return _shared(make, *args)


@lru_cache(maxsize=64)
def _shared(make: Callable[..., Any], *args: Any) -> Any:
    return make(*args)


def clear_compiled() -> None:
    """Forget the trios and rounds shared between methods (:func:`shared`,
    :func:`embedded_round`), and with them their compiled code. Each compiled XLA program holds
    memory mappings of its own; a process that builds hundreds of distinct methods (a test
    suite) calls this between groups of them to stay under the kernel's map limit."""
    embedded_round.cache_clear()
    _shared.cache_clear()


def as_runtime(runtime: Any) -> Runtime:
    """``runtime=`` as a :class:`Runtime`: None is :data:`EMBEDDED`; a bare callable
    ``runtime(trio, schedule)`` is one whose server holds the data (a runtime whose server does
    not is a ``Runtime(make_round, data_at_server=False)``)."""
    if runtime is None:
        return EMBEDDED
    if isinstance(runtime, Runtime):
        return runtime
    if callable(runtime):
        return Runtime(runtime)
    raise TypeError(f"runtime must be a fedppl.runtime.Runtime or a function (trio, schedule)"
                    f" -> round function, got {type(runtime).__name__}")


class Plan(NamedTuple):
    """A method's run, before its first round: what its plan builder (``method.plan``) returns.

    ``trio`` and ``schedule`` (what a runtime drives), ``server`` and ``clients`` (the initial
    states, clients stacked on axis 0), ``record(before, after, messages, replies, active,
    rng_key) -> (method_log, row)`` (how a round's messages become the method's history columns
    and its accumulators: ``after.log`` is still the log before the round), ``result(state,
    history, rejected) -> Result`` (how the final state becomes a result), the clients'
    ``names``, the method's accumulators at the start (``log``), the key the rounds start from,
    the runtime's ``round_fn`` (set by ``init``), whether the server holds the data, and the
    method's own static part (``static``: PVI's guide as set up, its compiled ELBO, a private
    run's calibration...), a line saying what the run fits (``about``: the first line of its
    progress), and the server's work on the host between rounds, where it has any
    (``next_server(state) -> server``: the state the next round starts from, made from the
    state after a round and its record, outside the round's compiled program: the check's next
    proposal, fitted with a library's PSIS; None: the round's own server state), and whether
    the runtime gives the server only the sum of each round's messages (``summed``,
    :class:`~fedppl.runtime.Runtime`'s)."""

    trio: Trio
    schedule: str
    server: Any
    clients: Any
    record: Callable[..., tuple[Any, dict[str, Any]]]
    result: Callable[..., Result]
    names: tuple[str, ...] = ()
    log: Any = None
    rng_key: Array | None = None
    round_fn: Callable | None = None
    data_at_server: bool = True
    static: Any = None
    about: str = ""
    next_server: Callable[[RunState], Any] | None = None
    summed: bool = False


class RunLog(NamedTuple):
    """A run's accumulators, replaced (never changed) each round: the refused updates so far
    ``(round, client, reason)``, the clients refused in the last round, what left the clients
    in the last round (stacked on the client axis; rows of clients that did not take part were
    never sent: :func:`fedppl.audit.audit_messages` reads it) and which took part, and the
    method's own accumulators (PVI's round log and privacy accounting)."""

    rejected: tuple[tuple[int, str, str], ...] = ()
    refused: tuple[str, ...] = ()
    last_messages: Any = None
    last_active: np.ndarray | None = None
    method: Any = None


class RunState(NamedTuple):
    """Everything a run needs, as numpyro's ``SVIState``: the server's and the clients' states
    (clients stacked on axis 0), their padded data and masks, the key for the next round, the
    rounds done, the run's :class:`Plan` (its static part: trio, round function, names, the
    method's record and result) and its :class:`RunLog` (``state.log.last_messages``: what
    left the clients in the last round)."""

    server: Any
    clients: Any
    data: tuple
    masks: Array
    rng_key: Array
    round: int
    plan: Plan | None = None
    log: RunLog = RunLog()


def num_bytes(tree: Any) -> int:
    """Bytes in a pytree's arrays (what a message or broadcast costs on the wire), read from
    their shapes and dtypes (arrays or ``jax.ShapeDtypeStruct``)."""
    return int(sum(math.prod(np.shape(x)) * np.dtype(x.dtype).itemsize if hasattr(x, "dtype")
                   else np.asarray(x).nbytes for x in jax.tree_util.tree_leaves(tree)))


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
    """Base of every method's front: a plan builder, and one driver for every plan.

    A method's settings live on the object; everything a run needs lives in its
    :class:`RunState` (the :class:`Plan` and the :class:`RunLog`), so ``update(state)`` depends
    on the state alone. A subclass provides its plan:

    * ``_plan(rng_key, clients, *, data_at_server, **kwargs) -> Plan`` (``rng_key`` the run's
      key: the plan says which key its rounds start from; its ``record`` and ``result`` say how
      a round's messages become history columns and the final state a result);

    and may override ``_refused(replies, active) -> (K,) booleans`` (updates the server did not
    accept), ``_round_inputs`` (keys and participants), ``_message_bytes`` and
    ``_broadcast_bytes`` (what a message and the server's broadcast cost on the wire),
    ``progress`` (the history keys its bar shows) and ``tol_objective`` (the history key whose
    relative change ``run(..., tol=)`` stops on; None: the method takes no ``tol``) or
    ``_tol_rule``.
    """

    name = "method"
    schedule = "synchronous"
    clients_per_round: int | None = None
    refusal = "update not accepted"
    # what the progress bar shows: history keys ("name:max" / "name:mean" reduce a per-client
    # array), those finite in a round (see fedppl.infer.round_log.postfix)
    progress: ClassVar[tuple[str, ...]] = ("elbo", "bound", "free_energy")
    # the scalar history entry whose relative change run(..., tol=) stops on (None: no tol)
    tol_objective: ClassVar[str | None] = None

    # -- what a subclass provides --------------------------------------------------------------

    def _plan(self, rng_key: Array, clients: Clients, *, data_at_server: bool = True,
              **kwargs: Any) -> Plan:
        """The run's plan, before its first round (each method provides it)."""
        raise NotImplementedError(f"{type(self).__name__} provides no plan")

    def _check_runtime(self, runtime: Runtime) -> None:
        """Refuse, with a clear error, a runtime the method's settings cannot run on (none by
        default; PVI's distributed DP noise needs one whose server sees only sums)."""

    def _refused(self, replies: Any, active: np.ndarray) -> np.ndarray:
        return np.zeros(len(active), bool)

    def _message_bytes(self, messages: Any) -> int:
        """Bytes of one client's message (messages stacked on the client axis), from shapes
        (indexing one client out compiled a program per shape)."""
        return num_bytes(jax.eval_shape(trees.first, messages))

    def _broadcast_bytes(self, server: Any) -> int:
        """Bytes of what the server sends each client taking part (``server``: the trio's
        broadcast of its state, :func:`fedppl.algorithms.trio.sent`)."""
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

    def plan(self, rng_key: Array, clients: Clients, *, runtime: Any = None,
             **kwargs: Any) -> Plan:
        """Check the clients and build the run's plan: its trio and initial states, how its
        rounds become history rows and its end a result (no round runs, no runtime is asked
        for a round function). A Flower node builds its trio this way."""
        if not isinstance(clients, Clients):
            raise TypeError(f"clients must be a fedppl.Clients (see fedppl.partition), got "
                            f"{type(clients).__name__}")
        rng_key = validation.rng_key(rng_key)
        clients.check()  # again: arrays may have changed in place since partitioning
        self._check_clients_per_round(clients.num_clients)
        for old in ("runtime", "data_at_server"):  # attributes an earlier version read
            if old in vars(self):
                raise TypeError(f"{type(self).__name__}.{old} is not read: pass the runtime to "
                                "init or run (runtime=..., see fedppl.runtime.Runtime)")
        rt = as_runtime(runtime)
        self._check_runtime(rt)
        data_at_server = rt.data_at_server
        plan = self._plan(rng_key, clients, data_at_server=data_at_server, **kwargs)
        return plan._replace(names=clients.names, data_at_server=data_at_server,
                             summed=rt.summed,
                             rng_key=rng_key if plan.rng_key is None else plan.rng_key)

    def init(self, rng_key: Array, clients: Clients, *, runtime: Any = None,
             **kwargs: Any) -> RunState:
        """Check the clients, build the plan and its initial state; ``runtime`` runs the rounds
        (None: the embedded runtime; see :class:`Runtime`)."""
        rt = as_runtime(runtime)
        plan = self.plan(rng_key, clients, runtime=rt, **kwargs)
        plan = plan._replace(round_fn=rt.make_round(plan.trio, plan.schedule))
        assert plan.rng_key is not None  # set by plan
        return RunState(plan.server, plan.clients, clients.stacked, clients.mask, plan.rng_key,
                        0, plan, RunLog(method=plan.log))

    def _check_clients_per_round(self, num_clients: int) -> None:
        """``clients_per_round`` no larger than the number of clients (known at ``init``)."""
        m = self.clients_per_round
        if m is not None and m > num_clients:
            raise ValueError(f"clients_per_round={m} exceeds the number of clients "
                             f"({num_clients}); give at most {num_clients}, or None for all")

    def _started(self, state: RunState) -> Plan:
        """The state's plan, or the error that says to call ``init`` first."""
        plan = getattr(state, "plan", None)
        if plan is None or plan.round_fn is None:
            raise RuntimeError(f"call {type(self).__name__}.init(rng_key, clients) before update")
        return plan

    def update(self, state: RunState) -> tuple[RunState, dict[str, Any]]:
        """One round: every taking part client's update, then the server's."""
        plan = self._started(state)
        rng_key, keys, active, server_key, spare = self._round_inputs(state)
        t0 = time.perf_counter()
        server, cstates, msgs, replies = plan.round_fn(state.server, state.clients, state.data,
                                                       state.masks, keys, active, server_key)
        jax.block_until_ready((server, cstates))
        seconds = time.perf_counter() - t0
        new = state._replace(server=server, clients=cstates, rng_key=rng_key,
                             round=state.round + 1)
        active = np.asarray(active)
        refused = self._refused(replies, active) & active
        n = int(active.sum())
        info = {"round": new.round, "seconds": seconds, "messages_up": n, "messages_down": n,
                "bytes_up": n * self._message_bytes(msgs),
                "bytes_down": n * self._broadcast_bytes(sent(plan.trio, state.server)),
                "rejected": int(refused.sum())}
        method_log, row = plan.record(state, new, msgs, replies, active, spare)
        info.update(row)
        names = tuple(plan.names[k] for k in np.nonzero(refused)[0])
        log = RunLog(state.log.rejected + tuple((new.round, who, self.refusal) for who in names),
                     names, msgs, active, method_log)
        new = new._replace(log=log)
        if plan.next_server is not None:
            new = new._replace(server=plan.next_server(new))
        return new, info

    def lower_round(self, state: RunState) -> Any:
        """The next round as XLA sees it (``jax.stages.Lowered``), with the inputs ``update``
        would give it, for inspection: ``.compile().memory_analysis()``, ``.cost_analysis()``."""
        plan = self._started(state)
        _, keys, active, server_key, _ = self._round_inputs(state)
        return jax.jit(plan.round_fn).lower(state.server, state.clients, state.data,
                                            state.masks, keys, active, server_key)

    def run(self, rng_key: Array, clients: Clients, num_rounds: int, *,
            progress_bar: bool = True, tol: float | None = None, runtime: Any = None,
            **kwargs: Any) -> Result:
        """``init``, then up to ``num_rounds`` calls of ``update`` (fewer once ``tol`` is met,
        where the method takes one); returns the method's result. ``runtime`` runs the rounds
        (None: the embedded runtime; see :class:`Runtime`)."""
        num_rounds = check_rounds(num_rounds)
        stop = self._tol_rule(check_tol(tol, self.name, self.tol_objective is not None))
        state = self.init(rng_key, clients, runtime=runtime, **kwargs)
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
        bar = Progress(f"{self.name} ({self.schedule})", num_rounds, self.progress,
                       progress_bar, self._started(state).about)
        why = None
        try:
            for _ in range(num_rounds):
                state, info = self.update(state)
                rows.append(info)
                bar.update(info)
                why = None if stop is None else stop(rows)
                if why:
                    break
        finally:
            early = why if why and len(rows) < num_rounds else None
            bar.close(early)
        history = {k: np.asarray([r[k] for r in rows]) for k in rows[0]}
        plan = self._started(state)
        result = plan.result(state, history, list(state.log.rejected))
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

