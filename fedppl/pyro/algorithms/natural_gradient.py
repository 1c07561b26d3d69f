"""The Pyro port's natural-gradient local step: the core's
(:class:`fedppl.algorithms.natural_gradient.NaturalGradientSolver`), with the Pyro guide supplying
the client's log density, gradient and Hessian from torch, and these fixed base draws.

The base draws come from torch's generator (``seed``), not JAX's, so the Pyro port and the NumPyro
core reach fixed points that differ by their Monte Carlo error (``tests/pyro``); the guide reads
this module's :func:`base_draws` when a solve is traced.

Example::

    >>> import torch
    >>> eps = base_draws(32, 2, torch.float64)
    >>> tuple(eps.shape), bool(torch.allclose(eps.T @ eps / 32, torch.eye(2, dtype=torch.float64)))
    ((32, 2), True)
"""

from __future__ import annotations

import torch
from torch import Tensor

from fedppl.algorithms.natural_gradient import LocalResult, NaturalGradientSolver, PriorSolver

__all__ = ["LocalResult", "NaturalGradientSolver", "PriorSolver", "base_draws"]


def base_draws(num_draws: int, dim: int, dtype: torch.dtype, seed: int = 0) -> Tensor:
    """``num_draws`` standard normal vectors in antithetic pairs, whitened to an exact identity
    second moment when there are more pairs than dimensions (torch's generator, seeded)."""
    gen = torch.Generator().manual_seed(seed)
    half = torch.randn((num_draws // 2, dim), generator=gen, dtype=torch.float32).double()
    if num_draws // 2 > dim:
        chol = torch.linalg.cholesky(half.T @ half / (num_draws // 2))
        half = torch.linalg.solve_triangular(chol, half.T, upper=False).T
    return torch.cat([half, -half]).to(dtype)
