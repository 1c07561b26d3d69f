"""Polya-Gamma PG(b, c) moments and KL, numerically stable for all real ``c``.

If ``omega ~ PG(b, c)`` then ``E[omega] = b / (2c) * tanh(c / 2)`` (``b / 4`` at ``c = 0``), and
its density is ``cosh(c/2)^b exp(-c^2 omega / 2) PG(omega; b, 0)``, so

    KL[PG(b, c) || PG(b, 0)] = b log cosh(c / 2) - c^2 / 2 * E[omega]

(the log-cosh term of Eq. 17 of the pFed-Mul paper). Both are even in ``c``.

Example::

    >>> mean(1.0, 0.0), kl_to_prior(1.0, 0.0)
    (0.25, 0.0)
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import Array

__all__ = ["mean", "kl_to_prior", "log_cosh"]

_SMALL = 1e-4


def log_cosh(x: Array | float) -> Array:
    """``log cosh(x)`` without overflow: ``|x| + log1p(exp(-2|x|)) - log 2``."""
    a = jnp.abs(jnp.asarray(x))
    return a + jnp.log1p(jnp.exp(-2.0 * a)) - jnp.log(2.0)


def mean(b: Array | float, c: Array | float) -> Array:
    """``E[omega]`` for ``omega ~ PG(b, c)``; a Taylor series near ``c = 0``.

    >>> mean(1.0, 2.0)  # tanh(1) / 4
    """
    c = jnp.abs(jnp.asarray(c))
    small = c < _SMALL
    safe = jnp.where(small, 1.0, c)
    exact = jnp.tanh(safe / 2.0) / (2.0 * safe)
    series = 0.25 - c**2 / 48.0
    return jnp.asarray(b) * jnp.where(small, series, exact)


def kl_to_prior(b: Array | float, c: Array | float) -> Array:
    """``KL[PG(b, c) || PG(b, 0)] = b log cosh(c/2) - c^2 E[omega] / 2`` (non-negative).

    >>> kl_to_prior(1.0, 3.0)
    """
    c = jnp.asarray(c)
    return jnp.asarray(b) * log_cosh(c / 2.0) - 0.5 * c**2 * mean(b, c)
