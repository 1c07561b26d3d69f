"""LogNormal factors: Gaussian natural parameters over ``log x``.

A LogNormal(mu, s) variable is Gaussian in the unconstrained space ``log x``, so its factors are
:class:`~fedppl.families.gaussian.DiagGaussian` objects over ``log x`` and share all the algebra
(product, quotient, damping, KL: the KL between two LogNormals equals the KL of their logs).

Example::

    >>> from fedppl.families import lognormal
    >>> prior = lognormal.from_params(0.0, 1.0)               # LogNormal(0, 1)
    >>> [round(float(m), 4) for m in lognormal.to_distribution(prior).mean.reshape(-1)]
    [1.6487]
"""

from __future__ import annotations

import jax.numpy as jnp
import numpyro.distributions as dist
from jax import Array

from fedppl.families.gaussian import DiagGaussian, to_moments

__all__ = ["from_params", "to_params", "to_distribution"]


def from_params(loc: Array | float, scale: Array | float) -> DiagGaussian:
    """The LogNormal(loc, scale) as a diagonal Gaussian over ``log x`` (at least 1-d)."""
    loc, scale = jnp.broadcast_arrays(jnp.atleast_1d(loc), jnp.atleast_1d(scale))
    return DiagGaussian.from_moments(loc, scale**2)


def to_params(g: DiagGaussian) -> tuple[Array, Array]:
    """``(loc, scale)`` of the LogNormal whose log is ``g``."""
    mean, var = to_moments(g)
    return mean, jnp.sqrt(var)


def to_distribution(g: DiagGaussian) -> dist.Distribution:
    """A NumPyro ``LogNormal`` with one batch element per coordinate of ``g``."""
    return dist.LogNormal(*to_params(g))
