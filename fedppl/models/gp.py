"""Exact GP regression with an SE-ARD kernel: type-II maximum likelihood and prediction.

Observations may carry extra, known covariance on top of the i.i.d. noise (heteroscedastic or
correlated pseudo-observations, as in co-training): ``y ~ N(0, K + noise^2 I + extra)``.

Example::

    >>> params = fit(X, y)                                   # type-II ML with optax
    >>> mean, var = predict(params, X, y, X_test)            # latent f at X_test
    >>> mean, cov = predict(params, X, y, X_test, full_cov=True)
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import jax.scipy.linalg as jsl
import optax
from jax import Array

from fedppl.models.kernels import se

__all__ = ["GPParams", "init_params", "kernel", "neg_log_marginal", "fit", "predict"]


class GPParams(NamedTuple):
    """Log lengthscales (one per input), log kernel variance, log noise standard deviation."""

    log_lengthscale: Array
    log_variance: Array
    log_noise: Array

    @property
    def noise_var(self) -> Array:
        return jnp.exp(2 * self.log_noise)


def init_params(input_dim: int, lengthscale: float = 1.0, variance: float = 1.0,
                noise: float = 0.3) -> GPParams:
    return GPParams(jnp.full(input_dim, jnp.log(lengthscale)), jnp.log(jnp.asarray(variance)),
                    jnp.log(jnp.asarray(noise)))


def kernel(params: GPParams, X1: Array, X2: Array) -> Array:
    """The latent covariance ``k(X1, X2)``."""
    return se(X1, X2, jnp.exp(params.log_lengthscale), jnp.exp(params.log_variance))


def _obs_cov(params: GPParams, X: Array, extra: Array | None) -> Array:
    C = kernel(params, X, X) + params.noise_var * jnp.eye(X.shape[0])
    return C if extra is None else C + extra


def neg_log_marginal(params: GPParams, X: Array, y: Array, extra: Array | None = None) -> Array:
    """``-log N(y | 0, K + noise^2 I + extra)``."""
    chol = jnp.linalg.cholesky(_obs_cov(params, X, extra))
    alpha = jsl.solve_triangular(chol, y, lower=True)
    return (0.5 * alpha @ alpha + jnp.sum(jnp.log(jnp.diagonal(chol)))
            + 0.5 * y.shape[0] * jnp.log(2 * jnp.pi))


def fit(X: Array, y: Array, extra: Array | None = None, init: GPParams | None = None,
        steps: int = 300, learning_rate: float = 0.05) -> GPParams:
    """Type-II maximum likelihood of the hyperparameters by Adam (``steps`` full-batch steps)."""
    X, y = jnp.asarray(X), jnp.asarray(y)
    params = init if init is not None else init_params(X.shape[1])
    return _fit(params, X, y, extra, steps, learning_rate)


@jax.jit(static_argnames=("steps", "learning_rate"))
def _fit(params, X, y, extra, steps, learning_rate):
    opt = optax.adam(learning_rate)

    def step(carry, _):
        p, state = carry
        grads = jax.grad(neg_log_marginal)(p, X, y, extra)
        updates, state = opt.update(grads, state, p)
        return (optax.apply_updates(p, updates), state), None

    (params, _), _ = jax.lax.scan(step, (params, opt.init(params)), None, length=steps)
    return params


def predict(params: GPParams, X: Array, y: Array, X_test: Array, extra: Array | None = None,
            full_cov: bool = False) -> tuple[Array, Array]:
    """Posterior mean and variance (or covariance) of the latent ``f`` at ``X_test``."""
    chol = jnp.linalg.cholesky(_obs_cov(params, X, extra))
    Ks = kernel(params, X, X_test)
    mean = Ks.T @ jsl.cho_solve((chol, True), y)
    half = jsl.solve_triangular(chol, Ks, lower=True)
    if full_cov:
        return mean, kernel(params, X_test, X_test) - half.T @ half
    return mean, jnp.exp(params.log_variance) - jnp.sum(half**2, axis=0)
