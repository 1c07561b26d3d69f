"""FedBNR (federated Bayesian neural regression) as pure functions.

Phase 1 learns the kernel (URK weights, noise ``sigma`` and prior scale ``lambda``) by maximising
each client's log marginal likelihood (Eq. 18), aggregated by FedAvg
(:mod:`fedppl.algorithms.fedavg`) or by knowledge distillation on a small server dataset (Eq. 19).
Phase 2 computes the last layer exactly from sufficient statistics
(:mod:`fedppl.algorithms.exact`).

Example::

    >>> loss = partial(neg_log_ml, omega=omega)              # per-datum, for local_train
    >>> params = kd_server_update(avg, client_params, omega, X_kd, y_kd, alpha=5.0,
    ...                           optimizer=optax.adam(1e-2), steps=50)
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import Array

from fedppl.algorithms import exact
from fedppl.models.random_features import URKParams, urk_features

__all__ = ["BNRParams", "init_params", "neg_log_ml", "client_message", "kd_loss",
           "kd_server_update"]


class BNRParams(NamedTuple):
    """Phase-1 parameters: the kernel network and the log noise / log prior scale."""

    kernel: URKParams
    log_noise: Array
    log_prior_scale: Array

    @property
    def noise(self) -> Array:
        return jnp.exp(self.log_noise)

    @property
    def prior_scale(self) -> Array:
        return jnp.exp(self.log_prior_scale)


def init_params(kernel: URKParams, noise: float = 0.3, prior_scale: float = 1.0) -> BNRParams:
    return BNRParams(kernel, jnp.log(jnp.asarray(noise)), jnp.log(jnp.asarray(prior_scale)))


def neg_log_ml(params: BNRParams, data: tuple, mask: Array, key: Array | None = None, *,
               omega: Array) -> Array:
    """Minus the client's log marginal likelihood (Eq. 18) per data point; ``data = (X, y)``."""
    X, y = data
    stats = exact.client_stats(urk_features(params.kernel, omega, X), y, mask)
    yy = jnp.sum(mask * y**2)
    lml = exact.log_marginal_likelihood(stats, yy, params.noise, params.prior_scale)
    return -lml / jnp.maximum(stats.count, 1.0)


def client_message(kernel: URKParams, omega: Array, X: Array, y: Array, mask: Array
                   ) -> exact.Stats:
    """Phase 2 on a client: the statistics of its data under the global kernel."""
    return exact.client_stats(urk_features(kernel, omega, X), y, mask)


def kd_loss(params: BNRParams, client_kernels: URKParams, omega: Array, X_kd: Array, y_kd: Array,
            alpha: float) -> Array:
    """Eq. 19 as a loss to minimise: the server data's per-datum negative log marginal
    likelihood plus ``alpha`` times the mean squared difference between the global URK Gram
    matrix on ``X_kd`` and the average of the clients' Gram matrices."""
    ones = jnp.ones(X_kd.shape[0])
    fit = neg_log_ml(params, (X_kd, y_kd), ones, omega=omega)
    Phi = urk_features(params.kernel, omega, X_kd)

    def gram(kernel):
        P = urk_features(kernel, omega, X_kd)
        return P @ P.T

    target = jnp.mean(jax.vmap(gram)(client_kernels), axis=0)
    return fit + alpha * jnp.mean((Phi @ Phi.T - target) ** 2)


def kd_server_update(start: BNRParams, client_params: BNRParams, omega: Array, X_kd: Array,
                     y_kd: Array, alpha: float, optimizer: optax.GradientTransformation,
                     steps: int) -> BNRParams:
    """Distil the clients' kernels into the global one, starting from ``start`` (the average)."""
    target = jax.lax.stop_gradient(client_params.kernel)

    def step(carry, _):
        p, opt_state = carry
        grads = jax.grad(kd_loss)(p, target, omega, X_kd, y_kd, alpha)
        updates, opt_state = optimizer.update(grads, opt_state, p)
        return (optax.apply_updates(p, updates), opt_state), None

    (params, _), _ = jax.lax.scan(step, (start, optimizer.init(start)), None, length=steps)
    return params
