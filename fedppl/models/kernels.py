"""Stationary kernels, written for one pair of points and mapped over rows (tinygp's shape).

A kernel is a function ``k(x1, x2, *params) -> scalar`` of two input vectors; :func:`gram`
turns it into the ``(n, m)`` matrix of two sets of rows with two ``vmap`` s. :func:`se` and
:func:`matern` are those matrices for the squared-exponential and Matérn kernels with ARD
lengthscales (``(p,)`` or a scalar) and a variance: the limits that random features
(:mod:`fedppl.models.random_features`) converge to, and the kernels of the GP models.
:func:`laplace_point`, :func:`cauchy_point` and :func:`cosine_point` are the other base
kernels of the multi-output GP (:mod:`fedppl.models.mogp`), parametrised by a rate.

:class:`SEParams` is the one container of squared-exponential hyperparameters (log lengthscales,
log variance, log noise standard deviation) that the exact GP, the sparse GPs and FSGP share.

Example::

    >>> import jax.numpy as jnp
    >>> X = jnp.array([[0.0, 0.0], [3.0, 4.0]])
    >>> K = se(X, X, lengthscale=5.0, variance=2.0)
    >>> round(float(K[0, 1]), 6), K.shape
    (1.213061, (2, 2))
    >>> round(float(matern_point(X[0], X[1], nu=0.5, lengthscale=5.0)), 6)
    0.367879
    >>> p = SEParams.init(2, lengthscale=5.0, variance=2.0, noise=0.1)
    >>> bool(jnp.allclose(p.kernel(X, X), K)), round(float(p.noise_var), 6)
    (True, 0.01)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import Array
from jax.typing import ArrayLike

__all__ = ["sq_distance", "se_point", "matern_point", "laplace_point", "cauchy_point",
           "cosine_point", "gram", "se", "matern", "SEParams"]

MATERN_NU = (0.5, 1.5, 2.5)


def sq_distance(x1: Array, x2: Array, lengthscale: Array | float = 1.0) -> Array:
    """Squared Euclidean distance of two points after dividing each input by its lengthscale."""
    return jnp.sum(((x1 - x2) / lengthscale) ** 2)


def se_point(x1: Array, x2: Array, lengthscale: Array | float = 1.0,
             variance: Array | float = 1.0) -> Array:
    """Squared-exponential kernel of two points: ``variance * exp(-r^2 / 2)``."""
    return variance * jnp.exp(-0.5 * sq_distance(x1, x2, lengthscale))


def matern_point(x1: Array, x2: Array, nu: float = 2.5, lengthscale: Array | float = 1.0,
                 variance: Array | float = 1.0) -> Array:
    """Matérn kernel of two points for ``nu`` in {0.5, 1.5, 2.5} (the half-integer forms)."""
    if nu not in MATERN_NU:
        raise ValueError(f"matern supports nu in {MATERN_NU}, got {nu}")
    r2 = sq_distance(x1, x2, lengthscale)
    r = jnp.where(r2 > 0, jnp.sqrt(jnp.where(r2 > 0, r2, 1.0)), 0.0)  # finite gradient at 0
    if nu == 0.5:
        k = jnp.exp(-r)
    elif nu == 1.5:
        s = jnp.sqrt(3.0) * r
        k = (1.0 + s) * jnp.exp(-s)
    else:
        s = jnp.sqrt(5.0) * r
        k = (1.0 + s + s**2 / 3.0) * jnp.exp(-s)
    return variance * k


def laplace_point(x1: Array, x2: Array, rate: Array | float = 1.0,
                  variance: Array | float = 1.0) -> Array:
    """Laplace (L1) kernel of two points: ``variance * exp(-rate |x1 - x2|_1 / 2)``."""
    return variance * jnp.exp(-0.5 * rate * jnp.sum(jnp.abs(x1 - x2)))


def cauchy_point(x1: Array, x2: Array, rate: Array | float = 1.0,
                 variance: Array | float = 1.0) -> Array:
    """Cauchy kernel of two points: ``variance / (rate |x1 - x2|^2 + 1)``."""
    return variance / (rate * jnp.sum((x1 - x2) ** 2) + 1.0)


def cosine_point(x1: Array, x2: Array, variance: Array | float = 1.0) -> Array:
    """Linear kernel on L2-normalised inputs: ``variance * x1'x2 / (|x1| |x2|)``."""
    def unit(x: Array) -> Array:
        return x / jnp.sqrt(jnp.sum(x**2) + 1e-12)
    return variance * jnp.dot(unit(x1), unit(x2))


def gram(kernel: Callable[..., Array], X1: ArrayLike, X2: ArrayLike, *params: object) -> Array:
    """The ``(n, m)`` matrix ``kernel(X1[i], X2[j], *params)`` of a kernel on single points."""
    row = jax.vmap(lambda a, b: kernel(a, b, *params), (None, 0))
    return jax.vmap(row, (0, None))(jnp.asarray(X1), jnp.asarray(X2))


def se(X1: ArrayLike, X2: ArrayLike, lengthscale: Array | float = 1.0, variance: Array | float = 1.0
       ) -> Array:
    """Squared-exponential Gram matrix of the rows of ``X1 (n, p)`` and ``X2 (m, p)``."""
    return gram(se_point, X1, X2, lengthscale, variance)


def matern(X1: ArrayLike, X2: ArrayLike, nu: float = 2.5, lengthscale: Array | float = 1.0,
           variance: Array | float = 1.0) -> Array:
    """Matérn Gram matrix (``nu`` in {0.5, 1.5, 2.5})."""
    if nu not in MATERN_NU:
        raise ValueError(f"matern supports nu in {MATERN_NU}, got {nu}")
    return gram(lambda a, b: matern_point(a, b, nu, lengthscale, variance), X1, X2)


class SEParams(NamedTuple):
    """Squared-exponential ARD hyperparameters with Gaussian observation noise, in log space:
    log lengthscales ``(p,)``, log kernel variance, log noise standard deviation.

    Unconstrained, so they are what optimisers move and what FedAvg averages.
    """

    log_lengthscale: Array
    log_variance: Array
    log_noise: Array

    @classmethod
    def init(cls, input_dim: int, lengthscale: float = 1.0, variance: float = 1.0,
             noise: float = 0.1, dtype: Any = None) -> SEParams:
        """Lengthscales all ``lengthscale``; with ``dtype``, strongly typed (jitted loops then
        see one input type from the first call on)."""
        def log(v: float) -> Array:
            return jnp.log(jnp.asarray(v, dtype=dtype))

        return cls(jnp.full(input_dim, log(lengthscale), dtype=dtype), log(variance), log(noise))

    @property
    def lengthscale(self) -> Array:
        return jnp.exp(self.log_lengthscale)

    @property
    def variance(self) -> Array:
        return jnp.exp(self.log_variance)

    @property
    def noise(self) -> Array:
        """The noise standard deviation."""
        return jnp.exp(self.log_noise)

    @property
    def noise_var(self) -> Array:
        return jnp.exp(2.0 * self.log_noise)

    def kernel(self, X1: ArrayLike, X2: ArrayLike) -> Array:
        """The latent covariance ``k(X1, X2)``."""
        return se(X1, X2, self.lengthscale, self.variance)
