"""``CoTraining``: private GP co-training between any number of parties (thesis Ch. 4).

Each party is one client of a :class:`~fedppl.Clients` holding its private labelled data
``(X_v, y_v)`` in its own view (its own covariate columns). What is not labelled data comes as
keywords, one array per party in the clients' order: ``pool``, the party's view of the shared
unlabelled pool (row ``i`` is the same point for every party), and optionally ``test`` (its view
of the test inputs) with the common targets ``y_test``, for the history's test RMSE. A
:class:`~fedppl.Clients` needs one width for every client's ``X``; parties whose views have
different numbers of columns pad them (and their pool and test views) with zero columns, which
leaves the SE-ARD kernel and hence every number unchanged (a zero column's lengthscale never
moves).

Randomness: only differentially private releases draw any. The responder ``b`` of round ``r``
answers party ``a`` with noise drawn by NumPy from the JAX key
``fold_in(fold_in(fold_in(k, r - 1), b), a)``, ``k`` the first half of
``jax.random.split(rng_key)`` (the run key of :meth:`FederatedMethod.init`), turned into a
NumPy generator by :func:`fedppl.privacy.release_mean` (seeded with the key's raw data, so
``jax.random.key(s)`` and ``jax.random.PRNGKey(s)`` draw alike). Each party draws from its own
keys, as it must where the parties run apart (a querier that knew the responder's stream could
subtract the noise); the earlier ``run(..., seed=s)`` drew every party's noise from one shared
``np.random.default_rng(s)`` stream in protocol order, which no key reproduces. Without DP a
run does not depend on the key at all.

Example::

    >>> import jax, numpy as np, fedppl
    >>> rng = np.random.default_rng(0)
    >>> def views(n):                       # two noisy views of one latent signal
    ...     y = rng.normal(size=n)
    ...     return [(0.9 * y + 0.4 * rng.normal(size=n))[:, None] for _ in range(2)], y
    >>> (X1, _), y1 = views(15)
    >>> (_, X2), y2 = views(15)
    >>> pool, _ = views(20)
    >>> test, y_test = views(30)
    >>> clients = fedppl.Clients.from_list([(X1, y1), (X2, y2)], names=["party 0", "party 1"])
    >>> method = fedppl.CoTraining("noisy", "full", fit_steps=30)
    >>> result = method.run(jax.random.key(0), clients, 3, pool=pool, test=test,
    ...                     y_test=y_test, progress_bar=False)
    >>> result.history["round"].tolist(), result.history["rmse"].shape
    ([1, 2, 3], (3, 2))
    >>> [type(m).__name__ for m in result.messages[:3]]
    ['Query', 'Response', 'Query']
    >>> mean, var = result.predict(0, test[0])
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import Array

from fedppl import metrics, validation
from fedppl.algorithms import cotraining as ct
from fedppl.clients import Clients
from fedppl.infer.base import (
    FederatedMethod,
    Plan,
    Result,
    RunState,
    check_rounds,
    num_bytes,
    shared,
)

__all__ = ["CoTraining", "CoTrainingResult", "DEFAULT_OPTIMIZER"]

# Adam at 0.05 for 300 steps fits the hyperparameters; one object, so that every run reuses
# the compiled fit
DEFAULT_OPTIMIZER = optax.adam(0.05)


@dataclass(kw_only=True)
class CoTrainingResult(Result):
    """What a co-training run leaves: each party's state and private data, every message in
    protocol order (per round: each party's :class:`~fedppl.algorithms.cotraining.Query`, then
    the :class:`~fedppl.algorithms.cotraining.Response` of each other party to it), and the
    history (``rmse`` (rounds, K) with test data; ``epsilon`` (rounds, K), the composed DP
    epsilon each party has spent so far at ``settings.dp.delta``, with DP)."""

    settings: ct.Settings
    parties: tuple[ct.PartyState, ...]
    data: tuple[tuple[np.ndarray, np.ndarray], ...]
    messages: list[ct.Query | ct.Response] = field(default_factory=list)
    test: tuple[tuple[np.ndarray, ...], np.ndarray] | None = None
    rmse_before: list[float] | None = None

    @property
    def rmse_after(self) -> list[float] | None:
        """Each party's test RMSE after the last round (None without test data)."""
        rmse = self.history.get("rmse")
        return None if rmse is None else [float(v) for v in rmse[-1]]

    @property
    def epsilon(self) -> list[float | None]:
        """Each party's composed DP epsilon after the last round (None without DP)."""
        eps = self.history.get("epsilon")
        return [None] * len(self.parties) if eps is None else [float(v) for v in eps[-1]]

    def _party(self, party: int | str) -> int:
        if isinstance(party, str):
            if party not in self.client_names:
                raise KeyError(f"no party named {party!r}; parties are {self.client_names}")
            return self.client_names.index(party)
        if isinstance(party, bool) or not isinstance(party, (int, np.integer)) or not (
                0 <= party < len(self.parties)):
            raise IndexError(f"party must be an index below {len(self.parties)} or a name, "
                             f"got {party!r}")
        return int(party)

    def predict(self, party: int | str, X: Any, *, alone: bool = False
                ) -> tuple[np.ndarray, np.ndarray]:
        """Party ``party``'s predictive mean and latent variance at ``X`` (rows in its view),
        from its data and every answer it received; ``alone``: from its private data only
        (its model before co-training)."""
        k = self._party(party)
        X = _matrix(X, f"X for {self.client_names[k]}", self.data[k][0].shape[1])
        state, (X_k, y_k) = self.parties[k], self.data[k]
        if alone:
            state = state._replace(got_index=state.got_index[:, :0])
        mean, var = ct.predict(state, X_k, y_k, X, self.settings)
        return np.asarray(mean), np.asarray(var)

    def queried(self, party: int | str) -> list[int]:
        """Pool indices queried by ``party``, in order."""
        k = self._party(party)
        return [m.pool_index for m in self.messages if isinstance(m, ct.Query) and m.sender == k]

    def summary(self) -> dict[str, Any]:
        out = super().summary()
        out.update(rmse_before=self.rmse_before, rmse_after=self.rmse_after,
                   epsilon=self.epsilon)
        return out

    def to_arviz(self, rng_key: Array | None = None, num_samples: int = 1000):
        """An ``xarray.DataTree`` for ArviZ 1.x. Group ``posterior`` holds ``f`` (dims
        ``client, point``): ``num_samples`` draws (4 chains) of each party's posterior over the
        latent function at its test inputs (at the pool without test data), drawn from its
        predictive marginals, point by point (correlations between points are not kept); group
        ``predictions`` those marginals' ``mean`` and ``sd`` (no sample dimensions);
        ``constant_data`` each party's fitted hyperparameters, the pool points it queried, and
        ``y_test``. Needs ``pip install 'fedppl[arviz]'``."""
        import xarray as xr

        from fedppl import arviz

        num_samples = arviz.check_num_samples(num_samples)
        key = jax.random.key(0) if rng_key is None else rng_key
        K = len(self.parties)
        points = self.test[0] if self.test is not None else [p.pool for p in self.parties]
        mean, var = (np.stack(a) for a in zip(*(self.predict(k, points[k]) for k in range(K)),
                                               strict=True))
        sd = np.sqrt(var)
        f = mean + sd * np.asarray(jax.random.normal(key, (num_samples, *mean.shape)))
        params = [p.params for p in self.parties]
        coords = {"client": list(self.client_names)}
        constant = {"lengthscale": np.exp(np.stack([p.log_lengthscale for p in params])),
                    "variance": np.exp([float(p.log_variance) for p in params]),
                    "noise": np.exp([float(p.log_noise) for p in params]),
                    "queried": np.array([self.queried(k) for k in range(K)])}
        dims = {"f": ["client", "point"], "lengthscale": ["client", "feature"],
                "variance": ["client"], "noise": ["client"], "queried": ["client", "round"],
                "y_test": ["point"]}
        if self.test is not None:
            constant["y_test"] = np.asarray(self.test[1])
        attrs = {"combination": self.settings.combination,
                 "uncertainty": self.settings.uncertainty, "num_rounds": self.num_rounds}
        dt = arviz.from_dict({"posterior": {"f": arviz.as_chains(f)}, "constant_data": constant},
                             coords=coords, dims=dims, attrs={"posterior": attrs})
        dt["predictions"] = xr.Dataset({"mean": (("client", "point"), mean),
                                        "sd": (("client", "point"), sd)},
                                       coords=coords, attrs=attrs)
        return dt


class CoTraining(FederatedMethod):
    """Private GP co-training: parties with different views of one response exchange
    predictions on a shared unlabelled pool (see :mod:`fedppl.algorithms.cotraining`).

    :param combination: how a party folds in the answers: ``"blocky"``, ``"noisy"`` or
        ``"hybrid"`` (thesis Eqs. 4.6, 4.8, 4.10).
    :param uncertainty: what a responder reports besides its mean: ``"none"``, ``"marginal"``
        (its predictive variance) or ``"full"`` (the covariance with its earlier answers).
    :param dp: a :class:`~fedppl.algorithms.cotraining.DPSettings` to release every mean with
        differential privacy (the GP-prior-sample mechanism), or None.
    :param optimizer: the optax optimiser of each party's type-II ML fit (default
        ``optax.adam(0.05)``).
    :param fit_steps: its number of full-batch steps.

    One round is one query by every party, answered by all the others; the embedded runtime
    runs it as two exchanges of :func:`~fedppl.algorithms.cotraining.make_trio` (queries up and
    relayed; answers up and routed), and the history has one row per round.
    """

    name = "CoTraining"
    # the bar: the parties' mean test RMSE (given test data), the largest epsilon (with dp)
    progress: ClassVar[tuple[str, ...]] = ("rmse:mean", "epsilon:max")
    schedule = "loop"

    def __init__(self, combination: str = "noisy", uncertainty: str = "full",
                 dp: ct.DPSettings | None = None, *,
                 optimizer: optax.GradientTransformation | None = None, fit_steps: int = 300):
        self.settings = ct.check_settings(ct.Settings(combination, uncertainty, dp))
        self.optimizer = (DEFAULT_OPTIMIZER if optimizer is None
                          else validation.optimizer(optimizer))
        self.fit_steps = validation.positive_int(fit_steps, "fit_steps")
        self._trio = shared(ct.make_trio, self.settings)  # one per settings in a process

    # -- running -------------------------------------------------------------------------------

    def init(self, rng_key: Array, clients: Clients, *, pool: Sequence[Any],
             test: Sequence[Any] | None = None, y_test: Any = None,
             runtime: Any = None) -> RunState:
        """Check the parties' data, fit each party's GP on its private data, and start."""
        return super().init(rng_key, clients, pool=pool, test=test, y_test=y_test,
                            runtime=runtime)

    def run(self, rng_key: Array, clients: Clients, num_rounds: int, *,
            pool: Sequence[Any], test: Sequence[Any] | None = None, y_test: Any = None,
            progress_bar: bool = True, runtime: Any = None) -> CoTrainingResult:
        """``init``, then ``num_rounds`` rounds (each party queries once per round, so at most
        as many rounds as the pool has points)."""
        num_rounds = check_rounds(num_rounds)
        if isinstance(clients, Clients):
            n_pool = _check_parties(clients, pool, test, y_test)[1][0].shape[0]
            if num_rounds > n_pool:
                raise ValueError(f"{num_rounds} rounds need {num_rounds} distinct pool points "
                                 f"per party; the pool has {n_pool}")
        state = self.init(rng_key, clients, pool=pool, test=test, y_test=y_test,
                          runtime=runtime)
        return self._loop(state, num_rounds, progress_bar)

    def update(self, state: RunState) -> tuple[RunState, dict[str, Any]]:
        """One round: the ask exchange, then the answer exchange (one history row)."""
        if getattr(state, "plan", None) is None:
            raise RuntimeError("call CoTraining.init(rng_key, clients, pool=...) before update")
        n_pool = state.clients.pool.shape[1]
        if state.round >= n_pool:
            raise ValueError(f"every party has queried all {n_pool} pool points")
        asked, ask = super().update(state)
        done, info = super().update(asked._replace(round=state.round))
        for key in ("seconds", "messages_up", "messages_down", "bytes_up", "bytes_down",
                    "rejected"):
            info[key] = ask[key] + info[key]
        return done, info

    # -- the front's hooks ---------------------------------------------------------------------

    def _plan(self, rng_key: Array, clients: Clients, *, pool: Sequence[Any] = (),
              test: Sequence[Any] | None = None, y_test: Any = None,
              data_at_server: bool = True) -> Plan:
        rng_key = jax.random.split(rng_key)[0]  # the rounds' key (the second half is unused)
        data, pools, tests = _check_parties(clients, pool, test, y_test)
        K = clients.num_clients
        states = [ct.init_party(k, K, X, y, pools[k], self.optimizer, self.fit_steps)
                  for k, (X, y) in enumerate(data)]
        held = None if tests is None else (tuple(tests), np.asarray(y_test, dtype=float))
        static = _Static(tuple(data), held, _rmse(states, data, held, self.settings))
        stacked = jax.tree_util.tree_map(lambda *xs: np.stack(xs), *states)
        return Plan(self._trio, self.schedule, ct.Relay(), stacked, self._row, self._result,
                    log=(), rng_key=rng_key, static=static)

    def _round_inputs(self, state: RunState):
        """Keys ``fold_in(fold_in(k, round), party)`` (``round`` the rounds done): the documented
        stream of the DP noise; every party takes part in every exchange."""
        K = state.masks.shape[0]
        round_key = jax.random.fold_in(state.rng_key, state.round)
        keys = jax.vmap(lambda k: jax.random.fold_in(round_key, k))(jnp.arange(K))
        return state.rng_key, keys, jnp.ones(K, bool), round_key, round_key

    def _row(self, before: RunState, after: RunState, messages: Any, replies: Any,
             active: np.ndarray, rng_key: Array) -> tuple[tuple, dict[str, Any]]:
        """An exchange's history columns, and every message so far in protocol order (the
        run's accumulator: ``state.log.method``)."""
        K = len(active)
        sent = after.log.method
        if isinstance(messages, ct.Query):  # the ask exchange: K queries up, kept by the relay
            return sent, {"messages_up": K, "bytes_up": num_bytes(messages),
                          "messages_down": 0, "bytes_down": 0}
        queries = before.server.queries  # relayed: each party gets the K - 1 others'
        row = {"messages_up": K * (K - 1), "bytes_up": num_bytes(messages),
               "messages_down": 2 * K * (K - 1),
               "bytes_down": (K - 1) * num_bytes(queries) + num_bytes(replies)}
        static: _Static = self._started(after).static
        parties = ct.unstack(after.clients)
        if static.test is not None:
            row["rmse"] = np.array(_rmse(parties, static.data, static.test, self.settings))
        if self.settings.dp is not None:
            row["epsilon"] = np.array([ct.epsilon_spent(p, self.settings.dp.delta)
                                       for p in parties])
        return (*sent, *_protocol_order(queries, replies)), row

    def _result(self, state: RunState, history: dict[str, np.ndarray],
                rejected: list) -> CoTrainingResult:
        plan = self._started(state)
        static: _Static = plan.static
        return CoTrainingResult(history=history, client_names=plan.names, rejected=rejected,
                                settings=self.settings,
                                parties=tuple(ct.unstack(state.clients)), data=static.data,
                                messages=list(state.log.method), test=static.test,
                                rmse_before=static.rmse_before)


class _Static(NamedTuple):
    """CoTraining's part of a plan (``plan.static``): each party's private ``(X, y)``, the
    test views and common targets (None: no test data), and each party's test RMSE before
    co-training (None: no test data)."""

    data: tuple[tuple[np.ndarray, np.ndarray], ...]
    test: tuple[tuple[np.ndarray, ...], np.ndarray] | None
    rmse_before: list[float] | None


def _protocol_order(queries: ct.Query, replies: ct.Answers) -> list[ct.Query | ct.Response]:
    """A round's messages in protocol order (each query, then the answers to it), as plain
    Python values."""
    out: list[ct.Query | ct.Response] = []
    for q, reply in zip(ct.unstack(queries), ct.unstack(replies), strict=True):
        out.append(ct.Query(int(q.sender), int(q.pool_index)))
        out += [_plain_response(r) for r in reply.responses]
    return out


def _rmse(parties: Sequence[ct.PartyState], data: Sequence[tuple[np.ndarray, np.ndarray]],
          test: tuple[tuple[np.ndarray, ...], np.ndarray] | None, settings: ct.Settings
          ) -> list[float] | None:
    """Each party's test RMSE (None without test data)."""
    if test is None:
        return None
    tests, y_test = test
    out = []
    for k, (state, (X, y)) in enumerate(zip(parties, data, strict=True)):
        mean, _ = ct.predict(state, X, y, tests[k], settings)
        out.append(metrics.rmse(y_test, np.asarray(mean)))
    return out


def _plain_response(r: ct.Response) -> ct.Response:
    return ct.Response(int(r.sender), int(r.querier), int(r.pool_index), float(r.mean),
                       None if r.cov_row is None else np.asarray(r.cov_row),
                       None if r.prior_row is None else np.asarray(r.prior_row),
                       float(r.dp_noise_std))


# -- validation --------------------------------------------------------------------------------

def _matrix(a: Any, what: str, columns: int | None = None) -> np.ndarray:
    """A finite, real, non-empty 2-D float array, or an error naming ``what``."""
    arr = np.asarray(a)
    if arr.dtype.kind not in "iuf":
        raise TypeError(f"{what} must hold real numbers, got dtype {arr.dtype}")
    if arr.ndim != 2 or arr.shape[0] == 0:
        raise ValueError(f"{what} must be a non-empty (rows, columns) matrix, got shape "
                         f"{arr.shape}")
    if columns is not None and arr.shape[1] != columns:
        raise ValueError(f"{what} has {arr.shape[1]} columns but the party's X has {columns}")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{what} has NaN or infinite values")
    return arr.astype(float)


def _vector(a: Any, what: str) -> np.ndarray:
    arr = np.asarray(a)
    if arr.dtype.kind not in "iuf":
        raise TypeError(f"{what} must hold real numbers, got dtype {arr.dtype}")
    if arr.ndim != 1 or arr.shape[0] == 0:
        raise ValueError(f"{what} must be a non-empty vector, got shape {arr.shape}")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{what} has NaN or infinite values")
    return arr.astype(float)


def _per_party(arrays: Any, what: str, names: tuple[str, ...], columns: list[int]
               ) -> list[np.ndarray]:
    if isinstance(arrays, (np.ndarray, str)) or not isinstance(arrays, Sequence):
        raise TypeError(f"{what} must be a list with one array per party ({len(names)}), got "
                        f"{type(arrays).__name__}")
    if len(arrays) != len(names):
        raise ValueError(f"{what} has {len(arrays)} arrays for {len(names)} parties")
    return [_matrix(a, f"{names[k]}'s {what}", columns[k]) for k, a in enumerate(arrays)]


def _check_parties(clients: Clients, pool: Any, test: Any, y_test: Any
                   ) -> tuple[list[tuple[np.ndarray, np.ndarray]], list[np.ndarray],
                              list[np.ndarray] | None]:
    """Each party's ``(X, y)``, pool view and test view, or an error naming the party."""
    names = clients.names
    if clients.num_clients < 2:
        raise ValueError(f"co-training needs at least two parties, got {clients.num_clients}")
    data = []
    for k, arrays in enumerate(clients.data):
        if len(arrays) != 2:
            raise ValueError(f"each party holds (X, y); {names[k]} has {len(arrays)} arrays")
        data.append((_matrix(arrays[0], f"{names[k]}'s X"), _vector(arrays[1],
                                                                      f"{names[k]}'s y")))
    columns = [X.shape[1] for X, _ in data]
    pools = _per_party(pool, "pool", names, columns)
    for k, p in enumerate(pools):
        if p.shape[0] != pools[0].shape[0]:
            raise ValueError(f"{names[k]}'s pool has {p.shape[0]} points but {names[0]}'s has "
                             f"{pools[0].shape[0]}: the parties must index the same pool")
    if (test is None) != (y_test is None):
        raise ValueError("give both test (each party's test inputs) and y_test, or neither")
    if test is None:
        return data, pools, None
    tests = _per_party(test, "test inputs", names, columns)
    y_test = _vector(y_test, "y_test")
    for k, t in enumerate(tests):
        if t.shape[0] != y_test.shape[0]:
            raise ValueError(f"{names[k]} has {t.shape[0]} test inputs for {y_test.shape[0]} "
                             "test targets")
    return data, pools, tests

