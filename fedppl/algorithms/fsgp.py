"""Federated sparse GP regression (FSGP): FedAvg of the Titsias collapsed bound, pure functions.

Each client ``k`` maximises its own collapsed bound ``F_k / N_k`` (Titsias 2009, evaluated on its
data only) over the shared parameters: SE-ARD kernel hyperparameters, noise and inducing inputs
``Z``. The server averages the local results with weights ``N_k / N`` (:mod:`.fedavg`); a client
whose parameters are not finite is rejected and named (:func:`rejected_names`).

Prediction needs only, from each client, the inducing-point statistics of its data

    A_k = C_{M N_k} C_{M N_k}^T   (M, M),     b_k = C_{M N_k} y_k   (M,),     N_k,

with ``C_{M N_k} = k(Z, X_k)``: exactly :class:`fedppl.algorithms.exact.Stats` of the features
``Phi_k = k(X_k, Z)``. The server adds them and forms the DTC/SGPR predictive (Eqs. 14-15)

    Sigma = C_MM + sum_k A_k / sigma^2,
    mean  = c_*M Sigma^-1 sum_k b_k / sigma^2,
    var   = c_** + sigma^2 - c_*M (C_MM^-1 - Sigma^-1) c_M*.

``y_k^T y_k`` is not needed for prediction and is not sent.

Example::

    >>> params = init_params(Z, input_dim=X.shape[1])
    >>> round_fn = make_round(optax.adam(1e-2), steps=50)         # jitted, vmapped over clients
    >>> state = fedavg.init(params)
    >>> state, accepted, bounds = round_fn(state, (X_pad, y_pad), masks, key)
    >>> msgs = [client_stats(state.params, X_k, y_k) for X_k, y_k in parts]   # on the clients
    >>> mean, var = predict(state.params, aggregate(msgs, names), X_test)      # on the server
"""

from __future__ import annotations

import warnings
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import jax.scipy.linalg as jsl
import numpy as np
import optax
from jax import Array

from fedppl.algorithms import exact, fedavg
from fedppl.models.kernels import se

__all__ = ["FSGPParams", "init_params", "kuu", "collapsed_bound", "client_loss", "make_round",
           "rejected_names", "client_stats", "validate", "aggregate", "predict"]

DEFAULT_JITTER = 1e-6


class FSGPParams(NamedTuple):
    """Log lengthscales ``(D,)``, log kernel variance, log noise std, inducing inputs ``(M, D)``."""

    log_lengthscale: Array
    log_variance: Array
    log_noise: Array
    inducing: Array

    @property
    def lengthscale(self) -> Array:
        return jnp.exp(self.log_lengthscale)

    @property
    def variance(self) -> Array:
        return jnp.exp(self.log_variance)

    @property
    def noise_var(self) -> Array:
        return jnp.exp(2.0 * self.log_noise)


def init_params(inducing: Array, lengthscale: float = 1.0, variance: float = 1.0,
                noise: float = 0.1) -> FSGPParams:
    """Parameters at the paper's initial values (lengthscales 1, noise 0.1) and given ``Z``."""
    Z = jnp.asarray(inducing, dtype=float)
    if Z.ndim != 2:
        raise ValueError(f"inducing inputs must have shape (M, D), got {Z.shape}")
    if min(lengthscale, variance, noise) <= 0:
        raise ValueError("initial lengthscale, variance and noise must be positive, got "
                         f"{lengthscale}, {variance}, {noise}")
    def log(v):  # strongly typed, so that jitted rounds do not recompile after round one
        return jnp.log(jnp.asarray(v, dtype=Z.dtype))

    return FSGPParams(jnp.full(Z.shape[1], log(lengthscale), dtype=Z.dtype), log(variance),
                      log(noise), Z)


def _kernel(params: FSGPParams, X1: Array, X2: Array) -> Array:
    return se(X1, X2, params.lengthscale, params.variance)


def kuu(params: FSGPParams, jitter: float = DEFAULT_JITTER) -> Array:
    """``C_MM + jitter I`` (the jitter keeps the Cholesky factor well defined)."""
    Z = params.inducing
    return _kernel(params, Z, Z) + jitter * jnp.eye(Z.shape[0])


def _masked(X: Array, y: Array, mask: Array | None) -> tuple[Array, Array, Array]:
    """Zero the padded rows (with ``where``, so NaN padding cannot leak into values or grads)."""
    if mask is None:
        return X, y, jnp.ones(X.shape[0], dtype=bool)
    mask = jnp.asarray(mask, dtype=bool)
    return jnp.where(mask[:, None], X, 0.0), jnp.where(mask, y, 0.0), mask


def collapsed_bound(params: FSGPParams, X: Array, y: Array, mask: Array | None = None,
                    jitter: float = DEFAULT_JITTER) -> Array:
    """Titsias' collapsed bound ``log N(y | 0, Q + s2 I) - tr(C_NN - Q) / (2 s2)`` in nats.

    ``Q = C_NM C_MM^-1 C_MN``; rows with ``mask == False`` are ignored (N counts real rows).
    Computed through Cholesky factors of ``C_MM`` and ``I + L^-1 C_MN C_NM L^-T / s2``.
    """
    X, y, mask = _masked(X, y, mask)
    s2 = params.noise_var
    n = jnp.sum(mask)
    L = jnp.linalg.cholesky(kuu(params, jitter))
    Kuf = jnp.where(mask[None, :], _kernel(params, params.inducing, X), 0.0)
    A = jsl.solve_triangular(L, Kuf, lower=True) / jnp.sqrt(s2)  # (M, N)
    AAT = A @ A.T
    LB = jnp.linalg.cholesky(jnp.eye(AAT.shape[0]) + AAT)
    c = jsl.solve_triangular(LB, A @ y, lower=True) / jnp.sqrt(s2)
    trace_knn = n * params.variance  # SE kernel: diagonal is the variance
    return (-0.5 * n * jnp.log(2.0 * jnp.pi * s2) - jnp.sum(jnp.log(jnp.diagonal(LB)))
            - 0.5 * (y @ y) / s2 + 0.5 * (c @ c)
            - 0.5 * trace_knn / s2 + 0.5 * jnp.trace(AAT))


def client_loss(params: FSGPParams, data: tuple[Array, Array], mask: Array,
                key: Array | None = None, jitter: float = DEFAULT_JITTER) -> Array:
    """The client's objective for :func:`fedavg.local_train`: ``-F_k / N_k`` (per-point bound)."""
    X, y = data
    return -collapsed_bound(params, X, y, mask, jitter) / jnp.sum(mask)


def make_round(optimizer: optax.GradientTransformation, steps: int,
               jitter: float = DEFAULT_JITTER) -> Callable:
    """A jitted synchronous FedAvg round over padded clients ``(K, N_max, ...)``.

    ``round_fn(state, (X, y), masks, key) -> (state, accepted (K,), bounds (K,))``: every client
    trains ``steps`` local steps from ``state.params``; the server averages the finite results
    with weights ``N_k``; ``bounds`` are the clients' collapsed bounds at the new averaged params.
    """

    def loss(p, data, mask, key):
        return client_loss(p, data, mask, key, jitter)

    def train(p, data, mask, key):
        return fedavg.local_train(p, loss, data, mask, optimizer, steps, key)[0]

    @jax.jit
    def round_fn(state: fedavg.FedAvgState, data: tuple[Array, Array], masks: Array, key: Array):
        keys = jax.random.split(key, masks.shape[0])
        local = jax.vmap(train, in_axes=(None, 0, 0, 0))(state.params, data, masks, keys)
        state, accepted = fedavg.server_update(state, local, weights=jnp.sum(masks, axis=1))
        bounds = jax.vmap(collapsed_bound, in_axes=(None, 0, 0, 0, None))(
            state.params, data[0], data[1], masks, jitter)
        return state, accepted, bounds

    return round_fn


def rejected_names(accepted: Array, names: Sequence[str], warn: bool = True) -> list[str]:
    """Names of the clients the server rejected (non-finite parameters); warns if any."""
    bad = [names[k] for k, ok in enumerate(np.asarray(accepted)) if not ok]
    if bad and warn:
        warnings.warn(f"FSGP server rejected non-finite parameters from {', '.join(bad)}; "
                      "they were not averaged", RuntimeWarning, stacklevel=2)
    return bad


# -- prediction from sufficient statistics -------------------------------------------------------

def client_stats(params: FSGPParams, X: Array, y: Array, mask: Array | None = None) -> exact.Stats:
    """What a client sends for prediction: ``A_k = C_MNk C_MNk^T``, ``b_k = C_MNk y_k``, ``N_k``."""
    X, y, mask = _masked(X, y, mask)
    Kfu = jnp.where(mask[:, None], _kernel(params, X, params.inducing), 0.0)  # Phi_k (N_k, M)
    return exact.client_stats(Kfu, y, mask.astype(Kfu.dtype))


def validate(stats: exact.Stats, num_inducing: int, who: str = "client") -> None:
    """Shapes, finiteness, count and symmetry (as :func:`exact.validate`), and ``A_k`` PSD."""
    exact.validate(stats, num_inducing, who)
    A = np.asarray(stats.scatter, dtype=np.float64)
    eig = np.linalg.eigvalsh(0.5 * (A + A.T))
    scale = max(1.0, float(np.abs(eig).max()))
    if eig.min() < -1e-8 * scale * num_inducing:
        raise ValueError(f"{who} sent A_k = C_MN C_MN^T that is not positive semi-definite "
                         f"(smallest eigenvalue {eig.min():.3g})")


def aggregate(messages: Sequence[exact.Stats], names: Sequence[str] | None = None) -> exact.Stats:
    """Validate every client's statistics (naming the one at fault) and add them up."""
    if len(messages) == 0:
        raise ValueError("no client statistics to aggregate")
    names = list(names) if names is not None else [f"client {k}" for k in range(len(messages))]
    if len(names) != len(messages):
        raise ValueError(f"{len(messages)} messages but {len(names)} names")
    num_inducing = int(np.shape(messages[0].proj)[0])
    for m, who in zip(messages, names):
        validate(m, num_inducing, who)
    return exact.aggregate(messages, names)


def predict(params: FSGPParams, stats: exact.Stats, X: Array, jitter: float = DEFAULT_JITTER
            ) -> tuple[Array, Array]:
    """DTC/SGPR predictive mean and variance of ``y`` (noise included) from summed statistics."""
    s2 = params.noise_var
    M = params.inducing.shape[0]
    L = jnp.linalg.cholesky(kuu(params, jitter))
    Li_A = jsl.solve_triangular(L, stats.scatter, lower=True)
    B = jnp.eye(M) + jsl.solve_triangular(L, Li_A.T, lower=True) / s2  # L^-1 A L^-T / s2 + I
    LB = jnp.linalg.cholesky(0.5 * (B + B.T))
    c = jsl.solve_triangular(LB, jsl.solve_triangular(L, stats.proj, lower=True), lower=True) / s2
    v = jsl.solve_triangular(L, _kernel(params, params.inducing, X), lower=True)  # (M, n)
    w = jsl.solve_triangular(LB, v, lower=True)
    mean = w.T @ c
    var = params.variance + s2 - jnp.sum(v**2, axis=0) + jnp.sum(w**2, axis=0)
    return mean, var
