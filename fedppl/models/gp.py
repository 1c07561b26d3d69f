"""Exact GP regression with an SE-ARD kernel: type-II maximum likelihood and prediction.

Observations may carry extra, known covariance on top of the i.i.d. noise (heteroscedastic or
correlated pseudo-observations, as in co-training): ``y ~ N(0, K + noise^2 I + extra)``. The
hyperparameters are a :class:`~fedppl.models.kernels.SEParams` (``GPParams`` is its name here).

Example::

    >>> import jax.numpy as jnp
    >>> X = jnp.linspace(-2.0, 2.0, 20)[:, None]; y = jnp.sin(2.0 * X[:, 0])
    >>> params = fit(X, y, steps=100)                       # type-II ML with optax
    >>> mean, var = predict(params, X, y, jnp.array([[0.5]]))
    >>> abs(float(mean[0]) - 0.841) < 0.05
    True
"""

from __future__ import annotations

from functools import lru_cache, partial

import jax
import jax.numpy as jnp
import jax.scipy.linalg as jsl
import optax
from jax import Array

from fedppl import validation
from fedppl.models.kernels import SEParams
from fedppl.optimise import minimise

__all__ = ["GPParams", "init_params", "kernel", "neg_log_marginal", "fit", "predict"]

GPParams = SEParams  # log lengthscales, log kernel variance, log noise standard deviation
DEFAULT_OPTIMIZER = optax.adam(0.05)


def init_params(input_dim: int, lengthscale: float = 1.0, variance: float = 1.0,
                noise: float = 0.3) -> SEParams:
    return SEParams.init(input_dim, lengthscale, variance, noise)


@jax.jit
def kernel(params: SEParams, X1: Array, X2: Array) -> Array:
    """The latent covariance ``k(X1, X2)``."""
    return params.kernel(X1, X2)


def _obs_cov(params: SEParams, X: Array, extra: Array | None) -> Array:
    C = kernel(params, X, X) + params.noise_var * jnp.eye(X.shape[0])
    return C if extra is None else C + extra


def neg_log_marginal(params: SEParams, X: Array, y: Array, extra: Array | None = None) -> Array:
    """``-log N(y | 0, K + noise^2 I + extra)``."""
    chol = jnp.linalg.cholesky(_obs_cov(params, X, extra))
    alpha = jsl.solve_triangular(chol, y, lower=True)
    return (0.5 * alpha @ alpha + jnp.sum(jnp.log(jnp.diagonal(chol)))
            + 0.5 * y.shape[0] * jnp.log(2 * jnp.pi))


def fit(X: Array, y: Array, extra: Array | None = None, init: SEParams | None = None,
        steps: int = 300, optimizer: optax.GradientTransformation | None = None,
        learning_rate: float | None = None) -> SEParams:
    """Type-II maximum likelihood of the hyperparameters: ``steps`` full-batch steps of any optax
    optimiser (default Adam with step size 0.05; ``learning_rate`` is short for
    ``optimizer=optax.adam(learning_rate)``)."""
    if learning_rate is not None:
        if optimizer is not None:
            raise ValueError("give optimizer or learning_rate, not both")
        optimizer = _adam(float(learning_rate))
    X, y = jnp.asarray(X), jnp.asarray(y)
    params = init if init is not None else init_params(X.shape[1])
    optimizer = DEFAULT_OPTIMIZER if optimizer is None else validation.optimizer(optimizer)
    return _fit(params, X, y, extra, steps, optimizer)


@lru_cache(maxsize=8)
def _adam(learning_rate: float) -> optax.GradientTransformation:
    """One optimiser object per step size, so that repeated fits reuse one compiled loop."""
    return optax.adam(learning_rate)


@partial(jax.jit, static_argnames=("steps", "optimizer"))
def _fit(params: SEParams, X: Array, y: Array, extra: Array | None, steps: int,
         optimizer: optax.GradientTransformation) -> SEParams:
    return minimise(lambda p, _: neg_log_marginal(p, X, y, extra), params, optimizer, steps)[0]


@partial(jax.jit, static_argnames=("full_cov",))
def predict(params: SEParams, X: Array, y: Array, X_test: Array, extra: Array | None = None,
            full_cov: bool = False) -> tuple[Array, Array]:
    """Posterior mean and variance (or covariance) of the latent ``f`` at ``X_test``."""
    chol = jnp.linalg.cholesky(_obs_cov(params, X, extra))
    Ks = kernel(params, X, X_test)
    mean = Ks.T @ jsl.cho_solve((chol, True), y)
    half = jsl.solve_triangular(chol, Ks, lower=True)
    if full_cov:
        return mean, kernel(params, X_test, X_test) - half.T @ half
    return mean, params.variance - jnp.sum(half**2, axis=0)
