"""Polya-Gamma PG(b, c) moments and KL, numerically stable for all real ``c``.

If ``omega ~ PG(b, c)`` then ``E[omega] = b / (2c) * tanh(c / 2)`` (``b / 4`` at ``c = 0``), and
its density is ``cosh(c/2)^b exp(-c^2 omega / 2) PG(omega; b, 0)``, so

    KL[PG(b, c) || PG(b, 0)] = b log cosh(c / 2) - c^2 / 2 * E[omega]

(the log-cosh term of Eq. 17 of the pFed-Mul paper). Both are even in ``c``.

For a Bernoulli-logit observation ``y in {0, 1}`` the identity
``sigmoid(f)^y sigmoid(-f)^(1-y) = 1/2 exp(kappa f) E_PG(1,0)[exp(-omega f^2 / 2)]`` with
``kappa = y - 1/2`` makes the likelihood Gaussian in ``f`` given ``omega``: a site with natural
parameters ``(kappa, E[omega])``, i.e. pseudo-observation ``kappa / E[omega]`` with precision
``E[omega]``. With ``q(f)`` of mean ``m`` and variance ``v`` the optimal ``q(omega)`` is
``PG(1, c)`` with ``c = sqrt(m^2 + v)``, and the augmented bound equals the Jaakkola-Jordan bound.

Example::

    >>> float(mean(1.0, 0.0)), float(kl_to_prior(1.0, 0.0))
    (0.25, 0.0)
    >>> nat1, prec = gaussian_site(jnp.array([0.0, 1.0]), optimal_c(jnp.zeros(2), jnp.ones(2)))
    >>> nat1.tolist()
    [-0.5, 0.5]
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import Array

__all__ = ["mean", "kl_to_prior", "log_cosh", "optimal_c", "gaussian_site", "augmented_bound"]

_SMALL = 1e-4
_SMALL_KL = 1e-2


def log_cosh(x: Array | float) -> Array:
    """``log cosh(x)`` without overflow: ``|x| + log1p(exp(-2|x|)) - log 2``."""
    a = jnp.abs(jnp.asarray(x))
    return a + jnp.log1p(jnp.exp(-2.0 * a)) - jnp.log(2.0)


def mean(b: Array | float, c: Array | float) -> Array:
    """``E[omega]`` for ``omega ~ PG(b, c)``; a Taylor series near ``c = 0``.

    >>> round(float(mean(1.0, 2.0)), 6)  # tanh(1) / 4
    0.190399
    """
    c = jnp.abs(jnp.asarray(c))
    small = c < _SMALL
    safe = jnp.where(small, 1.0, c)
    exact = jnp.tanh(safe / 2.0) / (2.0 * safe)
    series = 0.25 - c**2 / 48.0
    return jnp.asarray(b) * jnp.where(small, series, exact)


def kl_to_prior(b: Array | float, c: Array | float) -> Array:
    """``KL[PG(b, c) || PG(b, 0)] = b log cosh(c/2) - c^2 E[omega] / 2`` (non-negative).

    >>> round(float(kl_to_prior(1.0, 3.0)), 6)
    0.176579
    """
    c = jnp.asarray(c)
    # the two terms cancel to O(c^4) near 0: use the series c^4/192 - c^6/1440 there
    small = jnp.abs(c) < _SMALL_KL
    safe = jnp.where(small, 1.0, c)
    exact = log_cosh(safe / 2.0) - 0.5 * safe**2 * mean(1.0, safe)
    series = c**4 / 192.0 - c**6 / 1440.0
    return jnp.asarray(b) * jnp.where(small, series, exact)


def optimal_c(m: Array, v: Array) -> Array:
    """The CAVI optimum ``c = sqrt(E[f^2]) = sqrt(m^2 + v)`` of ``q(omega) = PG(1, c)``."""
    return jnp.sqrt(jnp.asarray(m) ** 2 + jnp.asarray(v))


def gaussian_site(y: Array, c: Array) -> tuple[Array, Array]:
    """Natural parameters ``(kappa, E[omega])`` of the Gaussian site in ``f`` (labels in
    {0, 1})."""
    return jnp.asarray(y) - 0.5, mean(1.0, c)


def augmented_bound(y: Array, m: Array, v: Array, c: Array | None = None) -> Array:
    """``E_q[log p(y | f, omega)] - KL[q(omega) || PG(1, 0)]`` per observation, labels in {0, 1}.

    ``q(f) = N(m, v)``, ``q(omega) = PG(1, c)``; ``c`` defaults to its optimum, where this equals
    the Jaakkola-Jordan bound ``log sigmoid(c) + (kappa m - c / 2) - lambda(c) (m^2 + v - c^2)``.
    """
    c = optimal_c(m, v) if c is None else jnp.asarray(c)
    kappa = jnp.asarray(y) - 0.5
    return (-jnp.log(2.0) + kappa * m - 0.5 * (jnp.asarray(m) ** 2 + v) * mean(1.0, c)
            - kl_to_prior(1.0, c))
