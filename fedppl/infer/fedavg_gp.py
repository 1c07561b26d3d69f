"""``fit_fsgp``: federated sparse GP regression by FedAvg of the Titsias bound (FSGP baseline).

Training follows the FSGP paper: each round every client takes ``local_steps`` Adam steps on its
own per-point collapsed bound from the server's parameters, and the server averages them with
weights ``N_k / N`` (synchronous: all clients take part every round, where the paper samples
``max(K rho, 1)`` of them). Afterwards each client sends ``A_k = C_MNk C_MNk^T``,
``b_k = C_MNk y_k`` and ``N_k`` once, and the server predicts from the sums (Eqs. 14-15 of the
paper), see :mod:`fedppl.algorithms.fsgp`.

Inputs and targets are expected standardised (``fedppl.datasets.Standardiser``).

Example::

    >>> res = fit_fsgp(clients, num_rounds=20, config=FSGPConfig(local_steps=50))
    >>> mean, var = res.predict(X_test)                     # of y, in standardised units
    >>> res.log_likelihood(X_test, y_test_orig, scaler.y_mean, scaler.y_std)
    >>> res.history["bound"]                                # sum of client bounds per round
"""

from __future__ import annotations

import time
from functools import lru_cache
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import Array

from fedppl import metrics
from fedppl.algorithms import exact, fedavg
from fedppl.algorithms import fsgp as alg
from fedppl.clients import Clients

__all__ = ["FSGPConfig", "FSGPResult", "fit_fsgp", "INIT_INDUCING"]

INIT_INDUCING = ("client-data", "random-normal")


class FSGPConfig(NamedTuple):
    """Settings of :func:`fit_fsgp`.

    ``init_inducing``:

    * ``"client-data"`` (default, the paper's choice): ``Z`` is a uniformly random subset of the
      pooled training inputs. Privacy caveat: those M input rows are revealed to the server (and
      to every client through the shared ``Z``); use only where that is acceptable.
    * ``"random-normal"``: ``Z ~ N(0, I)`` draws, reasonable for standardised inputs; no data
      leave the clients before training.
    """

    num_inducing: int = 100
    learning_rate: float = 1e-2
    local_steps: int = 200
    init_lengthscale: float = 1.0
    init_variance: float = 1.0
    init_noise: float = 0.1
    init_inducing: str = "client-data"
    jitter: float = alg.DEFAULT_JITTER


@dataclass
class FSGPResult:
    """Trained parameters, the aggregated prediction statistics and the training history.

    ``history`` has lists ``"round"``, ``"bound"`` (sum over clients of the collapsed bounds, in
    nats, at the averaged parameters after that round; round 0 is the initial point), ``"seconds"``
    (wall time of the round, the first includes compilation) and ``"rejected"`` (client names).
    """

    params: alg.FSGPParams
    stats: exact.Stats
    history: dict[str, list] = field(default_factory=dict)
    jitter: float = alg.DEFAULT_JITTER

    def predict(self, X: Array) -> tuple[Array, Array]:
        """Predictive mean and variance of ``y`` (observation noise included) at ``X (n, D)``."""
        X = jnp.asarray(X, dtype=float)
        D = self.params.inducing.shape[1]
        if X.ndim != 2 or X.shape[1] != D:
            raise ValueError(f"X must have shape (n, {D}), got {X.shape}")
        return _predict(self.params, self.stats, X, self.jitter)

    def _original(self, X, y_mean, y_std):
        mean, var = self.predict(X)
        return metrics.unstandardise(mean, var, y_mean, y_std)

    def log_likelihood(self, X: Array, y: Array, y_mean: float = 0.0, y_std: float = 1.0
                       ) -> float:
        """Average test log-likelihood of ``y`` (original units; ``X`` as trained on)."""
        mean, var = self._original(X, y_mean, y_std)
        return metrics.gaussian_log_likelihood(y, mean, var)

    def rmse(self, X: Array, y: Array, y_mean: float = 0.0, y_std: float = 1.0) -> float:
        """Test RMSE of the predictive mean against ``y`` in original units."""
        mean, _ = self._original(X, y_mean, y_std)
        return metrics.rmse(y, mean)


@jax.jit(static_argnames=("jitter",))
def _predict(params, stats, X, jitter):
    return alg.predict(params, stats, X, jitter)


@lru_cache(maxsize=8)
def _round_fn(learning_rate: float, steps: int, jitter: float) -> Callable:
    """One compiled round per setting (repeated fits of the same shapes do not recompile)."""
    return alg.make_round(optax.adam(learning_rate), steps, jitter)


def _check_config(config: FSGPConfig, num_rounds: int) -> None:
    if num_rounds < 0:
        raise ValueError(f"num_rounds must be >= 0, got {num_rounds}")
    if config.num_inducing < 1 or config.local_steps < 1:
        raise ValueError(f"num_inducing and local_steps must be >= 1, got "
                         f"{config.num_inducing}, {config.local_steps}")
    if min(config.learning_rate, config.init_lengthscale, config.init_variance,
           config.init_noise) <= 0 or config.jitter < 0:
        raise ValueError(f"learning rate and initial values must be positive: {config}")
    if config.init_inducing not in INIT_INDUCING:
        raise ValueError(f"init_inducing must be one of {INIT_INDUCING}, "
                         f"got {config.init_inducing!r}")


def _check_clients(clients: Clients, num_inducing: int) -> int:
    first = clients.client(0)
    if len(first) != 2 or np.ndim(first[0]) != 2 or np.ndim(first[1]) != 1:
        raise ValueError("FSGP needs clients holding (X (N_k, D), y (N_k,)); got arrays of shapes "
                         f"{[np.shape(a) for a in first]}")
    total = int(clients.sizes.sum())
    if num_inducing > total:
        raise ValueError(f"num_inducing = {num_inducing} exceeds the total number of training "
                         f"points N = {total}; use M <= N (a sparse GP needs M < N)")
    return np.shape(first[0])[1]


def _init_inducing(clients: Clients, config: FSGPConfig, dim: int, key: Array) -> Array:
    M = config.num_inducing
    if config.init_inducing == "random-normal":
        return jax.random.normal(key, (M, dim))
    pooled = np.concatenate([np.asarray(clients.client(k)[0], dtype=np.float64)
                             for k in range(clients.num_clients)])
    rows = jax.random.choice(key, pooled.shape[0], (M,), replace=False)
    return jnp.asarray(pooled[np.asarray(rows)])


_stats_all = jax.jit(jax.vmap(alg.client_stats, in_axes=(None, 0, 0, 0)))
_bounds_all = jax.jit(jax.vmap(alg.collapsed_bound, in_axes=(None, 0, 0, 0, None)))


def _final_stats(params: alg.FSGPParams, clients: Clients) -> exact.Stats:
    (X, y), masks = clients.stacked, clients.mask
    stacked = _stats_all(params, X, y, masks)
    msgs = [exact.Stats(*(leaf[k] for leaf in stacked)) for k in range(clients.num_clients)]
    return alg.aggregate(msgs, clients.names)


def fit_fsgp(clients: Clients, num_rounds: int, config: FSGPConfig = FSGPConfig(),
             key: Array | None = None, callback: Callable[[int, dict], None] | None = None
             ) -> FSGPResult:
    """Train an FSGP for ``num_rounds`` synchronous FedAvg rounds and aggregate the statistics.

    ``callback(round, info)`` is called after each round with ``info`` holding ``"bound"``,
    ``"seconds"`` and ``"rejected"``. Raises ``ValueError`` for bad settings, for
    ``num_inducing`` above the total data size, and (naming the client) for bad statistics.
    """
    _check_config(config, num_rounds)
    dim = _check_clients(clients, config.num_inducing)
    key = jax.random.key(0) if key is None else key
    k_init, k_run = jax.random.split(key)
    params = alg.init_params(_init_inducing(clients, config, dim, k_init), config.init_lengthscale,
                             config.init_variance, config.init_noise)
    (X, y), masks = clients.stacked, clients.mask
    data = (X.astype(float), y.astype(float))
    round_fn = _round_fn(float(config.learning_rate), int(config.local_steps), float(config.jitter))
    bound0 = _bounds_all(params, data[0], data[1], masks, config.jitter)
    history: dict[str, list] = {"round": [0], "bound": [float(jnp.sum(bound0))],
                                "seconds": [0.0], "rejected": [[]]}
    state = fedavg.init(params)
    for r in range(1, num_rounds + 1):
        k_run, k_round = jax.random.split(k_run)
        start = time.perf_counter()
        state, accepted, bounds = round_fn(state, data, masks, k_round)
        bound = float(jnp.sum(jax.block_until_ready(bounds)))
        seconds = time.perf_counter() - start
        rejected = alg.rejected_names(accepted, clients.names)
        for name, value in zip(("round", "bound", "seconds", "rejected"),
                               (r, bound, seconds, rejected)):
            history[name].append(value)
        if callback is not None:
            callback(r, {"round": r, "bound": bound, "seconds": seconds, "rejected": rejected})
    return FSGPResult(state.params, _final_stats(state.params, clients), history, config.jitter)
