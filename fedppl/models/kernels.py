"""Closed-form stationary kernels with ARD lengthscales.

Each kernel takes inputs ``X1 (n, p)``, ``X2 (m, p)``, lengthscales ``(p,)`` (or a scalar) and a
variance, and returns the ``(n, m)`` Gram matrix. They are the limits that random features
(:mod:`fedppl.models.random_features`) converge to, and the kernels of the sparse GP models.

Example::

    >>> K = se(X, X, lengthscale=jnp.ones(3), variance=2.0)
    >>> K52 = matern(X, X, nu=2.5, lengthscale=0.5)
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import Array

__all__ = ["scaled_distance", "se", "matern"]


def _scaled_sq_distance(X1: Array, X2: Array, lengthscale: Array | float) -> Array:
    a, b = X1 / lengthscale, X2 / lengthscale
    sq = jnp.sum(a**2, -1)[:, None] + jnp.sum(b**2, -1)[None, :] - 2.0 * a @ b.T
    return jnp.maximum(sq, 0.0)


def scaled_distance(X1: Array, X2: Array, lengthscale: Array | float) -> Array:
    """Euclidean distance between rows after dividing each input dimension by its lengthscale."""
    return jnp.sqrt(_scaled_sq_distance(X1, X2, lengthscale))


def se(X1: Array, X2: Array, lengthscale: Array | float = 1.0, variance: Array | float = 1.0
       ) -> Array:
    """Squared-exponential kernel ``variance * exp(-r^2 / 2)``, r the scaled distance."""
    return variance * jnp.exp(-0.5 * _scaled_sq_distance(X1, X2, lengthscale))


def matern(X1: Array, X2: Array, nu: float = 2.5, lengthscale: Array | float = 1.0,
           variance: Array | float = 1.0) -> Array:
    """Matérn kernel for ``nu`` in {0.5, 1.5, 2.5} (the half-integer closed forms)."""
    r = scaled_distance(X1, X2, lengthscale)
    if nu == 0.5:
        k = jnp.exp(-r)
    elif nu == 1.5:
        s = jnp.sqrt(3.0) * r
        k = (1.0 + s) * jnp.exp(-s)
    elif nu == 2.5:
        s = jnp.sqrt(5.0) * r
        k = (1.0 + s + s**2 / 3.0) * jnp.exp(-s)
    else:
        raise ValueError(f"matern supports nu in (0.5, 1.5, 2.5), got {nu}")
    return variance * k
