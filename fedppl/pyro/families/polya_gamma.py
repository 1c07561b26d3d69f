"""Polya-Gamma PG(b, c) moments and KL (the core's :mod:`fedppl.families.polya_gamma`) on torch
tensors.

Example::

    >>> import torch
    >>> from fedppl.pyro.families.polya_gamma import kl_to_prior, mean
    >>> float(mean(1.0, torch.tensor(0.0))), float(kl_to_prior(1.0, torch.tensor(0.0)))
    (0.25, 0.0)
"""

from __future__ import annotations

from fedppl.families import polya_gamma as core
from fedppl.pyro.families.gaussian import as_torch

__all__ = ["mean", "kl_to_prior", "log_cosh", "optimal_c", "augmented_bound"]  # noqa: F822


def __getattr__(name: str):
    """The core's function of that name, on torch tensors."""
    return as_torch(getattr(core, name))
