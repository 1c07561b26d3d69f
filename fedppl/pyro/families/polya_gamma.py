"""Polya-Gamma PG(b, c) moments and KL in torch (the twin of :mod:`fedppl.families.polya_gamma`).

``E[omega] = b / (2c) tanh(c / 2)`` (``b / 4`` at ``c = 0``) and
``KL[PG(b, c) || PG(b, 0)] = b log cosh(c / 2) - c^2 E[omega] / 2``, both with series near 0.

Example::

    >>> import torch
    >>> float(mean(1.0, torch.tensor(0.0))), float(kl_to_prior(1.0, torch.tensor(0.0)))
    (0.25, 0.0)
    >>> round(float(mean(1.0, torch.tensor(2.0, dtype=torch.float64))), 6)  # tanh(1) / 4
    0.190399
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["mean", "kl_to_prior", "log_cosh", "optimal_c", "augmented_bound"]

_SMALL = 1e-4
_SMALL_KL = 1e-2


def log_cosh(x: Tensor) -> Tensor:
    """``log cosh(x)`` without overflow."""
    a = x.abs()
    return a + torch.log1p(torch.exp(-2.0 * a)) - math.log(2.0)


def mean(b: float | Tensor, c: Tensor) -> Tensor:
    """``E[omega]`` for ``omega ~ PG(b, c)``."""
    c = c.abs()
    small = c < _SMALL
    safe = torch.where(small, 1.0, c)
    return b * torch.where(small, 0.25 - c**2 / 48.0, torch.tanh(safe / 2.0) / (2.0 * safe))


def kl_to_prior(b: float | Tensor, c: Tensor) -> Tensor:
    """``KL[PG(b, c) || PG(b, 0)]`` (non-negative)."""
    small = c.abs() < _SMALL_KL
    safe = torch.where(small, 1.0, c)
    exact = log_cosh(safe / 2.0) - 0.5 * safe**2 * mean(1.0, safe)
    return b * torch.where(small, c**4 / 192.0 - c**6 / 1440.0, exact)


def optimal_c(m: Tensor, v: Tensor) -> Tensor:
    """The CAVI optimum ``c = sqrt(m^2 + v)`` of ``q(omega) = PG(1, c)``."""
    return torch.sqrt(m**2 + v)


def augmented_bound(y: Tensor, m: Tensor, v: Tensor, c: Tensor | None = None) -> Tensor:
    """``E_q[log p(y | f, omega)] - KL[q(omega) || PG(1, 0)]`` per observation (labels in {0, 1},
    ``q(f) = N(m, v)``); at the optimal ``c`` it is the Jaakkola-Jordan bound."""
    c = optimal_c(m, v) if c is None else c
    return (-math.log(2.0) + (y - 0.5) * m - 0.5 * (m**2 + v) * mean(1.0, c)
            - kl_to_prior(1.0, c))
