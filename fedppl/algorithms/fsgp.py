"""Federated sparse GP regression (FSGP) as a trio: FedAvg of the Titsias bound, then the exact
aggregation of the inducing-point statistics.

The server's state has a ``phase``:

* :data:`TRAIN`: each client ``k`` takes optimiser steps
  (:func:`fedppl.optimise.minimise`) on its own per-point collapsed bound
  ``F_k / N_k`` (:func:`fedppl.models.sparse_gp.collapsed_bound` on its data only) over the
  shared parameters (SE-ARD kernel hyperparameters, noise and inducing inputs ``Z``) and sends
  them; the server averages the finite ones with weights ``N_k / N``
  (:func:`fedppl.algorithms.fedavg.server_update`);
* :data:`AGGREGATE` (the final round): each client sends, once, the statistics of its data at the
  trained parameters, ``A_k = C_{M N_k} C_{M N_k}^T``, ``b_k = C_{M N_k} y_k`` and ``N_k``
  (Eqs. 14-15), seen through ``L^-1`` (``L = chol(C_MM + jitter I)``, which every client
  computes from the shared parameters): :class:`fedppl.algorithms.exact.Stats` of the whitened
  features ``k(X_k, Z) L^-T`` (:func:`whitened_features`), i.e. ``L^-1 A_k L^-T`` and
  ``L^-1 b_k``. The server adds those that are finite, symmetric and PSD; their sum gives the
  DTC/SGPR predictive: the sparse GP posterior with the factor ``B = sum_k A_k / sigma^2``,
  ``b = sum_k b_k / sigma^2`` (:func:`predict`), the same posterior as from the plain sums.
  Whitening at the client is what keeps it computable: forming ``L^-1 (sum_k A_k) L^-T`` on the
  server loses positive definiteness when the noise is small against the kernel variance (as on
  naval-propulsion-plant, where FSGP learns a tiny noise variance and ``C_MM`` is badly
  conditioned: the plain sums gave a NaN prediction, the whitened ones a finite one; see the
  sgp_uci benchmark page in the docs). ``y_k^T y_k`` is not needed and not sent.

Private statistics (``privacy``, a :class:`fedppl.algorithms.dp_statistics.Mechanism`, in
:func:`make_trio`): in the aggregation round each client clips its whitened rows ``L^-1 k(Z, x_n)``
(whose squared norm is at most the kernel variance) and targets and adds Gaussian noise with its own
key, so the statistics leave it noised; the server then accepts every finite, symmetric message (a
noised ``A_k`` need not be PSD, nor ``N_k`` positive), projects the sum onto the PSD cone and
records in ``ServerState.repaired`` how many eigenvalues it raised
(:mod:`fedppl.algorithms.dp_statistics`). :func:`predict`'s ``stat_noise_var`` weighs the
projection's noise in q(u)'s likelihood and widens the variance by the scatter noise's effect on the
mean. The FedAvg rounds are not privatised.

Example (what :class:`fedppl.FSGP` runs: a FedAvg round, then the aggregation round)::

    >>> import jax, jax.numpy as jnp, optax
    >>> from fedppl.runtime import make_round
    >>> X = jnp.linspace(-2.0, 2.0, 12).reshape(2, 6, 1); y = jnp.sin(X[..., 0])
    >>> masks, everyone = jnp.ones((2, 6), bool), jnp.ones(2, bool)
    >>> keys = jax.random.split(jax.random.key(0), 2)
    >>> round_fn = make_round(make_trio(optax.adam(1e-2), steps=5), "synchronous")
    >>> state = init(init_params(X[0, :3]))
    >>> state = round_fn(state, (), (X, y), masks, keys, everyone, keys[0])[0]
    >>> state = state._replace(phase=jnp.asarray(AGGREGATE))
    >>> state = round_fn(state, (), (X, y), masks, keys, everyone, keys[0])[0]
    >>> float(state.stats.count), predict(state.params, state.stats, X[0])[0].shape
    (12.0, (6,))
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import jax.scipy.linalg as jsl
import optax
from jax import Array

from fedppl import trees
from fedppl.algorithms import dp_statistics, exact, fedavg
from fedppl.algorithms.trio import Trio
from fedppl.models import sparse_gp
from fedppl.models.kernels import SEParams
from fedppl.optimise import minimise

__all__ = ["FSGPParams", "ServerState", "Message", "TRAIN", "AGGREGATE", "DEFAULT_JITTER",
           "init_params", "kuu", "bound", "client_loss", "client_stats", "plausible", "init",
           "client_update", "server_update", "make_trio", "predict", "inducing_posterior",
           "private_client_stats", "whitened_features", "secure_summand", "secure_message"]

DEFAULT_JITTER = 1e-6  # absolute jitter on C_MM (FSGP's convention; the HVM's is relative)
TRAIN, AGGREGATE = 0, 1


class FSGPParams(NamedTuple):
    """Kernel hyperparameters (log space) and the inducing inputs ``(M, D)``."""

    hyper: SEParams
    inducing: Array


class ServerState(NamedTuple):
    """The shared parameters, the summed statistics (zero until the aggregation round), the
    phase (:data:`TRAIN` or :data:`AGGREGATE`) and the rounds done."""

    params: FSGPParams
    stats: exact.Stats
    phase: Array
    round: Array
    repaired: Array | None = None  # eigenvalues raised to make the noised sum PSD (private)


class Message(NamedTuple):
    """What a client sends: its trained parameters (TRAIN; zeros in the aggregation round) and
    its statistics (AGGREGATE; only the count ``N_k`` in training rounds, as FedAvg's weight)."""

    params: FSGPParams
    stats: exact.Stats


def init_params(inducing: Array, lengthscale: float = 1.0, variance: float = 1.0,
                noise: float = 0.1) -> FSGPParams:
    """Parameters at the paper's initial values (lengthscales 1, noise 0.1) and given ``Z``."""
    Z = jnp.asarray(inducing, dtype=float)
    if Z.ndim != 2:
        raise ValueError(f"inducing inputs must have shape (M, D), got {Z.shape}")
    if min(lengthscale, variance, noise) <= 0:
        raise ValueError("initial lengthscale, variance and noise must be positive, got "
                         f"{lengthscale}, {variance}, {noise}")
    return FSGPParams(SEParams.init(Z.shape[1], lengthscale, variance, noise, dtype=Z.dtype), Z)


def kuu(params: FSGPParams, jitter: float = DEFAULT_JITTER) -> Array:
    """``C_MM + jitter I``."""
    return sparse_gp.kzz(params.inducing, params.hyper, jitter, relative=False)


def bound(params: FSGPParams, X: Array, y: Array, mask: Array | None = None,
          jitter: float = DEFAULT_JITTER) -> Array:
    """The collapsed bound of one client's (padded, masked) data, in nats."""
    return sparse_gp.collapsed_bound(X, y, params.inducing, params.hyper, mask, jitter,
                                     relative=False)


def client_loss(params: FSGPParams, data: tuple[Array, Array], mask: Array,
                key: Array | None = None, jitter: float = DEFAULT_JITTER) -> Array:
    """The client's objective: ``-F_k / N_k`` (the per-point bound)."""
    X, y = data
    return -bound(params, X, y, mask, jitter) / jnp.sum(mask)


def whitened_features(params: FSGPParams, X: Array, mask: Array,
                      jitter: float = DEFAULT_JITTER) -> Array:
    """``k(X, Z) L^-T`` ``(N, M)``, ``L = chol(C_MM + jitter I)``; masked rows are zero."""
    L = jnp.linalg.cholesky(kuu(params, jitter))
    Kfu = jnp.where(mask[:, None], params.hyper.kernel(X, params.inducing), 0.0)
    return jsl.solve_triangular(L, Kfu.T, lower=True).T


def client_stats(params: FSGPParams, X: Array, y: Array, mask: Array | None = None,
                 jitter: float = DEFAULT_JITTER) -> exact.Stats:
    """What a client sends for prediction: ``L^-1 A_k L^-T``, ``L^-1 b_k`` and ``N_k``
    (``A_k = C_MNk C_MNk^T``, ``b_k = C_MNk y_k``; module doc)."""
    X, y, mask = sparse_gp.masked(X, y, mask)
    W = whitened_features(params, X, mask, jitter)
    return exact.client_stats(W, y, mask.astype(W.dtype))


def private_client_stats(params: FSGPParams, X: Array, y: Array, mask: Array | None,
                         privacy: dp_statistics.Mechanism, key: Array,
                         jitter: float = DEFAULT_JITTER) -> exact.Stats:
    """:func:`client_stats` released privately: the whitened rows and the targets clipped, noise
    added (:func:`fedppl.algorithms.dp_statistics.private_stats`)."""
    X, y, mask = sparse_gp.masked(X, y, mask)
    W = whitened_features(params, X, mask, jitter)
    return dp_statistics.private_stats(W, y, mask.astype(W.dtype), privacy, key)


def _symmetric_finite(stats: exact.Stats) -> Array:
    """What a server can check of a noised message: finite, ``A_k`` symmetric."""
    A = stats.scatter
    finite = jnp.all(jnp.isfinite(A)) & jnp.all(jnp.isfinite(stats.proj)) & jnp.isfinite(
        stats.count)
    A = jnp.where(finite, A, 0.0)
    return finite & jnp.all(jnp.abs(A - A.T) <= 1e-8 * (1.0 + jnp.max(jnp.abs(A))))


def plausible(stats: exact.Stats) -> Array:
    """Whether one client's statistics can be added: finite, a non-negative count, ``A_k``
    symmetric (to 1e-8) and positive semi-definite (smallest eigenvalue above ``-1e-8 M``
    times its scale)."""
    A, b = stats.scatter, stats.proj
    M = A.shape[0]
    finite = jnp.all(jnp.isfinite(A)) & jnp.all(jnp.isfinite(b)) & jnp.isfinite(stats.count)
    A = jnp.where(finite, A, 0.0)
    size = 1.0 + jnp.max(jnp.abs(A))
    symmetric = jnp.all(jnp.abs(A - A.T) <= 1e-8 * size + 1e-8 * jnp.abs(A.T))
    eig = jnp.linalg.eigvalsh(0.5 * (A + A.T))
    psd = eig[0] >= -1e-8 * jnp.maximum(1.0, jnp.max(jnp.abs(eig))) * M
    return finite & symmetric & psd & (stats.count >= 0)


def _no_stats(M: int, count: Array, dtype: Any) -> exact.Stats:
    return exact.Stats(jnp.zeros((M, M), dtype), jnp.zeros(M, dtype), count)


def init(params: FSGPParams) -> ServerState:
    """The server's state before the first FedAvg round."""
    M, dtype = params.inducing.shape[0], params.inducing.dtype
    return ServerState(params, _no_stats(M, jnp.asarray(0.0, dtype), dtype), jnp.asarray(TRAIN),
                       jnp.asarray(0), jnp.asarray(0, int))


def client_update(state: ServerState, data: tuple[Array, Array], mask: Array, key: Array,
                  optimizer: optax.GradientTransformation, steps: int,
                  jitter: float = DEFAULT_JITTER,
                  privacy: dp_statistics.Mechanism | None = None) -> Message:
    """Client ``k``'s work in the server's phase: ``steps`` optimiser steps from the server's
    parameters (TRAIN), or its statistics at them (AGGREGATE; noised with ``key`` when
    ``privacy`` is set)."""
    X, y = data
    params = state.params
    M, dtype = params.inducing.shape[0], params.inducing.dtype
    count = jnp.sum(mask).astype(dtype)

    def train(_: None) -> Message:
        new = minimise(lambda p, k: client_loss(p, data, mask, k, jitter), params, optimizer,
                       steps, key)[0]
        return Message(new, _no_stats(M, count, dtype))

    def statistics(_: None) -> Message:
        zero = jax.tree_util.tree_map(jnp.zeros_like, params)
        if privacy is None:
            return Message(zero, client_stats(params, X, y, mask, jitter))
        return Message(zero, private_client_stats(params, X, y, mask, privacy,
                                                  jax.random.fold_in(key, 1), jitter))

    return jax.lax.cond(state.phase == TRAIN, train, statistics, None)


def server_update(state: ServerState, msgs: Message, received: Array, private: bool = False
                  ) -> tuple[ServerState, Array]:
    """FedAvg of the received finite parameters (weights ``N_k``), or the sum of the received
    plausible statistics (:func:`plausible`); returns which clients were accepted. ``private``:
    the statistics are noised, so any finite, symmetric ones are added and the sum is projected
    onto the PSD cone (:func:`fedppl.algorithms.dp_statistics.repair_scatter`)."""

    def average(_: None) -> tuple[ServerState, Array]:
        fa, ok = fedavg.server_update(fedavg.FedAvgState(state.params, state.round),
                                      msgs.params, weights=msgs.stats.count, received=received)
        return state._replace(params=fa.params, round=fa.round,
                              repaired=jnp.asarray(0, int)), ok

    def add(_: None) -> tuple[ServerState, Array]:
        ok = received & jax.vmap(_symmetric_finite if private else plausible)(msgs.stats)

        def total(x: Array) -> Array:
            return jnp.sum(jnp.where(ok.reshape(ok.shape + (1,) * (x.ndim - 1)), x, 0.0), 0)

        stats = exact.Stats(*(total(x) for x in msgs.stats))
        repaired = jnp.asarray(0, int)
        if private:
            scatter, repaired = dp_statistics.repair_scatter(stats.scatter)
            stats, repaired = stats._replace(scatter=scatter), repaired.astype(int)
        return state._replace(stats=stats, round=state.round + 1, repaired=repaired), ok

    return jax.lax.cond(state.phase == TRAIN, average, add, None)


# -- secure aggregation: the server gets only the sum of the messages ------------------------


def secure_summand(state: ServerState, msg: Message) -> tuple[Message, Array]:
    """What a client adds into a secure sum (SecAgg+, :mod:`fedppl.runtime.secagg`) in place of
    ``msg``: its parameters times its count ``N_k`` and its statistics; and whether
    :func:`server_update` would accept ``msg`` (finite parameters; :func:`plausible` statistics
    in the aggregation round), checked by the client, as the server sees only the sum."""
    count = msg.stats.count
    finite = fedavg.all_finite(trees.broadcast(msg.params, 1))[0]  # FedAvg's check, one client
    ok = jnp.where(state.phase == TRAIN, finite, plausible(msg.stats))
    weighted = jax.tree_util.tree_map(lambda p: p * count, msg.params)
    return Message(weighted, msg.stats), ok


def secure_message(state: ServerState, total: Message, n: int) -> Message:
    """One of ``n`` equal messages that :func:`server_update` folds as it folds the ``n``
    messages whose summands (:func:`secure_summand`) add to ``total``: the count-weighted mean
    of the parameters (FedAvg's), ``1/n`` of the statistics (the sum)."""
    count = total.stats.count
    mean = jax.tree_util.tree_map(lambda p: p / jnp.where(count > 0, count, 1.0), total.params)
    return Message(mean, jax.tree_util.tree_map(lambda s: s / n, total.stats))


def make_trio(optimizer: optax.GradientTransformation, steps: int,
              jitter: float = DEFAULT_JITTER,
              privacy: dp_statistics.Mechanism | None = None) -> Trio:
    """FSGP's trio for :func:`fedppl.runtime.make_round` (clients keep no state; replies:
    accepted flags); ``privacy``: noise the aggregation round's statistics."""

    def client(server: ServerState, cstate: Any, data: tuple, mask: Array, key: Array,
               index: Array) -> tuple[Message, Any]:
        return client_update(server, data, mask, key, optimizer, steps, jitter,
                             privacy), cstate

    def server(state: ServerState, msgs: Message, index: Array, received: Array, key: Array,
               evaluate: Any) -> tuple[ServerState, Array]:
        return server_update(state, msgs, received, privacy is not None)

    return Trio(client, server)


# -- prediction from the summed statistics -------------------------------------------------------


def _posterior(params: FSGPParams, stats: exact.Stats, jitter: float,
               stat_noise_var: Array | float | None = None) -> sparse_gp.Whitened:
    """q(u): the prior times the factor of all clients' data, from the whitened sums (with
    ``stat_noise_var``, the noise in the projection weighed in the factor:
    :func:`fedppl.algorithms.dp_statistics.noise_aware_factor`)."""
    s2 = params.hyper.noise_var
    L = jnp.linalg.cholesky(kuu(params, jitter))
    if stat_noise_var is None:
        return sparse_gp.posterior(L, stats.scatter / s2, stats.proj / s2)
    nat1, prec = dp_statistics.noise_aware_factor(stats.scatter, stats.proj, s2, stat_noise_var)
    return sparse_gp.posterior(L, prec, nat1)


def predict(params: FSGPParams, stats: exact.Stats, X: Array, jitter: float = DEFAULT_JITTER,
            stat_noise_var: Array | float | None = None, noise_aware: bool = True
            ) -> tuple[Array, Array]:
    """DTC/SGPR predictive mean and variance of ``y`` (noise included) from summed statistics.

    ``stat_noise_var``: the variance of the privacy noise on each entry of the summed (whitened)
    statistics. q(u) then weighs the projection's noise in its likelihood
    (:func:`fedppl.algorithms.dp_statistics.noise_aware_factor`), and with ``noise_aware`` the
    variance adds the first-order effect of the scatter's noise on the mean ``w*^T v``, with
    ``w* = L^-1 k(Z, x*)`` and ``A = I + S / s^2`` in whitened coordinates
    (:func:`fedppl.algorithms.dp_statistics.mean_noise_variance`)."""
    hyper = params.hyper
    post = _posterior(params, stats, jitter, stat_noise_var)
    Kxz = hyper.kernel(X, params.inducing)
    mean, var = sparse_gp.predict_f(post, Kxz, jnp.full(X.shape[0], hyper.variance))
    if stat_noise_var is not None and noise_aware:
        v = jsl.cho_solve((post.C, True), post.c)  # A = C C^T
        features = jsl.solve_triangular(post.L, Kxz.T, lower=True).T
        M = stats.proj.shape[-1]
        plug = jnp.linalg.cholesky(jnp.eye(M, dtype=v.dtype) + stats.scatter / hyper.noise_var)
        var = var + dp_statistics.mean_noise_variance(plug, v, features, stat_noise_var,
                                                      hyper.noise_var, projection=False)
    return mean, var + hyper.noise_var


def inducing_posterior(params: FSGPParams, stats: exact.Stats, jitter: float = DEFAULT_JITTER,
                       stat_noise_var: Array | float | None = None) -> tuple[Array, Array]:
    """Mean and covariance of the inducing outputs ``u = f(Z)`` (Titsias' optimal q(u); with
    ``stat_noise_var``, from noised statistics as in :func:`predict`)."""
    return sparse_gp.moments(_posterior(params, stats, jitter, stat_noise_var))
