"""Bayesian generalised linear models written as ordinary Pyro code (the twins of
:mod:`fedppl.models.glm`).

Example::

    >>> import torch
    >>> from fedppl.pyro import PVIGuide
    >>> PVIGuide(logistic_regression).setup(torch.zeros(4, 3), torch.zeros(4)).layout.dim
    4
"""

from __future__ import annotations

import pyro
import pyro.distributions as dist
from torch import Tensor

__all__ = ["linear_regression", "logistic_regression"]


def linear_regression(X: Tensor, y: Tensor | None = None, noise: float = 1.0,
                      prior_scale: float = 1.0) -> None:
    """``y ~ N(X w + b, noise^2)`` with ``w, b ~ N(0, prior_scale^2)`` (conjugate in w, b)."""
    w = pyro.sample("w", dist.Normal(0.0, prior_scale).expand([X.shape[1]]).to_event(1))
    b = pyro.sample("b", dist.Normal(0.0, prior_scale))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("y", dist.Normal(X @ w + b, noise), obs=y)


def logistic_regression(X: Tensor, y: Tensor | None = None, prior_scale: float = 1.0) -> None:
    """``y ~ Bernoulli(sigmoid(X w + b))`` with ``w, b ~ N(0, prior_scale^2)``."""
    w = pyro.sample("w", dist.Normal(0.0, prior_scale).expand([X.shape[1]]).to_event(1))
    b = pyro.sample("b", dist.Normal(0.0, prior_scale))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("y", dist.Bernoulli(logits=X @ w + b), obs=y)
