"""Bayesian generalised linear models written as ordinary NumPyro code.

Example::

    >>> import numpy as np
    >>> from fedppl.guides import PVIGuide
    >>> from fedppl.models import logistic_regression
    >>> guide = PVIGuide(logistic_regression, family="fullrank")
    >>> guide.setup(np.zeros((4, 3)), np.zeros(4)).layout.dim   # w (3) and b (1)
    4
"""

from __future__ import annotations

import numpyro
import numpyro.distributions as dist
from jax import Array

__all__ = ["linear_regression", "logistic_regression"]


def linear_regression(X: Array, y: Array | None = None, noise: float = 1.0,
                      prior_scale: float = 1.0) -> None:
    """``y ~ N(X w + b, noise^2)`` with ``w, b ~ N(0, prior_scale^2)`` (conjugate in w, b)."""
    w = numpyro.sample("w", dist.Normal(0.0, prior_scale).expand([X.shape[1]]).to_event(1))
    b = numpyro.sample("b", dist.Normal(0.0, prior_scale))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Normal(X @ w + b, noise), obs=y)


def logistic_regression(X: Array, y: Array | None = None, prior_scale: float = 1.0) -> None:
    """``y ~ Bernoulli(sigmoid(X w + b))`` with ``w, b ~ N(0, prior_scale^2)``."""
    w = numpyro.sample("w", dist.Normal(0.0, prior_scale).expand([X.shape[1]]).to_event(1))
    b = numpyro.sample("b", dist.Normal(0.0, prior_scale))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w + b), obs=y)
